"""local.workers: clients trained in worker processes give what one process gives."""

from __future__ import annotations

import os

import pytest
import torch

from hyperfed.config import ConfigError, load_config
from hyperfed.runtime.parallel import (
    WorkerError,
    WorkerPool,
    chunks,
    resolve_workers,
    stochastic_models,
)
from hyperfed.runtime.simulate import Simulation, build_models

BASE = [
    "device=cpu",
    "dataset.name=digits",
    "dataset.subsample=400",
    "partition.name=iid",
    "local.epochs=1",
    "local.batch_size=16",
    "local.lr=0.05",
    "eval_every=1",
    "rounds=2",
    "seed=5",
]


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread in the main process, as each worker has: the reduction order of a
    step is then the same on both sides, so the comparison below can be bitwise."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _run(workers: int, *overrides: str) -> tuple[Simulation, list[dict], list[list[int]]]:
    sim = Simulation(load_config(None, [*BASE, *overrides, f"local.workers={workers}"]))
    pids: list[list[int]] = []

    def on_round(rnd: int, result: object, record: object) -> None:
        pool = sim.transport.parallel.pool if sim.transport.parallel else None
        pids.append([p.pid for p in pool.procs] if pool else [])

    records = sim.run(on_round=on_round)
    return sim, records, pids


def _same(a: Simulation, b: Simulation, ra: list[dict], rb: list[dict]) -> None:
    assert len(ra) == len(rb) == 2
    for x, y in zip(ra, rb):
        diff = {k: (x[k], y[k]) for k in x if k != "seconds" and x[k] != y[k]}
        assert not diff, f"records differ: {diff}"
    assert a.store.keys() == b.store.keys()
    for c in a.store:
        for k, v in a.store[c].items():
            assert torch.equal(v, b.store[c][k]), f"client {c} state {k} differs"
    sa, sb = a.server.state_dict(), b.server.state_dict()
    assert sa.keys() == sb.keys()
    for k, v in sa.items():
        pairs = [(v, sb[k])] if isinstance(v, torch.Tensor) else []
        if isinstance(v, dict):
            pairs = [(t, sb[k][n]) for n, t in v.items() if isinstance(t, torch.Tensor)]
        for x, y in pairs:
            assert torch.equal(x, y), f"server {k} differs"


def test_fedavg_with_two_workers_is_bitwise_the_one_process_run():
    # 5 clients in 2 workers: chunks of 3 and 2; the records (accuracies, losses, FLOPs,
    # bytes) and the global model equal the one-process run's exactly
    one, r1, _ = _run(1, "algorithm.name=fedavg", "clients.models=lenet", "clients.count=5")
    two, r2, pids = _run(2, "algorithm.name=fedavg", "clients.models=lenet", "clients.count=5")
    (theta,) = two.server.state_dict()["theta"].values()
    assert not torch.equal(theta, one.models["lenet"].initial_params())
    _same(one, two, r1, r2)
    assert r2[0]["flops_round"] > 0
    # one pool for the whole run (the same processes in both rounds), stopped at its end
    assert len(pids) == 2 and len(pids[0]) == 2 and pids[0] == pids[1]
    assert two.transport.parallel is not None and two.transport.parallel.pool is None
    for pid in pids[0]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_personalized_heterogeneous_partial_participation_matches():
    # MH-pFedHN (a hypernetwork server, deltas up), two architectures, 4 of 7 clients a
    # round: every group is chunked; the hypernetwork and the stored states match exactly
    args = (
        "algorithm.name=mh_pfedhn",
        'clients.models=["lenet","mlp"]',
        "clients.count=7",
        "participation=0.6",
    )
    one, r1, _ = _run(1, *args)
    two, r2, _ = _run(2, *args)
    assert any(len(set(r["replied"])) < 7 for r in r2)
    _same(one, two, r1, r2)


def test_chunks_are_contiguous_and_balanced():
    ids = [3, 4, 8, 9, 11]
    assert chunks(ids, 2) == [[3, 4, 8], [9, 11]]
    assert chunks(ids, 8) == [[c] for c in ids]
    assert chunks(ids, 1) == [ids]
    assert sum(chunks(list(range(17)), 4), []) == list(range(17))


def test_resolve_workers():
    cpu = torch.device("cpu")
    assert resolve_workers(3, cpu, 100) == 3
    assert resolve_workers("auto", cpu, 1) == 1  # never more workers than clients a round
    assert 1 <= resolve_workers("auto", cpu, 1000) <= (os.cpu_count() or 1)
    assert resolve_workers("auto", torch.device("cuda"), 100) == 1
    with pytest.raises(ConfigError, match="local.workers"):
        resolve_workers(2, torch.device("cuda"), 100)
    with pytest.raises(ConfigError, match="local.workers"):
        load_config(None, ["local.workers=0"])


