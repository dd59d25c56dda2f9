"""Fed-RoD (Chen & Chao, ICLR 2022, "On Bridging Generic and Personalized Federated Learning
for Image Classification"), a baseline of seed 001 (pFedKT, Table 1).

The model is a shared body ``f(x; theta)`` with two heads on its representation ``z``: a
*generic* head ``g(z; psi)`` and a *personalized* head ``p(z; phi_m)`` kept by client m. Round
t, for every sampled client m:

1. receive ``(theta, psi)``: the whole zoo model, whose last Linear layer is the generic head
   (FedAvg's payload ``theta``; ``phi_m`` never crosses);
2. local SGD on the sum of two losses, each moving only its own parameters:
   * the generic model is trained with the balanced softmax (BSM) loss, robust to the
     client's class imbalance: ``-log( N_{m,y}^gamma e^{g_y} / sum_c N_{m,c}^gamma e^{g_c} )``
     with ``N_{m,c}`` the number of class-c training samples of client m (cross-entropy on
     the logits shifted by ``gamma * log N_{m,c}``);
   * the personalized head is trained with the plain cross-entropy of the *personalized
     prediction* ``g(z) + p(z)`` (the personal head learns a residual on top of the generic
     one), with ``z`` and ``g(z)`` held fixed (stop-gradient), so the empirical-risk loss
     does not pull the shared parts toward the client's own distribution;
3. upload ``(theta, psi)``; the server averages them with FedAvg's rule (weights n_m).

A client is evaluated with its personalized prediction ``g(z) + p(z)`` on the latest global
``(theta, psi)`` and its own ``phi_m``. With linear heads that prediction is exactly a zoo
model whose last layer is ``(W_g + W_p, b_g + b_p)``, which is what :meth:`eval_model` builds.

Sources: the paper's abstract and seed 001's account of it; the full text could not be read
here (hence no equation numbers) and the authors' repository (hongyouc/Fed-RoD) holds no code.
The BSM loss, the stop-gradient and the summed logits follow PFLlib's ``clientrod.py``.

Choices (left open, or not readable here):

* **Linear personal head**: ``p`` has the shape of the zoo model's last Linear layer
  (``feature_dim -> classes``). The paper's other variant generates ``phi_m`` with a
  hypernetwork from the client's class distribution, shared through the server; it is not
  implemented here.
* ``phi_m`` starts at zero, so a client's personalized prediction starts as the generic one.
* A class the client holds no sample of has ``N_{m,c} = 0``: its shifted logit is ``-inf``,
  i.e. the BSM loss is a softmax over the client's own classes only.
* Both heads take the same SGD settings (lr, momentum, weight decay).
* Heterogeneous clients: the generic model is averaged within each architecture (one
  federation per architecture, as ``fedavg`` does); each personal head fits its own model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F
from torch import Tensor

from hyperfed.algorithms.base import (
    Algorithm,
    Client,
    ClientGroup,
    Payload,
    ServerContext,
    chosen,
)
from hyperfed.algorithms.fedavg import FedAvgServer
from hyperfed.algorithms.local_settings import SEED001
from hyperfed.data.federated import FederatedData
from hyperfed.engine.representations import header_names
from hyperfed.hparams import NonNeg
from hyperfed.models.adapter import ModelPartError
from hyperfed.models.layout import FunctionalModel


@dataclass
class FedRoDParams:
    """Fed-RoD's hyperparameter: the exponent of the class counts in the BSM loss."""

    gamma: NonNeg = chosen(
        1.0, "balanced softmax as Ren et al. (2020) define it (log N_c added to the logits)"
    )


@dataclass(frozen=True)
class Classifier:
    """Where the zoo model's last Linear layer (the generic head) sits in ``theta``."""

    start: int
    classes: int
    dim: int

    @property
    def size(self) -> int:
        return self.classes * self.dim + self.classes

    def logits(self, head: Tensor, z: Tensor) -> Tensor:
        """A linear head given as ``[W (classes x dim), b]`` applied to ``z [B, dim]``."""
        w = head[: self.classes * self.dim].view(self.classes, self.dim)
        return z @ w.T + head[self.classes * self.dim :]

    def add(self, theta: Tensor, head: Tensor) -> Tensor:
        """``theta`` with ``head`` added to its last Linear layer (``W_g + W_p, b_g + b_p``)."""
        end = self.start + self.size
        return torch.cat(
            [theta[..., : self.start], theta[..., self.start : end] + head, theta[..., end:]], -1
        )


