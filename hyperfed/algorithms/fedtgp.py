"""FedTGP (Zhang, Liu, Hua, Cao, AAAI 2024; arXiv 2401.03230): trainable global prototypes.

FedProto's round with the server's weighted average replaced by *trainable global prototypes*
(TGP) learned with *adaptive-margin-enhanced contrastive learning* (ACL). Every client k holds
its own model ``F_k = h_k(f_k(x))`` of any architecture whose representation ``f_k(x)`` has the
common width d. Round t:

1. the server sends the global prototypes ``P_hat^c`` of every class c (none before the first
   aggregation);
2. the client trains its own model for E local epochs on
   ``CE(F_k(x), y) + lam * phi(f_k(x), P_hat^y)``, phi the squared distance averaged over the
   d entries (``nn.MSELoss``, as FedProto's and FedTGP's official code); in round 1 (no
   ``P_hat`` yet) on CE alone. This is FedProto's loss, :func:`fedproto.proto_loss`;
3. with the trained model (inference mode, one pass over its training split) it computes one
   prototype per class it holds, ``P_k^c = mean of f_k(x)`` over its samples of class c, and
   uploads ``(P_k^c, c)`` (no sample counts);
4. the server
   a. computes the adaptive margin from the uploaded prototypes: the cluster centre of class c
      is ``Q^c = mean_k P_k^c`` over the clients that uploaded c, and
      ``delta = min( max_c min_{c' != c} ||Q^c - Q^{c'}||_2 , tau )``
      (the largest inter-class gap among the client prototype clusters, capped at tau);
   b. generates ``P_hat^c = W(e^c)`` for all classes from learnable embeddings
      ``e^c in R^d`` through a two-layer network ``W`` = Linear(d, hidden) - ReLU -
      Linear(hidden, d), and trains (e, W) for ``server_epochs`` passes over the uploaded
      prototypes (mini-batches of ``server_batch_size``, SGD of ``server_lr``; by default the
      clients' own batch size and lr, as the authors' server) on the ACL loss
      ``-log( exp(-(phi(P_k^c, P_hat^c) + delta)) /
      ( exp(-(phi(P_k^c, P_hat^c) + delta)) + sum_{c' != c} exp(-phi(P_k^c, P_hat^{c'})) ) )``
      with phi the Euclidean distance: a softmax cross-entropy on negative distances whose
      true class is handicapped by the margin delta;
   c. sends the new ``P_hat`` (every class, also those nobody uploaded this round).

Evaluation (``inference``): "prototype" classifies a sample by its nearest global prototype,
``argmin_c ||f_k(x) - P_hat^c||`` (the official code's ``test_metrics``, FedProto's Eq. 4); it is
run as the client's model with its last layer replaced by ``W = 2 P_hat``,
``b = -||P_hat^c||^2``, whose logits differ from ``-||f_k(x) - P_hat^c||^2`` only by the
per-sample constant ``||f_k(x)||^2``: the same argmax and the same cross-entropy. Before the
first aggregation (no ``P_hat``) the client's own classifier is used. "classifier" scores the
client's own classifier throughout (as hyperfed's FedProto does).

The paper's text (equation numbers, its hyperparameter section) could not be read here; the
round above is taken from the paper's abstract and the authors' code (TsingZ0/FedTGP,
TsingZ0/HtFLlib), whose defaults we use (see the hyperparameters' sources). Heterogeneous
clients need one representation width d, checked at join.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hyperfed.algorithms.base import (
    Algorithm,
    ClientContext,
    ClientGroup,
    Payload,
    Server,
    ServerContext,
    chosen,
)
from hyperfed.algorithms.fedproto import FedProtoClient
from hyperfed.engine.local import client_seed
from hyperfed.engine.representations import (
    KEYS,
    check_class_reply,
    common_width,
    header_index,
    minibatches,
    representation_join,
    uploaded_pairs,
)
from hyperfed.hparams import Count, NonNeg, NonNegInt, Positive, Space
from hyperfed.models.layout import FunctionalModel
from hyperfed.progress import phase

Inference = Literal["prototype", "classifier"]
INFERENCE = get_args(Inference)
CODE = "the authors' run_me.sh (TsingZ0/FedTGP)"


@dataclass
class FedTGPParams:
    """Defaults of the authors' own runs (the paper's hyperparameter text was not readable)."""

    lam: NonNeg = chosen(10.0, f"{CODE}: -lam 10 (FedProto's official value)")
    tau: NonNeg = chosen(100.0, f"{CODE}: -mart 100, the margin threshold")
    server_epochs: Count = chosen(100, f"{CODE}: -se 100")
    # None = the clients' [local] lr / batch: the authors' servertgp.py trains the generator
    # with args.local_learning_rate and args.batch_size (with run_me.sh's 10 at the server's
    # fixed batch 10, seed 003's batch-64 clients drove the margin up until VGG8 diverged)
    server_lr: Positive | None = chosen(None, "None = the [local] lr, as the authors' servertgp.py")
    server_batch_size: Count | None = chosen(
        None, "None = the [local] batch size, as the authors' servertgp.py"
    )
    hidden: NonNegInt = chosen(0, "width of W's hidden layer; 0 = d, as the authors' code")
    inference: Inference = chosen(
        "prototype", "nearest global prototype, as the authors' clienttgp.test_metrics"
    )


class TrainableGlobalPrototypes(nn.Module):
    """``P_hat^c = W(e^c)``: learnable class embeddings through Linear - ReLU - Linear."""

    def __init__(self, num_classes: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(num_classes, dim)
        self.hidden = nn.Linear(dim, hidden)
        self.out = nn.Linear(hidden, dim)

    def forward(self) -> Tensor:
        """The prototypes of all classes, ``[classes, d]``."""
        return self.out(F.relu(self.hidden(self.embeddings.weight)))


def adaptive_margin(protos: Tensor, labels: Tensor, num_classes: int, tau: float) -> Tensor:
    """``delta = min(max_c min_{c' != c} ||Q^c - Q^{c'}||, tau)`` with ``Q^c`` the unweighted mean
    of the uploaded prototypes of class c; ``tau`` when fewer than two classes were uploaded."""
    sums = torch.zeros(num_classes, protos.shape[1], dtype=protos.dtype, device=protos.device)
    sums.index_add_(0, labels, protos)
    counts = torch.bincount(labels, minlength=num_classes)
    present = counts > 0
    if int(present.sum()) < 2:
        return torch.tensor(float(tau), dtype=protos.dtype, device=protos.device)
    centres = sums[present] / counts[present].unsqueeze(1).to(protos.dtype)
    dist = torch.cdist(centres, centres)
    dist.fill_diagonal_(float("inf"))
    gap = dist.min(1).values  # each class's distance to its nearest other class
    return torch.clamp(gap.max(), max=float(tau))


def acl_loss(protos: Tensor, labels: Tensor, generated: Tensor, margin: Tensor) -> Tensor:
    """ACL: cross-entropy over ``-(||P_k^c - P_hat^j|| + margin * [j == c])``, mean over pairs."""
    dist = ((protos.unsqueeze(1) - generated.unsqueeze(0)) ** 2).sum(-1).sqrt()
    dist = dist + margin * F.one_hot(labels, generated.shape[0]).to(dist.dtype)
    return F.cross_entropy(-dist, labels)


class FedTGPServer(Server):
    def __init__(self, hp: FedTGPParams, clients: dict[int, Payload], ctx: ServerContext) -> None:
        super().__init__(hp, clients, ctx)
        self.hp: FedTGPParams = hp
        self.dim = common_width(clients, "fedtgp")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(ctx.seed)
            tgp = TrainableGlobalPrototypes(ctx.num_classes, self.dim, hp.hidden or self.dim)
        self.tgp = tgp.to(ctx.device)
        # the generator's SGD step and batch: the clients' own unless set
        lr, batch = hp.server_lr, hp.server_batch_size
        if ctx.local is not None:
            lr = ctx.local.lr if lr is None else lr
            batch = ctx.local.batch_size if batch is None else batch
        if lr is None or batch is None:
            raise ValueError(
                "fedtgp: server_lr / server_batch_size left at None (the clients' [local] lr / "
                "batch) but the server was given no [local] settings; set both"
            )
        self.server_lr, self.server_batch_size = lr, batch
        self.protos = torch.zeros(ctx.num_classes, self.dim, device=ctx.device)
        self.proto_mask = torch.zeros(ctx.num_classes, device=ctx.device)
        self.margin = torch.zeros((), device=ctx.device)  # the last round's delta (logged state)

    def configure_train(self, rnd: int, client_ids: list[int]) -> dict[int, Payload]:
        return {c: {"protos": self.protos, "proto_mask": self.proto_mask} for c in client_ids}

    def configure_eval(self, client_ids: list[int]) -> dict[int, Payload]:
        if self.hp.inference == "classifier":
            return {c: {} for c in client_ids}
        return self.configure_train(0, client_ids)

    def check_reply(self, client_id: int, reply: Payload) -> str | None:
        return check_class_reply(reply, self.ctx.num_classes, self.dim)

    def aggregate(self, rnd: int, replies: dict[int, Payload]) -> None:
        """Step 4: the adaptive margin, then ACL on (e, W), then the new P_hat."""
        if not replies:
            return
        protos, labels = uploaded_pairs(replies)
        if protos.shape[0] == 0:
            return
        protos = protos.to(self.protos.dtype)
        self.margin = adaptive_margin(protos, labels, self.ctx.num_classes, self.hp.tau)
        opt = torch.optim.SGD(self.tgp.parameters(), lr=self.server_lr)
        with (
            torch.enable_grad(),
            phase(
                "server: training the prototype generator", total=self.hp.server_epochs
            ) as progress,
        ):
            for epoch in range(self.hp.server_epochs):
                seed = client_seed(self.ctx.seed, rnd, 0, salt=epoch)
                for b in minibatches(len(labels), self.server_batch_size, seed, protos.device):
                    loss = acl_loss(protos[b], labels[b], self.tgp(), self.margin)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                progress.advance()
        with torch.no_grad():
            self.protos = self.tgp().detach().clone()
        self.proto_mask = torch.ones_like(self.proto_mask)


class FedTGPClient(FedProtoClient):
    """FedProto's client (its loss, its local training) with a count-free upload."""

    keys = KEYS  # ClassStatsClient.fit packs (classes, means, counts); zip keeps the first two

    def __init__(self, hp: FedTGPParams, ctx: ClientContext) -> None:
        super().__init__(hp, ctx)
        self.hp: FedTGPParams = hp

    def join(self, fm: FunctionalModel, num_samples: int) -> Payload:
        return representation_join(fm, num_samples, "fedtgp")

    def eval_model(
        self, group: ClientGroup, msg: Payload, state: Mapping[str, Tensor]
    ) -> tuple[Tensor, Tensor]:
        theta = state["theta"]
        if self.hp.inference == "classifier" or not msg:
            return theta, state["buffers"]
        return nearest_prototype_model(group.fm, theta, msg["protos"], msg["proto_mask"]), state[
            "buffers"
        ]


