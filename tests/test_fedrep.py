"""FedRep (Collins et al., ICML 2021) against its Algorithm 1, on a two-layer affine model.

Algorithm 1, round t, client i, given phi^t:
1. tau head steps, phi^t fixed:  h <- h - alpha * grad_h f_i(h, phi^t);
2. then the representation, the new head fixed:  phi_i <- phi^t - alpha * grad_phi f_i(h, phi^t);
3. phi_i goes to the server, h stays; ``phi^{t+1} = sum_i n_i phi_i / sum_i n_i``.
Client i is evaluated with the latest phi and its own head h_i.

Model: r = x W1^T + b1 (phi, ``features.0``), z = r W2^T + b2 (the head,
``classifier``); ``theta = [W1, b1 | W2, b2]``. Gradients by autograd on the explicit formula.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from toy import tiny_mlp, toy_federation

from hyperfed.algorithms.base import ClientContext, ClientGroup, ServerContext, stack_payloads
from hyperfed.algorithms.fedrep import FedRepClient, FedRepParams, FedRepServer, rep_split
from hyperfed.config import validate_hparams
from hyperfed.data.federated import FederatedData
from hyperfed.engine.local import SGDConfig
from hyperfed.errors import ConfigError
from hyperfed.models.layout import FunctionalModel
from hyperfed.models.zoo import ZooNet

CPU = torch.device("cpu")
D, H, C = 3, 2, 3
NB, NH = H * D + H, C * H + C
LR = 0.5


def _model() -> FunctionalModel:
    torch.manual_seed(0)
    return FunctionalModel(ZooNet(nn.Sequential(nn.Linear(D, H)), (D,), C).double(), "two")


def _data() -> FederatedData:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, D, generator=g, dtype=torch.float64)
    y = torch.tensor([0, 2, 1, 1, 2, 0, 0, 1])
    return toy_federation(x, y, [torch.arange(0, 4), torch.arange(4, 8)], C)


def _group(fm: FunctionalModel, data: FederatedData) -> ClientGroup:
    sgd = SGDConfig(lr=LR, momentum=0.0, weight_decay=0.0, epochs=7, batch_size=4)
    return ClientGroup(fm, [0, 1], data, rnd=1, seed=0, sgd=sgd, vectorize=False)


def _loss(body: Tensor, head: Tensor, x: Tensor, y: Tensor) -> Tensor:
    w1, b1 = body[: H * D].view(H, D), body[H * D :]
    w2, b2 = head[: C * H].view(C, H), head[C * H :]
    return F.cross_entropy((x @ w1.T + b1) @ w2.T + b2, y)


def _grads(body: Tensor, head: Tensor, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    b, h = body.clone().requires_grad_(True), head.clone().requires_grad_(True)
    gb, gh = torch.autograd.grad(_loss(b, h, x, y), (b, h))
    return gb, gh


def _xy(data: FederatedData, c: int) -> tuple[Tensor, Tensor]:
    return data.x[data.train_idx[c]], data.y[data.train_idx[c]]


def _client(**hp: int) -> FedRepClient:
    return FedRepClient(FedRepParams(**hp), ClientContext(0, CPU, C, (D,)))  # type: ignore[arg-type]


def _server(fm: FunctionalModel, n: dict[int, int]) -> FedRepServer:
    joins = {c: {"num_params": torch.tensor(fm.num_params), "num_samples": torch.tensor(k)}
             for c, k in n.items()}  # fmt: skip
    return FedRepServer(FedRepParams(), joins, ServerContext(0, CPU, C, (D,), {"two": fm}))


def _start(fm: FunctionalModel) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(4)
    body = torch.randn(NB, generator=g, dtype=torch.float64)
    heads = torch.randn(2, NH, generator=g, dtype=torch.float64)
    return body, heads


def test_the_head_is_the_last_layer() -> None:
    """§3: the head h_i is the last Linear only, so a hidden fc layer belongs to the shared
    representation."""
    hp = FedRepParams()
    fm = tiny_mlp(D, 4, C)  # fc.0 (4x3 + 4) then classifier (3x4 + 3)
    split = rep_split(fm, hp.head_layers)
    assert (split.num_body, split.num_head) == (4 * D + 4, C * 4 + C)


def test_a_round_gets_the_runs_epochs() -> None:
    """Unset head_epochs: E - 1 head epochs and 1 on phi (the authors' local_ep -
    local_rep_ep); E = 1: half and half; head_epochs set: both counts as given (§5's 10 + 1)."""
    hp = FedRepParams()
    assert (hp.head_epochs, hp.body_epochs) == (None, 1)
    assert hp.phase_epochs(2) == (1, 1)
    assert hp.phase_epochs(5) == (4, 1)
    assert hp.phase_epochs(1) == (0.5, 0.5)
    assert FedRepParams(body_epochs=3).phase_epochs(4) == (2, 2)
    assert FedRepParams(head_epochs=10, body_epochs=1).phase_epochs(2) == (10, 1)
    with pytest.raises(ValueError, match="head_epochs: allowed: a whole number from 0"):
        validate_hparams(FedRepParams, {"head_epochs": -1})
    with pytest.raises(ValueError, match="both be 0"):
        FedRepParams(head_epochs=0, body_epochs=0)


@pytest.mark.parametrize(
    "epochs,hp,steps",
    [
        # n = (10, 7), B = 4. E = 3: head ceil(2n/4) = (5, 4), phi ceil(n/4) = (3, 2); the same
        # total as FedAvg's ceil(3n/4) = (8, 6)
        (3, {}, 14),
        # E = 1: ceil(n/8) + ceil(n/8) = (2 + 2, 1 + 1)
        (1, {}, 6),
        # explicitly §5's 10 + 1 at E = 3: (25 + 3, 18 + 2)
        (3, {"head_epochs": 10, "body_epochs": 1}, 48),
    ],
)
def test_step_count_per_round_is_the_declared_budget(epochs, hp, steps) -> None:
    """Count the training forwards of one round (one per SGD step in the client loop):
    sum over clients of ``ceil(e_head * n / B) + ceil(e_phi * n / B)``."""
    torch.manual_seed(0)
    fm = tiny_mlp(D, 4, C)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(17, D, generator=g, dtype=torch.float64)
    data = toy_federation(x, torch.arange(17) % C, [torch.arange(10), torch.arange(10, 17)], C)
    sgd = SGDConfig(lr=0.1, momentum=0.9, weight_decay=0.0, epochs=epochs, batch_size=4)
    group = ClientGroup(fm, [0, 1], data, rnd=1, seed=0, sgd=sgd, vectorize=False)
    client = _client(**hp)
    body = rep_split(fm, "classifier").body(fm.initial_params())
    calls = []
    hook = fm.module.register_forward_pre_hook(lambda m, a: calls.append(1))
    try:
        client.fit(group, {"body": body.expand(2, -1).clone()}, client.init_state(fm, 2))
    finally:
        hook.remove()
    assert len(calls) == steps


def test_head_epochs_do_not_back_propagate_through_the_representation() -> None:
    """Step 1 trains h_i with phi^t frozen: the backward pass stops at the head (a spy layer
    after phi counts the backward calls through it); step 2 goes through phi."""

    class Spy(torch.autograd.Function):
        calls = 0

        @staticmethod
        def forward(ctx, r: Tensor) -> Tensor:
            return r.clone()

        @staticmethod
        def backward(ctx, g: Tensor) -> Tensor:
            Spy.calls += 1
            return g

    class SpyLayer(nn.Module):
        def forward(self, r: Tensor) -> Tensor:
            return Spy.apply(r)

    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(D, H), SpyLayer())
    fm = FunctionalModel(ZooNet(body, (D,), C).double(), "spy")
    data = _data()
    client = _client(head_epochs=3, body_epochs=0)
    msg = {"body": fm.initial_params()[:NB].expand(2, -1).clone()}
    client.fit(_group(fm, data), msg, client.init_state(fm, 2))
    assert Spy.calls == 0
    client = _client(head_epochs=0, body_epochs=2)
    client.fit(_group(fm, data), msg, client.init_state(fm, 2))
    assert Spy.calls == 2 * 2  # two full-batch steps per client


