"""Several clients per Flower node (issue 39 item 4): a node serves a list of partition ids
(node config ``partition-ids``, or a simulated node's group of ``clients-per-node``), trains
them as one engine group per architecture and answers one message per node; the server learns
each node's clients from its join and sends a node only its own clients' payloads.

The in-process runs drive the real ServerApp side (:class:`Deployment`) against the real
ClientApp through a Grid that delivers each message to its node's ClientApp in this process
(no SuperLink): seconds, not minutes. One slow test runs real SuperNode processes (about 50 s
on a 2-core box, so only with ``HYPERFED_FLOWER_GROUP_PROCESSES=1``).

Skipped as a whole when Flower is not installed (``pip install 'hyperfed[flower]'``)."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("flwr", reason="Flower is not installed: pip install 'hyperfed[flower]'")

from flwr.app import ConfigRecord, Context, Message, RecordDict  # noqa: E402

from hyperfed.config import ConfigError, load_config  # noqa: E402
from hyperfed.deploy import appconfig  # noqa: E402
from hyperfed.deploy import node as client_side  # noqa: E402
from hyperfed.deploy import records as wire  # noqa: E402
from hyperfed.deploy import server as server_side  # noqa: E402
from hyperfed.deploy.appconfig import (  # noqa: E402
    RunSettings,
    experiment_run_config,
    format_partition_ids,
    node_groups,
    parse_partition_ids,
)
from hyperfed.deploy.launch import (  # noqa: E402
    LocalDeployment,
    _group_alive,
    remote_commands,
    supernode_command,
)
from hyperfed.runtime.rundir import read_metrics  # noqa: E402
from hyperfed.runtime.simulate import Simulation  # noqa: E402

BASE = [
    "device=cpu",
    "seed=0",
    "rounds=2",
    "eval_every=2",
    "dataset.name=digits",
    "partition.name=quantity",
    "partition.classes_per_client=3",
    "clients.count=4",
    "local.epochs=1",
    "local.batch_size=32",
    "local.lr=0.05",
]
FEDPER = [*BASE, "algorithm.name=fedper", "clients.models=lenet"]


# -- which clients a node serves ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("", "empty"),
        ("  ", "empty"),
        ("a", "'a' is not an integer"),
        ("1.5", "'1.5' is not an integer"),
        ("0-x", "'0-x' is not an integer"),
        ("0,,2", "'' is not an integer"),
        ("3-1", "runs backwards"),
        ("0-10", "'0-10' is out of range"),
        ("10", "'10' is out of range"),
        ("-1", "is not an integer"),  # no negative ids: '' before the dash
        ("0-4,3-5", r"ids \[3, 4\] appear more than once"),
        ("2,2", r"ids \[2\] appear more than once"),
    ],
)
def test_partition_ids_refuse_bad_input_in_one_line(spec, why):
    with pytest.raises(ConfigError, match=why) as info:
        parse_partition_ids(spec, 10)
    assert "\n" not in str(info.value) and "e.g. '0-9'" in str(info.value)


def test_partition_ids_read_ranges_and_lists():
    assert parse_partition_ids("0-9", 10) == list(range(10))
    assert parse_partition_ids("0,3,5", 10) == [0, 3, 5]
    assert parse_partition_ids("0-4,9", 10) == [0, 1, 2, 3, 4, 9]
    assert parse_partition_ids(" 9 , 1-2 ", 10) == [1, 2, 9]
    assert parse_partition_ids(7, 10) == [7]  # Flower parses partition-ids=7 as an int
    for ids in ([0, 1, 2, 5, 7, 8], [3], list(range(20))):
        assert parse_partition_ids(format_partition_ids(ids), 20) == ids
    assert format_partition_ids([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    assert node_groups(5, 2) == [[0, 1], [2, 3], [4]]


def test_a_node_config_names_one_client_a_list_or_a_simulated_group():
    cfg = load_config(None, [*FEDPER, "clients.count=5"])
    assert appconfig.node_clients({"partition-ids": "1,3-4", "num-partitions": 5}, cfg) == [1, 3, 4]
    assert appconfig.node_clients({"partition-id": 2, "num-partitions": 5}, cfg) == [2]
    # Flower's Simulation Engine: node k of ceil(5 / 2) = 3 serves clients 2k, 2k + 1
    assert appconfig.node_clients({"partition-id": 1, "num-partitions": 3}, cfg, 2) == [2, 3]
    assert appconfig.node_clients({"partition-id": 2, "num-partitions": 3}, cfg, 2) == [4]
    assert appconfig.node_clients({"partition-id": 2, "num-partitions": 5}, cfg, 2) == [2]
    with pytest.raises(ConfigError, match=r"num-partitions=3 but clients.count=5 \(nor 2 node"):
        appconfig.node_clients({"partition-id": 0, "num-partitions": 3}, cfg, 4)
    with pytest.raises(ConfigError, match="num-partitions=3 but clients.count=5: every"):
        appconfig.node_clients({"partition-id": 0, "num-partitions": 3}, cfg)
    with pytest.raises(ConfigError, match="num-partitions=4 but clients.count=5"):
        appconfig.node_clients({"partition-ids": "0-1", "num-partitions": 4}, cfg)
    with pytest.raises(ConfigError, match=r"partition-id=3 not in \[0, 3\)"):
        appconfig.node_clients({"partition-id": 3, "num-partitions": 3}, cfg, 2)
    with pytest.raises(ConfigError, match="needs partition-id .or partition-ids."):
        appconfig.node_clients({"partition-ids": "0-1"}, cfg)


def test_launch_commands_name_each_nodes_group(tmp_path):
    cfg = load_config(None, FEDPER)
    from flwr.common.config import parse_config_args

    cmd = supernode_command("127.0.0.1:1", [2, 3], 4, 9000)
    assert cmd[cmd.index("--node-config") + 1] == 'partition-ids="2-3" num-partitions=4'
    # what flower-supernode makes of it (Flower's own parser)
    node_config = parse_config_args([cmd[cmd.index("--node-config") + 1]])
    assert node_config == {"partition-ids": "2-3", "num-partitions": 4}
    assert appconfig.node_clients(node_config, cfg) == [2, 3]
    one = supernode_command("127.0.0.1:1", 2, 4, 9000)
    assert one[one.index("--node-config") + 1] == "partition-id=2 num-partitions=4"
    d = LocalDeployment(cfg, tmp_path, tmp_path, nodes=2, num_partitions=4, clients_per_node=3)
    assert d.served() == [[0, 1, 2], [3]]
    text = remote_commands(tmp_path / "app", 10, clients_per_node=4)
    assert "client machine i = 0..2" in text and "IDS=(0-3 4-7 8-9)" in text
    assert "\"partition-ids='${IDS[$i]}' num-partitions=10\"" in text


def test_flower_app_writes_the_groups_into_the_app_and_the_commands(tmp_path):
    from flwr.cli.config_utils import load_and_validate
    from typer.testing import CliRunner

    from hyperfed.cli import app

    sets = [a for s in FEDPER for a in ("--set", s)]
    out = tmp_path / "app"
    res = CliRunner().invoke(
        app, ["flower", "app", *sets, "--out", str(out), "--clients-per-node", "3"]
    )
    assert res.exit_code == 0, res.output
    assert "IDS=(0-2 3)" in res.output and "partition-ids=" in res.output
    config, _ = load_and_validate(out / "pyproject.toml")
    run_config = config["tool"]["flwr"]["app"]["config"]
    assert run_config["clients-per-node"] == 3
    assert appconfig.config_from_run_config(run_config) == load_config(None, FEDPER)
    res = CliRunner().invoke(app, ["flower", "app", *sets, "--clients-per-node", "0"])
    assert res.exit_code != 0 and "--clients-per-node 0: must be >= 1" in res.output


# -- the ServerApp and ClientApps in one process --------------------------------------------------


@pytest.fixture(autouse=True)
def _server_identity(monkeypatch):
    """Messages the ServerApp creates name the run and the server node (Flower sets these in
    its ServerApp process)."""
    from flwr.supercore.task_identity import TaskIdentity

    monkeypatch.setattr(TaskIdentity, "_run_id", 77)
    monkeypatch.setattr(TaskIdentity, "_node_id", 1)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)


class InProcessGrid:
    """Flower's Grid as the Deployment uses it, delivering each message to its node's
    ClientApp in this process (each node with its own Context, as a SuperNode keeps it).
    ``sent`` records (node, message type, the clients a message carries)."""

    def __init__(self, run_config: dict[str, Any], node_configs: dict[int, dict[str, Any]]):
        self.contexts = {
            node: Context(
                run_id=77,
                node_id=node,
                node_config=nc,
                state=RecordDict(),
                run_config=dict(run_config),
            )
            for node, nc in node_configs.items()
        }
        self.sent: list[tuple[int, str, list[int]]] = []
        self.replies: dict[str, Message] = {}
        # per group message: (the message bundled, its reply bundled) as they crossed
        self.bundled: list[tuple[bool, bool]] = []

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def push_messages(self, messages: list[Message]) -> list[str]:
        """Deliver each message to its node's ClientApp now; the reply waits for a pull."""
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex  # as Grid.push_messages
            config = msg.content.config_records.get(wire.CONFIG, ConfigRecord())
            ids_ = config.get("client-ids", [])
            self.sent.append((msg.metadata.dst_node_id, msg.metadata.message_type, list(ids_)))
            reply = client_side.client_app(msg, self.contexts[msg.metadata.dst_node_id])
            if "client-ids" in config:
                self.bundled.append(
                    (
                        wire.BUNDLE_INDEX in msg.content.config_records,
                        wire.BUNDLE_INDEX in reply.content.config_records,
                    )
                )
            self.replies[msg.metadata.message_id] = reply
            ids.append(msg.metadata.message_id)
        return ids

    def pull_messages(self, message_ids: set[str]) -> list[Message]:
        """The replies ready, newest first (a SuperLink promises no order)."""
        ready = [i for i in self.replies if i in message_ids]
        return [self.replies.pop(i) for i in reversed(ready)]


