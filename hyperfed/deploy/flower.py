"""Flower ``ServerApp`` and ``ClientApp`` that run any centralized hyperfed algorithm.

The algorithm files are untouched: the server role and the client role exchange the same
payloads (dicts of named tensors) as in the simulator, serialized into Flower records
(:func:`payload_to_record` / :func:`record_to_payload`, exact round trip).

Every message to a node and every reply is one *group message* for the clients it serves
(one client is a group of one): config ``client-ids`` names them, each client's records stand
under ``<name>.<client id>`` (``payload.3``, ``metrics.3``), bundled into a few records
(:func:`group_message` / :func:`client_parts`). A run is

1. ``query.join``  -> every node answers the partition ids it serves (node config
   ``partition-id``, or ``partition-ids``, e.g. "0-9"; or a simulated node's group of the
   run's ``clients-per-node``) and each one's ``Client.join`` payload; nothing else about
   them. The server sends it messages for those clients only;
2. ``query.setup`` -> setup stages, for algorithms that have one (MH-pFedHNDD);
3. per round: ``train`` -> one message per sampled node holding its sampled clients'
   payloads (for MH-pFedHN each one's own theta_i), trained there as one engine group per
   architecture; ``Grid.send_and_receive`` with a timeout, carrying on with the replies that
   came back and passed ``Server.check_reply``;
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
from collections.abc import Callable, Mapping, Sequence
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
    check_join,
    payload_bytes,
    stack_payloads,
    unstack_payload,
)
from hyperfed.config import ConfigError, ExperimentConfig, config_from_dict, to_toml
from hyperfed.data.federated import FederatedData
from hyperfed.deploy.launch import (
    RC_CLIENTS_PER_NODE,
    RC_JOIN_TIMEOUT,
    RC_MIN_NODES,
    RC_RESUME,
    RC_ROUND_TIMEOUT,
    RC_RUN_DIR,
    check_deployable,
    experiment_from_run_config,
    node_groups,
    parse_partition_ids,
)
from hyperfed.deploy.supernode import FIRST_POLL, POLL_INTERVAL, PollSchedule, shorten_object_pulls
from hyperfed.models.layout import FunctionalModel
from hyperfed.runtime.clients import ClientHost
from hyperfed.runtime.driver import EvalCounts, Exchange, RoundResult
from hyperfed.runtime.federation import Federation
from hyperfed.runtime.gossip import Gossip
from hyperfed.runtime.rundir import (
    CheckpointWriteError,
    RunDir,
    atomic_torch_save,
    atomic_write_bytes,
)

log = logging.getLogger("hyperfed.flower")

# message types (ClientApp handlers below)
JOIN = f"{MessageType.QUERY}.join"
SETUP = f"{MessageType.QUERY}.setup"
GOSSIP = f"{MessageType.QUERY}.gossip"  # decentralized: the neighbours' payloads, relayed
TRAIN = MessageType.TRAIN
EVALUATE = MessageType.EVALUATE

# record names inside a message's RecordDict
PAYLOAD = "payload"  # ArrayRecord: the algorithm's payload, nothing else
CONFIG = "config"  # ConfigRecord: round / stage / client id / last checkpoint round
WEIGHTS = "weights"  # ArrayRecord of a gossip message: this node's row of W
METRICS = "metrics"  # MetricRecord: train loss, evaluation counts
NODE = "node"  # ConfigRecord in the join reply: the partition id(s) this node serves
STATE = "hyperfed.state"  # ArrayRecord in context.state: this client's persistent state
SERVER_STATE = "server_state.pt"  # in the run directory: the server role's final state
STATE_DIR_ENV = "HYPERFED_STATE_DIR"  # where nodes keep their client state of resumable runs
# node config keys: one client (partition-id), or several (partition-ids: "0-9", "0,3,5")
PARTITION_ID, PARTITION_IDS, NUM_PARTITIONS = "partition-id", "partition-ids", "num-partitions"

# -- payload <-> Flower records -----------------------------------------------------------
# Flower sends every Array of a message as its own objects (the Array, and a chunk per 5 MB),
# one HTTP request each on every hop (ServerApp -> SuperLink -> SuperNode -> ClientApp and
# back). A LeNet's 10 tensors were 22 objects; packed end to end they are 5.
PACKED = "hyperfed.bytes"  # Array (uint8): every tensor's bytes, end to end
LAYOUT = "hyperfed.layout"  # Array (uint8): JSON [[name, torch dtype, shape], ...]


def pack_tensors(tensors: Mapping[str, Tensor]) -> ArrayRecord:
    """Named tensors as one ArrayRecord of two Arrays (bytes + layout): exact for every torch
    dtype (bfloat16 too), in the given order."""
    layout: list[list[Any]] = []
    parts: list[Tensor] = []
    for name, value in tensors.items():
        t = value.detach().cpu().contiguous()
        layout.append([name, str(t.dtype).removeprefix("torch."), list(t.shape)])
        parts.append(t.reshape(-1).view(torch.uint8))
    data = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)
    return _packed(data.numpy(), layout)


def _packed(data: np.ndarray, layout: list[list[Any]]) -> ArrayRecord:
    meta = np.frombuffer(json.dumps(layout).encode(), dtype=np.uint8).copy()
    return ArrayRecord({PACKED: Array(data), LAYOUT: Array(meta)})


def _unpacked(record: ArrayRecord) -> tuple[np.ndarray, list[list[Any]]]:
    """A packed record's bytes and layout (refused in one line if it is not one)."""
    if set(record) != {PACKED, LAYOUT}:
        raise ValueError(
            f"not a hyperfed tensor record (arrays {sorted(record)}): the sender runs another "
            "hyperfed version; run the same version on the server and every node"
        )
    return record[PACKED].numpy(), json.loads(record[LAYOUT].numpy().tobytes())


