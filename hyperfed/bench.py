"""Speed benchmark: the papers' client-after-client loop vs the engine, same workload, one process.

The workload (issue 9): MH-pFedHN, ``clients`` x ``samples`` training images of CIFAR-100
shape (synthetic uint8 -- speed does not depend on the pixels), E = 2, batch 64, evaluation
every 10 rounds. Each execution path runs the same rounds from the same seed:

- ``reference``: per client, an ``nn.Module`` and ``torch.optim.SGD`` (the papers' code);
- ``loop``: the engine's functional step, client after client (with channels-last
  activations on a CPU, ``local.channels_last``); ``loop-nchw``: the same without them;
- ``vmap``: the engine, all clients of one architecture in one vmapped step;
- ``graphs`` (GPU): ``vmap`` with each step replayed as one captured CUDA graph;
- ``workers``: ``loop`` with the round's clients trained in one worker process per physical
  core (``local.workers = "auto"``, one torch thread each; the pool starts in the warm-up).

:func:`step_table` (``hyperfed bench --models ...``) times one client's local step per zoo
model instead and reports its FLOP/s against the machine's dense-matmul FLOP/s, measured in
the same process.

Hypernetwork generation and update are included in every path. Seconds per round count a
tenth of an evaluation (eval every 10 rounds). Never a unit test: it prints ratios.
"""

from __future__ import annotations

import dataclasses
import gc
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from hyperfed.config import ConfigError, ExperimentConfig, load_config
from hyperfed.data.federated import FederatedData
from hyperfed.engine.local import (
    GRAPH_STATS,
    BatchPlan,
    SGDConfig,
    client_seed,
    plan_batches,
    train_clients,
)
from hyperfed.engine.metering import FlopMeter
from hyperfed.models.layout import FunctionalModel, channels_last
from hyperfed.models.zoo import ModelInputError, build_model, check_input, model_names
from hyperfed.runtime.simulate import Simulation, resolve_device, use_channels_last

HETERO = ["lenet", "vgg8", "resnet10", "resnet12", "resnet18"]
# path -> local.vectorize
MODES = {
    "reference": "reference",
    "loop": "off",
    "loop-nchw": "off",
    "workers": "off",
    "vmap": "on",
    "graphs": "on",
}


def synthetic_federation(
    clients: int, samples: int, shape: tuple[int, ...], classes: int, seed: int = 0
) -> FederatedData:
    g = torch.Generator().manual_seed(seed)
    test = max(1, samples // 9)
    per = samples + test
    x = torch.randint(0, 256, (clients * per, *shape), generator=g, dtype=torch.uint8)
    y = torch.randint(0, classes, (clients * per,), generator=g)
    idx = torch.arange(clients * per).view(clients, per)
    return FederatedData(
        x=x,
        y=y,
        train_idx=[r[:samples] for r in idx],
        val_idx=[r[:0] for r in idx],
        test_idx=[r[samples:] for r in idx],
        num_classes=classes,
        input_shape=shape,
        mean=torch.full((shape[0],), 0.5),
        std=torch.full((shape[0],), 0.25),
        name="synthetic-images",
    )


@dataclass
class BenchResult:
    mode: str
    seconds_per_round: float
    train_seconds: float
    eval_seconds: float
    peak_memory_mb: float


def _median_result(results: list[BenchResult]) -> BenchResult:
    """A path's repetitions as one result: the median of each number."""
    fields = ("seconds_per_round", "train_seconds", "eval_seconds", "peak_memory_mb")
    medians = {f: statistics.median(getattr(r, f) for r in results) for f in fields}
    return dataclasses.replace(results[0], **medians)


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # process peak RSS


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _bench_config(
    data: FederatedData,
    models: list[str],
    rounds: int,
    algorithm: str,
    device: torch.device,
    batch_size: int,
    epochs: int,
    mode: str,
) -> ExperimentConfig:
    vectorize = MODES[mode]
    return load_config(
        None,
        [
            f"algorithm.name={algorithm}",
            f"clients.count={data.num_clients}",
            "clients.models=[" + ",".join(f'"{m}"' for m in models) + "]",
            f"local.batch_size={batch_size}",
            f"local.epochs={epochs}",
            "local.lr=0.01",
            f"local.vectorize={vectorize}",
            f"device={device.type}",
            f"rounds={rounds}",
            f"local.cuda_graphs={'on' if mode == 'graphs' else 'off'}",
            f"local.channels_last={'off' if mode == 'loop-nchw' else 'auto'}",
            f"local.workers={'auto' if mode == 'workers' else 1}",
        ],
    )


def bench_mode(
    mode: str,
    data: FederatedData,
    models: list[str],
    rounds: int,
    algorithm: str,
    device: torch.device,
    batch_size: int = 64,
    epochs: int = 2,
) -> BenchResult:
    cfg = _bench_config(data, models, rounds + 1, algorithm, device, batch_size, epochs, mode)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sim = Simulation(cfg, data=data)
    sim.run_round(1)  # warm-up: allocations, lazy initialisation (and compilation)
    _sync(device)
    t0 = time.perf_counter()
    for rnd in range(2, rounds + 2):
        sim.run_round(rnd)
    _sync(device)
    train = (time.perf_counter() - t0) / rounds
    t0 = time.perf_counter()
    sim.evaluate()
    _sync(device)
    evaluation = time.perf_counter() - t0
    result = BenchResult(mode, train + evaluation / 10, train, evaluation, _peak_memory_mb(device))
    sim.close()
    del sim
    gc.collect()
    return result


def profile_round(
    data: FederatedData,
    models: list[str],
    algorithm: str,
    device: torch.device,
    batch_size: int = 64,
    epochs: int = 2,
    mode: str = "vmap",
    rows: int = 25,
) -> str:
    """One engine round (after a warm-up round) under ``torch.profiler``: the ops that cost
    the most device time (CPU time on a CPU), as the profiler's table."""
    from torch.profiler import ProfilerActivity, profile

    sim = Simulation(
        _bench_config(data, models, 3, algorithm, device, batch_size, epochs, mode), data=data
    )
    sim.run_round(1)
    _sync(device)
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        sim.run_round(2)
        _sync(device)
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows)


