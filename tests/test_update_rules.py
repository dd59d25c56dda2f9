"""Update rules of the engine's local loop (issue 38 item 2): Adam by its equations, each
client's own optimizer state carried through ``train_clients`` and across calls, SGD's."""

from __future__ import annotations

import math

import pytest
import torch

from hyperfed.data.federated import FederatedData
from hyperfed.engine.local import SGDConfig, plan_batches, train_clients
from hyperfed.engine.optim import SGD, Adam
from hyperfed.models.layout import FunctionalModel

D_IN, N_CLS = 3, 3


def _adam_by_hand(p, g, m, v, t, lr, b1, b2, eps, wd):
    """Kingma & Ba Alg. 1 for one entry (torch's L2 weight decay added to g first)."""
    g = g + wd * p
    t += 1
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
    return p - lr * m_hat / (math.sqrt(v_hat) + eps), m, v, t


def test_adam_step_is_the_adam_equations_with_each_clients_own_bias_correction():
    """One step on two clients: client 0 fresh (t = 0), client 1 with moments from two earlier
    steps (t = 2). Non-default betas/eps and weight decay, so each appears in the value; the
    bias correction is large at t = 1 (m / sqrt(v) would be 0.2 / sqrt(0.1) = 0.63 of it)."""
    lr, b1, b2, eps, wd = 0.1, 0.8, 0.9, 1e-3, 0.05
    rule = Adam(lr, (b1, b2), eps, wd)
    theta = torch.tensor([[0.5, -1.0, 2.0], [1.5, 0.25, -0.5]], dtype=torch.float64)
    grads = torch.tensor([[0.3, -0.2, 0.05], [-0.4, 0.1, 0.6]], dtype=torch.float64)
    state = rule.init_state(theta)
    state["m"][1] = torch.tensor([0.1, -0.3, 0.2], dtype=torch.float64)
    state["v"][1] = torch.tensor([0.02, 0.05, 0.01], dtype=torch.float64)
    state["t"][1] = 2
    got, new = rule.step(theta, grads, state, None)
    for c in range(2):
        for k in range(3):
            p, m, v, t = _adam_by_hand(
                float(theta[c, k]), float(grads[c, k]), float(state["m"][c, k]),
                float(state["v"][c, k]), float(state["t"][c]), lr, b1, b2, eps, wd,
            )  # fmt: skip
            assert float(got[c, k]) == pytest.approx(p, rel=1e-6, abs=1e-12)
            assert float(new["m"][c, k]) == pytest.approx(m, rel=1e-12)
            assert float(new["v"][c, k]) == pytest.approx(v, rel=1e-12)
        assert float(new["t"][c]) == (1, 3)[c]
    # the inputs were not written to
    assert float(state["t"][1]) == 2 and float(state["m"][0].abs().sum()) == 0
    # in place (what the loop does when every client is active): the same step
    th, st = theta.clone(), {k: v.clone() for k, v in state.items()}
    rule.step_(th, grads.clone(), st, None)
    assert torch.equal(th, got) and all(torch.equal(st[k], new[k]) for k in new)
    # a masked entry does not move
    mask = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)
    masked, _ = rule.step(theta, grads, state, mask)
    assert torch.equal(masked[:, 1], theta[:, 1]) and torch.equal(masked[:, 0], got[:, 0])
    th, st = theta.clone(), {k: v.clone() for k, v in state.items()}
    rule.step_(th, grads.clone(), st, mask)
    assert torch.equal(th, masked)


def _lin_fm() -> FunctionalModel:
    torch.manual_seed(0)
    return FunctionalModel(torch.nn.Linear(D_IN, N_CLS).double(), "lin")


