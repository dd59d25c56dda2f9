"""Flower deployment: payload <-> record codec, the ClientApp's replies, and real loopback
deployments (a SuperLink and SuperNodes as separate processes on 127.0.0.1).

Skipped as a whole when Flower is not installed (``pip install 'hyperfed[flower]'``)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("flwr", reason="Flower is not installed: pip install 'hyperfed[flower]'")

from flwr.app import ConfigRecord, Context, Message, Metadata, RecordDict  # noqa: E402
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects  # noqa: E402
from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents  # noqa: E402

from hyperfed.config import ConfigError, load_config  # noqa: E402
from hyperfed.deploy import appconfig  # noqa: E402
from hyperfed.deploy import node as client_side  # noqa: E402
from hyperfed.deploy import records as wire  # noqa: E402
from hyperfed.deploy import server as server_side  # noqa: E402
from hyperfed.deploy.appconfig import (  # noqa: E402
    CLIENTAPP,
    SERVERAPP,
    RunSettings,
    experiment_run_config,
)
from hyperfed.deploy.launch import LocalDeployment, _group_alive  # noqa: E402
from hyperfed.runtime.rundir import read_machines, read_metrics  # noqa: E402
from hyperfed.runtime.simulate import Simulation  # noqa: E402

# digits, 3 heterogeneous clients, 3 rounds; one evaluation at the end (fewer messages)
SETTINGS = [
    "device=cpu",
    "seed=0",
    "rounds=3",
    "eval_every=3",
    "dataset.name=digits",
    "partition.name=quantity",
    "partition.classes_per_client=3",
    "clients.count=3",
    'clients.models=["lenet", "mlp"]',
    "algorithm.name=mh_pfedhn",
    "local.epochs=1",
    "local.batch_size=32",
    "local.lr=0.05",
]


@pytest.fixture(scope="module")
def cfg():
    return load_config(None, SETTINGS)


# -- the codec ----------------------------------------------------------------------------------


def _over_the_wire(content: RecordDict) -> RecordDict:
    """Deflate every object as Flower does before sending, then inflate them again."""
    objects = get_all_nested_objects(content)
    contents = {oid: obj.deflate() for oid, obj in objects.items()}
    out = inflate_object_from_contents(content.object_id, contents)
    assert isinstance(out, RecordDict)
    return out


def test_payload_record_round_trip_is_exact():
    g = torch.Generator().manual_seed(0)
    payload = {
        "theta": torch.randn(1000, generator=g),
        "double": torch.randn(3, 4, generator=g, dtype=torch.float64),
        "num_params": torch.tensor(26358, dtype=torch.int64),  # 0-d scalar
        "delta_idx": torch.randint(0, 1000, (30,), generator=g, dtype=torch.int32),
        "mask": torch.rand(7, generator=g) > 0.5,
        "half": torch.randn(5, generator=g).to(torch.bfloat16),  # numpy has no bfloat16
        "empty": torch.zeros(0, 3),
        "special": torch.tensor([float("inf"), -0.0, 1e-45, float("nan")]),
    }
    back = wire.record_to_payload(_over_the_wire(wire.payload_to_record(payload)))
    assert list(back) == list(payload)
    for k, v in payload.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape, k
        assert torch.equal(back[k].view(-1).view(torch.uint8), v.view(-1).view(torch.uint8)), k
    assert wire.record_to_payload(wire.payload_to_record({})) == {}
    # no bytes at all (Flower sends an empty array with stride 0)
    only_empty = wire.record_to_payload(
        _over_the_wire(wire.payload_to_record({"e": torch.zeros(0, 2)}))
    )
    assert only_empty["e"].shape == (0, 2) and only_empty["e"].dtype == torch.float32


def test_a_payload_travels_as_a_few_objects_whatever_its_tensor_count():
    """Flower sends each Array as its own objects, one request each per hop: a payload of 10
    tensors packs into one record of two arrays (the record, two arrays, a chunk each = 5
    objects; one Array per tensor made 21)."""
    from flwr.supercore.inflatable.inflatable_object import get_object_tree
    from flwr.supercore.inflatable.inflatable_utils import iterate_object_tree

    payload = {f"layer{i}": torch.randn(4, 3) for i in range(10)}
    record = wire.payload_to_record(payload)[wire.PAYLOAD]
    assert len(list(iterate_object_tree(get_object_tree(record)))) == 5


def test_a_group_message_travels_bundled_and_comes_back_the_same():
    """A node's reply for 10 clients: 10 payload records + 10 metrics records (one empty: the
    node answered without metrics) + a config record. Bundled it is a few objects whatever the
    client count (unbundled: 4 a client); unbundled again, every record is what it was."""
    from flwr.app import ConfigRecord, MetricRecord
    from flwr.supercore.inflatable.inflatable_object import get_object_tree
    from flwr.supercore.inflatable.inflatable_utils import iterate_object_tree

    def count(content: RecordDict) -> int:
        return len(list(iterate_object_tree(get_object_tree(content))))

    g = torch.Generator().manual_seed(0)
    content = RecordDict()
    for c in range(10):
        payload = {"body": torch.randn(5, generator=g), "n": torch.tensor(c)}
        content[wire.client_key(wire.PAYLOAD, c)] = wire.pack_tensors(payload)
        content[wire.client_key(wire.METRICS, c)] = MetricRecord(
            {"train_loss": 0.5 + c} if c else {}
        )
    content[wire.CONFIG] = ConfigRecord({"round": 3})
    sent = _over_the_wire(wire.bundle(content))
    assert count(sent) <= 9 < count(content)
    back = wire.unbundle(sent)
    assert sorted(back) == sorted(content)
    for c in range(10):
        want = wire.record_to_payload(wire.client_view(content, c))
        got = wire.record_to_payload(wire.client_view(back, c))
        assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
        assert dict(back[wire.client_key(wire.METRICS, c)]) == dict(
            content[wire.client_key(wire.METRICS, c)]
        )
    assert dict(back[wire.CONFIG]) == {"round": 3}
    assert wire.unbundle(content) is content  # not bundled: as it is


def test_a_record_from_another_format_is_refused_in_one_line():
    from flwr.app import Array, ArrayRecord

    old = ArrayRecord({"theta": Array(np.zeros(3, dtype=np.float32))})
    with pytest.raises(ValueError, match="not a hyperfed tensor record .*same version"):
        wire.unpack_tensors(old)


# -- the ClientApp, called in-process -----------------------------------------------------------


def _context(cfg, cid: int, run_id: int) -> Context:
    return Context(
        run_id=run_id,
        node_id=100 + cid,
        node_config={"partition-id": cid, "num-partitions": cfg.clients.count},
        state=RecordDict(),
        run_config=experiment_run_config(cfg),
    )


def _message(content: RecordDict, kind: str, node: int) -> Message:
    """A message as a SuperNode hands it to the ClientApp (sent by the server, node 1)."""
    meta = Metadata(
        run_id=1,
        message_id="m" * 64,
        src_node_id=1,
        dst_node_id=node,
        reply_to_message_id="",
        group_id="test",
        created_at=time.time(),
        ttl=3600.0,
        message_type=kind,
    )
    return Message(content, metadata=meta)


def test_mh_pfedhn_client_sends_its_size_at_join_and_only_its_update_after_fit(cfg):
    sim = Simulation(cfg)
    cid = 1  # an MLP client
    fm = sim.models[sim.arch_of[cid]]
    ctx = _context(cfg, cid, run_id=4242)

    reply = client_side.client_app(_message(RecordDict(), wire.JOIN, ctx.node_id), ctx)
    assert not reply.has_error(), reply.error.reason if reply.has_error() else ""
    # a group message of one client: its join payload and an empty metrics record
    answer = wire.unbundle(reply.content)
    assert set(answer.array_records) == {wire.client_key(wire.PAYLOAD, cid)}
    assert {k: dict(v) for k, v in answer.metric_records.items()} == {
        wire.client_key(wire.METRICS, cid): {}
    }
    assert {k: dict(v) for k, v in answer.config_records.items()} == {
        wire.NODE: {"partition-ids": [cid]}
    }
    join = wire.record_to_payload(wire.client_parts(reply.content, [cid])[cid])
    assert set(join) == {"num_params", "num_samples"}  # Client.join: no architecture
    assert int(join["num_params"]) == fm.num_params
    assert int(join["num_samples"]) == sim.data.train_sizes[cid]

    msg = sim.server.configure_train(1, [cid])[cid]
    config = ConfigRecord({"round": 1, "client-ids": [cid]})
    content = wire.group_message({cid: wire.payload_to_record(msg)}, {wire.CONFIG: config})
    reply = client_side.client_app(_message(content, wire.TRAIN, ctx.node_id), ctx)
    assert not reply.has_error(), reply.error.reason if reply.has_error() else ""
    answer = wire.unbundle(reply.content)
    assert set(answer) == {wire.client_key(wire.PAYLOAD, cid), wire.client_key(wire.METRICS, cid)}
    part = wire.client_parts(reply.content, [cid])[cid]
    update = wire.record_to_payload(part)
    assert set(update) == {"delta"}  # only Delta theta_i crosses
    assert update["delta"].shape == (fm.num_params,)
    assert set(part[wire.METRICS]) == {"train_loss", "train_flops"}
    assert sim.server.check_reply(cid, update) is None
    # the client state (BatchNorm statistics) stays on the node, in context.state
    assert f"{client_side.STATE}.{cid}" in ctx.state.array_records

    # the same update as the simulator computes for this client
    group = sim.group(sim.arch_of[cid], [cid], 1)
    expected, _, _ = sim.client.fit(group, {"theta": msg["theta"][None]}, sim.states([cid]))
    torch.testing.assert_close(update["delta"], expected["delta"][0], rtol=1e-5, atol=1e-6)


def test_client_rejects_a_node_config_that_splits_the_data_differently(cfg):
    """In a deployment the SuperNode turns this into an error reply the server logs."""
    ctx = _context(cfg, 0, run_id=4343)
    ctx.node_config["num-partitions"] = 5
    with pytest.raises(ConfigError, match="num-partitions=5 but clients.count=3"):
        client_side.client_app(_message(RecordDict(), wire.JOIN, ctx.node_id), ctx)


def test_flower_app_command_writes_an_app_flower_accepts(cfg, tmp_path):
    from flwr.cli.config_utils import load_and_validate
    from typer.testing import CliRunner

    from hyperfed.cli import app

    sets = [a for s in SETTINGS for a in ("--set", s)]
    out = tmp_path / "app"
    res = CliRunner().invoke(app, ["flower", "app", *sets, "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "flower-supernode --insecure" in res.output and "flwr run" in res.output
    config, _ = load_and_validate(out / "pyproject.toml")  # flwr run's own check
    components = config["tool"]["flwr"]["app"]["components"]
    assert components == {"serverapp": SERVERAPP, "clientapp": CLIENTAPP}
    run_config = config["tool"]["flwr"]["app"]["config"]
    assert (
        appconfig.config_from_run_config(run_config) == cfg
    )  # the experiment travels with the run

    res = CliRunner().invoke(app, ["flower", "app", "--set", "algorithm.name=nope"])
    assert res.exit_code == 2 and "nope" in res.output


# -- real loopback deployments ------------------------------------------------------------------

# the `deployments` fixture (conftest.py) also waits until nothing runs in the test's folder
CHECK_FOLDER = True


def _deploy(cfg, tmp_path: Path, started: list[LocalDeployment]) -> LocalDeployment:
    d = LocalDeployment(
        cfg,
        tmp_path / "flower",
        tmp_path / "run",
        nodes=cfg.clients.count,
        num_partitions=cfg.clients.count,
        threads=1,
        join_timeout=120,
        round_timeout=150,
    )
    started.append(d)
    d.start()
    return d


def _wire(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "wire.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_loopback_deployment_runs_mh_pfedhn_like_the_simulator(cfg, tmp_path, deployments):
    sim = Simulation(cfg)
    start = {k: v.clone() for k, v in sim.server.hnet.state_dict().items()}
    t0 = time.perf_counter()
    d = _deploy(cfg, tmp_path, deployments)
    run_id = d.submit()
    status = d.wait(run_id, timeout=900)
    assert status == "finished:completed", d.logs()
    seconds = time.perf_counter() - t0

    run = tmp_path / "run"
    records = read_metrics(run)
    assert [r["round"] for r in records] == [3]
    final = records[-1]
    assert final["eval_missing"] == [] and final["replied"] == [0, 1, 2]
    assert (run / "summary.md").exists()
    # each client measures its training FLOPs and reports them: the simulator's count; the
    # server's hypernetwork work is measured where it runs, as in the simulator
    simulated = Simulation(cfg).run_round(3)
    assert final["flops_round"] == simulated.flops > 0
    assert final["flops_server_round"] == simulated.server_flops > 0

    log = _wire(run)
    joins = [w for w in log if w["type"] == wire.JOIN]
    assert sorted(w["client"] for w in joins) == [0, 1, 2]
    assert all(set(w["content"][wire.PAYLOAD]) == {"num_params", "num_samples"} for w in joins)
    for rnd in ("1", "2", "3"):
        down = [
            w for w in log if w["type"] == wire.TRAIN and w["group"] == rnd and w["dir"] == "down"
        ]
        up = [w for w in log if w["type"] == wire.TRAIN and w["group"] == rnd and w["dir"] == "up"]
        assert sorted(w["client"] for w in down) == [0, 1, 2]
        # each client gets its own theta_i (its own length, its own values) ...
        assert all(set(w["content"][wire.PAYLOAD]) == {"theta"} for w in down)
        assert len({w["content"][wire.PAYLOAD]["theta"]["id"] for w in down}) == 3
        # ... and sends back only Delta theta_i
        assert sorted(w["client"] for w in up) == [0, 1, 2]
        for w in up:
            assert set(w["content"][wire.PAYLOAD]) == {"delta"}
            fm = sim.models[sim.arch_of[w["client"]]]
            assert w["content"][wire.PAYLOAD]["delta"]["shape"] == [fm.num_params]

    # the server's hypernetwork moved away from its initialization
    end = torch.load(run / server_side.SERVER_STATE, weights_only=False)["server"]["hnet"]
    assert set(start) == set(end)
    assert any(not torch.equal(start[k], end[k]) for k in start)

    # and the run agrees with the simulator on the same config
    sim_final = sim.run()[-1]
    assert final["mean_acc"] == pytest.approx(sim_final["mean_acc"], abs=0.05)
    print(
        f"\nloopback 3 nodes x 3 rounds: {seconds:.1f} s, mean acc {final['mean_acc']:.4f} "
        f"(simulated {sim_final['mean_acc']:.4f})"
    )


@pytest.mark.slow
def test_run_completes_when_a_supernode_dies(cfg, tmp_path, deployments):
    d = _deploy(cfg, tmp_path, deployments)
    run_id = d.submit()
    log = tmp_path / "run" / "server.log"
    deadline = time.monotonic() + 600
    # kill within a moment of round 1 (a long-lived ClientApp makes a round take seconds:
    # no `flwr list` in this loop, it can take longer than a round on a loaded machine)
    while "round 1:" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline, d.logs()
        assert d.processes[0].alive(), d.logs()
        time.sleep(0.2)
    victim = d.supernodes[2]  # serves client 2
    victim.kill()  # SIGKILL to its process group: a crashed machine
    assert not _group_alive(victim.pid)

    status = d.wait(run_id, timeout=900)
    assert status == "finished:completed", d.logs()
    final = read_metrics(tmp_path / "run")[-1]
    assert final["round"] == 3
    assert final["replied"] == [0, 1]
    assert final["eval_missing"] == [2]
    assert "no reply from clients [2]" in log.read_text()  # round 2, then left out
    up = [w for w in _wire(tmp_path / "run") if w["dir"] == "up" and w["type"] == wire.TRAIN]
    assert {w["client"] for w in up if w["group"] == "1"} == {0, 1, 2}
    assert {w["client"] for w in up if w["group"] == "3"} == {0, 1}


# -- run config, data per node, state that survives a restarted server ---------------------------


def test_every_setting_is_a_run_config_key_flwr_run_can_override(cfg, tmp_path):
    from flwr.cli.config_utils import load_and_validate
    from flwr.common.config import flatten_dict, fuse_dicts, parse_config_args

    from hyperfed.deploy.appconfig import write_app

    app = write_app(tmp_path / "app", cfg)
    config, _ = load_and_validate(app / "pyproject.toml")
    defaults = flatten_dict(config["tool"]["flwr"]["app"]["config"])
    assert defaults["rounds"] == 3 and defaults["algorithm.name"] == "mh_pfedhn"
    # what `flwr run APP --run-config "..."` does with the app's keys (Flower's own code)
    cli = ['rounds=50 local.lr=0.2 clients.models="vgg8" local.momentum=0.5']
    fused = fuse_dicts(defaults, parse_config_args(cli))
    got = appconfig.config_from_run_config(fused)
    assert (got.rounds, got.local.lr, got.clients.models, got.local.momentum) == (
        50,
        0.2,
        "vgg8",
        0.5,  # unset (None) in the file, still a key that can be set
    )
    assert (
        got.model_copy(update={"rounds": 3, "local": cfg.local, "clients": cfg.clients}) == cfg
    )  # nothing else moved
    assert appconfig.config_from_run_config(defaults) == cfg  # lists travel too (clients.models)
    with pytest.raises(ValueError, match="not present"):
        fuse_dicts(defaults, parse_config_args(["roundz=5"]))  # Flower refuses unknown keys
    # hyperfed's own keys (RunSettings): written with their defaults, overridden the same way
    assert RunSettings.from_run_config(defaults) == RunSettings()
    fused = fuse_dicts(defaults, parse_config_args(["round-timeout=30.0 clients-per-node=2"]))
    got_settings = RunSettings.from_run_config(fused)
    assert got_settings == RunSettings(round_timeout=30.0, clients_per_node=2)
    with pytest.raises(ConfigError, match="run config min-nodes='many': not a valid int"):
        RunSettings.from_run_config({"min-nodes": "many"})


def test_a_node_holds_only_its_own_clients_samples(cfg):
    from hyperfed.runtime.simulate import load_federation

    full = load_federation(cfg, torch.device("cpu"))
    for cid in range(cfg.clients.count):
        mine = load_federation(cfg, torch.device("cpu"), clients=[cid])
        sizes = [len(t) for t in (full.train_idx[cid], full.val_idx[cid], full.test_idx[cid])]
        assert mine.x.shape[0] == sum(sizes) < full.x.shape[0]
        for split in ("train_idx", "val_idx", "test_idx"):
            a, b = getattr(full, split)[cid], getattr(mine, split)[cid]
            assert torch.equal(full.x[a], mine.x[b]) and torch.equal(full.y[a], mine.y[b])
            others = [t for c, t in enumerate(getattr(mine, split)) if c != cid]
            assert all(t.numel() == 0 for t in others)


def _state_context(cfg, cid: int, run_id: int, run_dir: str) -> Context:
    ctx = _context(cfg, cid, run_id)
    ctx.run_config.update(RunSettings(run_dir=run_dir).to_run_config())
    return ctx


def test_a_resumed_run_gives_each_node_its_state_of_the_checkpoint_round(tmp_path, monkeypatch):
    """fedper keeps the head on the client: after a restart (a new Flower run, an empty
    context) the node continues from its state as of the server's last checkpoint."""
    monkeypatch.setenv(client_side.STATE_DIR_ENV, str(tmp_path / "state"))
    sets = [s for s in SETTINGS if not s.startswith(("algorithm.", "clients.models"))]
    cfg = load_config(
        None, [*sets, "algorithm.name=fedper", "checkpoint_every=2", "clients.models=lenet"]
    )
    client_side._RUNTIMES.clear()
    ctx = _state_context(cfg, 0, run_id=1, run_dir="r")
    rt = client_side._runtime(ctx)
    msg = Simulation(cfg).server.configure_train(1, [0])[0]  # the server's body
    states = {}
    for rnd in (1, 2, 3):  # the server checkpointed round 2, then died in round 3
        rt.fit(rnd, {0: msg}, ctx, checkpoint=2 if rnd == 3 else 0)
        states[rnd] = rt.load_states(ctx, [0])[0]
    assert not torch.equal(states[2]["head"], states[3]["head"])

    client_side._RUNTIMES.clear()  # the restarted run: a new run id, an empty context
    again = _state_context(cfg, 0, run_id=2, run_dir="r")
    rt2 = client_side._runtime(again)
    got = rt2.load_states(again, [0], checkpoint=2)[0]
    assert set(got) == set(states[2])
    assert all(torch.equal(got[k], states[2][k]) for k in got)
    assert not rt2.lost

    # a node whose files are gone starts from its initial state and says so
    client_side._RUNTIMES.clear()
    import shutil

    shutil.rmtree(tmp_path / "state")
    lost = _state_context(cfg, 0, run_id=3, run_dir="r")
    rt3 = client_side._runtime(lost)
    _, metrics = rt3.fit(3, {0: msg}, lost, checkpoint=2)
    assert metrics[0]["state_lost"] == 1.0
    # a fresh (not resumed) run in the same place never reads an earlier run's files
    client_side._RUNTIMES.clear()
    fresh = _state_context(cfg, 0, run_id=4, run_dir="r")
    rt4 = client_side._runtime(fresh)
    init = rt4.client.init_state(rt4.fms[rt4.federation.arch_of[0]], 1)
    first = rt4.load_states(fresh, [0], checkpoint=0)[0]
    assert all(torch.equal(first[k], init[k][0]) for k in init)
    folder = rt4.state_dir(fresh, 0)
    assert folder is not None and sorted(f.name for f in folder.iterdir()) == ["r0.pt"]