def _run_in_process(cfg, tmp_path: Path, node_configs: dict[int, dict], per_node: int = 1):
    client_side._RUNTIMES.clear()
    settings = RunSettings(
        run_dir=str(tmp_path / "run"),
        min_nodes=len(node_configs),
        join_timeout=5.0,
        clients_per_node=per_node,
    )
    run_config = {**experiment_run_config(cfg), **settings.to_run_config()}
    grid = InProcessGrid(run_config, node_configs)
    deployment = server_side.Deployment(grid, run_config)  # type: ignore[arg-type]
    records = deployment.run()
    client_side._RUNTIMES.clear()
    return records, grid, deployment


def _wire(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "wire.jsonl").read_text().splitlines()]


def _same_as_simulator(cfg, records: list[dict], run: Path | None = None) -> Simulation:
    """Every client's accuracy and the byte counts of every evaluation equal the simulator's;
    with ``run``, also the server's final state (what every reply went into)."""
    sim = Simulation(cfg)
    expected = sim.run()
    assert [r["round"] for r in records] == [r["round"] for r in expected]
    for a, b in zip(expected, records, strict=True):  # every client, every evaluation
        assert b["client_acc"] == pytest.approx(a["client_acc"], abs=1e-4)
        assert b["bytes_up_total"] == a["bytes_up_total"]
        assert b["bytes_down_total"] == a["bytes_down_total"]
        assert b["bytes_up_round"] == a["bytes_up_round"]
        assert b["replied"] == a["replied"] and b["eval_missing"] == []
        assert ("client_acc_before_gossip" in b) == ("client_acc_before_gossip" in a)
        if "client_acc_before_gossip" in a:  # gossip: also scored between training and mixing
            before = pytest.approx(a["client_acc_before_gossip"], abs=1e-4)
            assert b["client_acc_before_gossip"] == before
    if run is not None:
        got = torch.load(run / server_side.SERVER_STATE, weights_only=False)["server"]
        torch.testing.assert_close(got, sim.server.state_dict(), rtol=1e-5, atol=1e-6)
    return sim


