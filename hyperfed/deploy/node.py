"""A Flower node's side of hyperfed: the ``ClientApp`` and the clients a node serves.

A node serves one client or a group (its node config: ``partition-id``, ``partition-ids``, or a
simulated node's group of the run's ``clients-per-node``; :func:`~hyperfed.deploy.appconfig.
node_clients`) and builds them as the simulator does (:class:`hyperfed.runtime.federation.
Federation`), so client ``i`` trains on exactly the simulator's client ``i`` from the
simulator's initial state. Every message names the clients it is for (a group message,
:mod:`hyperfed.deploy.records`); the node runs its clients' role through one
:class:`~hyperfed.runtime.clients.ClientHost` call and answers one group message.

A long-lived ClientApp process (``flower-supernode --isolation process`` with
:mod:`hyperfed.deploy.clientapp`, what ``hyperfed flower local`` starts) builds the clients
once per run and keeps them between messages; with ``--isolation subprocess`` each message
runs in a fresh process that rebuilds them. Either way each client's state (BatchNorm
statistics, personal layers, ...) is kept in ``context.state`` between rounds (the SuperNode
holds it), never in the cached clients.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.supercore.utils import get_flwr_home
from torch import Tensor

from hyperfed.algorithms.base import Client, ClientGroup, Payload, unstack_payload
from hyperfed.config import ConfigError, ExperimentConfig, to_toml
from hyperfed.data.federated import FederatedData
from hyperfed.deploy.appconfig import (
    BUILD_LOG_ENV,
    NUM_PARTITIONS,
    PARTITION_ID,
    PARTITION_IDS,
    RunSettings,
    check_node_config,
    config_from_run_config,
    node_clients,
)
from hyperfed.deploy.records import (
    CONFIG,
    METRICS,
    NODE,
    WEIGHTS,
    client_parts,
    group_message,
    pack_tensors,
    payload_to_record,
    record_to_payload,
    unpack_tensors,
)
from hyperfed.models.layout import FunctionalModel
from hyperfed.runtime.clients import ClientHost
from hyperfed.runtime.federation import Federation
from hyperfed.runtime.gossip import Gossip
from hyperfed.runtime.rundir import atomic_write_bytes

log = logging.getLogger("hyperfed.flower")

STATE = "hyperfed.state"  # context.state holds client i's persistent state as "<STATE>.<i>"
STATE_DIR_ENV = "HYPERFED_STATE_DIR"  # where nodes keep their client state of resumable runs


@dataclass
class ClientRuntime:
    """The clients a node serves (the simulator's clients ``cids``; one client is a group of
    one), trained as the simulator trains them, one engine group per architecture
    (:meth:`Federation.group`), from the simulator's initial state."""

    cfg: ExperimentConfig
    cids: list[int]
    data: FederatedData
    fms: dict[str, FunctionalModel]  # the architectures of its clients
    client: Client
    federation: Federation
    lost: set[int] = field(default_factory=set)  # clients whose saved state was gone
    run_keys: dict[str, str] = field(default_factory=dict)  # run-dir -> its state folder name

    @classmethod
    def build(
        cls, cfg: ExperimentConfig, cids: Sequence[int], num_partitions: int
    ) -> ClientRuntime:
        if num_partitions != cfg.clients.count:
            raise ConfigError(
                f"node config num-partitions={num_partitions} but clients.count="
                f"{cfg.clients.count}: every node must split the data as the config does"
            )
        cids = sorted(cids)
        for c in cids:
            if not 0 <= c < cfg.clients.count:
                raise ConfigError(f"node config partition-id={c} not in [0, {cfg.clients.count})")
        fed = Federation(cfg)  # Flower runs every kind of algorithm (deploy/launch.py)
        data = fed.load_data(clients=cids)  # its own clients' samples only
        archs = {fed.arch_of[c] for c in cids}
        # its models and client role, initialized as the simulator initializes them
        fms = fed.models(data.input_shape, data.num_classes, only=archs)
        client = fed.client_role(data.input_shape, data.num_classes)
        return cls(cfg, cids, data, fms, client, fed)

    @property
    def device(self) -> torch.device:
        return self.federation.device

    @property
    def host(self) -> ClientHost:
        """Its clients' :class:`ClientHost` (grouped as the simulator groups them)."""
        fed = self.federation

        def make_group(arch: str, cids: list[int], rnd: int) -> ClientGroup:
            return fed.group(self.fms[arch], cids, self.data, rnd)

        return ClientHost(self.client, fed.groups, make_group, self.fms, self.data, fed.nhwc)

    def initial_states(self, cids: list[int]) -> dict[int, dict[str, Tensor]]:
        """These clients' initial states: the simulator's draws (the architecture groups
        before the last of theirs are drawn too, and dropped)."""
        fed, shape, classes = self.federation, self.data.input_shape, self.data.num_classes
        names = list(fed.groups)
        through = names[: max(names.index(fed.arch_of[c]) for c in cids) + 1]
        others = [a for a in through if a not in self.fms]
        models = fed.models(shape, classes, others) if others else {}
        return fed.initial_states(self.client, {**models, **self.fms}, cids)

    def joins(self) -> dict[int, Payload]:
        fed = self.federation
        return {
            c: self.client.join(self.fms[fed.arch_of[c]], self.data.train_sizes[c])
            for c in self.cids
        }

    # -- persistent state ------------------------------------------------------------------
    # Within a run each client's state lives in ``context.state`` (one record per client).
    # A resumable run (checkpoint_every set) also keeps it on the node's disk, one file per
    # round it changed, so that a restarted ServerApp (a new Flower run, an empty context)
    # continues from the server's last checkpoint C: the node loads its newest file of a
    # round <= C. Files are pruned to that one and the ones after C. A client whose files are
    # gone starts again from its initial state and says so (``state_lost``; the server logs it).
    @staticmethod
    def state_key(cid: int) -> str:
        return f"{STATE}.{cid}"

    def state_dir(self, context: Context, cid: int) -> Path | None:
        if self.cfg.checkpoint_every is None:
            return None
        root = os.environ.get(STATE_DIR_ENV) or str(Path(get_flwr_home()) / "hyperfed-state")
        run_dir = RunSettings.from_run_config(context.run_config).run_dir
        if run_dir not in self.run_keys:  # hashed once, not on every message
            text = run_dir + to_toml(self.cfg)
            self.run_keys[run_dir] = hashlib.sha256(text.encode()).hexdigest()[:16]
        return Path(root) / self.run_keys[run_dir] / f"client-{cid}"

    @staticmethod
    def _saved(folder: Path) -> dict[int, Path]:
        return {int(f.stem.removeprefix("r")): f for f in folder.glob("r*.pt")}

    def load_states(
        self, context: Context, cids: list[int], checkpoint: int = 0
    ) -> dict[int, dict[str, Tensor]]:
        """These clients' states (one each): from ``context.state``; on first use in this run
        from disk (a resumed run, ``checkpoint`` > 0) or the initial state."""
        records = context.state.array_records
        fresh = [c for c in cids if self.state_key(c) not in records]
        init = self.initial_states(fresh) if fresh else {}
        out: dict[int, dict[str, Tensor]] = {}
        for c in cids:
            if c in init:
                out[c] = self._first_state(context, c, init[c], checkpoint)
            else:
                out[c] = unpack_tensors(records[self.state_key(c)], self.device)
        return out

    def _first_state(
        self, context: Context, cid: int, init: dict[str, Tensor], checkpoint: int
    ) -> dict[str, Tensor]:
        folder = self.state_dir(context, cid)
        if folder is None:
            return init
        if checkpoint == 0:  # a fresh start: files of an earlier run here are not ours
            shutil.rmtree(folder, ignore_errors=True)
            self.save_states(context, {cid: init}, 0, 0)
            return init
        saved = {}
        for r, f in self._saved(folder).items():
            if r <= checkpoint:
                saved[r] = f
            else:  # written after the checkpoint by the run that was killed
                f.unlink(missing_ok=True)
        if not saved:
            log.warning("client %d: no saved state (round <= %d); starting anew", cid, checkpoint)
            self.lost.add(cid)
            self.save_states(context, {cid: init}, 0, checkpoint)
            return init
        one: dict[str, Tensor] = torch.load(
            saved[max(saved)], map_location=self.device, weights_only=True
        )
        context.state[self.state_key(cid)] = pack_tensors(one)
        return one

    def save_states(
        self, context: Context, states: dict[int, dict[str, Tensor]], rnd: int, checkpoint: int
    ) -> None:
        for cid, one in states.items():
            context.state[self.state_key(cid)] = pack_tensors(one)
            folder = self.state_dir(context, cid)
            if folder is None:
                continue
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"r{rnd}.pt"
            atomic_write_bytes(
                path, lambda f, s=one: torch.save({k: v.cpu() for k, v in s.items()}, f)
            )
            saved = self._saved(folder)
            kept = max(r for r in saved if r <= max(checkpoint, min(saved)))
            for r, f in saved.items():
                if r < kept:
                    f.unlink(missing_ok=True)

    # -- the messages, for any of its clients (one ClientHost call each) ----------------------
    def fit(
        self, rnd: int, msgs: dict[int, Payload], context: Context, checkpoint: int = 0
    ) -> tuple[dict[int, Payload], dict[int, dict[str, float]]]:
        """Local training of these clients, one engine group per architecture (as the
        simulator trains them); replies and metrics by client id. The FLOPs measured here
        (the server cannot see them) are reported once, with the first client's metrics."""
        got = self.host.fit(rnd, msgs, NodeStates(self, context, rnd, checkpoint))
        metrics: dict[int, dict[str, float]] = {}
        for part, loss in got.losses:
            losses = loss.reshape(-1)
            for i, c in enumerate(part):
                metrics[c] = {"train_loss": float(losses[i])}
        metrics[min(metrics)]["train_flops"] = float(got.flops)
        return got.replies, self._lost(metrics)

    def _lost(self, metrics: dict[int, dict[str, float]]) -> dict[int, dict[str, float]]:
        for c in sorted(self.lost & set(metrics)):
            metrics[c]["state_lost"] = 1.0
            self.lost.discard(c)
        return metrics

    def mix(
        self,
        rnd: int,
        neighbours: dict[int, Payload],
        weights: dict[int, Tensor],
        context: Context,
        checkpoint: int,
    ) -> None:
        """Decentralized: ``mixed_i = sum_j W[i, j] payload_j`` over client ``i``'s relayed
        neighbours' payloads (seed 004, Alg. 1), mixed here on the node, then ``Client.mix``
        for each architecture group."""
        mixed = {
            c: unstack_payload(Gossip.mix(weights[c].reshape(1, -1), neighbours[c]), 1)[0]
            for c in neighbours
        }
        self.host.mix(rnd, mixed, NodeStates(self, context, rnd, checkpoint))

    def setup(
        self, stage: int, msgs: dict[int, Payload], context: Context, checkpoint: int = 0
    ) -> tuple[dict[int, Payload], dict[int, dict[str, float]]]:
        got = self.host.setup(stage, msgs, NodeStates(self, context, 0, checkpoint))
        stats = {
            c: {k: float(v.reshape(-1)[i]) for k, v in st.items()}
            for part, st in got.stats
            for i, c in enumerate(part)
        }
        return got.replies, stats

    def evaluate(
        self, msgs: dict[int, Payload], context: Context, split: str = "test", checkpoint: int = 0
    ) -> dict[int, dict[str, float]]:
        if split not in ("test", "val"):
            raise ValueError(f"evaluate: unknown split {split!r}")
        got = self.host.evaluate(msgs, split, NodeStates(self, context, 0, checkpoint))
        return {
            c: {"correct": float(ok[i]), "total": float(total[i]), "loss_sum": float(loss[i])}
            for part, (ok, total, loss) in got
            for i, c in enumerate(part)
        }


