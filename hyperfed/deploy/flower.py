"""Flower ``ServerApp`` and ``ClientApp`` that run any centralized hyperfed algorithm.

The algorithm files are untouched: the server role and the client role exchange the same
payloads (dicts of named tensors) as in the simulator, serialized into Flower records
(:func:`payload_to_record` / :func:`record_to_payload`, exact round trip). A run is

1. ``query.join``  -> every node answers its client's ``Client.join`` payload and the
   partition id it serves (its node config ``partition-id``); nothing else about it;
2. ``query.setup`` -> setup stages, for algorithms that have one (MH-pFedHNDD);
3. per round: ``train`` -> one message per sampled node holding *that* client's payload
   (for MH-pFedHN its own theta_i), ``Grid.send_and_receive`` with a timeout, carrying on
   with the replies that came back and passed ``Server.check_reply``;
4. every ``eval_every`` rounds and at the end: ``evaluate`` -> each client's personalized
   model on its own test split; the server writes ``metrics.jsonl`` / ``summary.md`` into
   the run directory as the simulator does.

A client's data partition comes from its node config (``partition-id``, ``num-partitions``),
and the node builds its client as the simulator does (:class:`hyperfed.runtime.federation.
Federation`, which the server uses too), so node ``i`` trains on exactly the simulator's client
``i`` from the simulator's initial state. A long-lived ClientApp process
(``flower-supernode --isolation process`` with :mod:`hyperfed.deploy.clientapp`, what
``hyperfed flower local`` starts) builds the client once per run and keeps it between messages;
with ``--isolation subprocess`` each message runs in a fresh process that rebuilds it. Either
way the client's state (BatchNorm statistics, personal layers, ...) is kept in
``context.state`` between rounds (the SuperNode holds it), never in the cached client.

The run config (``[tool.flwr.app.config]`` of the app, see ``hyperfed.deploy.launch``): every
experiment setting as its own key (``rounds``, ``algorithm.name``, ``local.lr``, ...; ``flwr
run APP --run-config "rounds=50"`` overrides one), and ``run-dir``, ``min-nodes``,
``join-timeout`` / ``round-timeout`` (seconds) and ``resume``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.supercore.utils import get_flwr_home
from torch import Tensor

from hyperfed.algorithms.base import (
    Client,
    ClientGroup,
    Payload,
    Server,
    payload_bytes,
    stack_payloads,
    unstack_payload,
)
from hyperfed.config import ConfigError, ExperimentConfig, config_from_dict, to_toml
from hyperfed.data.federated import FederatedData
from hyperfed.deploy.launch import (
    RC_JOIN_TIMEOUT,
    RC_MIN_NODES,
    RC_RESUME,
    RC_ROUND_TIMEOUT,
    RC_RUN_DIR,
    experiment_from_run_config,
)
from hyperfed.engine.local import FlopMeter, evaluate_clients
from hyperfed.models.layout import FunctionalModel, channels_last
from hyperfed.runtime.driver import EvalCounts, Exchange, RoundResult
from hyperfed.runtime.federation import Federation
from hyperfed.runtime.gossip import Gossip
from hyperfed.runtime.rundir import RunDir, atomic_write_bytes

log = logging.getLogger("hyperfed.flower")

# message types (ClientApp handlers below)
JOIN = f"{MessageType.QUERY}.join"
SETUP = f"{MessageType.QUERY}.setup"
GOSSIP = f"{MessageType.QUERY}.gossip"  # decentralized: the neighbours' payloads, relayed
TRAIN = MessageType.TRAIN
EVALUATE = MessageType.EVALUATE

# record names inside a message's RecordDict
PAYLOAD = "payload"  # ArrayRecord: the algorithm's payload, nothing else
DTYPES = "dtypes"  # ConfigRecord: torch dtypes numpy cannot hold (bfloat16, ...)
CONFIG = "config"  # ConfigRecord: round / stage / client id / last checkpoint round
WEIGHTS = "weights"  # ArrayRecord of a gossip message: this node's row of W
METRICS = "metrics"  # MetricRecord: train loss, evaluation counts
NODE = "node"  # ConfigRecord in the join reply: the partition id this node serves
STATE = "hyperfed.state"  # ArrayRecord in context.state: this client's persistent state
SERVER_STATE = "server_state.pt"  # in the run directory: the server role's final state
STATE_DIR_ENV = "HYPERFED_STATE_DIR"  # where nodes keep their client state of resumable runs

# -- payload <-> Flower records -----------------------------------------------------------
_BIT_VIEWS = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8}


def payload_to_record(payload: Payload) -> RecordDict:
    """A payload as a RecordDict: one ``Array`` per tensor (numpy ``.npy`` bytes, exact)."""
    arrays: dict[str, Array] = {}
    dtypes: dict[str, str] = {}
    for key, value in payload.items():
        t = value.detach().cpu().contiguous()
        if t.dtype in _BIT_VIEWS:  # numpy has no bfloat16: send the bits, name the dtype
            dtypes[key] = str(t.dtype).removeprefix("torch.")
            t = t.view(_BIT_VIEWS[t.dtype])
        arrays[key] = Array(t.numpy())
    content = RecordDict({PAYLOAD: ArrayRecord(arrays)})
    if dtypes:
        content[DTYPES] = ConfigRecord(dict(dtypes))
    return content


def record_to_payload(content: RecordDict, device: torch.device | str = "cpu") -> Payload:
    """Inverse of :func:`payload_to_record`."""
    if PAYLOAD not in content.array_records:
        return {}
    dtypes: dict[str, Any] = dict(content.config_records.get(DTYPES, {}))
    out: Payload = {}
    for key, arr in content.array_records[PAYLOAD].items():
        t = torch.from_numpy(np.array(arr.numpy(), copy=True))
        if key in dtypes:
            t = t.view(getattr(torch, str(dtypes[key])))
        out[key] = t.to(device)
    return out


def _state_record(state: dict[str, Tensor]) -> ArrayRecord:
    record = payload_to_record(state)
    if DTYPES in record:
        raise TypeError(f"client state dtypes {dict(record[DTYPES])} cannot be stored")
    return record.array_records[PAYLOAD]


def _state_from_record(record: ArrayRecord, device: torch.device) -> dict[str, Tensor]:
    return record_to_payload(RecordDict({PAYLOAD: record}), device)


# -- what both sides rebuild from the config ----------------------------------------------
def config_from_run_config(run_config: dict[str, Any]) -> ExperimentConfig:
    """The experiment config carried in the run config, one key per setting (validated like
    ``hyperfed run``; ``flwr run --run-config "rounds=50"`` overrides one)."""
    return config_from_dict(experiment_from_run_config(run_config))


@dataclass
class ClientRuntime:
    """One real client: the simulator's client ``cid`` as a group of one."""

    cfg: ExperimentConfig
    cid: int
    data: FederatedData
    fm: FunctionalModel
    client: Client
    federation: Federation
    lost: bool = False  # its saved state was gone when a resumed run needed it
    run_keys: dict[str, str] = field(default_factory=dict)  # run-dir -> its state folder name

    @classmethod
    def build(cls, cfg: ExperimentConfig, cid: int, num_partitions: int) -> ClientRuntime:
        if num_partitions != cfg.clients.count:
            raise ConfigError(
                f"node config num-partitions={num_partitions} but clients.count="
                f"{cfg.clients.count}: every node must split the data as the config does"
            )
        if not 0 <= cid < cfg.clients.count:
            raise ConfigError(f"node config partition-id={cid} not in [0, {cfg.clients.count})")
        fed = Federation(cfg)  # Flower runs every kind of algorithm (deploy/launch.py)
        data = fed.load_data(clients=[cid])  # its own samples only
        arch = fed.arch_of[cid]
        # its model and client role, initialized as the simulator initializes them
        fm = fed.models(data.input_shape, data.num_classes, only=arch)[arch]
        client = fed.client_role(data.input_shape, data.num_classes)
        return cls(cfg, cid, data, fm, client, fed)

    @property
    def device(self) -> torch.device:
        return self.federation.device

    def group(self, rnd: int) -> ClientGroup:
        return self.federation.group(self.fm, [self.cid], self.data, rnd)

    def initial_state(self) -> dict[str, Tensor]:
        """This client's initial state, stacked: the simulator's draw for client ``cid``
        (the architecture groups before its own are drawn too, and dropped)."""
        fed, arch = self.federation, self.fm.name
        before = [name for name in fed.groups_through(self.cid) if name != arch]
        models = fed.models(self.data.input_shape, self.data.num_classes, before) if before else {}
        state = fed.initial_states(self.client, {**models, arch: self.fm}, [self.cid])
        return stack_payloads([state[self.cid]])

    def join(self) -> Payload:
        return self.client.join(self.fm, self.data.train_sizes[self.cid])

    # -- persistent state ------------------------------------------------------------------
    # Within a run the state lives in ``context.state``. A resumable run (checkpoint_every set)
    # also keeps it on the node's disk, one file per round it changed, so that a restarted
    # ServerApp (a new Flower run, an empty context) continues from the server's last
    # checkpoint C: the node loads its newest file of a round <= C. Files are pruned to that
    # one and the ones after C. A node whose files are gone starts again from its initial
    # state and says so (``state_lost``; the server logs it).
    def state_dir(self, context: Context) -> Path | None:
        if self.cfg.checkpoint_every is None:
            return None
        root = os.environ.get(STATE_DIR_ENV) or str(Path(get_flwr_home()) / "hyperfed-state")
        run_dir = str(context.run_config.get(RC_RUN_DIR, ""))
        if run_dir not in self.run_keys:  # hashed once, not on every message
            text = run_dir + to_toml(self.cfg)
            self.run_keys[run_dir] = hashlib.sha256(text.encode()).hexdigest()[:16]
        return Path(root) / self.run_keys[run_dir] / f"client-{self.cid}"

    @staticmethod
    def _saved(folder: Path) -> dict[int, Path]:
        return {int(f.stem.removeprefix("r")): f for f in folder.glob("r*.pt")}

    def load_state(self, context: Context, checkpoint: int = 0) -> dict[str, Tensor]:
        """This client's state, stacked: from ``context.state``; on first use in this run from
        disk (a resumed run, ``checkpoint`` > 0) or the initial state."""
        if STATE in context.state.array_records:
            one = _state_from_record(context.state.array_records[STATE], self.device)
            return stack_payloads([one])
        folder = self.state_dir(context)
        init = self.initial_state()
        if folder is None:
            return init
        if checkpoint == 0:  # a fresh start: files of an earlier run here are not ours
            shutil.rmtree(folder, ignore_errors=True)
            self.save_state(context, init, 0, 0)
            return init
        saved = {}
        for r, f in self._saved(folder).items():
            if r <= checkpoint:
                saved[r] = f
            else:  # written after the checkpoint by the run that was killed
                f.unlink(missing_ok=True)
        if not saved:
            log.warning(
                "client %d: no saved state (round <= %d); starting anew", self.cid, checkpoint
            )
            self.lost = True
            self.save_state(context, init, 0, checkpoint)
            return init
        one = torch.load(saved[max(saved)], map_location=self.device, weights_only=True)
        context.state[STATE] = _state_record(one)
        return stack_payloads([one])

    def save_state(
        self, context: Context, state: dict[str, Tensor], rnd: int, checkpoint: int
    ) -> None:
        one = unstack_payload(state, 1)[0]
        context.state[STATE] = _state_record(one)
        folder = self.state_dir(context)
        if folder is None:
            return
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"r{rnd}.pt"
        atomic_write_bytes(path, lambda f: torch.save({k: v.cpu() for k, v in one.items()}, f))
        saved = self._saved(folder)
        kept = max(r for r in saved if r <= max(checkpoint, min(saved)))
        for r, f in saved.items():
            if r < kept:
                f.unlink(missing_ok=True)

    def fit(
        self, rnd: int, msg: Payload, context: Context, checkpoint: int = 0
    ) -> tuple[Payload, dict[str, float]]:
        state = self.load_state(context, checkpoint)
        # FLOPs measured here, reported to the server (it cannot see them)
        with FlopMeter() as meter, channels_last(self.federation.nhwc):
            reply, new_state, loss = self.client.fit(self.group(rnd), stack_payloads([msg]), state)
        self.save_state(context, new_state, rnd, checkpoint)
        metrics = {"train_loss": float(loss.reshape(-1)[0]), "train_flops": float(meter.total)}
        return unstack_payload(reply, 1)[0], self._lost(metrics)

    def _lost(self, metrics: dict[str, float]) -> dict[str, float]:
        if self.lost:
            self.lost = False
            metrics["state_lost"] = 1.0
        return metrics

    def mix(
        self, rnd: int, neighbours: Payload, weights: Tensor, context: Context, checkpoint: int
    ) -> None:
        """Decentralized: ``mixed = sum_j W[i, j] payload_j`` over the relayed neighbours'
        payloads (seed 004, Alg. 1), mixed here on the node, then ``Client.mix``."""
        state = self.load_state(context, checkpoint)
        mixed = Gossip.mix(weights.reshape(1, -1), neighbours)
        self.save_state(context, self.client.mix(self.group(rnd), mixed, state), rnd, checkpoint)

    def setup(
        self, stage: int, msg: Payload, context: Context, checkpoint: int = 0
    ) -> tuple[Payload, dict[str, float]]:
        state = self.load_state(context, checkpoint)
        out, new_state, stats = self.client.setup(
            stage, self.group(0), stack_payloads([msg]), state
        )
        self.save_state(context, new_state, 0, checkpoint)
        return out[0], {k: float(v.reshape(-1)[0]) for k, v in stats.items()}

    def evaluate(
        self, msg: Payload, context: Context, split: str = "test", checkpoint: int = 0
    ) -> dict[str, float]:
        if split not in ("test", "val"):
            raise ValueError(f"evaluate: unknown split {split!r}")
        state = self.load_state(context, checkpoint)
        theta, buffers = self.client.eval_model(self.group(-1), stack_payloads([msg]), state)
        with channels_last(self.federation.nhwc):
            net = self.client.eval_network(self.fm)
            ok, total, loss = evaluate_clients(net, theta, buffers, self.data, [self.cid], split)
        return {"correct": float(ok[0]), "total": float(total[0]), "loss_sum": float(loss[0])}


