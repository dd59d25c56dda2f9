"""FedBN (Li et al., ICLR 2021) against its Algorithm 1, on a Linear-BatchNorm-Linear model.

Algorithm 1: every client trains its model locally; the server averages every layer that is
not BatchNorm and sends it back; each client keeps its BatchNorm layers -- affine parameters
(gamma, beta) and running statistics (mu, sigma^2) -- as they are. Hence: only the non-BN
parameters cross the wire, client k trains [averaged layers | own BN layers], the averaged part
is ``sum_k n_k w_k / sum_k n_k``, and client k is evaluated with the latest averaged layers and
its own BN parameters and statistics. Without BatchNorm, FedBN is FedAvg.

Model: h = x W1^T + b1 (``features.bn``: a Linear, named so to defeat name matching),
BN(h) = (h - mean) / sqrt(var + eps) * gamma + beta (``features.scale``: the BatchNorm1d),
z = BN(h) W2^T + b2; ``theta = [W1, b1, gamma, beta, W2, b2]``.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from toy import tiny_mlp, toy_federation

from hyperfed.algorithms.base import ClientContext, ClientGroup, ServerContext, stack_payloads
from hyperfed.algorithms.fedavg import FedAvgClient
from hyperfed.algorithms.fedbn import FedBNClient, FedBNParams, FedBNServer
from hyperfed.data.federated import FederatedData
from hyperfed.engine.local import SGDConfig
from hyperfed.models.layout import FunctionalModel
from hyperfed.models.select import norm_mask
from hyperfed.models.zoo import ZooNet

CPU = torch.device("cpu")
D, H, C = 3, 2, 3
K = H * D + H + 2 * H + C * H + C
NS = K - 2 * H  # the shared (averaged) part
LR, EPS, MOM = 0.5, 1e-5, 0.1


def _model() -> FunctionalModel:
    torch.manual_seed(0)
    body = nn.Sequential(OrderedDict(bn=nn.Linear(D, H), scale=nn.BatchNorm1d(H)))
    return FunctionalModel(ZooNet(body, (D,), C).double(), "lin-bn")


def _parts(theta: Tensor) -> dict[str, Tensor]:
    sizes = {"w1": H * D, "b1": H, "g": H, "beta": H, "w2": C * H, "b2": C}
    out, o = {}, 0
    for name, n in sizes.items():
        out[name] = theta[o : o + n]
        o += n
    out["w1"], out["w2"] = out["w1"].view(H, D), out["w2"].view(C, H)
    return out


def _shared(theta: Tensor) -> Tensor:
    return torch.cat([theta[: H * D + H], theta[H * D + 3 * H :]])


def _norm(theta: Tensor) -> Tensor:
    return theta[H * D + H : H * D + 3 * H]


def _join(shared: Tensor, norm: Tensor) -> Tensor:
    return torch.cat([shared[: H * D + H], norm, shared[H * D + H :]])


def _logits(theta: Tensor, x: Tensor, stats: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Training mode (batch statistics) or, given (mu, var), evaluation mode."""
    p = _parts(theta)
    h = x @ p["w1"].T + p["b1"]
    mu, var = stats if stats is not None else (h.mean(0), h.var(0, unbiased=False))
    return ((h - mu) / torch.sqrt(var + EPS) * p["g"] + p["beta"]) @ p["w2"].T + p["b2"]


