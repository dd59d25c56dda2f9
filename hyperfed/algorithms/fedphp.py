"""FedPHP (Li, Zhan, Shao, Li & Song, ECML-PKDD 2021, "FedPHP: Federated Personalization with
Inherited Private Models"), a baseline of seed 001 (pFedKT, Table 1).

Every client keeps an *inherited private model* (HPM) ``w_bar_k``: a temporal ensemble of its
past personalized models. Round t, for every sampled client k:

1. receive the global model ``w^t`` (FedAvg's payload ``theta``) and the HPM weight ``mu_k``;
2. train ``w^t`` locally with ``(1 - lam) * l_ce + lam * l_kt``, where the HPM teaches the
   model in training: ``l_kt`` is the MMD between the two models' representations of the batch
   (``transfer="mmd"``) or the distillation loss from the HPM's logits (``"kd"``); the HPM is a
   fixed teacher (no gradient);
3. inherit: ``w_bar_k <- mu_k * w_bar_k + (1 - mu_k) * w_k^t`` with ``w_k^t`` the trained model
   (BatchNorm statistics likewise), after the last local step;
4. upload ``w_k^t``; the server sets ``w^{t+1} = sum_k n_k w_k^t / sum_k n_k`` (FedAvg).

The HPM weight grows with the client's participations: ``mu_k = mu * min(s_k / S, 1)`` where
``s_k`` is how many rounds client k has completed before this one and ``S = max(floor(Q T), 1)``
the number it is expected to complete (participation rate Q, T rounds); so a first
participation (``s_k = 0``) replaces the HPM by the trained model, and the HPM becomes an
ever slower moving average, capped at ``mu``. The server counts participations and sends
``mu_k`` with the global model.

A client is evaluated with its HPM (the paper's personalized model; ``w^0`` for a client never
sampled).

Sources. The paper's text could not be read here (no open copy); the method is taken from the
authors' public code (``lxcnju/FedRepo``, ``algorithms/fedphp.py`` and ``tools.py``), which
also gives the schedule of ``mu_k``, the MMD estimator and the hyperparameter grid. Where this
file departs from that code:

* ``l_kt = "kd"`` is Hinton's loss at temperature T for both models (``engine/losses.kd_loss``);
  the authors' code softens only the teacher (``-sum softmax(p/4) * log_softmax(z)``).
* The authors clip the gradient norm (``max_grad_norm``); hyperfed's local SGD does not clip.
* The representation is the zoo's (the input of the last Linear layer), as in the authors'
  networks, which return it beside the logits.
* Heterogeneous clients: the HPM has the client's own architecture, so a mix runs one FedAvg
  federation per architecture, as ``fedavg`` does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Literal, get_args

import torch
import torch.nn.functional as F
from annotated_types import Ge, Lt
from torch import Tensor

from hyperfed.algorithms.base import (
    Algorithm,
    Client,
    ClientContext,
    ClientGroup,
    Payload,
    ServerContext,
    chosen,
)
from hyperfed.algorithms.fedavg import FedAvgServer
from hyperfed.algorithms.local_settings import SEED001
from hyperfed.engine.local import LossFn
from hyperfed.engine.losses import kd_loss
from hyperfed.hparams import Positive, Unit
from hyperfed.models.layout import FunctionalModel

Transfer = Literal["mmd", "kd"]
TRANSFERS = get_args(Transfer)


@dataclass
class FedPHPParams:
    """FedPHP's hyperparameters (local loss ``(1 - lam) l_ce + lam l_kt``; HPM weight cap ``mu``).

    The defaults come from the authors' code, since the paper was not available here."""

    lam: Unit = chosen(
        0.1,
        "authors' code (FedRepo train_lab.py) searches (KD, 0.05), (MMD, 0.1), (MMD, 0.05); "
        "FLGo's port of it defaults to MMD with 0.1",
    )
    mu: Annotated[float, Ge(0), Lt(1)] = chosen(
        0.9, "authors' code (FedRepo fedphp.py generate_mu): mu_k capped at 0.9"
    )
    transfer: Transfer = chosen("mmd", "MMD as the authors' code searches it twice as often as KD")
    temperature: Positive = chosen(4.0, "the teacher temperature of the authors' KD loss")