def _node_states_are_the_simulators(grid: InProcessGrid, deployment, sim: Simulation) -> None:
    """What each node keeps of each of its clients (context.state) is the simulator's state
    of that client at the end of the run."""
    for node, cids in deployment.clients_of.items():
        records = grid.contexts[node].state.array_records
        for c in cids:
            got = wire.unpack_tensors(records[f"{client_side.STATE}.{c}"], torch.device("cpu"))
            torch.testing.assert_close(got, sim.store[c], rtol=1e-5, atol=1e-6)


def _only_own_clients(grid: InProcessGrid, deployment: server_side.Deployment) -> None:
    """The server sent every node messages for its own clients only, one per node and type."""
    for node, kind, ids in grid.sent:
        if kind != wire.JOIN:
            assert ids and set(ids) <= set(deployment.clients_of[node]), (node, kind, ids)


def test_two_nodes_of_two_fedper_clients_give_the_simulators_metrics_and_bytes(
    tmp_path, monkeypatch
):
    cfg = load_config(None, FEDPER)
    nodes = {
        11: {"partition-ids": "0-1", "num-partitions": 4},
        12: {"partition-ids": "2,3", "num-partitions": 4},
    }
    replies: dict[int, dict] = {}  # round -> the server's replies by client id
    fit = server_side.Deployment.fit

    def recording_fit(self, rnd, msgs):
        out = fit(self, rnd, msgs)
        replies[rnd] = out.replies
        return out

    monkeypatch.setattr(server_side.Deployment, "fit", recording_fit)
    records, grid, deployment = _run_in_process(cfg, tmp_path, nodes)
    sim = _same_as_simulator(cfg, records, tmp_path / "run")
    # each client's round-1 update reached the server as that client's (FedPer averages
    # bodies with equal weights here: a swap inside a node would leave the metrics alone)
    want = Simulation(cfg).driver.train_exchange(1, [0, 1, 2, 3]).got.replies
    assert sorted(replies[1]) == [0, 1, 2, 3]
    for c, reply in want.items():
        torch.testing.assert_close(replies[1][c], reply, rtol=1e-5, atol=1e-6)
    assert deployment.clients_of == {11: [0, 1], 12: [2, 3]}
    _only_own_clients(grid, deployment)
    trains = [(node, ids) for node, kind, ids in grid.sent if kind == wire.TRAIN]
    assert sorted(trains) == [(11, [0, 1]), (11, [0, 1]), (12, [2, 3]), (12, [2, 3])]
    # every group message and every reply to one crossed bundled (a few objects, not 4 a client)
    assert grid.bundled and all(down and up for down, up in grid.bundled)
    # each node keeps one state record per client (the head stays on the node): the
    # simulator's state of that client
    for node, ids in ((11, [0, 1]), (12, [2, 3])):
        assert set(grid.contexts[node].state.array_records) == {
            f"{client_side.STATE}.{c}" for c in ids
        }
    _node_states_are_the_simulators(grid, deployment, sim)
    # wire.jsonl: a line per client and message, with that client's own payload
    up = [w for w in _wire(tmp_path / "run") if w["type"] == wire.TRAIN and w["dir"] == "up"]
    assert sorted((w["group"], w["client"], w["node"]) for w in up) == [
        ("1", 0, 11),
        ("1", 1, 11),
        ("1", 2, 12),
        ("1", 3, 12),
        ("2", 0, 11),
        ("2", 1, 11),
        ("2", 2, 12),
        ("2", 3, 12),
    ]
    assert all(set(w["content"][wire.PAYLOAD]) == {"body"} for w in up)
    assert len({w["content"][wire.PAYLOAD]["body"]["id"] for w in up}) == 8


