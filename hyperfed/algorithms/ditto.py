"""Ditto (Li et al., 2021): a FedAvg global model plus a proximal personal model per client.

Round t, the server sends the global model w^t. Each participating client

1. trains a copy of w^t for E epochs of plain SGD and returns it (the global update; the server
   aggregates with FedAvg's ``sum_k n_k w_k / sum_k n_k``);
2. trains its personal model v_k for ``personal_epochs`` epochs on
   ``F_k(v_k) + lam/2 * ||v_k - w^t||^2`` (Ditto's Eq. 2 / Alg. 1, anchored at the w^t it
   received this round) and keeps it.

Only w crosses the wire. A client is evaluated with v_k. The personal model and the global copy
keep separate BatchNorm statistics. ``lam = 0.1`` is one of the values of Ditto's grid; seed 004
does not give its setting.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial

import torch.nn.functional as F
from torch import Tensor

from hyperfed.algorithms.base import Algorithm, Client, ClientGroup, Payload, chosen
from hyperfed.algorithms.fedavg import FedAvgServer
from hyperfed.hparams import Count, NonNeg, Space
from hyperfed.models.layout import FunctionalModel


@dataclass
class DittoParams:
    """lam: weight of the proximal term; personal_epochs: None = the [local] epochs."""

    lam: NonNeg = chosen(0.1, "one of Ditto's grid values; seed 004 gives none")
    personal_epochs: Count | None = chosen(None, "the [local] epochs; seed 004 gives none")


def proximal_loss(
    fm: FunctionalModel,
    theta: Tensor,
    buffers: Tensor,
    x: Tensor,
    y: Tensor,
    ctx: dict[str, Tensor],
    *,
    lam: float,
) -> tuple[Tensor, Tensor]:
    """Ditto's personal objective: ``CE(v) + lam/2 * ||v - w||^2`` with ``w = ctx["anchor"]``."""
    logits, new_buffers = fm.forward_train(theta, buffers, x)
    prox = 0.5 * lam * ((theta - ctx["anchor"]) ** 2).sum()
    return F.cross_entropy(logits, y) + prox, new_buffers


class DittoClient(Client):
    def init_state(self, fm: FunctionalModel, num_clients: int) -> dict[str, Tensor]:
        state = super().init_state(fm, num_clients)
        state["global_buffers"] = state["buffers"].clone()
        state["personal"] = fm.initial_params().expand(num_clients, -1).clone()
        return state

    def fit(
        self, group: ClientGroup, msg: Payload, state: dict[str, Tensor]
    ) -> tuple[Payload, dict[str, Tensor], Tensor]:
        hp: DittoParams = self.hp
        w, global_buffers, _ = group.train(msg["theta"], state["global_buffers"], salt=1)
        epochs = hp.personal_epochs or group.sgd.epochs
        sgd = dataclasses.replace(group.sgd, epochs=epochs)
        v, buffers, loss = group.train(
            state["personal"],
            state["buffers"],
            loss_fn=partial(proximal_loss, lam=hp.lam),
            ctx={"anchor": msg["theta"]},
            sgd=sgd,
        )
        new_state = {"personal": v, "buffers": buffers, "global_buffers": global_buffers}
        return {"theta": w}, new_state, loss

    def eval_model(
        self, group: ClientGroup, msg: Payload, state: Mapping[str, Tensor]
    ) -> tuple[Tensor, Tensor]:
        return state["personal"], state["buffers"]


ALGORITHM = Algorithm(
    name="ditto",
    summary="Ditto: FedAvg global model + personal models with a proximal pull toward it",
    hparams=DittoParams,
    server=FedAvgServer,
    client=DittoClient,
    homogeneous_only=True,
    tune={"lam": Space(0.01, 2.0, log=True)},
)