def mmd_rbf(a: Tensor, b: Tensor, kernel_mul: float = 2.0, kernel_num: int = 5) -> Tensor:
    """The biased MMD^2 estimate between samples ``a [B, d]`` and ``b [B, d]`` with a sum of
    ``kernel_num`` Gaussian kernels ``exp(-||u - v||^2 / s_i)``, ``s_i = s * kernel_mul^i``;
    ``s`` is the mean squared distance between distinct points of ``[a; b]`` divided by
    ``kernel_mul^(kernel_num // 2)`` (a constant: no gradient flows through the bandwidth).
    Returns ``mean(K_aa) + mean(K_bb) - 2 mean(K_ab)``."""
    total = torch.cat([a, b], dim=0)
    n = total.shape[0]
    d2 = ((total.unsqueeze(0) - total.unsqueeze(1)) ** 2).sum(-1)
    scale = d2.detach().sum() / (n * n - n) + 1e-8
    scale = scale / kernel_mul ** (kernel_num // 2)
    k = sum(torch.exp(-d2 / (scale * kernel_mul**i)) for i in range(kernel_num))
    assert isinstance(k, Tensor)
    m = a.shape[0]
    return (k[:m, :m] + k[m:, m:] - k[:m, m:] - k[m:, :m]).mean()


def fedphp_loss(hp: FedPHPParams) -> LossFn:
    """The local loss with the HPM as teacher; ``ctx`` carries ``hpm`` and ``hpm_buffers``."""

    def loss_fn(
        fm: FunctionalModel, theta: Tensor, buffers: Tensor, x: Tensor, y: Tensor, ctx: dict
    ) -> tuple[Tensor, Tensor]:
        (h, logits), new_buffers = fm.forward_train(theta, buffers, x, return_features=True)
        ce = F.cross_entropy(logits, y)
        if not ctx:
            return ce, new_buffers
        h_t, logits_t = fm.forward(ctx["hpm"], ctx["hpm_buffers"], x, return_features=True)
        if hp.transfer == "kd":
            kt = kd_loss(logits, logits_t.detach(), hp.temperature)
        else:
            kt = mmd_rbf(h, h_t.detach())
        return (1 - hp.lam) * ce + hp.lam * kt, new_buffers

    return loss_fn


def inherit(hpm: Tensor, trained: Tensor, mu: Tensor) -> Tensor:
    """``mu * hpm + (1 - mu) * trained``, row by row (``mu [C]``)."""
    m = mu.to(hpm.dtype).unsqueeze(-1)
    return m * hpm + (1 - m) * trained


class FedPHPServer(FedAvgServer):
    """FedAvg's server, which also counts each client's completed rounds ``s_k`` and sends the
    HPM weight ``mu_k``."""

    hp: FedPHPParams

    def __init__(self, hp: FedPHPParams, clients: dict[int, Payload], ctx: ServerContext) -> None:
        super().__init__(hp, clients, ctx)  # type: ignore[arg-type]  # typed FedAvgParams there
        self.completed = torch.zeros(max(clients) + 1, device=ctx.device)

    def hpm_weight(self, client_ids: list[int]) -> Tensor:
        """``mu_k = mu * min(s_k / S, 1)``, ``S = max(floor(Q T), 1)``, for ``client_ids``."""
        expected = max(int(len(client_ids) / len(self.clients) * self.ctx.rounds), 1)
        s = self.completed[torch.tensor(client_ids, device=self.completed.device)]
        return self.hp.mu * (s / expected).clamp(max=1.0)

    def configure_train(self, rnd: int, client_ids: list[int]) -> dict[int, Payload]:
        msgs = super().configure_train(rnd, client_ids)
        for c, mu in zip(client_ids, self.hpm_weight(client_ids)):
            msgs[c]["mu"] = mu.to(torch.float32)
        return msgs

    def configure_eval(self, client_ids: list[int]) -> dict[int, Payload]:
        return {c: {} for c in client_ids}  # clients are evaluated with their own HPMs

    def aggregate(self, rnd: int, replies: dict[int, Payload]) -> None:
        super().aggregate(rnd, replies)
        for c in replies:
            self.completed[c] += 1


class FedPHPClient(Client):
    """State per client: ``hpm`` and ``hpm_buffers`` (the inherited private model, evaluated)
    and ``buffers`` (BatchNorm statistics of the model trained from the global one)."""

    hp: FedPHPParams

    def __init__(self, hp: FedPHPParams, ctx: ClientContext) -> None:
        super().__init__(hp, ctx)
        self.loss_fn = fedphp_loss(hp)

    def init_state(self, fm: FunctionalModel, num_clients: int) -> dict[str, Tensor]:
        state = super().init_state(fm, num_clients)
        state["hpm"] = fm.initial_params().expand(num_clients, -1).clone()  # w^0
        state["hpm_buffers"] = state["buffers"].clone()
        return state

    def fit(
        self, group: ClientGroup, msg: Payload, state: dict[str, Tensor]
    ) -> tuple[Payload, dict[str, Tensor], Tensor]:
        ctx = {"hpm": state["hpm"], "hpm_buffers": state["hpm_buffers"]}
        theta, buffers, loss = group.train(
            msg["theta"],
            state["buffers"],
            loss_fn=self.loss_fn,
            ctx=ctx if self.hp.lam > 0 else None,
        )
        new_state = {
            "buffers": buffers,
            "hpm": inherit(state["hpm"], theta, msg["mu"]),
            "hpm_buffers": inherit(state["hpm_buffers"], buffers, msg["mu"]),
        }
        return {"theta": theta}, new_state, loss

    def eval_model(
        self, group: ClientGroup, msg: Payload, state: Mapping[str, Tensor]
    ) -> tuple[Tensor, Tensor]:
        return state["hpm"], state["hpm_buffers"]


ALGORITHM = Algorithm(
    name="fedphp",
    summary="FedPHP: FedAvg + an inherited private model (moving average) teaching local training",
    hparams=FedPHPParams,
    server=FedPHPServer,
    client=FedPHPClient,
    local_defaults=SEED001,
)