def test_a_node_of_two_architectures_beside_a_one_client_node(tmp_path):
    """MH-pFedHN, LeNet and MLP clients: node 21 serves clients of both architectures (one
    engine group each), node 22 one client (a group of one: the same message format)."""
    cfg = load_config(None, [*BASE, "algorithm.name=mh_pfedhn", 'clients.models=["lenet","mlp"]'])
    sim = Simulation(cfg)
    serves = [0, 1, 2]
    assert len({sim.arch_of[c] for c in serves}) == 2
    nodes = {
        21: {"partition-ids": "0-2", "num-partitions": 4},
        22: {"partition-id": 3, "num-partitions": 4},
    }
    records, grid, deployment = _run_in_process(cfg, tmp_path, nodes)
    sim = _same_as_simulator(cfg, records, tmp_path / "run")
    _node_states_are_the_simulators(grid, deployment, sim)
    assert deployment.clients_of == {21: serves, 22: [3]}
    _only_own_clients(grid, deployment)
    assert grid.bundled and all(down and up for down, up in grid.bundled)  # node 22's too
    final = records[-1]
    assert final["flops_round"] == Simulation(cfg).run_round(2).flops > 0  # reported once


def test_gossip_dfedavg_on_a_ring_with_two_clients_per_node(tmp_path):
    cfg = load_config(
        None, [*BASE, "algorithm.name=dfedavg", "algorithm.topology=ring", "clients.models=lenet"]
    )
    nodes = {31: {"partition-ids": "0,2", "num-partitions": 4}}
    nodes[32] = {"partition-ids": "1,3", "num-partitions": 4}
    records, grid, deployment = _run_in_process(cfg, tmp_path, nodes)
    assert all(len(r["client_acc_before_gossip"]) == 4 for r in records)  # scored both ways
    sim = _same_as_simulator(cfg, records)
    _node_states_are_the_simulators(grid, deployment, sim)
    _only_own_clients(grid, deployment)
    relayed = [
        w for w in _wire(tmp_path / "run") if w["type"] == wire.GOSSIP and w["dir"] == "down"
    ]
    assert sorted(w["client"] for w in relayed if w["group"] == "gossip-1") == [0, 1, 2, 3]
    for w in relayed:  # each client: its two ring neighbours' payloads and its own, its row
        assert {v["shape"][0] for v in w["content"][wire.PAYLOAD].values()} == {3}
        assert w["content"][wire.WEIGHTS]["w"]["shape"] == [3]