@cache
def classifier(fm: FunctionalModel) -> Classifier:
    seg = {s.name: s for s in fm.layout.segments}
    names = header_names(fm.module)  # the last Linear's weight and bias
    if names[0] not in seg or names[1] not in seg:
        raise ModelPartError(
            f"model {fm.name!r}: fedrod needs an nn.Linear with a bias giving the logits, "
            "called last in the forward"
        )
    w, b = seg[names[0]], seg[names[1]]
    assert w.end == b.offset, "the classifier's weight must be followed by its bias"
    return Classifier(w.offset, w.shape[0], w.shape[1])


def class_counts(data: FederatedData, client_ids: list[int]) -> Tensor:
    """``N_{m,c}``: training samples of each class, per client ``[C, num_classes]``."""
    return torch.stack(
        [torch.bincount(data.y[data.train_idx[c]], minlength=data.num_classes) for c in client_ids]
    )


def bsm_loss(logits: Tensor, y: Tensor, log_prior: Tensor) -> Tensor:
    """Balanced softmax: cross-entropy of ``logits + gamma * log N_{m,c}`` (``log_prior``)."""
    return F.cross_entropy(logits + log_prior.to(logits.dtype), y)


def fedrod_loss(
    fm: FunctionalModel, theta: Tensor, buffers: Tensor, x: Tensor, y: Tensor, ctx: dict
) -> tuple[Tensor, Tensor]:
    """``theta = [zoo model | personal head]``: BSM on the generic logits (moves the model) plus
    cross-entropy of ``g(z) + p(z)`` with ``z`` and ``g(z)`` fixed (moves the personal head)."""
    cls = classifier(fm)
    k = fm.num_params
    (z, generic), new_buffers = fm.forward_train(theta[:k], buffers, x, return_features=True)
    personal = generic.detach() + cls.logits(theta[k:], z.detach())
    return bsm_loss(generic, y, ctx["log_prior"]) + F.cross_entropy(personal, y), new_buffers


class FedRoDServer(FedAvgServer):
    """FedAvg on the generic model (body and generic head); the personal heads never come."""

    def __init__(self, hp: FedRoDParams, clients: dict[int, Payload], ctx: ServerContext) -> None:
        super().__init__(hp, clients, ctx)  # type: ignore[arg-type]  # typed FedAvgParams there


class FedRoDClient(Client):
    """State per client: ``head`` (the personal head ``phi_m``, laid out like the zoo model's
    last Linear layer) and ``buffers``."""

    hp: FedRoDParams

    def init_state(self, fm: FunctionalModel, num_clients: int) -> dict[str, Tensor]:
        state = super().init_state(fm, num_clients)
        theta0 = fm.initial_params()
        state["head"] = theta0.new_zeros(num_clients, classifier(fm).size)
        return state

    def fit(
        self, group: ClientGroup, msg: Payload, state: dict[str, Tensor]
    ) -> tuple[Payload, dict[str, Tensor], Tensor]:
        k = group.fm.num_params
        counts = class_counts(group.data, group.client_ids).to(msg["theta"].device)
        log_prior = self.hp.gamma * torch.log(counts.to(msg["theta"].dtype))
        if self.hp.gamma == 0:
            log_prior = torch.zeros_like(log_prior)  # N^0 = 1, even for absent classes
        theta, buffers, loss = group.train(
            torch.cat([msg["theta"], state["head"]], -1),
            state["buffers"],
            loss_fn=fedrod_loss,
            ctx={"log_prior": log_prior},
        )
        return {"theta": theta[:, :k]}, {"head": theta[:, k:], "buffers": buffers}, loss

    def eval_model(
        self, group: ClientGroup, msg: Payload, state: Mapping[str, Tensor]
    ) -> tuple[Tensor, Tensor]:
        return classifier(group.fm).add(msg["theta"], state["head"]), state["buffers"]


ALGORITHM = Algorithm(
    name="fedrod",
    summary="Fed-RoD: FedAvg'd body + generic head (balanced softmax), personal residual head",
    hparams=FedRoDParams,
    server=FedRoDServer,
    client=FedRoDClient,
    local_defaults=SEED001,
)