def run_benchmark(
    clients: int = 20,
    samples: int = 900,
    shape: tuple[int, ...] = (3, 32, 32),
    classes: int = 100,
    hetero: bool = False,
    rounds: int = 2,
    modes: tuple[str, ...] = ("reference", "loop", "vmap"),
    algorithm: str = "mh_pfedhn",
    device: str = "auto",
    batch_size: int = 64,
    epochs: int = 2,
    profile: bool = False,
    repeat: int = 1,
    printer=print,  # type: ignore[no-untyped-def]
) -> list[BenchResult]:
    """Time every path in ``modes``, all of them ``repeat`` times in turn (so that a drift of
    the machine's load hits every path alike); returns each path's median result."""
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ConfigError(f"--modes: unknown path(s) {unknown}; choose from {', '.join(MODES)}")
    if repeat < 1:
        raise ConfigError(f"--repeat: must be at least 1 (got {repeat})")
    dev = resolve_device(device)
    data = synthetic_federation(clients, samples, shape, classes).to(dev)
    models = HETERO if hetero else ["lenet"]
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    printer(
        f"workload: {algorithm}, {clients} clients x {samples} samples of shape {shape}, "
        f"{classes} classes, models {models}, E={epochs}, batch {batch_size}, eval every 10 "
        f"rounds; device {name} ({torch.get_num_threads()} threads), torch {torch.__version__}"
    )
    loop_cfg = _bench_config(data, models, 1, algorithm, dev, batch_size, epochs, "loop")
    nhwc = "on" if use_channels_last(loop_cfg, dev) else "off"
    printer(f"channels-last activations in the engine's loop and evaluation: {nhwc}")
    if profile:
        fast = "graphs" if dev.type == "cuda" else "loop"
        printer(f"profile of one {fast} round:")
        printer(profile_round(data, models, algorithm, dev, batch_size, epochs, fast))
    runs: dict[str, list[BenchResult]] = {mode: [] for mode in modes}
    for rep in range(repeat):
        if repeat > 1:
            printer(f"repetition {rep + 1} of {repeat}:")
        for mode in modes:
            GRAPH_STATS.update(captured=0, failed=0)
            r = bench_mode(mode, data, models, rounds, algorithm, dev, batch_size, epochs)
            runs[mode].append(r)
            extra = ""
            if mode == "graphs":
                extra = (
                    f" ({GRAPH_STATS['captured']} graphs captured, {GRAPH_STATS['failed']} failed)"
                )
            printer(f"  {mode:<9} {r.seconds_per_round:8.3f} s/round" + extra)
    base_mode = "reference" if "reference" in runs else modes[0]
    results = []
    printer("")
    spread = " (range over repetitions)" if repeat > 1 else ""
    printer(f"| path | s/round | speed-up vs reference{spread} | 500 rounds | peak memory (MB) |")
    printer("|---|---|---|---|---|")
    for mode, rs in runs.items():
        # each repetition's ratio against the reference of the same repetition, then medians
        ratios = sorted(
            b.seconds_per_round / r.seconds_per_round for b, r in zip(runs[base_mode], rs)
        )
        r = _median_result(rs)
        results.append(r)
        ratio = f"{statistics.median(ratios):.2f}x"
        if repeat > 1:
            ratio += f" ({ratios[0]:.2f}-{ratios[-1]:.2f}x)"
        printer(
            f"| {mode} | {r.seconds_per_round:.3f} | {ratio} | "
            f"{500 * r.seconds_per_round / 60:.1f} min | {r.peak_memory_mb:.0f} |"
        )
    if dev.type == "cpu":
        printer("(CPU peak memory is the process's peak RSS so far, not per path)")
    return results