def _dtype(name: Any) -> torch.dtype:
    """The torch dtype a layout names (refused in one line if it names none)."""
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"a tensor record names no torch dtype: {str(name)[:40]!r}")
    return dtype


def _nbytes(dtype_name: str, shape: list[int]) -> int:
    if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
        raise ValueError(f"a tensor record has an invalid shape: {str(shape)[:40]}")
    return math.prod(shape) * torch.empty(0, dtype=_dtype(dtype_name)).element_size()


def unpack_tensors(record: ArrayRecord, device: torch.device | str = "cpu") -> dict[str, Tensor]:
    """Inverse of :func:`pack_tensors`."""
    raw, layout = _unpacked(record)
    data = torch.from_numpy(np.array(raw, copy=True))
    out: dict[str, Tensor] = {}
    offset = 0
    for name, dtype_name, shape in layout:
        dtype = _dtype(dtype_name)
        size = _nbytes(dtype_name, shape)
        if offset + size > data.numel():
            raise ValueError(f"a tensor record holds fewer bytes than its layout ({name!r})")
        # clone: a fresh, aligned buffer for the dtype's view (an empty one has no bytes to view)
        part = (
            data[offset : offset + size].clone().view(dtype)
            if size
            else torch.empty(0, dtype=dtype)
        )
        out[name] = part.reshape(shape).to(device)
        offset += size
    return out


def payload_to_record(payload: Payload) -> RecordDict:
    """A payload as a RecordDict holding one packed ArrayRecord (:func:`pack_tensors`)."""
    return RecordDict({PAYLOAD: pack_tensors(payload)}) if payload else RecordDict()


def record_to_payload(content: RecordDict, device: torch.device | str = "cpu") -> Payload:
    """Inverse of :func:`payload_to_record`."""
    if PAYLOAD not in content.array_records:
        return {}
    return unpack_tensors(content.array_records[PAYLOAD], device)


# Every message to or from a node is a group message (one client is a group of one): config
# ``client-ids`` names its clients, and each client's records (payload, weights, metrics) stand
# under ``<name>.<client id>``.
def client_key(name: str, cid: int) -> str:
    return f"{name}.{cid}"


def client_view(content: RecordDict, cid: int) -> RecordDict:
    """Client ``cid``'s records of a group message, under their own names."""
    suffix = f".{cid}"
    return RecordDict({k.removesuffix(suffix): v for k, v in content.items() if k.endswith(suffix)})