def test_only_the_representation_crosses_the_wire() -> None:
    fm = _model()
    server = _server(fm, {0: 4, 1: 4})
    msg = server.configure_train(1, [0])[0]
    assert set(msg) == {"body"}
    assert torch.equal(msg["body"], fm.initial_params()[:NB])
    client = _client(head_epochs=1, body_epochs=1)
    reply, state, _ = client.fit(
        _group(fm, _data()), stack_payloads([msg, msg]), client.init_state(fm, 2)
    )
    assert set(reply) == {"body"} and reply["body"].shape == (2, NB)
    assert state["head"].shape == (2, NH)
    assert server.check_reply(0, {"body": reply["body"][0], "head": state["head"][0]})


def test_head_steps_first_then_one_representation_step_with_the_new_head() -> None:
    """Alg. 1 with tau = 2 head steps and one phi step (full batch): phi's gradient is taken
    at the *updated* head and the *received* phi^t."""
    fm, data = _model(), _data()
    body, heads = _start(fm)
    client = _client(head_epochs=2, body_epochs=1)
    state = client.init_state(fm, 2)
    state["head"] = heads.clone()
    reply, new, _ = client.fit(_group(fm, data), {"body": body.expand(2, -1).clone()}, state)
    for c in range(2):
        x, y = _xy(data, c)
        h = heads[c]
        for _ in range(2):
            h = h - LR * _grads(body, h, x, y)[1]
        phi = body - LR * _grads(body, h, x, y)[0]
        assert torch.allclose(new["head"][c], h, atol=1e-10)
        assert torch.allclose(reply["body"][c], phi, atol=1e-10)
        # neither joint training nor the reverse order gives this
        gb, gh = _grads(body, heads[c], x, y)
        assert not torch.allclose(reply["body"][c], body - LR * gb, atol=1e-6)
        assert not torch.allclose(new["head"][c], heads[c] - LR * gh, atol=1e-6)


