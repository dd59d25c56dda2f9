"""FD, federated distillation (Jeong et al., 2018): clients exchange per-label average logits.

Round t:

1. the server sends client k the global average logit vector of every label,
   ``g_k^j = (sum_i n_ij z_i^j - n_kj z_k^j) / (sum_i n_ij - n_kj)`` over the previous round's
   reports -- FD's target excludes the device's own logits -- with labels nobody else reported
   marked missing;
2. the client trains its own model for E epochs on ``CE(F_k(x), y) + kd_weight * KD(g_k^y)``,
   where ``KD`` is the soft-target loss ``T^2 KL(softmax(g/T) || softmax(F_k(x)/T))`` (samples
   whose label has no global logits get only the CE term); then, with the trained model
   (inference mode, one pass over its training split), it computes the mean logit vector of
   each label it holds and uploads them with their sample counts;
3. the server keeps each participant's report for the next round's targets.

Payload up: ``logit_classes`` (int32 ``[S]``), ``logits`` (``[S, classes]``), ``logit_counts``
(``[S]``) for the S labels the client holds. The original FD averages the logits *during*
local training and adds federated augmentation (a conditional GAN); neither is implemented.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from hyperfed.algorithms.base import (
    Algorithm,
    Payload,
    Server,
    ServerContext,
    chosen,
)
from hyperfed.algorithms.fedproto import ClassStatsClient
from hyperfed.algorithms.local_settings import SEED002
from hyperfed.engine.local import LossFn, per_parameter
from hyperfed.engine.losses import (
    check_class_payload,
    class_sums,
    kd_loss,
)
from hyperfed.hparams import NonNeg, Positive, Space
from hyperfed.models.layout import FunctionalModel

KEYS = ("logit_classes", "logits", "logit_counts")


@dataclass
class FDParams:
    """FD's distillation weight and temperature (FD does not state them; 1.0 and 1.0 here)."""

    kd_weight: NonNeg = chosen(1.0, "FD states none; CE and KD weighed equally")
    temperature: Positive = chosen(1.0, "FD states none; plain softmax")


@per_parameter
def fd_loss(
    fm: FunctionalModel,
    theta: Tensor,
    buffers: Tensor,
    x: Tensor,
    y: Tensor,
    ctx: dict[str, Tensor],
    *,
    kd_weight: float,
    temperature: float,
) -> tuple[Tensor, Tensor]:
    """CE + kd_weight * KD toward the global logits of each sample's label."""
    logits, new_buffers = fm.forward_train(theta, buffers, x)
    have = ctx["global_mask"][y]  # [B]
    kl = kd_loss(logits, ctx["global_logits"][y], temperature, reduction="none")
    kd = (kl * have).sum() / have.sum().clamp(min=1.0)
    return F.cross_entropy(logits, y) + kd_weight * kd, new_buffers


class FDServer(Server):
    def __init__(self, hp: FDParams, clients: dict[int, Payload], ctx: ServerContext) -> None:
        super().__init__(hp, clients, ctx)
        nc = ctx.num_classes
        self.slot = {c: i for i, c in enumerate(sorted(clients))}
        # each client's last report, as count-weighted sums, for the leave-one-out targets
        self.report_sums = torch.zeros(len(clients), nc, nc, device=ctx.device)
        self.report_counts = torch.zeros(len(clients), nc, device=ctx.device)

    def configure_train(self, rnd: int, client_ids: list[int]) -> dict[int, Payload]:
        sums, counts = self.report_sums.sum(0), self.report_counts.sum(0)
        msgs = {}
        for c in client_ids:
            i = self.slot[c]
            n = counts - self.report_counts[i]
            mean = (sums - self.report_sums[i]) / n.clamp(min=1e-12).unsqueeze(1)
            have = n > 0.5
            msgs[c] = {
                "global_logits": torch.where(have.unsqueeze(1), mean, torch.zeros_like(mean)),
                "global_mask": have.to(mean.dtype),
            }
        return msgs

    def check_reply(self, client_id: int, reply: Payload) -> str | None:
        if set(reply) != set(KEYS):
            return f"expected {', '.join(KEYS)}, got {sorted(reply)}"
        return check_class_payload(reply, KEYS, self.ctx.num_classes, self.ctx.num_classes)

    def aggregate(self, rnd: int, replies: dict[int, Payload]) -> None:
        if not replies:
            return
        self.report_sums = torch.zeros_like(self.report_sums)
        self.report_counts = torch.zeros_like(self.report_counts)
        for c, reply in replies.items():
            s, n = class_sums(reply[KEYS[0]], reply[KEYS[1]], reply[KEYS[2]], self.ctx.num_classes)
            self.report_sums[self.slot[c]] = s
            self.report_counts[self.slot[c]] = n


class FDClient(ClassStatsClient):
    keys = KEYS
    features = False  # FD reports per-label average logits

    def join(self, fm: FunctionalModel, num_samples: int) -> Payload:
        return {"num_samples": torch.tensor(num_samples, dtype=torch.int64)}

    def loss(self, msg: Payload) -> tuple[LossFn, dict[str, Tensor]]:
        ctx = {"global_logits": msg["global_logits"], "global_mask": msg["global_mask"]}
        return partial(fd_loss, kd_weight=self.hp.kd_weight, temperature=self.hp.temperature), ctx


ALGORITHM = Algorithm(
    name="fd",
    summary="FD: federated distillation of per-label average logits",
    hparams=FDParams,
    server=FDServer,
    client=FDClient,
    local_defaults=SEED002,
    tune={"kd_weight": Space(0.01, 10.0, log=True)},
)