# On the wire a group message's per-client records travel bundled: every ArrayRecord's
# tensors in one packed record, every MetricRecord's values in one MetricRecord, and an index
# of the record names (an empty record too) -- 3 + 2 objects however many clients, against 4
# per client (a node's reply for 10 clients took ~0.35 s to push as 40 objects on loopback).
BUNDLED_ARRAYS = "hyperfed.arrays"  # packed: "<record>/<tensor>"
BUNDLED_METRICS = "hyperfed.metrics"  # "<record>/<metric>"
BUNDLE_INDEX = "hyperfed.records"  # ConfigRecord: arrays / metrics -> the record names


def bundle(content: RecordDict) -> RecordDict:
    """``content`` with its (packed) ArrayRecords and its MetricRecords merged: see above. The
    packed records' bytes are joined as they are (one copy, no tensor is rebuilt)."""
    out = RecordDict()
    parts: list[np.ndarray] = []
    layout: list[list[Any]] = []
    values: dict[str, Any] = {}
    index: dict[str, list[str]] = {"arrays": [], "metrics": []}
    for name, rec in content.items():
        if isinstance(rec, ArrayRecord):
            index["arrays"].append(name)
            data, entries = _unpacked(rec)
            parts.append(data.reshape(-1))
            layout += [[f"{name}/{k}", dtype, shape] for k, dtype, shape in entries]
        elif isinstance(rec, MetricRecord):
            index["metrics"].append(name)
            values.update({f"{name}/{k}": v for k, v in rec.items()})
        else:
            out[name] = rec
    if parts:  # a message of no tensors (an evaluation request) sends no bytes record
        out[BUNDLED_ARRAYS] = _packed(np.concatenate(parts), layout)
    if values:
        out[BUNDLED_METRICS] = MetricRecord(values)
    out[BUNDLE_INDEX] = ConfigRecord(index)  # type: ignore[arg-type]
    return out


def unbundle(content: RecordDict) -> RecordDict:
    """Inverse of :func:`bundle` (each record's bytes sliced back out, not re-packed); a
    content that is not bundled comes back as it is."""
    if BUNDLE_INDEX not in content.config_records:
        return content
    index = content.config_records[BUNDLE_INDEX]
    out = RecordDict({k: v for k, v in content.items() if not k.startswith("hyperfed.")})
    data: np.ndarray = np.zeros(0, dtype=np.uint8)
    layout: list[list[Any]] = []
    if BUNDLED_ARRAYS in content.array_records:
        data, layout = _unpacked(content.array_records[BUNDLED_ARRAYS])
    spans: dict[str, list[int]] = {str(n): [0, 0] for n in index["arrays"]}  # type: ignore[union-attr]
    entries: dict[str, list[list[Any]]] = {name: [] for name in spans}
    offset = 0
    for key, dtype, shape in layout:  # each record's tensors lie together, in order
        name, _, sub = key.partition("/")
        if not entries[name]:
            spans[name][0] = offset
        entries[name].append([sub, dtype, shape])
        offset += _nbytes(dtype, shape)
        spans[name][1] = offset
    values: dict[str, dict[str, Any]] = {str(n): {} for n in index["metrics"]}  # type: ignore[union-attr]
    for key, v in content.metric_records.get(BUNDLED_METRICS, {}).items():
        name, _, sub = key.partition("/")
        values[name][sub] = v
    for name, (start, end) in spans.items():
        out[name] = _packed(data[start:end].copy(), entries[name])
    for name, metrics in values.items():
        out[name] = MetricRecord(metrics)
    return out


def group_message(parts: Mapping[int, RecordDict], shared: Mapping[str, Any]) -> RecordDict:
    """A group message's content, bundled: each client's records (``parts``, by client id)
    under ``<name>.<client id>``, the ``shared`` records under their names."""
    content = RecordDict()
    for cid, part in parts.items():
        for name, record in part.items():
            content[client_key(name, cid)] = record
    for name, record in shared.items():
        content[name] = record
    return bundle(content)