def test_a_node_mixes_its_relayed_neighbours_as_the_simulator_mixes():
    """Gossip over Flower: node i gets the payloads with W[i, j] != 0 and that row of W; its
    mix equals row i of the simulator's ``W @ payloads`` (seed 004, Alg. 1 lines 20-22)."""
    from hyperfed.engine.topology import active_mixing, adjacency
    from hyperfed.runtime.gossip import Gossip

    W = active_mixing(adjacency("ring", 5), list(range(5)), "metropolis")
    g = torch.Generator().manual_seed(0)
    payloads = {"phi": torch.randn(5, 3, 2, generator=g), "z": torch.randn(5, 4, generator=g)}
    everyone = Gossip.mix(W, payloads)
    for i in range(5):
        near = [j for j in range(5) if W[i, j] != 0]
        assert len(near) == 3  # two ring neighbours and itself
        mine = Gossip.mix(W[i, near].reshape(1, -1), {k: v[near] for k, v in payloads.items()})
        for k, v in payloads.items():
            assert mine[k].shape == (1, *v.shape[1:])
            expected = sum(float(W[i, j]) * v[j] for j in near)  # by hand
            assert torch.allclose(mine[k][0], expected, atol=1e-6)
            assert torch.allclose(mine[k][0], everyone[k][i], atol=1e-6)