# The clients this process built, by (run id, partition id, num-partitions): a long-lived
# ClientApp process (``hyperfed.deploy.clientapp``) builds its client once per run and reuses
# it for every message; one of another run is dropped when a new run's first message comes.
_RUNTIMES: dict[tuple[int, int, int], ClientRuntime] = {}
BUILD_LOG_ENV = "HYPERFED_BUILD_LOG"  # a file: one line per client built (pid, run, client)


def _runtime(context: Context) -> ClientRuntime:
    nc = context.node_config
    if "partition-id" not in nc or "num-partitions" not in nc:
        raise ConfigError(
            "node config needs partition-id and num-partitions, e.g. flower-supernode "
            "--node-config 'partition-id=0 num-partitions=10'"
        )
    key = (int(context.run_id), int(nc["partition-id"]), int(nc["num-partitions"]))
    if key not in _RUNTIMES:
        for old in [k for k in _RUNTIMES if k[0] != key[0]]:
            del _RUNTIMES[old]  # a finished run's client: its state lives on in its context
        cfg = config_from_run_config(dict(context.run_config))
        _RUNTIMES[key] = ClientRuntime.build(cfg, key[1], key[2])
        built = os.environ.get(BUILD_LOG_ENV)
        if built:  # one short line per build, appended (atomic for concurrent processes)
            line = json.dumps({"pid": os.getpid(), "run": key[0], "client": key[1]})
            with open(built, "a") as f:
                f.write(line + "\n")
    return _RUNTIMES[key]