def test_dropout_models_refuse_explicit_workers_only_when_vmapped():
    # a vmapped step draws every client's dropout masks from one process's stream: workers
    # could not match; the client loop seeds each client's masks, so it needs no refusal
    cfg = load_config(None, [*BASE, "clients.models=squeezenet1_1"])
    models = build_models(cfg, (3, 32, 32), 10, torch.device("cpu"))
    with pytest.raises(ConfigError, match="dropout"):
        stochastic_models(models, 2, vectorize=True)
    assert stochastic_models(models, "auto", vectorize=True) == ["squeezenet1_1"]  # one process
    assert stochastic_models(models, 2, vectorize=False) == []
    lenet = build_models(load_config(None, BASE), (1, 8, 8), 10, torch.device("cpu"))
    assert stochastic_models(lenet, 2, vectorize=True) == []


def test_a_dropout_model_trains_in_workers_exactly_as_in_one_process():
    # SqueezeNet 1.1 (Dropout 0.5 before its classifier), FedAvg, 4 clients in 2 workers: the
    # client loop seeds each client's masks by (run, round, client), so chunking changes nothing
    from hyperfed.bench import synthetic_federation

    data = synthetic_federation(4, 24, (3, 20, 20), 10)
    args = ["algorithm.name=fedavg", "clients.models=squeezenet1_1", "clients.count=4"]
    runs = []
    for workers in (1, 2):
        cfg = load_config(None, [*BASE, *args, f"local.workers={workers}"])
        sim = Simulation(cfg, data=data)
        records = sim.run()
        assert (sim.transport.parallel is not None) == (workers == 2)
        runs.append((sim, records))
    (one, r1), (two, r2) = runs
    _same(one, two, r1, r2)


# -- the pool on its own: errors come back as one line, never a hang ------------------------------
def _init(mode: str, data: object):
    if mode == "bad-init":
        raise KeyError("no such algorithm")

    def run(name: str, cids: list[int], rnd: int, msgs: list, state: dict) -> tuple:
        if mode == "raise" and rnd == 2:
            raise ValueError("client 7 diverged")
        if mode == "crash" and rnd == 2:
            os._exit(3)
        return {"x": torch.full((len(cids),), float(rnd))}, {}, torch.zeros(len(cids)), 0

    return run


def _pool(mode: str) -> WorkerPool:
    from hyperfed.bench import synthetic_federation

    return WorkerPool(2, _init, (mode,), synthetic_federation(2, 4, (1, 4, 4), 2))


def test_pool_reraises_a_worker_exception_and_survives_a_crash_with_one_line():
    pool = _pool("raise")
    task = ("m", [0, 1], 1, [], {})
    out = pool.map([task, task, task], str)  # 3 tasks on 2 workers, in task order
    assert [float(r[0]["x"][0]) for r in out] == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="client 7 diverged"):
        pool.map([("m", [0], 2, [], {})], str)
    assert pool.closed  # a failed round stops the pool

    pool = _pool("crash")
    with pytest.raises(WorkerError) as e:
        pool.map([("m", [4, 5], 2, [], {}), ("m", [6], 1, [], {})], lambda t: f"task {t}")
    msg = str(e.value)
    assert "\n" not in msg and "exit code 3" in msg and "local.workers = 1" in msg
    assert pool.closed

    with pytest.raises(WorkerError, match="could not build"):
        _pool("bad-init")


def test_the_default_gives_one_result_at_any_worker_or_thread_count(monkeypatch):
    # local.workers = auto (the default) on 2 available cores against one process, both
    # called from a process at 2 torch threads (a multi-threaded convolution's backward sums
    # in another order than a one-thread one): every computation runs on one thread in both,
    # so the per-client accuracies and the global model agree bitwise, and the caller's
    # thread count is given back
    args = ("algorithm.name=fedavg", "clients.models=lenet", "clients.count=4")
    monkeypatch.setenv("HYPERFED_CORES", "2")
    torch.set_num_threads(2)
    cfg = load_config(None, [*BASE, *args])
    assert cfg.local.workers == "auto"
    auto = Simulation(cfg)
    assert auto.workers == 2 and "2 worker processes x 1 thread" in auto.compute_line()
    r_auto = auto.run()
    assert torch.get_num_threads() == 2
    one, r_one, _ = _run(1, *args)
    assert torch.get_num_threads() == 2
    _same(one, auto, r_one, r_auto)


def test_auto_shares_the_machine_by_hyperfed_cores(monkeypatch):
    monkeypatch.setenv("HYPERFED_CORES", "1")
    assert resolve_workers("auto", torch.device("cpu"), 100) == 1
    monkeypatch.setenv("HYPERFED_CORES", "two")
    with pytest.raises(ConfigError, match="HYPERFED_CORES='two'"):
        resolve_workers("auto", torch.device("cpu"), 100)


def test_a_role_that_batches_its_clients_keeps_its_groups_whole_in_workers(small_sim):
    # FedDM distills every client of a group through one sampled model at once: cut into
    # chunks, its arithmetic (and here one client's accuracy) changed; Client.splits_groups
    # keeps the group whole, so 2 workers give what one process gives
    def run(workers: int) -> tuple[Simulation, list[dict]]:
        sim = small_sim("feddm", "lenet", f"local.workers={workers}")
        return sim, sim.run()

    one, r1 = run(1)
    two, r2 = run(2)
    assert two.transport.parallel is not None
    _same(one, two, r1, r2)
