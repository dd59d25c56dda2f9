"""MOON (Li, He & Song, CVPR 2021) against its Eq. 2-3 and Algorithm 1, on a tiny float64 MLP.

Eq. 3: client i trains the received global model w^t on ``l_sup + mu * l_con``;
Eq. 2: ``l_con = -log(e^{cos(z, z_glob)/tau} / (e^{cos(z, z_glob)/tau} + e^{cos(z, z_prev)/tau}))``
with z the representation (here the classifier's input, the MLP's ReLU layer) of the model in
training, of the global model and of the client's previous-round model. The server averages
the trained models with weights n_i (FedAvg). MOON's paper and code score the global model.

Model: z = relu(x W1^T + b1), logits = z W2^T + b2; ``theta = [W1, b1, W2, b2]``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from toy import tiny_mlp, toy_federation

from hyperfed.algorithms.base import ClientContext, ClientGroup, ServerContext, stack_payloads
from hyperfed.algorithms.fedavg import FedAvgClient, FedAvgParams
from hyperfed.algorithms.moon import (
    MoonClient,
    MoonParams,
    MoonServer,
    model_contrastive_loss,
)
from hyperfed.data.federated import FederatedData
from hyperfed.engine.local import SGDConfig
from hyperfed.models.layout import FunctionalModel

CPU = torch.device("cpu")
D, H, C = 3, 4, 3
LR = 0.3


def _data() -> FederatedData:
    """Two clients of 4 samples: with batch 4 an epoch is one full-batch step (the mean losses
    do not depend on the order the shuffle puts the 4 samples in)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, D, generator=g, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 1, 2, 2, 0, 1])
    return toy_federation(x, y, [torch.arange(0, 4), torch.arange(4, 8)], C)


def _group(fm: FunctionalModel, data: FederatedData, epochs: int = 1) -> ClientGroup:
    sgd = SGDConfig(lr=LR, momentum=0.0, weight_decay=0.0, epochs=epochs, batch_size=4)
    return ClientGroup(fm, [0, 1], data, rnd=1, seed=0, sgd=sgd, vectorize=False)