@dataclass
class NodeStates:
    """A node's :class:`~hyperfed.runtime.clients.StateStore` for one message: its clients'
    states in ``context.state`` (and, for a resumable run, on its disk), written as those of
    round ``rnd`` with the server's last checkpoint round ``checkpoint``."""

    runtime: ClientRuntime
    context: Context
    rnd: int
    checkpoint: int

    def get(self, cids: list[int]) -> dict[int, dict[str, Tensor]]:
        return self.runtime.load_states(self.context, cids, self.checkpoint)

    def put(self, states: dict[int, dict[str, Tensor]]) -> None:
        self.runtime.save_states(self.context, states, self.rnd, self.checkpoint)


# The clients this process built, by (run id, what the node config names, num-partitions): a
# long-lived ClientApp process (``hyperfed.deploy.clientapp``) builds its clients once per run
# and reuses them for every message; those of another run are dropped when a new run's first
# message comes.
_RUNTIMES: dict[tuple[int, int | str, int], ClientRuntime] = {}


def _runtime(context: Context) -> ClientRuntime:
    nc = context.node_config
    check_node_config(nc)
    served: int | str = str(nc[PARTITION_IDS]) if PARTITION_IDS in nc else int(nc[PARTITION_ID])
    key = (int(context.run_id), served, int(nc[NUM_PARTITIONS]))
    if key not in _RUNTIMES:
        for old in [k for k in _RUNTIMES if k[0] != key[0]]:
            del _RUNTIMES[old]  # a finished run's clients: their state lives on in its context
        cfg = config_from_run_config(dict(context.run_config))
        per_node = RunSettings.from_run_config(context.run_config).clients_per_node
        cids = node_clients(dict(nc), cfg, per_node)
        _RUNTIMES[key] = ClientRuntime.build(cfg, cids, cfg.clients.count)
        built = os.environ.get(BUILD_LOG_ENV)
        if built:  # one short line per build, appended (atomic for concurrent processes)
            line = json.dumps(
                {"pid": os.getpid(), "run": key[0], "client": cids[0], "clients": cids}
            )
            with open(built, "a") as f:
                f.write(line + "\n")
    return _RUNTIMES[key]


