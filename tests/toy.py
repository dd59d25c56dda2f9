"""Hand-sized building blocks the defining-property tests share: a float64 federation whose
clients train and test on the same few samples, a tiny zoo MLP and a scripted transport; for
the decentralized methods, a tanh net, a federation of contiguous sample blocks and a
simulation gossiping on a fixed path of three clients."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hyperfed.algorithms.base import Payload, ServerContext
from hyperfed.algorithms.fedavg import FedAvgParams, FedAvgServer
from hyperfed.config import DefenseConfig, load_config
from hyperfed.data.federated import FederatedData
from hyperfed.models.layout import FunctionalModel
from hyperfed.models.zoo import ZooNet
from hyperfed.runtime.driver import EvalCounts, Exchange, RoundDriver
from hyperfed.runtime.simulate import Simulation


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


def tanh_net(dtype: torch.dtype = torch.float64) -> FunctionalModel:
    """Linear(3, 2) - tanh body, Linear(2, 2) classifier as a zoo model: 8 body + 6 head
    entries."""
    torch.manual_seed(0)
    module = ZooNet(nn.Sequential(nn.Linear(3, 2), nn.Tanh()), (3,), 2).to(dtype)
    fm = FunctionalModel(module, "tiny")
    assert fm.layout.names == [
        "features.0.weight",
        "features.0.bias",
        "classifier.weight",
        "classifier.bias",
    ]
    return fm


def tanh_loss(body: Tensor, head: Tensor, x: Tensor, y: Tensor) -> Tensor:
    """:func:`tanh_net`'s mean cross-entropy written out: ``tanh(x W1^T + b1) Wc^T + bc``, with
    ``body = [W1, b1]`` and ``head = [Wc, bc]``."""
    feats = torch.tanh(x @ body[:6].view(2, 3).T + body[6:8])
    return F.cross_entropy(feats @ head[:4].view(2, 2).T + head[4:6], y)


def gd(f: Callable[[Tensor], Tensor], p: Tensor, lr: float, steps: int) -> Tensor:
    """``steps`` plain gradient steps ``p <- p - lr grad f(p)``."""
    for _ in range(steps):
        q = p.detach().requires_grad_(True)
        (g,) = torch.autograd.grad(f(q), q)
        p = (q - lr * g).detach()
    return p


def block_data(
    n_clients: int, n_train: int = 4, n_test: int = 3, dtype: torch.dtype = torch.float64
) -> FederatedData:
    """Vectors ``x in R^3``, 2 classes; client c owns a contiguous block of samples."""
    g = torch.Generator().manual_seed(0)
    per = n_train + n_test
    x = torch.randn(n_clients * per, 3, generator=g, dtype=torch.float64).to(dtype)
    y = torch.randint(0, 2, (n_clients * per,), generator=g)
    train = [torch.arange(c * per, c * per + n_train) for c in range(n_clients)]
    test = [torch.arange(c * per + n_train, (c + 1) * per) for c in range(n_clients)]
    empty = [torch.zeros(0, dtype=torch.long) for _ in range(n_clients)]
    none = torch.zeros(0)
    return FederatedData(x, y, train, empty, test, 2, (3,), none, none, "tiny", dtype)


# A path 0 - 1 - 2 and its Metropolis-Hastings weights W_ij = 1 / (1 + max(d_i, d_j)) on the
# edges (degrees 1, 2, 1), W_ii = 1 - sum_j W_ij: symmetric, doubly stochastic, positive on the
# edges and the diagonal and zero elsewhere (seed 004, Definition 1 (i)-(iv)).
PATH = torch.tensor([[0, 1, 0], [1, 0, 1], [0, 1, 0]], dtype=torch.bool)
W_PATH = torch.tensor(
    [[2 / 3, 1 / 3, 0.0], [1 / 3, 1 / 3, 1 / 3], [0.0, 1 / 3, 2 / 3]], dtype=torch.float64
)


def path_sim(
    algorithm: str,
    n: int,
    store: Callable[[], dict[int, dict[str, Tensor]]],
    dtype: torch.dtype = torch.float64,
    *sets: str,
) -> Simulation:
    """A decentralized ``algorithm`` run of ``n`` clients on :func:`block_data` with the
    :func:`tanh_net` (full-batch momentum-free SGD at lr 0.1, no vectorization), its gossip
    graph replaced by :data:`PATH` and its client states by what ``store()`` gives (called
    after the model is built, as the global RNG stands then); ``sets``: further ``--set``
    overrides."""
    cfg = load_config(
        None,
        [
            "device=cpu",
            "clients.models=mlp",
            f"clients.count={n}",
            "partition.name=iid",
            "local.batch_size=4",
            "local.lr=0.1",
            "local.momentum=0",
            "local.weight_decay=0",
            "local.vectorize=off",
            f"algorithm.name={algorithm}",
            'algorithm.topology="ring"',
            *sets,
            "seed=0",
        ],
    )
    sim = Simulation(cfg, data=block_data(n, dtype=dtype))
    sim.models["mlp"] = tanh_net(dtype)  # the one architecture, replaced by the tiny one
    sim.store = store()
    assert sim.gossip is not None
    sim.gossip.adj = PATH
    return sim


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
