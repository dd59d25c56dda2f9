"""Hand-sized building blocks the defining-property tests share: a float64 federation whose
clients train and test on the same few samples, a tiny zoo MLP and a scripted transport."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from hyperfed.algorithms.base import Payload, ServerContext
from hyperfed.algorithms.fedavg import FedAvgParams, FedAvgServer
from hyperfed.config import DefenseConfig
from hyperfed.data.federated import FederatedData
from hyperfed.models.layout import FunctionalModel
from hyperfed.models.zoo import ZooNet
from hyperfed.runtime.driver import EvalCounts, Exchange, RoundDriver


def toy_federation(x: Tensor, y: Tensor, idx: list[Tensor], num_classes: int) -> FederatedData:
    """Client k trains and is tested on ``x[idx[k]]`` (no validation split), in float64; with a
    batch as large as a client's share, an epoch is one full-batch step."""
    empty = [torch.zeros(0, dtype=torch.long) for _ in idx]
    shape = tuple(x.shape[1:])
    none = torch.zeros(0)
    return FederatedData(x, y, idx, empty, idx, num_classes, shape, none, none, dtype=torch.float64)


def tiny_mlp(d_in: int, hidden: int, classes: int, seed: int = 0) -> FunctionalModel:
    """Linear(d_in, hidden) - ReLU - Linear(hidden, classes) as a zoo model, in float64; its
    representation (the classifier's input) is the ReLU."""
    torch.manual_seed(seed)
    fm = FunctionalModel(ZooNet(nn.Flatten(), (d_in,), classes, hidden=(hidden,)).double(), "tiny")
    assert fm.layout.names == ["fc.0.weight", "fc.0.bias", "classifier.weight", "classifier.bias"]
    return fm


class Scripted:
    """A transport whose clients answer what the test says: ``answer(c, msg) -> reply``; its
    evaluation returns ``counts`` (a copy), if given."""

    name = "simulation"
    reference = False

    def __init__(self, answer: Any, counts: EvalCounts | None = None) -> None:
        self.answer = answer
        self.counts = counts

    def reachable(self) -> set[int] | None:
        return None

    def fit(self, rnd: int, msgs: dict[int, Payload]) -> Exchange:
        return Exchange({c: self.answer(c, m) for c, m in msgs.items()})

    def evaluate(self, msgs: dict[int, Payload], split: str) -> EvalCounts:
        assert self.counts is not None, "this scripted transport has no evaluation counts"
        return EvalCounts(
            *(x.clone() for x in (self.counts.correct, self.counts.total, self.counts.loss_sum))
        )


def fedavg(
    sizes: list[int], fm: FunctionalModel, answer: Any, defense: DefenseConfig | None = None
) -> tuple[FedAvgServer, RoundDriver]:
    """A FedAvg server over clients of ``sizes`` samples whose replies ``answer(c, msg)`` gives,
    and its round driver (``defense``: the [defense] settings, robust rule included)."""
    joins = {
        c: {"num_params": torch.tensor(fm.num_params), "num_samples": torch.tensor(n)}
        for c, n in enumerate(sizes)
    }
    rule = defense.rule() if defense is not None else None
    ctx = ServerContext(0, torch.device("cpu"), 2, (3,), {"tiny": fm}, aggregation=rule)
    server = FedAvgServer(FedAvgParams(), joins, ctx)
    n = len(sizes)
    driver = RoundDriver(
        server,
        Scripted(answer),
        num_clients=n,
        participation=1.0,
        seed=0,
        arch_of=["tiny"] * n,
        order=list(range(n)),
        defense=defense,
    )
    return server, driver
