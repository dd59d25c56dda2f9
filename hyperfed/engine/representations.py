"""Representation sharing (FedGH, FedTGP): what a client that uploads per-class mean
representations reports at join, how such an upload is checked and unpacked, and where the
header (the last Linear, ``classifier``) sits in a model's flat vector."""

from __future__ import annotations

from functools import cache

import torch
from torch import Tensor, nn

from hyperfed.engine.losses import check_class_payload
from hyperfed.errors import ConfigError
from hyperfed.models.layout import FunctionalModel

Payload = dict[str, Tensor]
KEYS = ("proto_classes", "protos")  # an upload: class ids [S] (-1: padding), representations


def header_names(module: nn.Module) -> tuple[str, str]:
    """The parameter names of the header, the model's last Linear (``classifier_prefix``:
    ``classifier`` in the zoo, e.g. ``net.fc`` for a wrapped module)."""
    prefix = getattr(module, "classifier_prefix", "classifier")
    return (f"{prefix}.weight", f"{prefix}.bias")


def shared_join_value(clients: dict[int, Payload], key: str, problem: str) -> int:
    """The join value ``key`` that every client must report alike (a feature width, the size
    of the shared layers); otherwise a ConfigError, ``problem`` formatted with ``{values}``."""
    values = sorted({int(p[key]) for p in clients.values()})
    if len(values) > 1:
        raise ConfigError(problem.format(values=values))
    return values[0]


def representation_join(fm: FunctionalModel, num_samples: int, method: str) -> Payload:
    """Join payload of a client that shares representations: ``n_k`` and the width d of its
    representation (the input of its last Linear, ``classifier``), checked against the model."""
    module = fm.module
    dim = getattr(module, "feature_dim", None)
    head = getattr(module, "classifier", None)
    if (
        not isinstance(dim, int)
        or not isinstance(head, nn.Linear)
        or head.in_features != dim
        or head.bias is None
    ):
        raise ConfigError(
            f"clients.models: {method} needs a model whose forward ends in an nn.Linear (with "
            f"a bias) from its representation to the logits; {fm.name} has none"
        )
    return {
        "num_samples": torch.tensor(num_samples, dtype=torch.int64),
        "feature_dim": torch.tensor(dim, dtype=torch.int64),
    }


def common_width(clients: dict[int, Payload], method: str) -> int:
    """The representation width every client reported at join (a ConfigError otherwise)."""
    return shared_join_value(
        clients,
        "feature_dim",
        f"clients.models: {method} needs one representation size for all clients "
        "(got {values}); choose models whose last hidden layer has the same width",
    )


def check_class_reply(reply: Payload, num_classes: int, dim: int) -> str | None:
    """Why a ``(proto_classes, protos)`` reply is malformed (missing / extra tensor, shapes,
    class ids outside ``[-1, classes)``, NaN/Inf), or None."""
    if set(reply) != set(KEYS):
        return f"expected {', '.join(KEYS)}, got {sorted(reply)}"
    cls = reply[KEYS[0]]
    ones = torch.ones(cls.shape[:1], device=cls.device)  # count-free: every slot counts once
    return check_class_payload({**reply, "_n": ones}, (*KEYS, "_n"), num_classes, dim)


def uploaded_pairs(replies: dict[int, Payload]) -> tuple[Tensor, Tensor]:
    """All (representation, class) pairs of the replies, padding dropped, in client-id and
    slot order: ``(protos [M, d], labels [M])``."""
    protos, labels = [], []
    for cid in sorted(replies):
        cls, val = replies[cid][KEYS[0]], replies[cid][KEYS[1]]
        keep = cls >= 0
        protos.append(val[keep])
        labels.append(cls[keep].long())
    return torch.cat(protos), torch.cat(labels)


def minibatches(m: int, batch_size: int, seed: int, device: torch.device) -> list[Tensor]:
    """One shuffled pass over ``m`` items in batches of ``batch_size`` (the last may be short),
    from a generator seeded by ``seed`` (reproducible, resumable)."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(m, generator=g).to(device)
    return list(perm.split(batch_size))


@cache
def header_index(fm: FunctionalModel) -> Tensor:
    """Positions of the header (:func:`header_names`: the last Linear's weight row-major, then
    its bias) in the model's flat vector."""
    segs = {s.name: s for s in fm.layout.segments}
    idx = [torch.arange(segs[n].offset, segs[n].end) for n in header_names(fm.module)]
    return torch.cat(idx).to(fm.initial_params().device)


def with_header(fm: FunctionalModel, theta: Tensor, header: Tensor) -> Tensor:
    """``theta [C, K]`` with its header entries replaced by ``header [C, classes * (d + 1)]``."""
    out = theta.clone()
    out[:, header_index(fm)] = header.to(theta.dtype)
    return out