# -- ClientApp ------------------------------------------------------------------------------
client_app = ClientApp()


def _int(value: Any) -> int:
    return int(value)


def _reply(msg: Message, payload: Payload | None, **records: Any) -> Message:
    content = payload_to_record(payload) if payload is not None else RecordDict()
    for name, record in records.items():
        content[name] = record
    return Message(content, reply_to=msg)


@client_app.query("join")
def _client_join(msg: Message, context: Context) -> Message:
    rt = _runtime(context)
    return _reply(msg, rt.join(), **{NODE: ConfigRecord({"partition-id": rt.cid})})


def _checkpoint(msg: Message) -> int:
    """The server's last checkpoint round, sent with every message (0: none yet)."""
    return _int(msg.content.config_records[CONFIG].get("checkpoint", 0))


@client_app.query("setup")
def _client_setup(msg: Message, context: Context) -> Message:
    rt = _runtime(context)
    stage = _int(msg.content.config_records[CONFIG]["stage"])
    payload = record_to_payload(msg.content, rt.device)
    reply, stats = rt.setup(stage, payload, context, _checkpoint(msg))
    return _reply(msg, reply, **{METRICS: MetricRecord(dict(stats))})


@client_app.train()
def _client_train(msg: Message, context: Context) -> Message:
    rt = _runtime(context)
    rnd = _int(msg.content.config_records[CONFIG]["round"])
    payload = record_to_payload(msg.content, rt.device)
    reply, metrics = rt.fit(rnd, payload, context, _checkpoint(msg))
    return _reply(msg, reply, **{METRICS: MetricRecord(dict(metrics))})


