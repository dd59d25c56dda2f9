"""The sparse-upload codec (seed 000 Table 12): an update sent dense, or as the top-k entries
by magnitude (``<name>_idx`` int32 positions, ``<name>_val`` values). MH-pFedHN's clients
encode their updates with it, its server and the gradient-inversion harness decode them; every
received payload passes :func:`nonfinite_tensor`."""

from __future__ import annotations

import math

import torch
from torch import Tensor

Payload = dict[str, Tensor]


def encode_update(delta: Tensor, fraction: float, name: str) -> Payload:
    """The update as sent: dense, or the top-``fraction`` entries by magnitude (Table 12)."""
    if fraction >= 1.0:
        return {name: delta}
    k = max(1, math.ceil(fraction * delta.shape[-1]))
    idx = delta.abs().topk(k, dim=-1).indices
    return {f"{name}_idx": idx.to(torch.int32), f"{name}_val": delta.gather(-1, idx)}


def decode_update(payload: Payload, name: str, length: int) -> Tensor:
    """The dense update ``name`` of length ``length`` from a payload :func:`encode_update` wrote."""
    if name in payload:
        return payload[name]
    idx, val = payload[f"{name}_idx"].long(), payload[f"{name}_val"]
    return torch.zeros(length, dtype=val.dtype, device=val.device).scatter_(0, idx, val)


def check_update(payload: Payload, name: str, length: int) -> str | None:
    """Why update ``name`` in ``payload`` is malformed (its shape, top-k indices out of range),
    or None."""
    if name in payload:
        if payload[name].shape != (length,):
            return f"{name} has shape {tuple(payload[name].shape)}, expected ({length},)"
    elif f"{name}_idx" in payload and f"{name}_val" in payload:
        idx = payload[f"{name}_idx"]
        if idx.shape != payload[f"{name}_val"].shape or idx.dim() != 1:
            return f"{name}_idx and {name}_val must be 1-D of equal length"
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= length):
            return f"{name}_idx out of range [0, {length})"
    else:
        return f"missing {name}"
    return None


def nonfinite_tensor(payload: Payload) -> str | None:
    """Which tensor of ``payload`` holds NaN or Inf (None if all are finite)."""
    for key, value in payload.items():
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            return f"{key} contains NaN or Inf"
    return None