def client_parts(content: RecordDict, cids: Sequence[int]) -> dict[int, RecordDict]:
    """Inverse of :func:`group_message`: each client's records, under their own names (empty
    for a client the message holds nothing for)."""
    whole = unbundle(content)
    return {cid: client_view(whole, cid) for cid in cids}


def _state_record(state: dict[str, Tensor]) -> ArrayRecord:
    return pack_tensors(state)


def _state_from_record(record: ArrayRecord, device: torch.device) -> dict[str, Tensor]:
    return unpack_tensors(record, device)


# -- what both sides rebuild from the config ----------------------------------------------
def config_from_run_config(run_config: dict[str, Any]) -> ExperimentConfig:
    """The experiment config carried in the run config, one key per setting (validated like
    ``hyperfed run``; ``flwr run --run-config "rounds=50"`` overrides one)."""
    cfg = config_from_dict(experiment_from_run_config(run_config))
    check_deployable(cfg)  # flwr run --run-config "attack.kind='scale'": refused here too
    return cfg


def _check_node_config(node_config: Mapping[str, Any]) -> None:
    if NUM_PARTITIONS not in node_config or (
        PARTITION_IDS not in node_config and PARTITION_ID not in node_config
    ):
        raise ConfigError(
            "node config needs partition-id (or partition-ids) and num-partitions, e.g. "
            "flower-supernode --node-config 'partition-id=0 num-partitions=10'"
        )


def node_clients(
    node_config: Mapping[str, Any], cfg: ExperimentConfig, clients_per_node: int = 1
) -> list[int]:
    """The client ids a node serves, from its node config: ``partition-ids`` (a list, e.g.
    "0-9", "0,3,5", "0-4,9"; ``num-partitions`` must be ``clients.count``), or one
    ``partition-id`` -- of ``clients.count`` partitions, or, with the run's
    ``clients-per-node`` G, of ceil(clients.count / G) node groups (Flower's Simulation Engine
    numbers its simulated nodes so): node ``k`` serves ``k*G .. k*G+G-1``."""
    _check_node_config(node_config)
    n = cfg.clients.count
    m = _int(node_config[NUM_PARTITIONS])
    if PARTITION_IDS in node_config:
        if m != n:
            raise ConfigError(
                f"node config num-partitions={m} but clients.count={n}: every node must "
                "split the data as the config does"
            )
        return parse_partition_ids(node_config[PARTITION_IDS], n)
    cid = _int(node_config[PARTITION_ID])
    groups = node_groups(n, clients_per_node) if clients_per_node > 1 else None
    if m == n or groups is None or m != len(groups):
        if m != n:
            grouped = "" if groups is None else f" (nor {len(groups)} node groups)"
            raise ConfigError(
                f"node config num-partitions={m} but clients.count={n}{grouped}: every node "
                "must split the data as the config does"
            )
        if not 0 <= cid < n:
            raise ConfigError(f"node config partition-id={cid} not in [0, {n})")
        return [cid]
    if not 0 <= cid < m:
        raise ConfigError(f"node config partition-id={cid} not in [0, {m})")
    return groups[cid]


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
        run_dir = str(context.run_config.get(RC_RUN_DIR, ""))
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
                out[c] = _state_from_record(records[self.state_key(c)], self.device)
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
        context.state[self.state_key(cid)] = _state_record(one)
        return one

    def save_states(
        self, context: Context, states: dict[int, dict[str, Tensor]], rnd: int, checkpoint: int
    ) -> None:
        for cid, one in states.items():
            context.state[self.state_key(cid)] = _state_record(one)
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
BUILD_LOG_ENV = "HYPERFED_BUILD_LOG"  # a file: one line per node built (pid, run, clients)


def _runtime(context: Context) -> ClientRuntime:
    nc = context.node_config
    _check_node_config(nc)
    served: int | str = str(nc[PARTITION_IDS]) if PARTITION_IDS in nc else _int(nc[PARTITION_ID])
    key = (int(context.run_id), served, _int(nc[NUM_PARTITIONS]))
    if key not in _RUNTIMES:
        for old in [k for k in _RUNTIMES if k[0] != key[0]]:
            del _RUNTIMES[old]  # a finished run's clients: their state lives on in its context
        cfg = config_from_run_config(dict(context.run_config))
        per_node = _int(context.run_config.get(RC_CLIENTS_PER_NODE, 1) or 1)
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


