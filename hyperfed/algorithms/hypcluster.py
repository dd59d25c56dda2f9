"""HypCluster (Mansour, Mohri, Ro, Suresh 2020, "Three approaches for personalization",
§3 user clustering, Algorithm 1 HYPCLUSTER): q cluster models on the server, each client
served by the one that fits its data best.

The server holds q hypotheses h_1..h_q, randomly initialized. Round t:

1. the server sends all q models to every sampled client;
2. client k assigns itself to ``f(k) = argmin_j L_k(h_j)``, the cluster whose model has the
   lowest empirical loss (mean cross-entropy) on k's training data (the expectation /
   assignment step of the Lloyd-style algorithm);
3. it trains h_{f(k)} locally for E epochs of SGD and returns the trained model and f(k);
4. the server sets each cluster's model to the FedAvg of the models returned for it,
   ``h_j = sum_{k: f(k)=j} n_k h_k / sum_{k: f(k)=j} n_k``; a cluster no client chose this
   round keeps its model.

A client is evaluated with the cluster model it would choose now (step 2 on the latest
models), whether or not it was sampled. With a mix of architectures, each architecture has
its own q clusters (clients grouped by the parameter count they report, as FedAvg does).

Choices: random initialization = cluster 0 is the architecture's shared initialization and
cluster j > 0 re-runs PyTorch's default initializer under the run seed and j (identical
starts would send every client to cluster 0 forever). q = 3: seed 001 does not give its
setting; at q = 2 a label-skewed task's clients fell into one large cluster, in effect FedAvg
(docs/methods.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from hyperfed.algorithms.base import (
    Algorithm,
    Client,
    ClientGroup,
    Payload,
    Server,
    ServerContext,
    chosen,
)
from hyperfed.engine.evaluation import evaluate_clients
from hyperfed.engine.metering import FlopMeter
from hyperfed.hparams import Count
from hyperfed.models.layout import FunctionalModel, fresh_init


@dataclass
class HypClusterParams:
    """clusters: q, the number of cluster models on the server."""

    clusters: Count = chosen(
        3, "seed 001 gives none; q=2 collapsed to near-FedAvg on test_learning (0.288 vs 0.524)"
    )


def cluster_losses(
    fm: FunctionalModel, clusters: Tensor, buffers: Tensor, group: ClientGroup
) -> Tensor:
    """``L_k(h_j)``: mean cross-entropy of every cluster model on every client's training
    data, ``[C, q]`` (``clusters [C, q, K]``)."""
    out = []
    for j in range(clusters.shape[1]):
        _, total, loss_sum = evaluate_clients(
            fm, clusters[:, j], buffers, group.data, group.client_ids, split="train"
        )
        out.append(loss_sum / total.clamp(min=1))
    return torch.stack(out, dim=1)


class HypClusterServer(Server):
    def __init__(
        self, hp: HypClusterParams, clients: dict[int, Payload], ctx: ServerContext
    ) -> None:
        super().__init__(hp, clients, ctx)
        self.size = {c: int(p["num_params"]) for c, p in clients.items()}
        self.theta: dict[str, Tensor] = {}  # per architecture (parameter count): [q, K]
        for k in sorted(set(self.size.values())):
            fm = ctx.model_with(k)
            inits = [fm.initial_params()]
            inits += [fresh_init(fm, ctx.seed * 1_000 + j) for j in range(1, hp.clusters)]
            self.theta[str(k)] = torch.stack(inits).to(ctx.device)

    def configure_train(self, rnd: int, client_ids: list[int]) -> dict[int, Payload]:
        return {c: {"clusters": self.theta[str(self.size[c])]} for c in client_ids}

    def configure_eval(self, client_ids: list[int]) -> dict[int, Payload]:
        return self.configure_train(0, client_ids)

    def reply_shapes(self, client_id: int) -> dict[str, tuple[int, ...]]:
        return {"theta": (self.size[client_id],), "cluster": ()}

    def check_reply(self, client_id: int, reply: Payload) -> str | None:
        problem = super().check_reply(client_id, reply)
        if problem is None:
            j = reply["cluster"]
            if j.is_floating_point() or not 0 <= int(j) < self.hp.clusters:
                return f"cluster must be an integer in [0, {self.hp.clusters}), got {j}"
        return problem

    def aggregate(self, rnd: int, replies: dict[int, Payload]) -> None:
        for key, models in self.theta.items():
            for j in range(models.shape[0]):
                ids = [
                    c
                    for c in replies
                    if str(self.size[c]) == key and int(replies[c]["cluster"]) == j
                ]
                if ids:  # FedAvg within the cluster; an unchosen cluster keeps its model
                    models[j] = self.average_reply(replies, "theta", ids).to(models)


class HypClusterClient(Client):
    def choose(self, group: ClientGroup, clusters: Tensor, buffers: Tensor) -> Tensor:
        """Step 2: ``argmin_j L_k(h_j)`` per client, ``[C]``."""
        return cluster_losses(group.fm, clusters, buffers, group).argmin(dim=1)

    def fit(
        self, group: ClientGroup, msg: Payload, state: dict[str, Tensor]
    ) -> tuple[Payload, dict[str, Tensor], Tensor]:
        clusters = msg["clusters"]
        with FlopMeter.counting():  # step 2 is the client's per-round work
            choice = self.choose(group, clusters, state["buffers"])
        start = clusters[torch.arange(len(choice), device=choice.device), choice]
        theta, buffers, loss = group.train(start, state["buffers"])
        return {"theta": theta, "cluster": choice}, {"buffers": buffers}, loss

    def eval_model(
        self, group: ClientGroup, msg: Payload, state: Mapping[str, Tensor]
    ) -> tuple[Tensor, Tensor]:
        clusters = msg["clusters"]
        choice = self.choose(group, clusters, state["buffers"])
        return clusters[torch.arange(len(choice), device=choice.device), choice], state["buffers"]


ALGORITHM = Algorithm(
    name="hypcluster",
    summary="HypCluster: q server models, each client trains and uses the one of lowest loss",
    hparams=HypClusterParams,
    server=HypClusterServer,
    client=HypClusterClient,
)