# -- Flower's Simulation Engine, resumed deployments, gossip over Flower ------------------------

FEDPER = [
    *[s for s in SETTINGS if not s.startswith(("algorithm.", "clients.models", "rounds"))],
    "algorithm.name=fedper",
    "clients.models=lenet",
    "rounds=2",
    "eval_every=2",
]


def _client_acc(run: Path) -> list[list[float]]:
    return [r["client_acc"] for r in read_metrics(run)]


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("HYPERFED_RAY_TESTS"),
    reason="Ray's Simulation Engine, ~65 s on 2 cores: set HYPERFED_RAY_TESTS=1 (the loopback "
    "deployments cover the same ServerApp / ClientApp in CI)",
)
def test_flower_simulation_engine_gives_the_simulators_metrics(tmp_path):
    pytest.importorskip("ray", reason="Ray is not installed: pip install 'hyperfed[simulation]'")
    from typer.testing import CliRunner

    from hyperfed.cli import app

    sets = [a for s in FEDPER for a in ("--set", s)]
    runner = CliRunner()
    res = runner.invoke(app, ["run", *sets, "--out", str(tmp_path / "native"), "--quiet"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["flower", "sim", *sets, "--out", str(tmp_path / "sim"), "--quiet"])
    assert res.exit_code == 0, res.output
    native, sim = read_metrics(tmp_path / "native"), read_metrics(tmp_path / "sim")
    assert [r["round"] for r in sim] == [r["round"] for r in native] == [2]
    for a, b in zip(native, sim):  # every client's accuracy, every evaluation
        assert b["client_acc"] == pytest.approx(a["client_acc"], abs=1e-4)
        assert b["bytes_up_total"] == a["bytes_up_total"]
        assert b["bytes_down_total"] == a["bytes_down_total"]
    assert (tmp_path / "sim" / "summary.md").exists()


@pytest.mark.slow
def test_a_killed_deployment_resumes_and_ends_as_an_uninterrupted_run(tmp_path, deployments):
    """Server and nodes killed after the checkpoint of round 1, the run restarted with
    resume: the same metrics as the simulator's uninterrupted run (fedper: each node's head
    is state that must survive)."""
    cfg = load_config(None, [*FEDPER, "checkpoint_every=1"])
    expected = Simulation(cfg).run()
    d = _deploy(cfg, tmp_path, deployments)
    d.submit()
    run = tmp_path / "run"
    deadline = time.monotonic() + 600
    while not (run / "checkpoint.pt").exists():  # no `flwr list` here: see above
        assert time.monotonic() < deadline, d.logs()
        assert d.processes[0].alive(), d.logs()
        time.sleep(0.2)
    for proc in d.processes:  # the machines crash: SuperLink and every SuperNode
        proc.kill()
    again = LocalDeployment(
        cfg,
        tmp_path / "flower",
        run,
        nodes=cfg.clients.count,
        num_partitions=cfg.clients.count,
        threads=1,
        join_timeout=120,
        round_timeout=150,
        resume=True,
    )
    deployments.append(again)
    again.start()
    status = again.wait(again.submit(), timeout=900)
    assert status == "finished:completed", again.logs()
    got = read_metrics(run)
    assert [r["round"] for r in got] == [2]
    for a, b in zip(expected, got):
        assert b["client_acc"] == pytest.approx(a["client_acc"], abs=1e-4)
    assert "resumed from the checkpoint of round 1" in (run / "server.log").read_text()
    # the server's machine, once for the start and once for the resume
    assert [m["from_round"] for m in read_machines(run)] == [0, 1]


@pytest.mark.slow
def test_decentralized_dfedavg_over_flower_on_a_ring_equals_the_simulator(tmp_path, deployments):
    sets = [s for s in FEDPER if not s.startswith(("algorithm.", "clients.count"))]
    cfg = load_config(
        None, [*sets, "clients.count=4", "algorithm.name=dfedavg", "algorithm.topology=ring"]
    )
    expected = Simulation(cfg).run()
    d = _deploy(cfg, tmp_path, deployments)
    status = d.wait(d.submit(), timeout=900)
    assert status == "finished:completed", d.logs()
    got = read_metrics(tmp_path / "run")
    for a, b in zip(expected, got, strict=True):
        assert b["client_acc"] == pytest.approx(a["client_acc"], abs=1e-4)
        assert b["bytes_up_total"] == a["bytes_up_total"]
    # the server relayed: each node got its two ring neighbours' payloads and its own
    log = _wire(tmp_path / "run")
    relayed = [
        w
        for w in log
        if w["type"] == wire.GOSSIP and w["group"] == "gossip-1" and w["dir"] == "down"
    ]
    assert sorted(w["client"] for w in relayed) == [0, 1, 2, 3]
    for w in relayed:
        shapes = {k: v["shape"][0] for k, v in w["content"][wire.PAYLOAD].items()}
        assert set(shapes.values()) == {3}
        assert w["content"][wire.WEIGHTS]["w"]["shape"] == [3]