def _int(value: Any) -> int:
    return int(value)


def _request(msg: Message, rt: ClientRuntime) -> dict[int, RecordDict]:
    """Each client's records of a message, by client id: the clients its config names
    (``client-ids``), all served by this node."""
    config: Mapping[str, Any] = msg.content.config_records.get(CONFIG, {})
    if "client-ids" not in config:
        raise ConfigError(
            f"a message naming no clients (config client-ids) to the node of clients {rt.cids}: "
            "run the same hyperfed version on the server and every node"
        )
    cids = [_int(c) for c in config["client-ids"]]
    stray = sorted(set(cids) - set(rt.cids))
    if stray or len(set(cids)) != len(cids):
        raise ConfigError(f"message for clients {cids}; this node serves {rt.cids}")
    return client_parts(msg.content, cids)


def _payloads(parts: dict[int, RecordDict], rt: ClientRuntime) -> dict[int, Payload]:
    return {c: record_to_payload(part, rt.device) for c, part in parts.items()}


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


def _checkpoint(msg: Message) -> int:
    """The server's last checkpoint round, sent with every message (0: none yet)."""
    return _int(msg.content.config_records[CONFIG].get("checkpoint", 0))


@client_app.query("setup")
def _client_setup(msg: Message, context: Context) -> Message:
    rt = _runtime(context)
    parts = _request(msg, rt)
    stage = _int(msg.content.config_records[CONFIG]["stage"])
    replies, stats = rt.setup(stage, _payloads(parts, rt), context, _checkpoint(msg))
    return _answer(msg, list(parts), replies, stats)


@client_app.train()
def _client_train(msg: Message, context: Context) -> Message:
    rt = _runtime(context)
    parts = _request(msg, rt)
    rnd = _int(msg.content.config_records[CONFIG]["round"])
    replies, metrics = rt.fit(rnd, _payloads(parts, rt), context, _checkpoint(msg))
    return _answer(msg, list(parts), replies, metrics)


@client_app.query("gossip")
def _client_gossip(msg: Message, context: Context) -> Message:
    rt = _runtime(context)
    parts = _request(msg, rt)
    rnd = _int(msg.content.config_records[CONFIG]["round"])
    weights = {c: unpack_tensors(part.array_records[WEIGHTS])["w"] for c, part in parts.items()}
    rt.mix(rnd, _payloads(parts, rt), weights, context, _checkpoint(msg))
    return _answer(msg, list(parts), None, None)


@client_app.evaluate()
def _client_evaluate(msg: Message, context: Context) -> Message:
    rt = _runtime(context)
    parts = _request(msg, rt)
    split = str(msg.content.config_records[CONFIG].get("split", "test"))
    metrics = rt.evaluate(_payloads(parts, rt), context, split, _checkpoint(msg))
    return _answer(msg, list(parts), None, metrics)


# -- ServerApp ------------------------------------------------------------------------------
server_app = ServerApp()


def _check_join(
    payload: Payload, server_needs_size: bool = True, max_samples: int = 10**9
) -> str | None:
    """A join payload's problem, if any (a decentralized client tells nothing: ``{}``):
    :func:`~hyperfed.algorithms.base.check_join` (counts one integer each, a sample count in
    ``[1, max_samples]``)."""
    if server_needs_size and ("num_params" not in payload or payload["num_params"].numel() != 1):
        return "join payload has no num_params"
    return check_join(payload, max_samples)


def describe(content: RecordDict) -> dict[str, Any]:
    """What a message carries, for the wire log: every record and key; tensors with shape,
    dtype and content id (sha256 of their bytes; a plain Array: Flower's object id)."""
    out: dict[str, Any] = {}
    for name, rec in content.items():
        try:
            out[name] = _describe(rec)
        except Exception as e:  # a hostile or broken record: logged, never a crash
            out[name] = {"malformed": _why(e)}
    return out


def _why(e: BaseException) -> str:
    """One short line on why a record could not be decoded."""
    return f"malformed record: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