@client_app.query("gossip")
def _client_gossip(msg: Message, context: Context) -> Message:
    rt = _runtime(context)
    rnd = _int(msg.content.config_records[CONFIG]["round"])
    weights = torch.from_numpy(msg.content.array_records[WEIGHTS]["w"].numpy().copy())
    neighbours = record_to_payload(msg.content, rt.device)
    rt.mix(rnd, neighbours, weights, context, _checkpoint(msg))
    return _reply(msg, None)


@client_app.evaluate()
def _client_evaluate(msg: Message, context: Context) -> Message:
    rt = _runtime(context)
    split = str(msg.content.config_records[CONFIG].get("split", "test"))
    payload = record_to_payload(msg.content, rt.device)
    metrics = rt.evaluate(payload, context, split, _checkpoint(msg))
    return _reply(msg, None, **{METRICS: MetricRecord(dict(metrics))})


# -- ServerApp ------------------------------------------------------------------------------
server_app = ServerApp()


def _check_join(payload: Payload, server_needs_size: bool = True) -> str | None:
    """A join payload's problem, if any (a decentralized client tells nothing: ``{}``)."""
    if server_needs_size and ("num_params" not in payload or payload["num_params"].numel() != 1):
        return "join payload has no num_params"
    for key, value in payload.items():
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            return f"{key} contains NaN or Inf"
    return None