# -- ClientApp ------------------------------------------------------------------------------
client_app = ClientApp()


@dataclass
class _Request:
    """What a message asks of this node: its clients' records and payloads (by client id),
    the message's config and the server's last checkpoint round (0: none yet)."""

    rt: ClientRuntime
    parts: dict[int, RecordDict]
    payloads: dict[int, Payload]
    config: Mapping[str, Any]
    checkpoint: int


def _request(msg: Message, context: Context) -> _Request:
    """A message decoded for the node's clients: the clients its config names
    (``client-ids``), all served by this node."""
    rt = _runtime(context)
    config: Mapping[str, Any] = msg.content.config_records.get(CONFIG, {})
    if "client-ids" not in config:
        raise ConfigError(
            f"a message naming no clients (config client-ids) to the node of clients {rt.cids}: "
            "run the same hyperfed version on the server and every node"
        )
    cids = [int(c) for c in config["client-ids"]]
    stray = sorted(set(cids) - set(rt.cids))
    if stray or len(set(cids)) != len(cids):
        raise ConfigError(f"message for clients {cids}; this node serves {rt.cids}")
    parts = client_parts(msg.content, cids)
    payloads = {c: record_to_payload(part, rt.device) for c, part in parts.items()}
    return _Request(rt, parts, payloads, config, int(config.get("checkpoint", 0)))


