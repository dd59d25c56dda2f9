"""The wire format of hyperfed's Flower messages: message types, record names, the codec
between payloads (dicts of named tensors) and Flower records, and the group message.

Every message to a node and every reply is one *group message* for the clients it serves (one
client is a group of one): config ``client-ids`` names them, and each client's records (its
payload, a gossip message's row of W, its metrics) stand under ``<name>.<client id>``
(``payload.3``, ``metrics.3``), bundled into a few records (:func:`group_message` /
:func:`client_parts`). A payload travels as one packed record (:func:`pack_tensors`), exact
for every torch dtype.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MessageType, MetricRecord, RecordDict
from torch import Tensor

from hyperfed.algorithms.base import Payload

# message types (the ClientApp's handlers, hyperfed.deploy.node)
JOIN = f"{MessageType.QUERY}.join"
SETUP = f"{MessageType.QUERY}.setup"
GOSSIP = f"{MessageType.QUERY}.gossip"  # decentralized: the neighbours' payloads, relayed
TRAIN = MessageType.TRAIN
EVALUATE = MessageType.EVALUATE

# record names inside a message's RecordDict (a client's, under "<name>.<client id>")
PAYLOAD = "payload"  # ArrayRecord: the algorithm's payload, nothing else
CONFIG = "config"  # ConfigRecord: round / stage / client ids / last checkpoint round
WEIGHTS = "weights"  # ArrayRecord of a gossip message: this client's row of W
METRICS = "metrics"  # MetricRecord: train loss, evaluation counts
NODE = "node"  # ConfigRecord in the join reply: the partition ids this node serves
EVAL_FIELDS = ("correct", "total", "loss_sum")  # what a node's evaluation reply holds

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


# -- the group message: each client's records under "<name>.<client id>" -----------------------
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


# -- the wire log ---------------------------------------------------------------------
def describe(content: RecordDict) -> dict[str, Any]:
    """What a message carries, for the wire log: every record and key; tensors with shape,
    dtype and content id (sha256 of their bytes; a plain Array: Flower's object id)."""
    out: dict[str, Any] = {}
    for name, rec in content.items():
        try:
            out[name] = _describe(rec)
        except Exception as e:  # a hostile or broken record: logged, never a crash
            out[name] = {"malformed": decode_error(e)}
    return out


def decode_error(e: BaseException) -> str:
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