def describe(content: RecordDict) -> dict[str, Any]:
    """What a message carries, for the wire log: every record and key; arrays with shape,
    dtype and content id (Flower's sha256 of the array bytes)."""
    out: dict[str, Any] = {}
    for name, rec in content.items():
        if isinstance(rec, ArrayRecord):
            out[name] = {
                k: {"shape": list(a.shape), "dtype": a.dtype, "id": a.object_id[:16]}
                for k, a in rec.items()
            }
        else:
            out[name] = sorted(rec.keys())
    return out


class Deployment:
    """The server side of a run: the algorithm's server role, run by the round driver
    (:mod:`hyperfed.runtime.driver`), and the Flower nodes it reaches -- this class is the
    driver's transport: one Flower message per client, replies by client id."""

    name = "flower"

    def __init__(self, grid: Grid, run_config: dict[str, Any]) -> None:
        self.grid = grid
        self.cfg = cfg = config_from_run_config(run_config)
        self.federation = fed = Federation(cfg)  # the simulator's builder (runtime/federation.py)
        self.algorithm = fed.algorithm
        self.resume = bool(run_config.get(RC_RESUME, False))
        self.last_checkpoint = 0  # round of the last checkpoint written (sent to the nodes)
        self.device = fed.device
        self.reference = fed.reference  # its nodes report no loss
        self.n = cfg.clients.count
        self.min_nodes = int(run_config.get(RC_MIN_NODES, self.n) or self.n)
        self.join_timeout = float(run_config.get(RC_JOIN_TIMEOUT, 300.0))
        self.round_timeout = float(run_config.get(RC_ROUND_TIMEOUT, 600.0))
        stamp = time.strftime("%Y%m%d-%H%M%S")
        run_dir = str(run_config.get(RC_RUN_DIR, "") or f"runs/{stamp}-flower-{cfg.algorithm.name}")
        self.run_dir = RunDir(run_dir)
        self.node_of: dict[int, int] = {}  # client id -> Flower node id
        self.server: Server | None = None
        self.totals: dict[str, int] = {}
        self.evaluated = 0  # evaluation exchanges so far (names their message group)

    # -- messaging ------------------------------------------------------------------------
    def exchange(
        self,
        kind: str,
        payloads: dict[int, Payload],
        config: dict[str, Any],
        group: str,
        extra: dict[int, Tensor] | None = None,
    ) -> dict[int, Message]:
        """One message per client (its own payload), replies by client id; errors and
        late replies are logged and dropped (the run carries on with the others)."""
        messages: list[Message] = []
        for cid, payload in payloads.items():
            content = payload_to_record(payload)
            content[CONFIG] = ConfigRecord(
                {**config, "client-id": cid, "checkpoint": self.last_checkpoint}
            )
            if extra is not None:  # a gossip message: this node's row of W
                content[WEIGHTS] = ArrayRecord({"w": Array(extra[cid].numpy())})
            msg = Message(content, self.node_of[cid], kind, group_id=group, ttl=self.round_timeout)
            self.wire("down", kind, group, cid, msg)
            messages.append(msg)
        replies: dict[int, Message] = {}
        received = self.grid.send_and_receive(messages, timeout=self.round_timeout)
        # a reply names the message it answers (ids are set when pushed); the SuperLink's
        # own error replies (an unreachable node) come from the SuperLink, not the node
        by_id = {msg.metadata.message_id: cid for msg, cid in zip(messages, payloads)}
        by_node = {msg.metadata.dst_node_id: cid for msg, cid in zip(messages, payloads)}
        for reply in received:
            cid_or_none = by_id.get(reply.metadata.reply_to_message_id)
            if cid_or_none is None:
                cid_or_none = by_node.get(reply.metadata.src_node_id)
            if cid_or_none is None:
                continue
            cid = cid_or_none
            if reply.has_error():
                log.warning(
                    "%s %s: client %d (node %d) failed: error %s %s",
                    kind,
                    group,
                    cid,
                    self.node_of[cid],
                    reply.error.code,
                    (reply.error.reason or "")[:300],
                )
                continue
            self.wire("up", kind, group, cid, reply)
            replies[cid] = reply
            metrics: dict[str, Any] = dict(reply.content.metric_records.get(METRICS, {}))
            if metrics.get("state_lost"):
                log.warning(
                    "%s %s: client %d had lost its state; it restarted from its initial state",
                    kind,
                    group,
                    cid,
                )
        missing = sorted(set(payloads) - set(replies))
        if missing:
            log.warning("%s %s: no reply from clients %s", kind, group, missing)
        return replies

    def wire(self, direction: str, kind: str, group: str, cid: int, msg: Message) -> None:
        """One line per message in ``wire.jsonl``: what crossed, to and from which client."""
        line = {
            "dir": direction,
            "type": kind,
            "group": group,
            "client": cid,
            "node": msg.metadata.dst_node_id if direction == "down" else msg.metadata.src_node_id,
            "content": describe(msg.content),
        }
        with open(self.run_dir.path / "wire.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")

    def online(self) -> set[int]:
        nodes = set(self.grid.get_node_ids())
        return {c for c, node in self.node_of.items() if node in nodes}

    # -- phases ---------------------------------------------------------------------------
    def wait_for_nodes(self) -> list[int]:
        deadline = time.monotonic() + self.join_timeout
        while True:
            nodes = sorted(self.grid.get_node_ids())
            if len(nodes) >= self.min_nodes or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        if len(nodes) < self.min_nodes:
            log.warning(
                "only %d of %d nodes connected after %.0f s; carrying on",
                len(nodes),
                self.min_nodes,
                self.join_timeout,
            )
        return nodes

    def join(self) -> dict[int, Payload]:
        nodes = self.wait_for_nodes()
        messages = [Message(RecordDict(), node, JOIN, group_id="join") for node in nodes]
        joins: dict[int, Payload] = {}
        for reply in self.grid.send_and_receive(messages, timeout=self.join_timeout):
            node = reply.metadata.src_node_id
            if reply.has_error():
                log.warning("join: node %d failed: %s", node, (reply.error.reason or "")[:300])
                continue
            cid = _int(reply.content.config_records[NODE]["partition-id"])
            payload = record_to_payload(reply.content, self.device)
            problem = _check_join(payload, self.algorithm.kind == "centralized")
            if cid in self.node_of or not 0 <= cid < self.n:
                problem = f"partition id {cid} taken or out of range [0, {self.n})"
            if problem:
                log.warning("join: rejected node %d: %s", node, problem)
                continue
            self.node_of[cid] = node
            joins[cid] = payload
            self.wire("up", JOIN, "join", cid, reply)
        if not joins:
            raise RuntimeError("no node joined the run")
        log.info("joined: clients %s of %d", sorted(joins), self.n)
        return dict(sorted(joins.items()))

    def build_server(self, joins: dict[int, Payload]) -> Server:
        """The server role for the nodes that joined, built as the simulator builds it."""
        ds = self.cfg.dataset.load()  # shape and classes only
        self.models = self.federation.models(ds.input_shape, ds.num_classes)
        return self.federation.server_role(joins, self.models, ds.input_shape, ds.num_classes)

    # -- the Transport the round driver talks to (runtime/driver.py) ---------------------
    def reachable(self) -> set[int] | None:
        return self.online()

    def fit(self, rnd: int, msgs: dict[int, Payload]) -> Exchange:
        out = Exchange({})
        for cid, reply in self.exchange(TRAIN, msgs, {"round": rnd}, str(rnd)).items():
            out.replies[cid] = record_to_payload(reply.content, self.device)
            metrics: dict[str, Any] = dict(reply.content.metric_records.get(METRICS, {}))
            reported = metrics.get("train_flops")  # what the client measured (engine.local)
            if isinstance(reported, int | float) and math.isfinite(reported) and reported >= 0:
                out.flops += int(reported)
            loss = metrics.get("train_loss")
            if isinstance(loss, float):
                out.losses.append(torch.tensor([loss]))
        return out

    def setup(self, stage: int, msgs: dict[int, Payload]) -> Exchange:
        out = Exchange({})
        stats: dict[str, list[float]] = {}
        got = self.exchange(SETUP, msgs, {"stage": stage}, f"setup-{stage}")
        for cid, reply in got.items():
            out.replies[cid] = record_to_payload(reply.content, self.device)
            for k, v in reply.content.metric_records.get(METRICS, {}).items():
                stats.setdefault(k, []).append(float(v))  # type: ignore[arg-type]
        out.stats = {k: torch.tensor(vs) for k, vs in stats.items()}
        return out

    def relay(self, rnd: int, W: Tensor, payloads: dict[int, Payload]) -> None:
        """Gossip over Flower: node ``i`` gets its neighbours' payloads (``W[i, j] != 0``,
        itself included) and its row of ``W``, and mixes them itself; the server only
        relays (it never adds payloads up)."""
        active = list(payloads)
        messages: dict[int, Payload] = {}
        rows: dict[int, Tensor] = {}
        for i, cid in enumerate(active):
            near = [j for j in range(len(active)) if W[i, j] != 0]
            messages[cid] = stack_payloads([payloads[active[j]] for j in near])
            rows[cid] = W[i, near]
        self.exchange(GOSSIP, messages, {"round": rnd}, f"gossip-{rnd}", extra=rows)

    def evaluate(self, msgs: dict[int, Payload], split: str) -> EvalCounts:
        rnd = self.evaluated = self.evaluated + 1
        got = self.exchange(EVALUATE, msgs, {"round": rnd, "split": split}, f"eval-{rnd}-{split}")
        counts = EvalCounts(*(torch.full((self.n,), math.nan) for _ in range(3)))
        for cid, reply in got.items():
            m = reply.content.metric_records[METRICS]
            counts.correct[cid] = float(m["correct"])  # type: ignore[arg-type]
            counts.total[cid] = float(m["total"])  # type: ignore[arg-type]
            counts.loss_sum[cid] = float(m["loss_sum"])  # type: ignore[arg-type]
        return counts

    # -- the run --------------------------------------------------------------------------
    def run(self) -> list[dict[str, Any]]:
        cfg = self.cfg
        state = None
        if self.resume:  # verified before anything is built (rundir.py)
            state = self.run_dir.load_checkpoint()
            if state is None:
                raise ConfigError(
                    f"resume: {self.run_dir.path} has no checkpoint; set checkpoint_every "
                    "and start the run anew"
                )
        else:
            self.run_dir.create(to_toml(cfg))
            (self.run_dir.path / "wire.jsonl").write_text("")
        self.checkpoint_state = state
        handler = logging.FileHandler(self.run_dir.path / "server.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        log.addHandler(handler)
        try:
            return self._run()
        finally:
            log.removeHandler(handler)
            handler.close()

    def _run(self) -> list[dict[str, Any]]:
        cfg = self.cfg
        joins = self.join()
        self.server = server = self.build_server(joins)
        driver = self.federation.driver(server, self)
        start = 0
        if self.checkpoint_state is not None:
            start = self.last_checkpoint = driver.load_state_dict(self.checkpoint_state)
            self.run_dir.truncate_metrics(start)
            log.info("resumed from the checkpoint of round %d", start)
        else:
            driver.totals["bytes_up"] += sum(payload_bytes(p) for p in joins.values())

        def checkpoint(rnd: int) -> dict[str, Any]:
            self.last_checkpoint = rnd  # nodes keep their state files from here on
            return driver.state_dict(rnd)

        def progress(rnd: int, result: RoundResult, record: dict[str, Any] | None) -> None:
            log.info(
                "round %d: %d/%d updates, train loss %.4f, %.1f s",
                rnd,
                len(result.replied),
                len(result.clients),
                result.train_loss,
                driver.elapsed(),
            )
            if record is not None:
                log.info("round %d: mean acc %.4f", rnd, record["mean_acc"])

        records = driver.run(
            cfg.rounds,
            cfg.eval_every,
            start_round=start,
            run_dir=self.run_dir,
            checkpoint_every=cfg.checkpoint_every,
            checkpoint=checkpoint if cfg.checkpoint_every else None,
            on_round=progress,
        )
        self.totals = driver.totals
        # the server's final state (not a simulator checkpoint: the client state is on the nodes)
        state = {"round": cfg.rounds, "server": server.state_dict(), "totals": dict(self.totals)}
        atomic_write_bytes(self.run_dir.path / SERVER_STATE, lambda f: torch.save(state, f))
        from hyperfed.report import write_summary

        write_summary(self.run_dir.path)
        return records


@server_app.main()
def _server_main(grid: Grid, context: Context) -> None:
    if not log.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("hyperfed %(levelname)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    Deployment(grid, dict(context.run_config)).run()
