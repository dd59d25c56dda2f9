"""FedProto (Tan et al., AAAI 2022): clients exchange class prototypes, never parameters.

A prototype of class j on client k is the mean representation ``f_k(x)`` (the input of the
model's last Linear layer) over k's samples of class j (FedProto Eq. 3). Round t:

1. the server sends the global prototypes ``C_bar^j`` (classes nobody has reported yet are
   marked missing);
2. the client trains its own model for E epochs on
   ``CE(F_k(x), y) + lam * ||f_k(x) - C_bar^y||^2`` (Eq. 7; the squared distance is averaged
   over the feature entries, as the official code's ``nn.MSELoss``; samples whose class has no
   global prototype yet get only the CE term), then computes its prototypes with the trained
   model (inference mode, one pass over its training split) and uploads them for the classes
   it holds, with their sample counts;
3. the server averages each class's prototypes weighted by the clients' sample counts of that
   class (Eq. 6, normalized); a class no participant reported this round keeps its previous
   global prototype (with partial participation most classes are not seen every round).

The payload is ``proto_classes`` (int32 ``[S]``), ``protos`` (``[S, d]``) and ``proto_counts``
(``[S]``) for the S classes a client holds: ``S * (d + 2) * 4`` bytes up. Heterogeneous clients
need a common representation size d (CNN-1..5 all have d = 500); the server checks it at join.

Evaluation: each client's own model with its own classifier (argmax of the logits). FedProto
can also classify by the nearest global prototype; we report the classifier, which is the
personalized model the other methods are scored with.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from hyperfed.algorithms.base import (
    Algorithm,
    ClientGroup,
    Payload,
    PersonalModelClient,
    Server,
    ServerContext,
    chosen,
    shared_join_value,
)
from hyperfed.algorithms.local_settings import SEED002
from hyperfed.engine.local import LossFn, per_parameter
from hyperfed.engine.losses import check_class_payload, class_means, class_sums, pack_classes
from hyperfed.errors import ConfigError
from hyperfed.hparams import NonNeg, Space
from hyperfed.models.layout import FunctionalModel

KEYS = ("proto_classes", "protos", "proto_counts")


@dataclass
class FedProtoParams:
    """lam: weight of the prototype regularizer (Eq. 7; 1.0 in FedProto's official code)."""

    lam: NonNeg = chosen(1.0, "FedProto's official code (ld = 1); not found in the paper")


@per_parameter
def proto_loss(
    fm: FunctionalModel,
    theta: Tensor,
    buffers: Tensor,
    x: Tensor,
    y: Tensor,
    ctx: dict[str, Tensor],
    *,
    lam: float,
) -> tuple[Tensor, Tensor]:
    """Eq. 7: CE + lam * mean_j (f(x)_j - C_bar^y_j)^2 over samples with a global prototype."""
    (feats, logits), new_buffers = fm.forward_train(theta, buffers, x, return_features=True)
    target = ctx["protos"][y]  # [B, d]
    have = ctx["proto_mask"][y]  # [B] 1.0 where class y has a global prototype
    dist = ((feats - target) ** 2).mean(-1)
    reg = (dist * have).sum() / have.sum().clamp(min=1.0)
    return F.cross_entropy(logits, y) + lam * reg, new_buffers


class FedProtoServer(Server):
    def __init__(self, hp: FedProtoParams, clients: dict[int, Payload], ctx: ServerContext) -> None:
        super().__init__(hp, clients, ctx)
        self.dim = shared_join_value(
            clients,
            "feature_dim",
            "clients.models: fedproto needs one representation size for all clients "
            "(got {values}); choose models whose last hidden layer has the same width",
        )
        self.protos = torch.zeros(ctx.num_classes, self.dim, device=ctx.device)
        self.proto_mask = torch.zeros(ctx.num_classes, device=ctx.device)

    def configure_train(self, rnd: int, client_ids: list[int]) -> dict[int, Payload]:
        return {c: {"protos": self.protos, "proto_mask": self.proto_mask} for c in client_ids}

    def check_reply(self, client_id: int, reply: Payload) -> str | None:
        if set(reply) != set(KEYS):
            return f"expected {', '.join(KEYS)}, got {sorted(reply)}"
        return check_class_payload(reply, KEYS, self.ctx.num_classes, self.dim)

    def aggregate(self, rnd: int, replies: dict[int, Payload]) -> None:
        if not replies:
            return
        sums = torch.zeros_like(self.protos)
        counts = torch.zeros_like(self.proto_mask)
        for reply in replies.values():
            s, n = class_sums(reply[KEYS[0]], reply[KEYS[1]], reply[KEYS[2]], self.ctx.num_classes)
            sums, counts = sums + s, counts + n
        # classes nobody reported this round keep their previous prototype
        seen = counts > 0
        self.protos = torch.where(
            seen.unsqueeze(1), sums / counts.clamp(min=1).unsqueeze(1), self.protos
        )
        self.proto_mask = torch.maximum(self.proto_mask, seen.to(self.proto_mask.dtype))


class ClassStatsClient(PersonalModelClient):
    """Trains its own model with :meth:`loss` (given the server's message), then reports the
    per-class means of its model's outputs on its training split as ``keys``: FedProto's
    representations (``features``), FD's logits."""

    keys: tuple[str, ...] = KEYS
    features = True

    def loss(self, msg: Payload) -> tuple[LossFn, dict[str, Tensor]]:
        raise NotImplementedError

    def fit(
        self, group: ClientGroup, msg: Payload, state: dict[str, Tensor]
    ) -> tuple[Payload, dict[str, Tensor], Tensor]:
        loss_fn, ctx = self.loss(msg)
        theta, buffers, loss = group.train(
            state["theta"], state["buffers"], loss_fn=loss_fn, ctx=ctx
        )
        means, counts = class_means(
            group.fm, theta, buffers, group.data, group.client_ids, features=self.features
        )
        reply = dict(zip(self.keys, pack_classes(means, counts)))
        return reply, {"theta": theta, "buffers": buffers}, loss


class FedProtoClient(ClassStatsClient):
    def join(self, fm: FunctionalModel, num_samples: int) -> Payload:
        feature_dim = getattr(fm.module, "feature_dim", None)  # the last Linear's input size
        if not isinstance(feature_dim, int):
            raise ConfigError(
                f"clients.models: fedproto needs a model whose forward ends in an nn.Linear to "
                f"the logits (its input is the representation); {fm.name} has none"
            )
        return {
            "num_samples": torch.tensor(num_samples, dtype=torch.int64),
            "feature_dim": torch.tensor(feature_dim, dtype=torch.int64),
        }

    def loss(self, msg: Payload) -> tuple[LossFn, dict[str, Tensor]]:
        ctx = {"protos": msg["protos"], "proto_mask": msg["proto_mask"]}
        return partial(proto_loss, lam=self.hp.lam), ctx


ALGORITHM = Algorithm(
    name="fedproto",
    summary="FedProto: clients share per-class prototypes (mean representations)",
    hparams=FedProtoParams,
    server=FedProtoServer,
    client=FedProtoClient,
    local_defaults=SEED002,
    tune={"lam": Space(0.01, 10.0, log=True)},
)