def _data() -> FederatedData:
    """Two clients of 4 samples: with batch 4 an epoch is one full-batch step."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(8, D, generator=g, dtype=torch.float64)
    x[4:] = 3.0 * x[4:] + 1.0  # client 1's features are shifted and scaled (feature shift)
    y = torch.tensor([0, 2, 1, 1, 2, 0, 1, 2])
    return toy_federation(x, y, [torch.arange(0, 4), torch.arange(4, 8)], C)


def _group(fm: FunctionalModel, data: FederatedData) -> ClientGroup:
    sgd = SGDConfig(lr=LR, momentum=0.0, weight_decay=0.0, epochs=1, batch_size=4)
    return ClientGroup(fm, [0, 1], data, rnd=1, seed=0, sgd=sgd, vectorize=False)


def _server(fm: FunctionalModel, n: dict[int, int]) -> FedBNServer:
    joins = {c: {"num_params": torch.tensor(fm.num_params), "num_samples": torch.tensor(k)}
             for c, k in n.items()}  # fmt: skip
    return FedBNServer(FedBNParams(), joins, ServerContext(0, CPU, C, (D,), {"m": fm}))


def _client() -> FedBNClient:
    return FedBNClient(FedBNParams(), ClientContext(0, CPU, C, (D,)))


def test_bn_parameters_are_found_from_the_module_not_from_names() -> None:
    """The affine parameters of the BatchNorm1d (named ``scale``) are local; the Linear
    named ``bn`` is not (name matching, as in the authors' ``'bn' in key``, would invert it)."""
    fm = _model()
    expected = torch.zeros(K, dtype=torch.bool)
    expected[H * D + H : H * D + 3 * H] = True  # gamma, beta
    assert fm.num_params == K
    assert torch.equal(norm_mask(fm), expected)


def test_only_the_non_bn_layers_cross_the_wire() -> None:
    fm = _model()
    server = _server(fm, {0: 4, 1: 4})
    msg = server.configure_train(1, [0])[0]
    assert set(msg) == {"shared"}
    assert torch.equal(msg["shared"], _shared(fm.initial_params()))
    client = _client()
    reply, state, _ = client.fit(
        _group(fm, _data()), stack_payloads([msg, msg]), client.init_state(fm, 2)
    )
    assert set(reply) == {"shared"} and reply["shared"].shape == (2, NS)
    assert server.check_reply(0, {"shared": reply["shared"][0]}) is None
    whole = {"shared": torch.cat([reply["shared"][0], state["norm"][0]])}
    assert server.check_reply(0, whole) is not None  # a reply carrying gamma, beta is refused


def test_client_trains_averaged_layers_with_its_own_bn_and_keeps_bn() -> None:
    """Client k starts from [shared (received) | gamma_k, beta_k (kept)], takes one full-batch
    SGD step on CE through train-mode BN, returns the shared part and keeps gamma, beta and
    the running statistics ``(1 - m) * old + m * batch`` (unbiased variance)."""
    fm, data = _model(), _data()
    client = _client()
    state = client.init_state(fm, 2)
    g = torch.Generator().manual_seed(8)
    shared = torch.randn(NS, generator=g, dtype=torch.float64)
    norms = torch.randn(2, 2 * H, generator=g, dtype=torch.float64)
    state["norm"] = norms.clone()
    state["buffers"] = torch.tensor([[0.5, -0.5, 2.0, 3.0], [1.0, 0.0, 1.0, 0.5]]).double()
    old_stats = state["buffers"].clone()
    reply, new, _ = client.fit(_group(fm, data), {"shared": shared.expand(2, -1).clone()}, state)
    for c in range(2):
        x, y = data.x[data.train_idx[c]], data.y[data.train_idx[c]]
        theta = _join(shared, norms[c]).requires_grad_(True)
        (grad,) = torch.autograd.grad(F.cross_entropy(_logits(theta, x), y), theta)
        stepped = theta.detach() - LR * grad
        assert torch.allclose(reply["shared"][c], _shared(stepped), atol=1e-10)
        assert torch.allclose(new["norm"][c], _norm(stepped), atol=1e-10)
        p = _parts(theta.detach())
        h = x @ p["w1"].T + p["b1"]
        stats = torch.cat([h.mean(0), h.var(0, unbiased=True)])
        assert torch.allclose(new["buffers"][c], (1 - MOM) * old_stats[c] + MOM * stats)
    assert not torch.allclose(new["norm"], norms)  # gamma, beta are trained too


def test_shared_part_is_averaged_with_sample_weights_and_bn_never_is() -> None:
    fm = _model()
    server = _server(fm, {0: 1, 1: 3, 2: 4})
    base = torch.arange(NS, dtype=torch.float64)
    parts = {0: base, 1: 1.0 - base, 2: 2 * base + 3}
    server.aggregate(1, {c: {"shared": s} for c, s in parts.items()})
    expected = (parts[0] + 3 * parts[1] + 4 * parts[2]) / 8
    assert torch.allclose(server.shared[str(K)], expected, atol=1e-12)
    assert not torch.allclose(expected, (parts[0] + parts[1] + parts[2]) / 3)
    server.aggregate(2, {c: {"shared": parts[c]} for c in (0, 1)})
    assert torch.allclose(server.shared[str(K)], (parts[0] + 3 * parts[1]) / 4, atol=1e-12)
    assert torch.equal(server.configure_eval([2])[2]["shared"], server.shared[str(K)])


def test_evaluation_uses_latest_shared_layers_with_own_bn_parameters_and_statistics() -> None:
    fm, data = _model(), _data()
    server = _server(fm, {0: 1, 1: 3})
    s0, s1 = torch.ones(NS, dtype=torch.float64), -torch.linspace(0, 1, NS).double()
    server.aggregate(1, {0: {"shared": s0}, 1: {"shared": s1}})
    msgs = server.configure_eval([0, 1])
    client = _client()
    state = client.init_state(fm, 2)
    state["norm"] = torch.tensor([[1.5, 0.5, 0.1, -0.2], [0.3, 2.0, -1.0, 0.4]]).double()
    state["buffers"] = torch.tensor([[0.5, -0.5, 2.0, 3.0], [1.0, 0.0, 1.0, 0.5]]).double()
    theta, buffers = client.eval_model(_group(fm, data), stack_payloads([msgs[0], msgs[1]]), state)
    shared = (s0 + 3 * s1) / 4
    for c in range(2):
        stats = (state["buffers"][c, :H], state["buffers"][c, H:])
        expected = _logits(_join(shared, state["norm"][c]), data.x, stats)
        assert torch.allclose(fm.forward(theta[c], buffers[c], data.x), expected, atol=1e-12)


def test_without_batchnorm_fedbn_is_fedavg() -> None:
    """A model with no normalization layer: FedBN's reply equals FedAvg's whole model."""
    fm = tiny_mlp(D, 4, C)
    data = _data()
    assert not bool(norm_mask(fm).any())
    theta = fm.initial_params().expand(2, -1).clone()
    bn_client, avg_client = _client(), FedAvgClient(None, ClientContext(0, CPU, C, (D,)))
    bn_reply, _, _ = bn_client.fit(_group(fm, data), {"shared": theta}, bn_client.init_state(fm, 2))
    avg_reply, _, _ = avg_client.fit(
        _group(fm, data), {"theta": theta}, avg_client.init_state(fm, 2)
    )
    assert torch.equal(bn_reply["shared"], avg_reply["theta"])
