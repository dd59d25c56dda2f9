"""DFedAvg (Sun et al., 2022, DFedAvgM; a baseline of seed 004): defining-property tests.

Round t of client i: K local SGD(-momentum) steps from its own model, ``y^{t,0} = x_i^t``,
``y^{t,k+1} = y^{t,k} - eta g(y^{t,k}) + beta (y^{t,k} - y^{t,k-1})`` (``y^{t,-1} = y^{t,0}``),
then the gossip ``x_i^{t+1} = sum_j W_ij y_j^{t,K}`` -- trained, *then* mixed; the whole model
crosses the wire and each client is evaluated with its own mixed model ``x_i^{t+1}``.

Checked on a hand-sized model (Linear(3, 2) + tanh body, Linear(2, 2) head) with full-batch
SGD, so one local epoch is one gradient step; the expected values are plain torch.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from toy import W_PATH, block_data, path_sim, tanh_net

from hyperfed.algorithms.base import ClientContext, ClientGroup
from hyperfed.algorithms.dfedavg import DFedAvgClient, DFedAvgParams
from hyperfed.engine.local import SGDConfig
from hyperfed.runtime.simulate import Simulation

K = 14  # features.0 (2x3 + 2) + classifier (2x2 + 2)


def loss(theta: Tensor, x: Tensor, y: Tensor) -> Tensor:
    """F_i(theta): mean cross-entropy of ``tanh(x W1^T + b1) Wc^T + bc`` (written by hand)."""
    feats = torch.tanh(x @ theta[:6].view(2, 3).T + theta[6:8])
    return F.cross_entropy(feats @ theta[8:12].view(2, 2).T + theta[12:14], y)


def heavy_ball(
    f: Callable[[Tensor], Tensor], p: Tensor, lr: float, steps: int, beta: float = 0.0
) -> Tensor:
    """DFedAvgM's local iteration ``y+ = y - lr g(y) + beta (y - y-)`` from ``y- = y``."""
    prev = p
    for _ in range(steps):
        q = p.detach().requires_grad_(True)
        (g,) = torch.autograd.grad(f(q), q)
        p, prev = (q - lr * g + beta * (q - prev)).detach(), p
    return p


def random_thetas(n: int, dtype: torch.dtype = torch.float64) -> Tensor:
    """Every client at its own model, so that each row weight of W shows in the mix."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, K, generator=g, dtype=torch.float64).to(dtype)


def tiny_sim(n: int = 3, dtype: torch.dtype = torch.float64, epochs: int = 2) -> Simulation:
    """A DFedAvg Simulation on the tiny model and data, graph = the path 0 - 1 - 2, full-batch
    momentum-free SGD with lr 0.1."""

    def store() -> dict[int, dict[str, Tensor]]:
        thetas = random_thetas(n, dtype)
        return {c: {"theta": thetas[c], "buffers": torch.zeros(0)} for c in range(n)}

    return path_sim("dfedavg", n, store, dtype, f"local.epochs={epochs}")


def test_fit_is_e_epochs_of_local_sgd_from_the_clients_own_model() -> None:
    """Local phase: y^{t,0} = x_i^t (the client's own model, no server model), K = E steps of
    heavy-ball SGD; the reply and the new state are y^{t,K}, the *trained* model."""
    fm, data = tanh_net(), block_data(2)
    client = DFedAvgClient(DFedAvgParams(), ClientContext(0, torch.device("cpu"), 2, (3,)))
    sgd = SGDConfig(lr=0.2, momentum=0.5, weight_decay=0.0, epochs=3, batch_size=4)
    start = random_thetas(2)
    reply, state, _ = client.fit(
        ClientGroup(fm, [0, 1], data, 1, 0, sgd, vectorize=False),
        {},
        {"theta": start, "buffers": torch.zeros(2, 0)},
    )
    assert set(reply) == {"theta"}  # the whole model crosses the wire
    for c in range(2):
        x, y = data.batch(data.train_idx[c])
        expected = heavy_ball(partial(loss, x=x, y=y), start[c], 0.2, 3, beta=0.5)
        assert torch.allclose(reply["theta"][c], expected, atol=1e-12)
        assert torch.allclose(state["theta"][c], expected, atol=1e-12)


def test_round_trains_then_mixes_the_whole_model_through_w() -> None:
    """x_i^{t+1} = sum_j W_ij SGD_E(x_j^t) on the hand-made path 0 - 1 - 2 (row weights
    2/3, 1/3 | 1/3, 1/3, 1/3 | 1/3, 2/3). Mixing first and training after
    (SGD_E(sum_j W_ij x_j^t)) gives another model, and so does skipping either part."""
    sim = tiny_sim()
    start = torch.stack([sim.store[c]["theta"] for c in range(3)])
    trained = []
    for c in range(3):
        x, y = sim.data.batch(sim.data.train_idx[c])
        trained.append(heavy_ball(partial(loss, x=x, y=y), start[c], 0.1, 2))
    expected = W_PATH @ torch.stack(trained)
    result = sim.run_round(1)
    assert torch.allclose(sim.gossip.mixing(1, [0, 1, 2]), W_PATH, atol=1e-15)
    for c in range(3):
        assert torch.allclose(sim.store[c]["theta"], expected[c], atol=1e-12)
        x, y = sim.data.batch(sim.data.train_idx[c])
        mixed_first = heavy_ball(partial(loss, x=x, y=y), (W_PATH @ start)[c], 0.1, 2)
        assert not torch.allclose(sim.store[c]["theta"], mixed_first, atol=1e-6)
        assert not torch.allclose(sim.store[c]["theta"], trained[c], atol=1e-6)
    assert result.bytes_up == 4 * K * 8  # whole model, once per neighbour (degrees 1, 2, 1)


def test_each_client_is_evaluated_with_its_own_mixed_model() -> None:
    """After round t client i's personalized model is x_i^{t+1} = sum_j W_ij SGD_E(x_j^t)
    (mixed -- not its local y_i^{t,K}, the initialization, nor a neighbour's): eval_model
    returns it and the reported test loss is its mean cross-entropy on the client's own test
    split, averaged over clients. Expected values recomputed by hand in float64."""
    sim = tiny_sim(dtype=torch.float32)
    start = torch.stack([sim.store[c]["theta"] for c in range(3)]).double()
    trained = []
    for c in range(3):
        x, y = sim.data.batch(sim.data.train_idx[c])
        trained.append(heavy_ball(partial(loss, x=x.double(), y=y), start[c], 0.1, 2))
    mixed = W_PATH @ torch.stack(trained)
    sim.run_round(1)
    theta, _ = sim.client.eval_model(sim.group("mlp", [0, 1, 2], -1), {}, sim.states([0, 1, 2]))
    assert torch.allclose(theta.double(), mixed, atol=1e-5)
    per_client = []
    for c in range(3):
        x, y = sim.data.batch(sim.data.test_idx[c])
        per_client.append(float(loss(mixed[c], x.double(), y)))
    assert sim.evaluate()["test_loss"] == pytest.approx(sum(per_client) / 3, rel=1e-5)


def test_simulation_evaluates_a_float64_model() -> None:
    """A float64 federation is evaluated like a float32 one (the metrics buffers once refused
    float64 loss sums)."""
    m64 = tiny_sim(dtype=torch.float64).evaluate()
    m32 = tiny_sim().evaluate()
    assert m64["mean_acc"] == m32["mean_acc"]
    assert m64["test_loss"] == pytest.approx(m32["test_loss"], rel=1e-4)
