"""FedKD (Wu et al., Nature Communications 2022): adaptive mutual distillation.

Every client keeps a large private *mentor* (its own architecture) and receives a small
shared *mentee* (``shared_model``; pFedES §6.2 uses CNN-5). Both learn from the labels and
from each other; the mentee alone is averaged by the server (FedAvg, weighted by n_k) and is
all that crosses the wire. Clients are evaluated with their mentor.

FedKD's losses (its Eqs. 1-4), with ``L_t``, ``L_s`` the mentor's and mentee's task losses:

* mentor: ``L_t + KL(p_s || p_t) / (L_t + L_s) [+ hidden losses / (L_t + L_s)]``,
* mentee: ``L_s + KL(p_t || p_s) / (L_t + L_s) [+ hidden losses / (L_t + L_s)]``.

The adaptive factor ``1 / (L_t + L_s)`` (treated as a constant, not differentiated) lets the
distillation weigh more as both models get their labels right.

**Simplified here**, as pFedES's comparison needs only the heterogeneous-model part:

* the hidden-state and attention losses (between Transformer layers of matching width) are
  dropped -- CNN-1..5 and CNN-5 have no such matching layers; only logit distillation stays;
* the dynamic SVD compression of the mentee's update is not applied: the upload is the full
  mentee (its parameter count x 4 bytes), an upper bound on FedKD's traffic.

The server, client state and joint training are FML's (:mod:`hyperfed.algorithms.fml`); only
the local objective differs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch.nn.functional as F
from torch import Tensor

from hyperfed.algorithms.base import Algorithm, paper
from hyperfed.algorithms.fml import FMLClient, FMLServer
from hyperfed.algorithms.local_settings import SEED002
from hyperfed.engine.losses import ModelPair, kd_loss
from hyperfed.hparams import Positive
from hyperfed.models.layout import FunctionalModel


@dataclass
class FedKDParams:
    """The mentee's architecture (pFedES §6.2) and the distillation temperature (1 in FedKD)."""

    shared_model: str = paper("cnn5", "seed 002 §6.2 (CNN-5 as the small model)")
    temperature: Positive = paper(1.0, "FedKD Eqs. 1-2 (plain softmax, no temperature)")


def fedkd_loss(
    fm: FunctionalModel,
    theta: Tensor,
    buffers: Tensor,
    x: Tensor,
    y: Tensor,
    ctx: dict[str, Tensor],
    *,
    pair: ModelPair,
    temperature: float,
) -> tuple[Tensor, Tensor]:
    """Mentor + mentee losses with the adaptive distillation weight 1 / (L_t + L_s)."""
    z_t, z_s, new_buffers = pair.forward_train_both(theta, buffers, x)
    task_t, task_s = F.cross_entropy(z_t, y), F.cross_entropy(z_s, y)
    w = 1.0 / (task_t + task_s).detach().clamp(min=1e-8)
    loss_t = task_t + w * kd_loss(z_t, z_s, temperature)
    loss_s = task_s + w * kd_loss(z_s, z_t, temperature)
    return loss_t + loss_s, new_buffers


class FedKDClient(FMLClient):
    def loss_fn(self, pair: ModelPair) -> Callable:
        return partial(fedkd_loss, pair=pair, temperature=self.hp.temperature)


ALGORITHM = Algorithm(
    name="fedkd",
    summary="FedKD: private mentor + shared mentee, adaptive mutual distillation of logits",
    hparams=FedKDParams,
    server=FMLServer,
    client=FedKDClient,
    local_defaults=SEED002,
)