def _describe(rec: Any) -> Any:
    """One record of :func:`describe`."""
    if isinstance(rec, ArrayRecord) and set(rec) == {PACKED, LAYOUT}:
        return {
            k: {
                "shape": list(t.shape),
                "dtype": str(t.dtype).removeprefix("torch."),
                "id": hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[
                    :16
                ],
            }
            for k, t in unpack_tensors(rec).items()
        }
    if isinstance(rec, ArrayRecord):
        return {
            k: {"shape": list(a.shape), "dtype": a.dtype, "id": a.object_id[:16]}
            for k, a in rec.items()
        }
    return sorted(rec.keys())


# The server pulls for replies on a PollSchedule (FIRST_POLL seconds after a push or a reply,
# growing to POLL_INTERVAL; the nodes ask for work the same way: hyperfed.deploy.supernode).
# Flower's Grid.send_and_receive sleeps 3 s between pulls, so every message exchange cost up
# to 3 s on top of the nodes' own 3 s idle poll: ~11 s a round for 3 loopback clients whose
# training takes milliseconds.


def send_and_receive(
    grid: Grid, messages: Sequence[Message], timeout: float | None, poll: float = POLL_INTERVAL
) -> list[Message]:
    """Flower's ``Grid.send_and_receive`` (push, then pull until every message is answered or
    ``timeout`` seconds have passed; None: no limit), waiting ``FIRST_POLL`` seconds after the
    push or a reply and at most ``poll`` seconds between pulls."""
    waiting = set(grid.push_messages(messages))
    end = None if timeout is None else time.monotonic() + timeout
    schedule = PollSchedule(FIRST_POLL, poll)
    replies: list[Message] = []
    while waiting:
        got = list(grid.pull_messages(waiting))
        replies += got
        waiting -= {m.metadata.reply_to_message_id for m in got}
        if not waiting or (end is not None and time.monotonic() >= end):
            break
        if got:
            schedule.reset()
        time.sleep(schedule.next())
    return replies


class _Forward(logging.Handler):
    """Hands another logger's records to ``to``, except this module's own (``to`` has them)."""

    def __init__(self, to: logging.Handler) -> None:
        super().__init__()
        self.to = to

    def emit(self, record: logging.LogRecord) -> None:
        if not record.name.startswith(log.name):
            self.to.handle(record)


EVAL_FIELDS = ("correct", "total", "loss_sum")  # what a node's evaluation reply holds


def counts_fields(counts: EvalCounts) -> tuple[Tensor, Tensor, Tensor]:
    """The tensors of ``counts`` in the order of :data:`EVAL_FIELDS`."""
    return counts.correct, counts.total, counts.loss_sum


class ServerRunDir(RunDir):
    """The ServerApp's run directory: a checkpoint it cannot write (a full disk, a quota, an
    I/O error) is one logged line, the previous checkpoint is kept and the federation goes on
    (the nodes are waiting for it); ``on_failure`` is told, so that the nodes keep the state
    files of the checkpoint that is on disk."""

    def __init__(self, path: str | Path, on_failure: Callable[[], None]) -> None:
        super().__init__(path)
        self.on_failure = on_failure

    def save_checkpoint(self, state: dict[str, Any]) -> int:
        try:
            return super().save_checkpoint(state)
        except CheckpointWriteError as e:
            log.error("%s; the run goes on", e)
            self.on_failure()
            return 0


def save_server_state(path: Path, state: dict[str, Any]) -> bool:
    """Write the server's final state (``server_state.pt``) atomically; a write failure (a
    full disk) is one logged line and the previous file is kept. Whether it was written."""
    try:
        atomic_torch_save(path, state, "server state")
    except CheckpointWriteError as e:
        log.error("%s", e)
        return False
    return True