def test_head_phase_leaves_the_representation_untouched() -> None:
    """With no representation epoch the client sends back phi^t exactly (the body is frozen
    while the head trains), and the head took ``head_epochs`` steps."""
    fm, data = _model(), _data()
    body, heads = _start(fm)
    client = _client(head_epochs=3, body_epochs=0)
    state = client.init_state(fm, 2)
    state["head"] = heads.clone()
    reply, new, _ = client.fit(_group(fm, data), {"body": body.expand(2, -1).clone()}, state)
    assert torch.equal(reply["body"], body.expand(2, -1))
    for c in range(2):
        x, y = _xy(data, c)
        h = heads[c]
        for _ in range(3):
            h = h - LR * _grads(body, h, x, y)[1]
        assert torch.allclose(new["head"][c], h, atol=1e-10)


def test_representation_phase_leaves_the_head_untouched() -> None:
    fm, data = _model(), _data()
    body, heads = _start(fm)
    client = _client(head_epochs=0, body_epochs=2)
    state = client.init_state(fm, 2)
    state["head"] = heads.clone()
    reply, new, _ = client.fit(_group(fm, data), {"body": body.expand(2, -1).clone()}, state)
    assert torch.equal(new["head"], heads)
    for c in range(2):
        x, y = _xy(data, c)
        phi = body
        for _ in range(2):
            phi = phi - LR * _grads(phi, heads[c], x, y)[0]
        assert torch.allclose(reply["body"][c], phi, atol=1e-10)


def test_representation_is_averaged_with_sample_weights() -> None:
    fm = _model()
    server = _server(fm, {0: 1, 1: 3, 2: 4})
    base = torch.arange(NB, dtype=torch.float64)
    bodies = {0: base, 1: 1.0 - base, 2: 2 * base + 3}
    server.aggregate(1, {c: {"body": b} for c, b in bodies.items()})
    expected = (bodies[0] + 3 * bodies[1] + 4 * bodies[2]) / 8
    assert torch.allclose(server.body, expected, atol=1e-12)
    assert torch.equal(server.configure_train(2, [1])[1]["body"], server.body)


def test_evaluation_uses_the_latest_representation_and_the_clients_own_head() -> None:
    fm, data = _model(), _data()
    server = _server(fm, {0: 1, 1: 3})
    b0, b1 = torch.ones(NB, dtype=torch.float64), -torch.ones(NB, dtype=torch.float64)
    server.aggregate(1, {0: {"body": b0}, 1: {"body": b1}})
    msgs = server.configure_eval([0, 1])
    client = _client()
    state = client.init_state(fm, 2)
    state["head"] = torch.stack([torch.full((NH,), 0.5), torch.linspace(-1, 1, NH)]).double()
    theta, buffers = client.eval_model(_group(fm, data), stack_payloads([msgs[0], msgs[1]]), state)
    body = (b0 + 3 * b1) / 4
    w1, bb1 = body[: H * D].view(H, D), body[H * D :]
    for c in range(2):
        w2, bb2 = state["head"][c, : C * H].view(C, H), state["head"][c, C * H :]
        expected = (data.x @ w1.T + bb1) @ w2.T + bb2
        assert torch.allclose(fm.forward(theta[c], buffers[c], data.x), expected, atol=1e-12)


def test_a_head_that_selects_nothing_or_everything_is_a_config_error() -> None:
    fm = _model()
    with pytest.raises(ConfigError, match="head_layers"):
        rep_split(fm, "nothing_here")
    with pytest.raises(ConfigError, match="head_layers"):
        rep_split(fm, "features,classifier")
