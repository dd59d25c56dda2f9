"""FedAvg (McMahan et al., 2017) against its Algorithm 1, on hand-sized examples.

Algorithm 1 (FederatedAveraging): the server sends ``w_t``; each client k runs
``ClientUpdate(k, w_t)``: ``w <- w - eta * grad l(w; b)`` for E epochs of batches b, starting from
the ``w_t`` it received; the server sets ``w_{t+1} = sum_k n_k w^k_{t+1} / sum_k n_k`` over the
clients that took part. The model every client is evaluated with is that global ``w``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from toy import toy_federation

from hyperfed.algorithms.base import ClientContext, ClientGroup, ServerContext, stack_payloads
from hyperfed.algorithms.fedavg import ALGORITHM, FedAvgClient, FedAvgParams, FedAvgServer
from hyperfed.data.federated import FederatedData
from hyperfed.engine.local import SGDConfig
from hyperfed.models.layout import FunctionalModel
from hyperfed.models.zoo import ZooNet

CPU = torch.device("cpu")
D, C = 3, 3  # input width, classes: the model is z = x W^T + b, theta = [W (C x D), b]
LR = 0.5
CLIENT_CTX = ClientContext(0, CPU, C, (D,))


def _linear(in_dim: int = D, classes: int = C, seed: int = 0) -> FunctionalModel:
    torch.manual_seed(seed)
    return FunctionalModel(ZooNet(nn.Identity(), (in_dim,), classes).double(), "lin")


def _data(parts: list[tuple[Tensor, Tensor]], in_dim: int = D) -> FederatedData:
    """One client per (x, y) part; every sample is a training sample."""
    x = torch.cat([p[0] for p in parts])
    y = torch.cat([p[1] for p in parts])
    idx, start = [], 0
    for px, _ in parts:
        idx.append(torch.arange(start, start + len(px)))
        start += len(px)
    return toy_federation(x, y, idx, C)


def _two_clients() -> FederatedData:
    """Client 0 holds 2 samples, client 1 holds 4: with batch 4 each takes one full-batch step
    (client 0's batch is its 2 samples twice, so the mean loss is its full-data loss)."""
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(2, D, generator=g, dtype=torch.float64)
    x1 = torch.randn(4, D, generator=g, dtype=torch.float64)
    return _data([(x0, torch.tensor([0, 1])), (x1, torch.tensor([2, 2, 1, 0]))])


def _group(fm: FunctionalModel, data: FederatedData) -> ClientGroup:
    sgd = SGDConfig(lr=LR, momentum=0.0, weight_decay=0.0, epochs=1, batch_size=4)
    ids = list(range(data.num_clients))
    return ClientGroup(fm, ids, data, rnd=1, seed=0, sgd=sgd, vectorize=False)


def _ce_grad(theta: Tensor, x: Tensor, y: Tensor) -> Tensor:
    """d/dtheta of mean_i CE(x_i W^T + b, y_i), by hand: G = (softmax(z) - onehot(y)) / B."""
    w, b = theta[: C * D].view(C, D), theta[C * D :]
    g = (torch.softmax(x @ w.T + b, -1) - F.one_hot(y, C).to(x.dtype)) / len(y)
    return torch.cat([(g.T @ x).reshape(-1), g.sum(0)])


def _client_xy(data: FederatedData, c: int) -> tuple[Tensor, Tensor]:
    return data.x[data.train_idx[c]], data.y[data.train_idx[c]]


def _server(fms: dict[str, FunctionalModel], sizes: dict[int, tuple[int, int]]) -> FedAvgServer:
    """``sizes``: client -> (num_params it reports, num_samples n_k)."""
    ctx = ServerContext(0, CPU, C, (D,), models=fms)
    joins = {
        c: {"num_params": torch.tensor(k), "num_samples": torch.tensor(n)}
        for c, (k, n) in sizes.items()
    }
    return FedAvgServer(FedAvgParams(), joins, ctx)


def test_aggregate_is_the_sample_weighted_mean_of_the_replies() -> None:
    """Alg. 1: w_{t+1} = sum_k n_k w_k / sum_k n_k, normalized over the participants."""
    fm = _linear()
    K = fm.num_params
    server = _server({"lin": fm}, {0: (K, 1), 1: (K, 3), 2: (K, 6)})
    base = torch.arange(K, dtype=torch.float64)
    replies = {0: base + 1.0, 1: 2.0 * base, 2: -base + 4.0}
    server.aggregate(1, {c: {"theta": t} for c, t in replies.items()})
    expected = (1 * replies[0] + 3 * replies[1] + 6 * replies[2]) / 10
    assert torch.allclose(server.theta[str(K)], expected, atol=1e-12)
    uniform = (replies[0] + replies[1] + replies[2]) / 3
    assert not torch.allclose(expected, uniform)  # the example tells the two weightings apart

    # a round where only clients 0 and 2 took part: weights n_k / (n_0 + n_2)
    server.aggregate(2, {c: {"theta": replies[c]} for c in (0, 2)})
    assert torch.allclose(server.theta[str(K)], (replies[0] + 6 * replies[2]) / 7, atol=1e-12)


def test_each_architecture_is_averaged_within_its_own_federation() -> None:
    """Mixed models: one FedAvg per architecture, each with its own clients' n_k."""
    a = _linear()
    b = FunctionalModel(ZooNet(nn.Sequential(nn.Linear(D, 2)), (D,), C).double(), "two")
    ka, kb = a.num_params, b.num_params
    assert ka != kb
    server = _server({"lin": a, "two": b}, {0: (ka, 1), 1: (ka, 3), 2: (kb, 2), 3: (kb, 6)})
    ones_a, ones_b = torch.ones(ka, dtype=torch.float64), torch.ones(kb, dtype=torch.float64)
    replies = {0: 4 * ones_a, 1: 8 * ones_a, 2: 1 * ones_b, 3: 5 * ones_b}
    server.aggregate(1, {c: {"theta": t} for c, t in replies.items()})
    assert torch.allclose(server.theta[str(ka)], (4 + 3 * 8) / 4 * ones_a)
    assert torch.allclose(server.theta[str(kb)], (2 * 1 + 6 * 5) / 8 * ones_b)
    msgs = server.configure_train(2, [0, 3])
    assert torch.equal(msgs[0]["theta"], server.theta[str(ka)])
    assert torch.equal(msgs[3]["theta"], server.theta[str(kb)])


def test_client_update_starts_from_the_received_global_model() -> None:
    """ClientUpdate(k, w): w <- w - eta * grad l(w; b), from the server's w (not a local model)."""
    fm, data = _linear(), _two_clients()
    group = _group(fm, data)
    client = FedAvgClient(FedAvgParams(), CLIENT_CTX)
    state = client.init_state(fm, 2)
    w = fm.initial_params() + 0.3 * torch.randn(fm.num_params, dtype=torch.float64)
    reply, _, _ = client.fit(group, {"theta": w.expand(2, -1).clone()}, state)
    assert set(reply) == {"theta"}
    for c in range(2):
        x, y = _client_xy(data, c)
        expected = w - LR * _ce_grad(w, x, y)
        assert torch.allclose(reply["theta"][c], expected, atol=1e-10)


def test_one_round_is_local_sgd_then_weighted_average() -> None:
    """A whole round (Alg. 1): w_1 = sum_k n_k (w_0 - eta g_k(w_0)) / sum_k n_k, n = (2, 4)."""
    fm, data = _linear(), _two_clients()
    K = fm.num_params
    client = FedAvgClient(FedAvgParams(), CLIENT_CTX)
    joins = {c: client.join(fm, data.train_sizes[c]) for c in range(2)}
    server = ALGORITHM.server(FedAvgParams(), joins, ServerContext(0, CPU, C, (D,), {"lin": fm}))
    w0 = server.theta[str(K)].clone()
    assert torch.equal(w0, fm.initial_params())
    msgs = server.configure_train(1, [0, 1])
    reply, _, _ = client.fit(
        _group(fm, data), stack_payloads([msgs[0], msgs[1]]), client.init_state(fm, 2)
    )
    server.aggregate(1, {c: {"theta": reply["theta"][c]} for c in range(2)})
    steps = [w0 - LR * _ce_grad(w0, *_client_xy(data, c)) for c in range(2)]
    expected = (2 * steps[0] + 4 * steps[1]) / 6
    assert torch.allclose(server.theta[str(K)], expected, atol=1e-10)


def test_clients_are_evaluated_with_the_current_global_model() -> None:
    """Every client is evaluated with the latest w (FedAvg has no personal model)."""
    fm = _linear()
    K = fm.num_params
    server = _server({"lin": fm}, {0: (K, 1), 1: (K, 3)})
    t0, t1 = torch.full((K,), 2.0, dtype=torch.float64), torch.full((K,), 6.0, dtype=torch.float64)
    server.aggregate(1, {0: {"theta": t0}, 1: {"theta": t1}})
    msgs = server.configure_eval([0, 1])
    client = FedAvgClient(FedAvgParams(), CLIENT_CTX)
    group = _group(fm, _two_clients())
    theta, _ = client.eval_model(
        group, stack_payloads([msgs[0], msgs[1]]), client.init_state(fm, 2)
    )
    expected = torch.full((K,), (2.0 + 3 * 6.0) / 4, dtype=torch.float64)
    assert torch.allclose(theta[0], expected) and torch.allclose(theta[1], expected)


def test_evaluate_local_scores_each_clients_locally_trained_model() -> None:
    """Seed 001's PM@Acc (§6.1, "the trained private models' mean accuracy"): under
    ``evaluate="local"`` client k is evaluated with w_0 - eta g_k(w_0), its own model after
    local training, not the average; a client never trained is evaluated with w_0."""
    fm, data = _linear(), _two_clients()
    K = fm.num_params
    hp = FedAvgParams(evaluate="local")
    client = FedAvgClient(hp, CLIENT_CTX)
    state = client.init_state(fm, 2)
    w0 = fm.initial_params()
    group = _group(fm, data)
    before, _ = client.eval_model(group, {"theta": torch.zeros(2, K, dtype=torch.float64)}, state)
    assert torch.equal(before[0], w0) and torch.equal(before[1], w0)  # never trained: w_0
    _, state, _ = client.fit(group, {"theta": w0.expand(2, -1).clone()}, state)
    averaged = torch.full((2, K), 9.0, dtype=torch.float64)  # what the server would send
    theta, _ = client.eval_model(group, {"theta": averaged}, state)
    for c in range(2):
        expected = w0 - LR * _ce_grad(w0, *_client_xy(data, c))
        assert torch.allclose(theta[c], expected, atol=1e-10)
    assert not torch.allclose(theta[0], theta[1])  # two private models, not one global
    assert ALGORITHM.scored_model(hp) == "local"
    assert ALGORITHM.scored_model(FedAvgParams()) == "global"  # the paper's default


def test_evaluate_rejects_an_unknown_model() -> None:
    import pytest

    from hyperfed.config import validate_hparams

    with pytest.raises(ValueError, match=r"evaluate: allowed: one of global, local \(got 'best'\)"):
        validate_hparams(FedAvgParams, {"evaluate": "best"})