def nearest_prototype_model(
    fm: FunctionalModel, theta: Tensor, protos: Tensor, mask: Tensor
) -> Tensor:
    """``theta [C, K]`` with the last layer set to ``W = 2 P_hat``, ``b = -||P_hat||^2`` for the
    clients whose ``P_hat`` covers every class (``mask`` all ones); the others keep theirs."""
    weight = 2 * protos  # [C, classes, d]
    bias = -(protos**2).sum(-1)  # [C, classes]
    header = torch.cat([weight.flatten(1), bias], dim=1).to(theta.dtype)
    ready = (mask > 0).all(1, keepdim=True)
    out = theta.clone()
    idx = header_index(fm)
    out[:, idx] = torch.where(ready, header, theta[:, idx])
    return out


ALGORITHM = Algorithm(
    name="fedtgp",
    summary="FedTGP: FedProto with server-trained global prototypes (adaptive-margin "
    "contrastive learning)",
    hparams=FedTGPParams,
    server=FedTGPServer,
    client=FedTGPClient,
    # the authors' run_me.sh: SGD lr 0.01 without momentum, 1 local epoch (-lr 0.01 -ls 1)
    local_defaults={"lr": 0.01, "momentum": 0.0, "weight_decay": 0.0, "epochs": 1},
    tune={"lam": Space(0.1, 100.0, log=True)},
)