def _two_clients() -> FederatedData:
    """Client 0: 6 samples (3 steps of 2 a call); client 1: 2 samples (1 step)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, D_IN, generator=g, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 0, 1, 2, 1, 0])
    train = [torch.arange(0, 6), torch.arange(6, 8)]
    empty = [torch.zeros(0, dtype=torch.long)] * 2
    return FederatedData(x, y, train, empty, empty, N_CLS, (D_IN,), torch.zeros(0), torch.ones(0))


def _alone_by_hand(theta, data, plans, update):
    """Each client alone over every call's batches: the gradient of the linear model's
    cross-entropy (weight [out, in] then bias, nn.Linear's order), ``update(p, g, state)``
    with ONE state per client kept across the calls."""
    out = []
    for c in range(theta.shape[0]):
        p, state = theta[c].clone(), {}
        for plan in plans:
            for s in range(plan.counts[c]):
                x, y = data.batch(plan.idx[s, c])
                leaf = p.clone().requires_grad_(True)
                w, b = leaf[: D_IN * N_CLS].view(N_CLS, D_IN), leaf[D_IN * N_CLS :]
                loss = torch.nn.functional.cross_entropy(x @ w.T + b, y)
                (g,) = torch.autograd.grad(loss, leaf)
                p = update(p, g, state)
        out.append(p)
    return torch.stack(out)


def _adam(lr, b1, b2, eps=1e-8):
    def update(p, g, st):
        st["t"] = st.get("t", 0) + 1
        st["m"] = b1 * st.get("m", 0) + (1 - b1) * g
        st["v"] = b2 * st.get("v", 0) + (1 - b2) * g * g
        m_hat, v_hat = st["m"] / (1 - b1 ** st["t"]), st["v"] / (1 - b2 ** st["t"])
        return p - lr * m_hat / (v_hat.sqrt() + eps)

    return update


def _sgd(lr, mu, wd):
    def update(p, g, st):
        st["buf"] = mu * st.get("buf", 0) + (g + wd * p)
        return p - lr * st["buf"]

    return update


@pytest.mark.parametrize("vectorize", [True, False])
def test_train_clients_carries_each_clients_adam_state_across_calls(vectorize):
    """Two calls of ``train_clients`` with the Adam rule and its state carried in
    ``rule_state`` equal, per client, one Adam (by hand) run over both calls' batches.
    The clients take 3 and 1 steps a call, so their step counts differ (6 and 2 after both
    calls): a step count or moments shared between clients, or moved on a finished client's
    padding steps, gives another bias correction and another model."""
    fm, data = _lin_fm(), _two_clients()
    theta0 = fm.initial_params().expand(2, -1).clone()
    theta0[1] += 0.3
    buffers = torch.zeros(2, 0, dtype=torch.float64)
    sgd = SGDConfig(lr=123.0, momentum=0.5, epochs=1, batch_size=2)  # ignored: the rule steps
    rule = Adam(0.05, (0.8, 0.95))
    state = rule.init_state(theta0)
    theta, plans = theta0, []
    for call in range(2):
        plan = plan_batches(data.train_idx, 1, 2, [10 + call, 20 + call])
        theta, buffers, _ = train_clients(
            fm, theta, buffers, data, plan, sgd, vectorize=vectorize, rule=rule, rule_state=state
        )
        plans.append(plan)
    assert plans[0].counts == (3, 1)
    assert state["t"].tolist() == [6.0, 2.0]
    want = _alone_by_hand(theta0, data, plans, _adam(0.05, 0.8, 0.95))
    assert torch.allclose(theta, want, rtol=1e-9, atol=1e-12)
    assert not torch.allclose(theta, theta0, atol=1e-3)


@pytest.mark.parametrize("vectorize", [True, False])
def test_sgd_rule_state_carries_momentum_across_calls(vectorize):
    """The default rule is ``sgd.rule()`` (torch.optim.SGD's step, by hand here); with
    ``rule_state`` its momentum goes on from call to call like one optimizer's (the client
    loop's per-parameter fused kernel included: cross-entropy takes it when ``vectorize`` is
    off). Without it, each call starts from a zero buffer (a fresh optimizer per call)."""
    fm, data = _lin_fm(), _two_clients()
    theta0 = fm.initial_params().expand(2, -1).clone()
    buffers = torch.zeros(2, 0, dtype=torch.float64)
    sgd = SGDConfig(lr=0.1, momentum=0.9, weight_decay=0.01, epochs=1, batch_size=2)
    assert sgd.rule() == SGD(0.1, 0.9, 0.01)
    plans = [plan_batches(data.train_idx, 1, 2, [5 + i, 6 + i]) for i in range(2)]

    def run(carry: bool) -> torch.Tensor:
        state = sgd.rule().init_state(theta0) if carry else None
        theta, bu = theta0, buffers
        for plan in plans:
            theta, bu, _ = train_clients(
                fm, theta, bu, data, plan, sgd, vectorize=vectorize, rule_state=state
            )
        return theta

    carried = run(True)
    want = _alone_by_hand(theta0, data, plans, _sgd(0.1, 0.9, 0.01))
    assert torch.allclose(carried, want, rtol=1e-9, atol=1e-12)
    fresh = _alone_by_hand(theta0, data, plans[:1], _sgd(0.1, 0.9, 0.01))
    fresh = _alone_by_hand(fresh, data, plans[1:], _sgd(0.1, 0.9, 0.01))
    assert torch.allclose(run(False), fresh, rtol=1e-9, atol=1e-12)
    assert not torch.allclose(carried, fresh, atol=1e-4)