# -- per-model local step: FLOP/s against the machine's dense matmul -------------------------


def _timed(device: torch.device, fn: Callable[..., object], *args: object) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn(*args)
    _sync(device)
    return time.perf_counter() - t0


def matmul_flops(device: torch.device, n: int = 1024, reps: int = 5) -> float:
    """FLOP/s of one dense ``n x n`` fp32 matmul (``2 n^3`` FLOPs), best of ``reps``, with
    this process's thread count: the machine's practical limit for a training step."""
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    a @ b  # warm-up
    best = min(_timed(device, torch.mm, a, b) for _ in range(reps))
    return 2 * n**3 / best


@dataclass
class StepResult:
    model: str
    flops_per_step: int
    eager_s: float  # median seconds per local step (the engine's client loop)
    matmul_flops: float  # median dense-matmul FLOP/s, measured between the steps

    @property
    def flops(self) -> float:
        return self.flops_per_step / self.eager_s


def _client_steps(
    fm: FunctionalModel,
    theta: Tensor,
    buffers: Tensor,
    data: FederatedData,
    plan: BatchPlan,
    sgd: SGDConfig,
) -> object:
    return train_clients(fm, theta, buffers, data, plan, sgd, vectorize=False)


def step_table(
    models: list[str],
    shape: tuple[int, ...] = (3, 32, 32),
    classes: int = 100,
    batch_size: int = 64,
    steps: int = 5,
    repeats: int = 5,
    device: str = "auto",
    printer=print,  # type: ignore[no-untyped-def]
) -> list[StepResult]:
    """Per model: one client's local step as the engine's client loop runs it (forward,
    backward, in-place SGD; channels-last on a CPU), its FLOPs as :class:`FlopMeter` counts
    them, and its FLOP/s against a dense matmul timed in between (``repeats`` interleaved
    rounds of ``steps`` steps each; medians)."""
    dev = resolve_device(device)
    for m in models:
        try:
            check_input(m, shape)
        except ModelInputError as e:
            raise ConfigError(f"--models: {e}; choose another --shape or model") from None
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    printer(
        f"local step of one client: batch {batch_size}, input {shape}, {classes} classes; "
        f"device {name} ({torch.get_num_threads()} threads), torch {torch.__version__}; "
        f"medians of {repeats} interleaved rounds of {steps} steps"
    )
    data = synthetic_federation(1, batch_size * steps, shape, classes).to(dev)
    plan = plan_batches(data.train_idx, 1, batch_size, [client_seed(0, 1, 0)])
    sgd = SGDConfig(lr=0.01, momentum=0.9, weight_decay=1e-4, epochs=1, batch_size=batch_size)
    results = []
    with channels_last(dev.type == "cpu"):
        for m in models:
            torch.manual_seed(0)
            fm = FunctionalModel(build_model(m, shape, classes).to(dev), m)
            theta, buffers = fm.initial_params()[None], fm.initial_buffers()[None].to(dev)

            run = partial(_client_steps, fm, theta, buffers, data, plan)

            with FlopMeter() as meter:
                run(sgd)  # warm-up
            flops = meter.total // plan.steps
            eager, mm = [], []
            for _ in range(repeats):
                mm.append(matmul_flops(dev))
                eager.append(_timed(dev, run, sgd) / plan.steps)
            r = StepResult(m, flops, statistics.median(eager), statistics.median(mm))
            results.append(r)
            printer(f"  {m}: {1e3 * r.eager_s:.2f} ms/step, {r.flops / 1e9:.2f} GFLOP/s")
    printer("")
    printer("| model | MFLOP/step | ms/step | GFLOP/s | matmul GFLOP/s | fraction |")
    printer("|---|---|---|---|---|---|")
    for r in results:
        line = (
            f"| {r.model} | {r.flops_per_step / 1e6:.1f} | {1e3 * r.eager_s:.2f} | "
            f"{r.flops / 1e9:.2f} | {r.matmul_flops / 1e9:.1f} | "
            f"{r.flops / r.matmul_flops:.1%} |"
        )
        printer(line)
    return results


def parse_models(spec: str) -> list[str]:
    """``--models``: comma-separated zoo names, or ``all``."""
    names = model_names() if spec.strip() == "all" else [m.strip() for m in spec.split(",")]
    unknown = [m for m in names if m not in model_names()]
    if unknown:
        raise ConfigError(f"--models: unknown model(s) {unknown}; see `hyperfed list models`")
    return names