def test_a_simulated_node_serves_its_group_of_clients_per_node(tmp_path):
    """What Flower's Simulation Engine gives each node (partition-id k of ceil(N/G)) with the
    run's clients-per-node G: node k trains clients kG..kG+G-1; DisPFL has a setup stage."""
    cfg = load_config(None, [*BASE, "algorithm.name=dispfl", "clients.models=lenet"])
    nodes = {40 + k: {"partition-id": k, "num-partitions": 2} for k in range(2)}
    records, grid, deployment = _run_in_process(cfg, tmp_path, nodes, per_node=2)
    sim = _same_as_simulator(cfg, records, tmp_path / "run")
    _node_states_are_the_simulators(grid, deployment, sim)
    assert deployment.clients_of == {40: [0, 1], 41: [2, 3]}
    assert any(kind == wire.SETUP for _, kind, _ in grid.sent)
    _only_own_clients(grid, deployment)


def test_the_server_keeps_a_client_claimed_twice_on_its_first_node(tmp_path, caplog):
    """Two nodes both say they serve client 1: the second is refused that client (and never
    sent its messages) but serves its others."""
    cfg = load_config(None, FEDPER)
    nodes = {
        51: {"partition-ids": "0-1", "num-partitions": 4},
        52: {"partition-ids": "1-3", "num-partitions": 4},
    }
    records, grid, deployment = _run_in_process(cfg, tmp_path, nodes)
    assert deployment.clients_of == {51: [0, 1], 52: [2, 3]}
    assert "rejected client 1 of node 52" in (tmp_path / "run" / "server.log").read_text()
    _only_own_clients(grid, deployment)
    _same_as_simulator(cfg, records, tmp_path / "run")


def test_a_node_refuses_a_message_for_a_client_it_does_not_serve():
    cfg = load_config(None, FEDPER)
    client_side._RUNTIMES.clear()
    ctx = Context(
        run_id=5,
        node_id=9,
        node_config={"partition-ids": "0-1", "num-partitions": 4},
        state=RecordDict(),
        run_config=experiment_run_config(cfg),
    )
    content = RecordDict({wire.CONFIG: ConfigRecord({"round": 1, "client-ids": [1, 2]})})
    msg = Message(content, 9, wire.TRAIN)
    msg.metadata.__dict__["_message_id"] = "m" * 64
    with pytest.raises(ConfigError, match=r"clients \[1, 2\]; this node serves \[0, 1\]"):
        client_side.client_app(msg, ctx)
    # a message that names no clients (not the group format): refused too, in one line
    msg = Message(RecordDict({wire.CONFIG: ConfigRecord({"round": 1})}), 9, wire.TRAIN)
    msg.metadata.__dict__["_message_id"] = "m" * 64
    with pytest.raises(ConfigError, match=r"naming no clients .* clients \[0, 1\]"):
        client_side.client_app(msg, ctx)
    client_side._RUNTIMES.clear()


# -- real SuperNode processes ---------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("HYPERFED_FLOWER_GROUP_PROCESSES") != "1",
    reason="real SuperNode processes, ~50 s: set HYPERFED_FLOWER_GROUP_PROCESSES=1 (the "
    "in-process runs above cover the protocol in CI)",
)
def test_flower_local_with_two_clients_per_node_gives_the_simulators_metrics(tmp_path):
    """``LocalDeployment(clients_per_node=2)`` (``hyperfed flower local --clients-per-node
    2``): 2 SuperNode processes for 4 clients, the simulator's metrics and bytes."""
    cfg = load_config(None, [*FEDPER, "rounds=1", "eval_every=1"])
    d = LocalDeployment(
        cfg,
        tmp_path / "flower",
        tmp_path / "run",
        nodes=2,
        num_partitions=4,
        threads=1,
        join_timeout=120,
        round_timeout=150,
        clients_per_node=2,
    )
    try:
        d.start()
        assert len(d.supernodes) == 2
        status = d.wait(d.submit(), timeout=600)
        assert status == "finished:completed", d.logs()
    finally:
        d.stop()
        assert not [p.pid for p in d.processes if _group_alive(p.pid)]
    _same_as_simulator(cfg, read_metrics(tmp_path / "run"))
    log = _wire(tmp_path / "run")
    nodes = {w["node"]: set() for w in log}
    for w in log:
        nodes[w["node"]].add(w["client"])
    assert sorted(map(sorted, nodes.values())) == [[0, 1], [2, 3]]