def _forward(theta: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
    """(representation z, logits) of the MLP, written out."""
    w1, b1 = theta[: H * D].view(H, D), theta[H * D : H * D + H]
    o = H * D + H
    w2, b2 = theta[o : o + C * H].view(C, H), theta[o + C * H :]
    z = torch.relu(x @ w1.T + b1)
    return z, z @ w2.T + b2


def _cos(u: list[float], v: list[float]) -> float:
    dot = sum(a * b for a, b in zip(u, v))
    return dot / math.sqrt(sum(a * a for a in u) * sum(b * b for b in v))


def _l_con(z: Tensor, z_glob: Tensor, z_prev: Tensor, tau: float) -> float:
    """Eq. 2 per sample with Python floats, averaged over the batch."""
    out = []
    for a, p, n in zip(z.tolist(), z_glob.tolist(), z_prev.tolist()):
        e_pos, e_neg = math.exp(_cos(a, p) / tau), math.exp(_cos(a, n) / tau)
        out.append(-math.log(e_pos / (e_pos + e_neg)))
    return sum(out) / len(out)


def _client(hp: MoonParams) -> MoonClient:
    return MoonClient(hp, ClientContext(0, CPU, C, (D,)))


def test_contrastive_loss_is_eq2() -> None:
    """Eq. 2 on hand-written representations, and its direction: closer to the positive
    (global) than to the negative (previous) gives less than log 2, the reverse more."""
    z = torch.tensor([[1.0, 2.0, 0.0], [0.5, -1.0, 2.0]], dtype=torch.float64)
    z_glob = torch.tensor([[1.0, 1.5, 0.5], [0.0, -1.0, 1.0]], dtype=torch.float64)
    z_prev = torch.tensor([[-1.0, 0.5, 2.0], [2.0, 1.0, 0.0]], dtype=torch.float64)
    for tau in (0.5, 2.0):
        got = float(model_contrastive_loss(z, z_glob, z_prev, tau))
        assert got == pytest.approx(_l_con(z, z_glob, z_prev, tau), rel=1e-12)
    assert float(model_contrastive_loss(z, z_glob, z_prev, 0.5)) < math.log(2)
    assert float(model_contrastive_loss(z, z_prev, z_glob, 0.5)) > math.log(2)
    # cosine similarity: scaling a representation changes nothing
    assert float(model_contrastive_loss(z, 3 * z_glob, 0.2 * z_prev, 0.5)) == pytest.approx(
        _l_con(z, z_glob, z_prev, 0.5), rel=1e-12
    )


def test_local_steps_descend_ce_plus_mu_times_l_con_from_the_global_model() -> None:
    """Eq. 3: client i's SGD starts at w^t and follows grad(CE + mu * l_con) with z_glob from
    w^t and z_prev from w_i^{t-1} held fixed; the trained model is both sent and kept as the
    next negative. Two full-batch steps: at the first, z = z_glob and the positive pair has no
    gradient (cosine is maximal), so only the second step checks the pull toward w^t."""
    fm, data = tiny_mlp(D, H, C), _data()
    g = torch.Generator().manual_seed(5)
    glob = fm.initial_params().clone()
    glob[H * D : H * D + H] += 1.0  # b1 up: most ReLUs active, so cosines have gradients
    prev = torch.stack([glob + 0.4 * torch.randn(glob.shape, generator=g, dtype=glob.dtype)
                        for _ in range(2)])  # fmt: skip
    hp = MoonParams(mu=2.5, temperature=0.7)
    client = _client(hp)
    state = client.init_state(fm, 2)
    state["theta_prev"] = prev.clone()
    group = _group(fm, data, epochs=2)
    reply, new_state, _ = client.fit(group, {"theta": glob.expand(2, -1).clone()}, dict(state))
    for c in range(2):
        x, y = data.x[data.train_idx[c]], data.y[data.train_idx[c]]
        zg, zp = _forward(glob, x)[0], _forward(prev[c], x)[0]
        theta = glob.clone()
        for _ in range(2):
            leaf = theta.clone().requires_grad_(True)
            z, logits = _forward(leaf, x)
            pos = F.cosine_similarity(z, zg, dim=1) / hp.temperature
            neg = F.cosine_similarity(z, zp, dim=1) / hp.temperature
            l_con = -torch.log(pos.exp() / (pos.exp() + neg.exp())).mean()
            expected_l_con = _l_con(z.detach(), zg, zp, hp.temperature)
            assert float(l_con.detach()) == pytest.approx(expected_l_con, rel=1e-10)
            (grad,) = torch.autograd.grad(F.cross_entropy(logits, y) + hp.mu * l_con, leaf)
            theta = theta - LR * grad
        assert torch.allclose(reply["theta"][c], theta, rtol=0, atol=1e-10), c
    assert torch.equal(new_state["theta_prev"], reply["theta"])
    # the contrastive term matters here: plain FedAvg lands elsewhere
    fedavg = FedAvgClient(FedAvgParams(), ClientContext(0, CPU, C, (D,)))
    ref, _, _ = fedavg.fit(group, {"theta": glob.expand(2, -1).clone()}, fedavg.init_state(fm, 2))
    assert not torch.allclose(ref["theta"], reply["theta"], atol=1e-6)


def test_first_participation_is_plain_fedavg() -> None:
    """w_i^{t-1} = w^0 = w^t before a client's first training: positive == negative, so
    l_con = log 2 has no gradient and the step is FedAvg's (loss value: CE + mu log 2)."""
    fm, data = tiny_mlp(D, H, C), _data()
    glob = fm.initial_params().expand(2, -1).clone()
    client = _client(MoonParams(mu=3.0))
    reply, _, loss = client.fit(_group(fm, data), {"theta": glob}, client.init_state(fm, 2))
    fedavg = FedAvgClient(FedAvgParams(), ClientContext(0, CPU, C, (D,)))
    ref, _, ref_loss = fedavg.fit(_group(fm, data), {"theta": glob}, fedavg.init_state(fm, 2))
    assert torch.allclose(reply["theta"], ref["theta"], rtol=0, atol=1e-12)
    assert torch.allclose(loss, ref_loss + 3.0 * math.log(2), atol=1e-6)


def _server(fm: FunctionalModel, hp: MoonParams, n: dict[int, int]) -> MoonServer:
    joins = {c: {"num_params": torch.tensor(fm.num_params), "num_samples": torch.tensor(k)}
             for c, k in n.items()}  # fmt: skip
    return MoonServer(hp, joins, ServerContext(0, CPU, C, (D,), {"tiny": fm}))


def test_server_averages_trained_models_with_sample_weights() -> None:
    """w^{t+1} = sum_i n_i w_i^t / sum_i n_i over the replies; it is what the next round sends."""
    fm = tiny_mlp(D, H, C)
    server = _server(fm, MoonParams(), {0: 1, 1: 3, 2: 4})
    k = fm.num_params
    ws = {0: torch.linspace(-1, 1, k), 1: torch.ones(k), 2: torch.arange(k) / k}
    ws = {c: w.double() for c, w in ws.items()}
    server.aggregate(1, {c: {"theta": w} for c, w in ws.items()})
    expected = (ws[0] + 3 * ws[1] + 4 * ws[2]) / 8
    sent = server.configure_train(2, [1])[1]
    assert set(sent) == {"theta"}
    assert torch.allclose(sent["theta"], expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("evaluate", ["local", "global"])
def test_evaluated_model(evaluate: str) -> None:
    """``local``: each client's trained model w_i; ``global``: the global model."""
    fm, data = tiny_mlp(D, H, C), _data()
    hp = MoonParams(evaluate=evaluate)
    server = _server(fm, hp, {0: 4, 1: 4})
    glob = torch.full((fm.num_params,), 0.25, dtype=torch.float64)
    server.aggregate(1, {0: {"theta": glob}, 1: {"theta": glob}})
    msgs = server.configure_eval([0, 1])
    client = _client(hp)
    state = client.init_state(fm, 2)
    state["theta_prev"] = torch.stack([glob - 1, glob + 1])
    theta, _ = client.eval_model(_group(fm, data), stack_payloads([msgs[0], msgs[1]]), state)
    if evaluate == "local":
        assert msgs[0] == {}  # nothing needs to cross for evaluation
        assert torch.equal(theta, state["theta_prev"])
    else:
        assert torch.equal(theta, glob.expand(2, -1))


def test_default_scores_the_global_model_as_the_moon_paper_does() -> None:
    """MOON §4 and its code test the aggregated global model; the default must score it (and
    say so in every metrics record), not the locally trained models."""
    from hyperfed.algorithms.moon import ALGORITHM

    hp = MoonParams()
    assert ALGORITHM.scored_model(hp) == "global"
    assert ALGORITHM.scored_model(MoonParams(evaluate="local")) == "local"
    fm, data = tiny_mlp(D, H, C), _data()
    server = _server(fm, hp, {0: 4, 1: 4})
    glob = torch.full((fm.num_params,), 0.5, dtype=torch.float64)
    server.aggregate(1, {0: {"theta": glob}, 1: {"theta": glob}})
    client = _client(hp)
    state = client.init_state(fm, 2)
    state["theta_prev"] = torch.stack([glob - 1, glob + 1])
    msgs = server.configure_eval([0, 1])
    theta, _ = client.eval_model(_group(fm, data), stack_payloads([msgs[0], msgs[1]]), state)
    assert torch.equal(theta, glob.expand(2, -1))