def _answer(
    msg: Message,
    cids: Sequence[int],
    replies: dict[int, Payload] | None,
    metrics: dict[int, dict[str, float]] | None,
    **shared: Any,
) -> Message:
    """The reply: each client's payload and metrics (always a metrics record: it says the node
    answered for this client), as one group message."""
    parts = {}
    for c in cids:
        part = payload_to_record(replies[c]) if replies is not None else RecordDict()
        part[METRICS] = MetricRecord(dict(metrics[c]) if metrics is not None else {})
        parts[c] = part
    return Message(group_message(parts, shared), reply_to=msg)


@client_app.query("join")
def _client_join(msg: Message, context: Context) -> Message:
    rt = _runtime(context)
    served = ConfigRecord({PARTITION_IDS: rt.cids})
    return _answer(msg, rt.cids, rt.joins(), None, **{NODE: served})


@client_app.query("setup")
def _client_setup(msg: Message, context: Context) -> Message:
    req = _request(msg, context)
    stage = int(req.config["stage"])
    replies, stats = req.rt.setup(stage, req.payloads, context, req.checkpoint)
    return _answer(msg, list(req.parts), replies, stats)


@client_app.train()
def _client_train(msg: Message, context: Context) -> Message:
    req = _request(msg, context)
    replies, metrics = req.rt.fit(int(req.config["round"]), req.payloads, context, req.checkpoint)
    return _answer(msg, list(req.parts), replies, metrics)


@client_app.query("gossip")
def _client_gossip(msg: Message, context: Context) -> Message:
    req = _request(msg, context)
    weights = {c: unpack_tensors(part.array_records[WEIGHTS])["w"] for c, part in req.parts.items()}
    req.rt.mix(int(req.config["round"]), req.payloads, weights, context, req.checkpoint)
    return _answer(msg, list(req.parts), None, None)


@client_app.evaluate()
def _client_evaluate(msg: Message, context: Context) -> Message:
    req = _request(msg, context)
    split = str(req.config.get("split", "test"))
    metrics = req.rt.evaluate(req.payloads, context, split, req.checkpoint)
    return _answer(msg, list(req.parts), None, metrics)