class Deployment:
    """The server side of a run: the algorithm's server role, run by the round driver
    (:mod:`hyperfed.runtime.driver`), and the Flower nodes it reaches -- this class is the
    driver's transport: one Flower message per node, holding the payloads of the clients it
    serves (a group message; one client is a group of one), replies by client id."""

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
        per_node = int(run_config.get(RC_CLIENTS_PER_NODE, 1) or 1)
        nodes = math.ceil(self.n / max(per_node, 1))  # every client served
        self.min_nodes = int(run_config.get(RC_MIN_NODES, nodes) or nodes)
        self.join_timeout = float(run_config.get(RC_JOIN_TIMEOUT, 300.0))
        self.round_timeout = float(run_config.get(RC_ROUND_TIMEOUT, 600.0))
        stamp = time.strftime("%Y%m%d-%H%M%S")
        run_dir = str(run_config.get(RC_RUN_DIR, "") or f"runs/{stamp}-flower-{cfg.algorithm.name}")
        self.run_dir = ServerRunDir(run_dir, self._checkpoint_failed)
        self.saved_checkpoint = 0  # round of the last checkpoint on disk
        self.node_of: dict[int, int] = {}  # client id -> Flower node id
        self.clients_of: dict[int, list[int]] = {}  # Flower node id -> the clients it serves
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
    ) -> dict[int, RecordDict]:
        """One message per node: its clients' payloads (only clients it serves, as its join
        said), replies by client id (each client's records under their own names);
        errors and late replies are logged and dropped (the run carries on with the others)."""
        by_node: dict[int, list[int]] = {}
        for cid in payloads:
            by_node.setdefault(self.node_of[cid], []).append(cid)
        messages: list[Message] = []
        for node, cids in by_node.items():
            served = ConfigRecord(
                {**config, "client-ids": cids, "checkpoint": self.last_checkpoint}
            )
            parts: dict[int, RecordDict] = {}
            for cid in cids:
                parts[cid] = part = payload_to_record(payloads[cid])
                if extra is not None:  # a gossip message: this client's row of W
                    part[WEIGHTS] = pack_tensors({"w": extra[cid]})
                view = RecordDict(dict(part))
                view[CONFIG] = served
                self.wire("down", kind, group, cid, node, view)
            content = group_message(parts, {CONFIG: served})
            messages.append(Message(content, node, kind, group_id=group, ttl=self.round_timeout))
        replies: dict[int, RecordDict] = {}
        received = send_and_receive(self.grid, messages, self.round_timeout)
        # a reply names the message it answers (ids are set when pushed); the SuperLink's
        # own error replies (an unreachable node) come from the SuperLink, not the node
        by_id = {msg.metadata.message_id: msg.metadata.dst_node_id for msg in messages}
        for reply in received:
            node_or_none = by_id.get(reply.metadata.reply_to_message_id)
            if node_or_none is None and reply.metadata.src_node_id in by_node:
                node_or_none = reply.metadata.src_node_id
            if node_or_none is None:
                continue
            node = node_or_none
            if reply.has_error():
                log.warning(
                    "%s %s: clients %s (node %d) failed: error %s %s",
                    kind,
                    group,
                    by_node[node],
                    node,
                    reply.error.code,
                    (reply.error.reason or "")[:300],
                )
                continue
            try:
                parts = client_parts(reply.content, by_node[node])
            except Exception as e:  # a malformed record: that node's replies are rejected
                log.warning(
                    "%s %s: rejected reply of node %d (clients %s): %s",
                    kind,
                    group,
                    node,
                    by_node[node],
                    _why(e),
                )
                continue
            for cid, view in parts.items():
                if not view:
                    continue  # the node did not answer for this client
                self.wire("up", kind, group, cid, node, view)
                replies[cid] = view
                metrics: dict[str, Any] = dict(view.metric_records.get(METRICS, {}))
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

    def wire(
        self, direction: str, kind: str, group: str, cid: int, node: int, content: RecordDict
    ) -> None:
        """One line per client and message in ``wire.jsonl``: what crossed, to and from which
        client (a group message: that client's part) and node."""
        line = {
            "dir": direction,
            "type": kind,
            "group": group,
            "client": cid,
            "node": node,
            "content": describe(content),
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
        """Every node's join: the clients it serves (``partition-ids``, one join payload each)
        -- the only clients the server sends it messages for."""
        nodes = self.wait_for_nodes()
        messages = [Message(RecordDict(), node, JOIN, group_id="join") for node in nodes]
        joins: dict[int, Payload] = {}
        replies = send_and_receive(self.grid, messages, self.join_timeout)
        # in node order, whatever order the replies came in: a client two nodes claim stays
        # with the first node, the same one every run
        rank = {node: i for i, node in enumerate(nodes)}
        for reply in sorted(replies, key=lambda r: rank.get(r.metadata.src_node_id, len(rank))):
            node = reply.metadata.src_node_id
            if reply.has_error():
                log.warning("join: node %d failed: %s", node, (reply.error.reason or "")[:300])
                continue
            try:
                served = reply.content.config_records[NODE][PARTITION_IDS]
                cids = [_int(c) for c in served]  # type: ignore[union-attr]
                views = client_parts(reply.content, cids)
                payloads = {c: record_to_payload(views[c], self.device) for c in cids}
            except Exception as e:  # a malformed join: that node is left out, logged
                log.warning("join: rejected node %d: %s", node, _why(e))
                continue
            accepted: list[int] = []
            for cid in cids:
                payload = payloads[cid]
                problem = _check_join(
                    payload, self.algorithm.kind == "centralized", self.cfg.defense.max_samples
                )
                if cid in self.node_of or cid in accepted or not 0 <= cid < self.n:
                    problem = f"partition id {cid} taken or out of range [0, {self.n})"
                if problem:
                    what = f"client {cid} of node {node}" if len(cids) > 1 else f"node {node}"
                    log.warning("join: rejected %s: %s", what, problem)
                    continue
                self.node_of[cid] = node
                joins[cid] = payload
                accepted.append(cid)
                self.wire("up", JOIN, "join", cid, node, views[cid])
            if accepted:
                self.clients_of[node] = accepted
        if not joins:
            raise RuntimeError("no node joined the run")
        log.info(
            "joined: clients %s of %d on %d nodes", sorted(joins), self.n, len(self.clients_of)
        )
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
            try:
                out.replies[cid] = record_to_payload(reply, self.device)
                metrics: dict[str, Any] = dict(reply.metric_records.get(METRICS, {}))
            except Exception as e:  # a rejected reply (the driver logs it), not a crash
                out.malformed[cid] = _why(e)
                continue
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
            try:
                payload = record_to_payload(reply, self.device)
                values = {
                    k: float(v)  # type: ignore[arg-type]
                    for k, v in reply.metric_records.get(METRICS, {}).items()
                }
            except Exception as e:  # a rejected reply (the driver logs it), not a crash
                out.malformed[cid] = _why(e)
                continue
            out.replies[cid] = payload
            for k, v in values.items():
                stats.setdefault(k, []).append(v)
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
            # a field missing or not a number: rejected here (logged), left NaN (no answer);
            # impossible counts are the driver's to reject (runtime.driver.check_eval_counts)
            m: Mapping[str, Any] = reply.metric_records.get(METRICS, {})
            values = [m.get(k) for k in EVAL_FIELDS]
            wrong = [
                k
                for k, v in zip(EVAL_FIELDS, values, strict=True)
                if not isinstance(v, int | float) or isinstance(v, bool)
            ]
            if wrong:
                log.warning(
                    "evaluation (%s): rejected reply from client %d: %s missing or not a number",
                    split,
                    cid,
                    ", ".join(wrong),
                )
                continue
            for into, value in zip(counts_fields(counts), values, strict=True):
                into[cid] = float(value)  # type: ignore[arg-type]
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
        # the round driver's lines (rejected replies, logger "hyperfed") go there too
        driver_log, forward = logging.getLogger("hyperfed"), _Forward(handler)
        driver_log.addHandler(forward)
        try:
            return self._run()
        finally:
            log.removeHandler(handler)
            driver_log.removeHandler(forward)
            handler.close()

    def _checkpoint_failed(self) -> None:
        # the checkpoint on disk is still the previous one: the nodes keep its state files
        self.last_checkpoint = self.saved_checkpoint

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
            self.saved_checkpoint = self.last_checkpoint
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
        save_server_state(self.run_dir.path / SERVER_STATE, state)
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
    shorten_object_pulls()  # the replies' objects, from the SuperLink
    Deployment(grid, dict(context.run_config)).run()
