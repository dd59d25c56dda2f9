"""Long-lived ClientApps (issue 39 item 3): a deployed SuperNode runs its ClientApp in one
process for the whole run (``--isolation process`` + ``hyperfed.deploy.clientapp``), which
builds its client once and keeps it between messages.

Skipped as a whole when Flower is not installed (``pip install 'hyperfed[flower]'``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason="Flower is not installed: pip install 'hyperfed[flower]'")

from flwr.app import Context, RecordDict  # noqa: E402

from hyperfed.config import load_config  # noqa: E402
from hyperfed.deploy import appconfig  # noqa: E402
from hyperfed.deploy import node as client_side  # noqa: E402
from hyperfed.deploy.appconfig import experiment_run_config  # noqa: E402
from hyperfed.deploy.launch import (  # noqa: E402
    LONG_LIVED,
    PER_MESSAGE,
    DeployError,
    LocalDeployment,
    _group_alive,
    remote_commands,
    supernode_command,
)
from hyperfed.runtime.rundir import read_metrics  # noqa: E402
from hyperfed.runtime.simulate import Simulation  # noqa: E402

FEDPER = [
    "device=cpu",
    "seed=0",
    "rounds=2",
    "eval_every=2",
    "dataset.name=digits",
    "partition.name=quantity",
    "partition.classes_per_client=3",
    "clients.count=3",
    "clients.models=lenet",
    "algorithm.name=fedper",
    "local.epochs=1",
    "local.batch_size=32",
    "local.lr=0.05",
]


@pytest.fixture(scope="module")
def cfg():
    return load_config(None, FEDPER)


def _context(cfg, cid: int, run_id: int, state: RecordDict | None = None) -> Context:
    return Context(
        run_id=run_id,
        node_id=100 + cid,
        node_config={"partition-id": cid, "num-partitions": cfg.clients.count},
        state=RecordDict() if state is None else state,
        run_config=experiment_run_config(cfg),
    )


def _builds(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_client_is_built_once_per_run_and_rebuilt_for_a_new_run(cfg, tmp_path, monkeypatch):
    """Messages of one run reuse the built client (one build line); a new run id builds anew
    and drops the old run's client; the client's state still lives in context.state."""
    log = tmp_path / "builds.jsonl"
    monkeypatch.setenv(appconfig.BUILD_LOG_ENV, str(log))
    client_side._RUNTIMES.clear()
    ctx = _context(cfg, 1, run_id=7)
    first = client_side._runtime(ctx)
    msg = Simulation(cfg).server.configure_train(1, [1])[1]
    for rnd in (1, 2, 3):
        assert client_side._runtime(ctx) is first
        first.fit(rnd, {1: msg}, ctx)
    assert [(b["run"], b["client"]) for b in _builds(log)] == [(7, 1)]
    assert (
        f"{client_side.STATE}.1" in ctx.state.array_records
    )  # the context's state, not the cache's

    other = client_side._runtime(_context(cfg, 1, run_id=8))
    assert other is not first
    assert [(b["run"], b["client"]) for b in _builds(log)] == [(7, 1), (8, 1)]
    assert list(client_side._RUNTIMES) == [(8, 1, cfg.clients.count)]  # run 7's client dropped


def test_the_cached_client_trains_as_a_fresh_one_would(cfg):
    """Round 2 on the cached client equals round 2 on a client built afresh (what a process
    per message does) from the same context state: caching changes no number."""
    import torch

    client_side._RUNTIMES.clear()
    msg = Simulation(cfg).server.configure_train(1, [0])[0]
    ctx = _context(cfg, 0, run_id=11)
    cached = client_side._runtime(ctx)
    cached.fit(1, {0: msg}, ctx)
    key = f"{client_side.STATE}.0"
    state_after_1 = RecordDict({key: ctx.state.array_records[key]})
    fresh_ctx = _context(cfg, 0, run_id=12, state=state_after_1)
    got = cached.fit(2, {0: msg}, ctx)[0][0]
    client_side._RUNTIMES.clear()
    want = client_side._runtime(fresh_ctx).fit(2, {0: msg}, fresh_ctx)[0][0]
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in got)


def test_supernode_isolation_follows_the_clientapp_mode(tmp_path, cfg):
    long = supernode_command("127.0.0.1:1", 0, 3, 9000, clientapp=LONG_LIVED)
    per = supernode_command("127.0.0.1:1", 0, 3, 9000, clientapp=PER_MESSAGE)
    assert long[long.index("--isolation") + 1] == "process"
    assert per[per.index("--isolation") + 1] == "subprocess"
    with pytest.raises(ValueError, match="long-lived, per-message"):
        supernode_command("127.0.0.1:1", 0, 3, 9000, clientapp="pooled")
    with pytest.raises(DeployError, match="long-lived, per-message"):
        LocalDeployment(cfg, tmp_path, tmp_path, 3, 3, clientapp="pooled")
    text = remote_commands(tmp_path / "app", 3)
    assert "--isolation process --port 9094" in text
    assert "python -m hyperfed.deploy.clientapp --runtime-api-address 127.0.0.1:9094" in text


@pytest.mark.slow
def test_a_deployed_node_keeps_one_clientapp_process_for_the_whole_run(cfg, tmp_path):
    """Three SuperNodes, two rounds (join, 2 x train, evaluate: 4 messages per node): each
    node's client is built once, in its long-lived ClientApp process, and the run ends with
    the simulator's per-client accuracies."""
    expected = Simulation(cfg).run()
    d = LocalDeployment(
        cfg,
        tmp_path / "flower",
        tmp_path / "run",
        nodes=3,
        num_partitions=3,
        threads=1,
        join_timeout=120,
        round_timeout=150,
    )
    try:
        d.start()
        apps = {int(n.name.rsplit("-", 1)[1]): m for n in d.supernodes for m in n.members}
        status = d.wait(d.submit(), timeout=900)
        assert status == "finished:completed", d.logs()
        builds = _builds(tmp_path / "flower" / "logs" / "builds.jsonl")
        assert sorted(b["client"] for b in builds) == [0, 1, 2], builds
        assert {b["client"]: b["pid"] for b in builds} == {c: p.pid for c, p in apps.items()}
        assert all(p.alive() for p in apps.values())
        got = read_metrics(tmp_path / "run")
        for a, b in zip(expected, got, strict=True):
            assert b["client_acc"] == pytest.approx(a["client_acc"], abs=1e-4)
            assert b["bytes_up_total"] == a["bytes_up_total"]
    finally:
        d.stop()
    pids = [p.pid for n in d.processes for p in (n, *n.members)]
    assert not [pid for pid in pids if _group_alive(pid)], "processes left running"
