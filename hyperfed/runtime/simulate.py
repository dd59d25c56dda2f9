"""A federation on one machine.

:class:`Simulation` builds the config's data, models, server role and client role with the
:class:`~hyperfed.runtime.federation.Federation` every runtime shares, and runs
them through the round driver (:mod:`hyperfed.runtime.driver`, the loop every transport
shares) with an :class:`InMemoryTransport`: the clients' state lives in a store indexed by
client id and each architecture group trains together. A run appends to ``metrics.jsonl``
and checkpoints atomically, so a killed run resumes to the same result.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from hyperfed.algorithms.base import (
    EVAL_REQUEST,
    Client,
    ClientGroup,
    Payload,
    payload_bytes,
    stack_payloads,
    unstack_payload,
)
from hyperfed.config import ConfigError, ExperimentConfig, to_toml
from hyperfed.data.federated import FederatedData
from hyperfed.engine.metering import FlopSum
from hyperfed.models.layout import FunctionalModel, channels_last
from hyperfed.progress import PhaseCost, phase
from hyperfed.runtime.clients import ClientHost, MemoryStore
from hyperfed.runtime.driver import EvalCounts, Exchange, RoundResult
from hyperfed.runtime.federation import (
    Federation,
    build_models,
    load_federation,
    resolve_device,
    use_channels_last,
)
from hyperfed.runtime.gossip import Gossip
from hyperfed.runtime.parallel import (
    ChunkFn,
    ParallelFit,
    available_cores,
    registered_here,
    resolve_workers,
    run_chunk,
    start_fork_server,
    stochastic_models,
)
from hyperfed.runtime.poison import UPDATE_ATTACKS, Poisoning, flip_labels, lie_about_counts
from hyperfed.runtime.rundir import CHECKPOINT, RunDir, RunDirError
from hyperfed.runtime.tracking import check_tracking, open_tracking

log = logging.getLogger("hyperfed")

# the builders live in runtime/federation.py; importers of this module keep these names
__all__ = [
    "InMemoryTransport",
    "Simulation",
    "build_models",
    "load_federation",
    "resolve_device",
    "resume",
    "train_flops_per_sample",
    "use_channels_last",
    "worker_chunks",
]


def train_flops_per_sample(
    fm: FunctionalModel, input_shape: tuple[int, ...], device: torch.device
) -> int:
    """Forward + backward FLOPs of one sample, counted by torch's flop counter."""
    module = fm.module
    x = torch.zeros(2, *input_shape, device=device)
    module.train()
    with FlopSum() as counter:
        module(x).sum().backward()
    module.zero_grad(set_to_none=True)
    return int(counter.get_total_flops() // 2)


class InMemoryTransport:
    """The simulator's transport: every client in this process, their persistent state in a
    store indexed by client id (gathered for the participants, scattered back), trained one
    architecture group at a time (one vmapped step per group, or client after client) by a
    :class:`~hyperfed.runtime.clients.ClientHost`."""

    name = "simulation"
    parallel: ParallelFit | None = None  # local.workers > 1: fit in worker processes
    poison: Poisoning | None = None  # [attack]: what the attackers do to their replies

    def __init__(
        self,
        client: Client,
        store: dict[int, dict[str, Tensor]],
        groups: dict[str, list[int]],
        make_group: Callable[[str, list[int], int], ClientGroup],
        data: FederatedData,
        models: dict[str, FunctionalModel],
        reference: bool,
    ) -> None:
        self.host = ClientHost(client, groups, make_group, models, data)
        self.store = store
        self.reference = reference

    @property
    def client(self) -> Client:
        return self.host.client

    @client.setter
    def client(self, client: Client) -> None:
        self.host.client = client

    def reachable(self) -> set[int] | None:
        return None

    def states(self, cids: list[int]) -> dict[str, Tensor]:
        """The stored state of ``cids``, stacked (a leading client axis)."""
        return stack_payloads([self.store[c] for c in cids])

    def fit(self, rnd: int, msgs: dict[int, Payload]) -> Exchange:
        if self.poison is None:
            return self._fit(rnd, msgs)
        references = self.poison.references(msgs, self.store)
        out = self._fit(rnd, msgs)
        out.replies = self.poison.replies(rnd, out.replies, msgs, references)  # [attack]
        return out

    def _fit(self, rnd: int, msgs: dict[int, Payload]) -> Exchange:
        store = MemoryStore(self.store)
        if self.parallel is not None:
            got = self.parallel.fit(rnd, msgs, self.host.parts(msgs), store)
        else:
            got = self.host.fit(rnd, msgs, store)
        return Exchange(got.replies, [loss for _, loss in got.losses], got.flops)

    def setup(self, stage: int, msgs: dict[int, Payload]) -> Exchange:
        what = "evaluation request" if stage == EVAL_REQUEST else f"setup stage {stage}"
        with phase(f"{what}, clients done", len(msgs)) as tick:
            got = self.host.setup(stage, msgs, MemoryStore(self.store), tick.advance)
        stats: dict[str, list[Tensor]] = {}
        for _, st in got.stats:
            for k, v in st.items():
                stats.setdefault(k, []).append(v.detach().float().reshape(-1).cpu())
        return Exchange(got.replies, stats={k: torch.cat(vs) for k, vs in stats.items()})

    def relay(self, rnd: int, W: Tensor, payloads: dict[int, Payload]) -> None:
        active = list(payloads)
        mixed = Gossip.mix(W, stack_payloads([payloads[c] for c in active]))
        self.host.mix(
            rnd, dict(zip(active, unstack_payload(mixed, len(active)))), MemoryStore(self.store)
        )

    def evaluate(self, msgs: dict[int, Payload], split: str) -> EvalCounts:
        n = len(self.store)
        counts = EvalCounts(
            torch.full((n,), math.nan), torch.full((n,), math.nan), torch.full((n,), math.nan)
        )
        store = MemoryStore(self.store)
        if self.parallel is not None and self.parallel.running:  # in the workers
            results = self.parallel.evaluate(split, msgs, self.host.parts(msgs), store)
        else:
            results = self.host.evaluate(msgs, split, store)
        for part, (ok, tot, ls) in results:
            idx = torch.tensor(part)
            counts.correct[idx], counts.total[idx] = ok.cpu().float(), tot.cpu().float()
            counts.loss_sum[idx] = ls.cpu().float()  # a float64 model evaluates too
        return counts


class Simulation:
    """A federation in one process: the config's data, models, server role and client role,
    driven round by round by :class:`~hyperfed.runtime.driver.RoundDriver` through an
    :class:`InMemoryTransport`."""

    def __init__(self, cfg: ExperimentConfig, data: FederatedData | None = None) -> None:
        self.cfg = cfg
        self.federation = fed = Federation(cfg)  # runtime/federation.py: every runtime's builder
        if cfg.tensorboard:
            open_tensorboard()
        check_tracking(cfg)  # [tracking]: MLflow / W&B installed? (before any work)
        self.device, self.algorithm, self.hp, self.sgd = fed.device, fed.algorithm, fed.hp, fed.sgd
        self.arch_of, self.groups = fed.arch_of, fed.groups
        self.vectorize, self.reference, self.nhwc = fed.vectorize, fed.reference, fed.nhwc
        per_round = max(1, round(cfg.participation * cfg.clients.count))
        if resolve_workers(cfg.local.workers, fed.device, per_round) > 1:
            start_fork_server()  # its imports overlap the data loading below
        data = fed.load_data() if data is None else data
        # the poisoning harness ([attack], runtime/poison.py): who attacks, and how
        attack = cfg.attack
        self.poison = None
        if attack.kind != "none":
            self.poison = Poisoning(attack, cfg.clients.count, cfg.seed)
            log.info("attack: %s by clients %s", attack.kind, self.poison.attackers)
            if attack.kind == "label_flip":
                data = flip_labels(data, self.poison.attackers)
        self.data = data
        shape, classes = data.input_shape, data.num_classes

        self.models = fed.models(shape, classes)
        self.client = fed.client_role(shape, classes)
        self.joins = fed.joins(self.client, self.models, data.train_sizes)
        if self.poison is not None and attack.kind == "sample_count_lie":
            self.joins = lie_about_counts(
                self.joins, self.poison.attackers, attack.scale, cfg.defense.max_samples
            )
        self.server = fed.server_role(self.joins, self.models, shape, classes)
        store = fed.initial_states(self.client, self.models)
        self.transport = InMemoryTransport(
            self.client, store, self.groups, self.group, data, self.models, self.reference
        )
        # decentralized algorithms: no server, gossip over a graph (runtime/gossip.py)
        self.driver = fed.driver(self.server, self.transport)
        if self.poison is not None:
            self.poison.updates = self.server.model_updates()
            if attack.kind in UPDATE_ATTACKS and not self.poison.updates:
                log.warning(
                    "attack.kind = %s: %s declares no model updates (Server.model_updates); "
                    "its attackers reply honestly",
                    attack.kind,
                    cfg.algorithm.name,
                )
            self.transport.poison = self.poison
            self.driver.extra_groups = self.poison.groups()
        self.gossip = self.driver.gossip
        self.bytes_join = sum(payload_bytes(p) for p in self.joins.values())
        self.driver.totals["bytes_up"] += self.bytes_join
        workers = resolve_workers(cfg.local.workers, self.device, per_round)
        if workers > 1 and stochastic_models(self.models, cfg.local.workers, self.vectorize):
            workers = 1
        if workers > 1 and registered_here(cfg, cfg.local.workers):
            workers = 1
        if workers > 1:  # runtime/parallel.py; started on the first round
            split = self.client.splits_groups
            self.transport.parallel = ParallelFit(workers, worker_chunks, (cfg,), data, split)
        self.workers = workers
        # one torch thread for every computation on a CPU, in this process as in the workers:
        # the summation order, hence every result, is then that of workers = 1 at any thread
        # or worker count (a multi-threaded convolution may sum in another order)
        self.threads = 1 if self.device.type == "cpu" else None

    def compute_line(self) -> str:
        """Where this simulation computes, for a run's header line."""
        if self.threads is None:
            return f"device {self.device}"
        procs = f"{self.workers} worker processes" if self.workers > 1 else "1 process"
        cores = available_cores()
        return f"CPU, {procs} x 1 thread ({cores} core{'s' * (cores != 1)} available)"

    @contextlib.contextmanager
    def computing(self) -> Iterator[None]:
        """The block runs as every computation of this simulation does: channels-last where
        it is on (``local.channels_last``), one torch thread on a CPU (restored after)."""
        before = torch.get_num_threads()
        if self.threads is not None and before != self.threads:
            torch.set_num_threads(self.threads)
        try:
            with channels_last(self.nhwc):
                yield
        finally:
            if torch.get_num_threads() != before:
                torch.set_num_threads(before)

    def close(self) -> None:
        """Stop the worker processes (``local.workers``); a later round starts them anew."""
        if self.transport.parallel is not None:
            self.transport.parallel.close()

    @property
    def store(self) -> dict[int, dict[str, Tensor]]:
        """Every client's persistent state, by client id (the transport holds it)."""
        return self.transport.store

    @store.setter
    def store(self, store: dict[int, dict[str, Tensor]]) -> None:
        self.transport.store = store

    @property
    def totals(self) -> dict[str, int]:
        return self.driver.totals

    @property
    def setup_info(self) -> dict[str, Any]:
        return self.driver.setup_info

    def group(self, name: str, cids: list[int], rnd: int) -> ClientGroup:
        """The ClientGroup of ``cids`` (all of architecture ``name``) in round ``rnd``."""
        return self.federation.group(self.models[name], cids, self.data, rnd)

    def states(self, cids: list[int]) -> dict[str, Tensor]:
        """The stored client state of ``cids``, stacked."""
        return self.transport.states(cids)

    def run_round(self, rnd: int) -> RoundResult:
        with self.computing():
            return self.driver.run_round(rnd)

    def heavy_phases(self) -> list[PhaseCost]:
        """What the client role's known heavy phases (``Client.heavy_phases(group)``, where a
        method has them: the distillation methods) will cost, per architecture group, from a
        short timed probe on this machine; empty for other methods."""
        probe = getattr(self.client, "heavy_phases", None)
        if probe is None:
            return []
        with self.computing():
            return [c for n, cids in self.groups.items() for c in probe(self.group(n, cids, 1))]

    def estimate(self, budget_s: float = 1.0) -> list[PhaseCost]:
        """What the whole run will cost on this machine, from short timed probes: the heavy
        phases (:meth:`heavy_phases`), the rounds (a few run here, :func:`timed_probe` as the
        distillation probes use it; for a method with a heavy phase every round, that phase
        stands for the round) and the evaluations (one timed). It runs rounds on this
        federation: call it on a Simulation that is then discarded (``reproduce --dry-run``)."""
        import time

        from hyperfed.distill.synthesis import timed_probe

        cfg = self.cfg
        costs = self.heavy_phases()
        if not costs:
            self.run_setup()  # cheap without a heavy phase (a distilled set is not made here)
        if not any(c.per_round for c in costs):
            done = 0

            def rounds(n: int) -> None:
                nonlocal done
                for _ in range(n):
                    done += 1
                    self.run_round(done)

            seconds = timed_probe(rounds, cfg.rounds, budget_s)
            costs.append(PhaseCost(f"{cfg.rounds} rounds of training", seconds))
        evals = cfg.rounds // cfg.eval_every + (cfg.rounds % cfg.eval_every > 0)
        t0 = time.perf_counter()
        self.evaluate("test")
        seconds = (time.perf_counter() - t0) * evals
        costs.append(PhaseCost(f"{evals} evaluations", seconds))
        return costs

    def run_setup(self) -> dict[str, Any]:
        """The one-off setup exchanges before round 1 (base.py); their bytes count."""
        with self.computing():
            return self.driver.run_setup()

    def evaluate(self, split: str = "test") -> dict[str, Any]:
        """Every client's personalized model on its own split (DESIGN: what accuracy means)."""
        with self.computing():
            return self.driver.evaluate(split)

    # -- checkpoints -------------------------------------------------------------------
    def state_dict(self, rnd: int) -> dict[str, Any]:
        return {
            **self.driver.state_dict(rnd),
            "store": {c: {k: v.cpu() for k, v in s.items()} for c, s in self.store.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> int:
        rnd = self.driver.load_state_dict(state)
        self.store.clear()
        self.store.update(
            {
                int(c): {k: v.to(self.device) for k, v in s.items()}
                for c, s in state["store"].items()
            }
        )
        return rnd

    def elapsed(self) -> float:
        return self.driver.elapsed()

    # -- the loop ----------------------------------------------------------------------
    def run(
        self,
        run_dir: RunDir | None = None,
        *,
        start_round: int = 0,
        on_round: Callable[[int, RoundResult, dict[str, Any] | None], None] | None = None,
    ) -> list[dict[str, Any]]:
        """Rounds ``start_round+1 .. rounds``; returns the evaluation records."""
        cfg = self.cfg
        if run_dir is not None and start_round == 0:
            run_dir.create(to_toml(cfg))
        if run_dir is not None:
            run_dir.note_machine(start_round, self.device)
        tensorboard = open_tensorboard(run_dir.path) if cfg.tensorboard and run_dir else None
        tracking = open_tracking(cfg, run_dir.path if run_dir else None, start_round)  # MLflow, W&B

        def to_trackers(rnd: int, record: dict[str, Any]) -> None:
            if tensorboard is not None:
                for key, value in record.items():
                    if isinstance(value, int | float) and key != "round":
                        tensorboard.add_scalar(key, value, rnd)
            if tracking is not None:
                tracking.log(rnd, record)

        status = "FAILED"
        try:
            with self.computing():
                records = self.driver.run(
                    cfg.rounds,
                    cfg.eval_every,
                    start_round=start_round,
                    run_dir=run_dir,
                    checkpoint_every=cfg.checkpoint_every,
                    checkpoint=self.state_dict,
                    on_round=on_round,
                    on_record=to_trackers,
                )
            status = "FINISHED"
        except KeyboardInterrupt:
            status = "KILLED"
            raise
        finally:
            self.close()
            if tracking is not None:
                tracking.close(status)
        if tensorboard is not None:
            tensorboard.close()
        return records


def worker_chunks(cfg: ExperimentConfig, data: FederatedData) -> ChunkFn:
    """A worker process's side of ``local.workers``: the client role, models and groups built
    by the same :class:`Federation` as the main process's (on the CPU), hosted by the same
    :class:`ClientHost` (its one-group operations, on chunks)."""
    fed = Federation(cfg, torch.device("cpu"))
    models = fed.models(data.input_shape, data.num_classes)
    client = fed.client_role(data.input_shape, data.num_classes)
    fed.joins(client, models, data.train_sizes)  # as the main process (a role may note them)

    def make_group(name: str, cids: list[int], rnd: int) -> ClientGroup:
        return fed.group(models[name], cids, data, rnd)

    return run_chunk(ClientHost(client, {}, make_group, models, data, fed.nhwc))


def open_tensorboard(path: Path | None = None) -> Any:
    """TensorBoard event files in the run directory (``tensorboard = true``); without a path,
    only checks that the package is there (before any work is done)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError(
            "tensorboard: the tensorboard package is missing; pip install 'hyperfed[tensorboard]'"
        ) from None
    return None if path is None else SummaryWriter(log_dir=str(path / "tensorboard"))


def resume(path: str | Path, sets: Iterable[str] = ()) -> tuple[Simulation, RunDir, int]:
    """Rebuild a run from its directory and load its last checkpoint. ``sets`` may change
    ``rounds`` alone (``--set rounds=N``: a finished run extended to N rounds, its metrics
    continued); any other change is refused in one line, and so is an N below the
    checkpoint's round. Nothing in the directory changes before the run is rebuilt."""
    from hyperfed.config import load_config

    run_dir = RunDir(path)
    config = run_dir.path / "config.toml"
    cfg = load_config(config)
    extended = load_config(config, list(sets)) if sets else cfg
    changed = changed_keys(cfg, extended)
    if set(changed) - {"rounds"}:  # checked first: the cheapest refusal
        raise RunDirError(
            f"--resume {run_dir.path}: --set may change only rounds (to extend the run), not "
            f"{', '.join(k for k in changed if k != 'rounds')}; start a new run with --out"
        )
    state = run_dir.load_checkpoint()  # verified first: nothing is built for a bad one
    if state is None:
        # a resume that cannot resume changes nothing (a Flower run directory has no checkpoint)
        raise RunDirError(
            f"{run_dir.path} has no checkpoint to resume from; start the run anew with "
            f"--out {run_dir.path} --force"
        )
    # a checkpoint with a valid checksum whose state is not this run's (another version's
    # layout, or crafted): one line, nothing changed
    foreign = (
        f"checkpoint {run_dir.path / CHECKPOINT} is unusable: its state does not fit this "
        f"run ({cfg.algorithm.name})"
    )
    if not isinstance(state, dict) or type(state.get("round")) is not int:
        raise RunDirError(
            f"{foreign} (no round number); start the run anew with --out {run_dir.path} --force"
        )
    if extended.rounds < int(state["round"]):
        raise RunDirError(
            f"--set rounds={extended.rounds}: {run_dir.path} has run {state['round']} rounds "
            "already; rounds can only grow past them"
        )
    sim = Simulation(extended)
    try:
        start = sim.load_state_dict(state)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, RuntimeError) as e:
        why = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        raise RunDirError(
            f"{foreign} ({why}); start the run anew with --out {run_dir.path} --force"
        ) from None
    if changed:
        run_dir.rebind_config(to_toml(extended))
    run_dir.truncate_metrics(start)
    return sim, run_dir, start


def changed_keys(a: ExperimentConfig, b: ExperimentConfig) -> list[str]:
    """The ``--set`` keys whose resolved values differ between two configs."""
    from hyperfed.config import flat_keys

    fa, fb = (flat_keys(c.model_dump(mode="json")) for c in (a, b))
    return sorted(k for k in fa.keys() | fb.keys() if fa.get(k) != fb.get(k))
