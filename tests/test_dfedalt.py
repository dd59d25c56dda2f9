"""DFedAlt (Shi et al., 2023; a baseline of seed 004): defining-property tests.

Round t of client i (the DFedAlt algorithm, mirrored by seed 004's Alg. 1 lines 7-22):

1. personal step, ``K_v`` epochs:  ``v <- v - eta_v grad_v F_i(u_i^t, v)``  (u frozen);
2. shared step, ``K_u`` epochs:    ``u <- u - eta_u grad_u F_i(u, v_i^{t+1})``  (v frozen);
3. gossip of the shared part only: ``u_i^{t+1} = sum_j W_ij u_j^{t,K_u}``; v never leaves.

Everything is checked on a hand-sized float64 model (Linear(3, 2) + tanh body, Linear(2, 2)
head) with full-batch, momentum-free SGD, so one epoch is one gradient step and the expected
values are plain-torch gradient descent written here from the equations.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from toy import W_PATH, block_data, gd, path_sim, tanh_loss, tanh_net

from hyperfed.algorithms.base import ClientContext, ClientGroup
from hyperfed.algorithms.dfedalt import DFedAltClient, DFedAltParams
from hyperfed.engine.local import SGDConfig
from hyperfed.runtime.simulate import Simulation

N_BODY, N_HEAD = 8, 6  # features.0.weight (2x3) + bias (2) | classifier.weight (2x2) + bias (2)


# --- the paper's updates written in plain torch (model, data, loss and gd: tests/toy.py) ------


def dfedalt_local(
    u: Tensor, v: Tensor, x: Tensor, y: Tensor, hp: DFedAltParams, lr: float
) -> tuple[Tensor, Tensor]:
    """Steps 1-2 of a DFedAlt round: K_v GD steps on v (u fixed), then K_u on u (v fixed)."""
    v = gd(lambda v_: tanh_loss(u, v_, x, y), v, hp.lr_v or lr, hp.epochs_v)
    u = gd(lambda u_: tanh_loss(u_, v, x, y), u, hp.lr_u or lr, hp.epochs_u)
    return u, v


def full_batch(n: int, lr: float = 0.1) -> SGDConfig:
    """Batch = the whole client set, no momentum / weight decay: one epoch == one GD step."""
    return SGDConfig(lr=lr, momentum=0.0, weight_decay=0.0, epochs=1, batch_size=n)


def random_state(n_clients: int, dtype: torch.dtype = torch.float64) -> dict[str, Tensor]:
    """Every client at its own (u, v), so that mixing and freezing are visible."""
    g = torch.Generator().manual_seed(1)
    return {
        "buffers": torch.zeros(n_clients, 0),
        "shared": torch.randn(n_clients, N_BODY, generator=g, dtype=torch.float64).to(dtype),
        "head": torch.randn(n_clients, N_HEAD, generator=g, dtype=torch.float64).to(dtype),
    }


def tiny_sim(n: int = 3, dtype: torch.dtype = torch.float64) -> Simulation:
    """A DFedAlt Simulation on the tiny model and data, graph = the path 0 - 1 - 2. (float32
    where ``Simulation.evaluate`` runs: it does not take float64 models, see test_dfedavg.py.)"""

    def store() -> dict[int, dict[str, Tensor]]:
        state = random_state(n, dtype)
        return {c: {k: v[c] for k, v in state.items()} for c in range(n)}

    return path_sim("dfedalt", n, store, dtype, "local.epochs=1")


# --- step 1 and 2: alternating, frozen parts ------------------------------------------------


def test_fit_is_personal_then_shared_with_the_other_part_frozen() -> None:
    """DFedAlt steps 1-2: K_v = 2 steps on v at u^t (u frozen), then K_u = 3 steps on u at
    v^{t+1} (v frozen), each with its own rate. Fails if the head is left trainable in the
    shared phase (it would move u's later gradients), if the body is left trainable in the
    personal phase, if the order is swapped, or if epochs / rates are mixed up."""
    fm, data = tanh_net(), block_data(2)
    hp = DFedAltParams(epochs_v=2, epochs_u=3, lr_v=0.7, lr_u=0.3)
    client = DFedAltClient(hp, ClientContext(0, torch.device("cpu"), 2, (3,)))
    group = ClientGroup(fm, [0, 1], data, 1, 0, full_batch(4), vectorize=False)
    state = random_state(2)
    reply, new, _ = client.fit(group, {}, state)
    assert set(reply) == {"shared"}  # step 3 sends u only
    for c in range(2):
        x, y = data.batch(data.train_idx[c])
        u, v = dfedalt_local(state["shared"][c], state["head"][c], x, y, hp, 0.1)
        assert torch.allclose(new["head"][c], v, atol=1e-12)
        assert torch.allclose(new["shared"][c], u, atol=1e-12)
        assert torch.allclose(reply["shared"][c], u, atol=1e-12)
        # the two parts really moved: the comparison above is not vacuous
        assert not torch.allclose(v, state["head"][c]) and not torch.allclose(u, state["shared"][c])
    # the order matters on this example: shared-then-personal gives another result
    x, y = data.batch(data.train_idx[0])
    u_sw = gd(lambda u_: tanh_loss(u_, state["head"][0], x, y), state["shared"][0], 0.3, 3)
    assert not torch.allclose(new["shared"][0], u_sw, atol=1e-6)


def test_unset_phase_rates_fall_back_to_the_local_lr_and_zero_epochs_skip_a_phase() -> None:
    """lr_v = lr_u = None: both phases use the [local] rate (eta_v = eta_u = lr); K_u = 0
    leaves u as it was (only v trains), K_v = 0 leaves v (only u trains)."""
    fm, data = tanh_net(), block_data(1)
    ctx = ClientContext(0, torch.device("cpu"), 2, (3,))
    group = ClientGroup(fm, [0], data, 1, 0, full_batch(4, lr=0.4), vectorize=False)
    state = random_state(1)
    x, y = data.batch(data.train_idx[0])
    u0, v0 = state["shared"][0], state["head"][0]
    hp = DFedAltParams(epochs_v=1, epochs_u=2)
    _, new, _ = DFedAltClient(hp, ctx).fit(group, {}, state)
    u, v = dfedalt_local(u0, v0, x, y, hp, 0.4)
    assert torch.allclose(new["shared"][0], u, atol=1e-12)
    assert torch.allclose(new["head"][0], v, atol=1e-12)
    _, only_v, _ = DFedAltClient(DFedAltParams(epochs_v=2, epochs_u=0), ctx).fit(group, {}, state)
    assert torch.equal(only_v["shared"][0], u0)
    assert torch.allclose(only_v["head"][0], gd(lambda q: tanh_loss(u0, q, x, y), v0, 0.4, 2))
    _, only_u, _ = DFedAltClient(DFedAltParams(epochs_v=0, epochs_u=2), ctx).fit(group, {}, state)
    assert torch.equal(only_u["head"][0], v0)
    assert torch.allclose(only_u["shared"][0], gd(lambda q: tanh_loss(q, v0, x, y), u0, 0.4, 2))


def test_an_epoch_is_a_pass_over_the_local_data() -> None:
    """K_v, K_u count local *epochs* (seed 004 §5.1: 4 local epochs): with batch n/2 one epoch
    is 2 steps. Every sample of the client is the same here, so every mini-batch gradient is
    the full gradient and K epochs are exactly 2K gradient steps whatever the shuffle."""
    fm = tanh_net()
    data = block_data(1)
    data.x[data.train_idx[0]] = data.x[data.train_idx[0][0]].clone()
    data.y[data.train_idx[0]] = 1
    hp = DFedAltParams(epochs_v=1, epochs_u=2, lr_v=0.5, lr_u=0.2)
    client = DFedAltClient(hp, ClientContext(0, torch.device("cpu"), 2, (3,)))
    sgd = SGDConfig(lr=0.1, momentum=0.0, weight_decay=0.0, epochs=1, batch_size=2)
    state = random_state(1)
    _, new, _ = client.fit(ClientGroup(fm, [0], data, 1, 0, sgd, vectorize=False), {}, state)
    x, y = data.batch(data.train_idx[0])
    v = gd(lambda q: tanh_loss(state["shared"][0], q, x, y), state["head"][0], 0.5, 2)
    u = gd(lambda q: tanh_loss(q, v, x, y), state["shared"][0], 0.2, 4)
    assert torch.allclose(new["head"][0], v, atol=1e-12)
    assert torch.allclose(new["shared"][0], u, atol=1e-12)


def test_defaults_split_the_papers_four_local_epochs() -> None:
    """Seed 004 §5.1: 4 local epochs per round (split 1 personal + 3 shared here)."""
    hp = DFedAltParams()
    assert (hp.epochs_v, hp.epochs_u) == (1, 3)


# --- step 3: gossip of u only, evaluation with (mixed u, own v) -----------------------------


def test_round_mixes_only_the_shared_part_through_w() -> None:
    """Step 3 on a hand-made path 0 - 1 - 2: u_i <- sum_j W_ij u_j with W's row weights and
    self-weights (2/3, 1/3 | 1/3, 1/3, 1/3 | 1/3, 2/3); v_i is the locally trained head, never
    mixed. Every client starts from its own (u, v) so a missing row weight shows."""
    sim = tiny_sim()
    hp = sim.hp
    start = sim.states([0, 1, 2])
    trained_u, trained_v = [], []
    for c in range(3):
        x, y = sim.data.batch(sim.data.train_idx[c])
        u, v = dfedalt_local(start["shared"][c], start["head"][c], x, y, hp, 0.1)
        trained_u.append(u)
        trained_v.append(v)
    U, V = torch.stack(trained_u), torch.stack(trained_v)
    result = sim.run_round(1)
    assert torch.allclose(sim.gossip.mixing(1, [0, 1, 2]), W_PATH, atol=1e-15)
    mixed = W_PATH @ U
    for c in range(3):
        assert torch.allclose(sim.store[c]["shared"], mixed[c], atol=1e-12)
        assert torch.allclose(sim.store[c]["head"], V[c], atol=1e-12)  # personal: not mixed
    # not the plain average: clients 0 and 2 are not neighbours (W_02 = 0)
    assert not torch.allclose(sim.store[0]["shared"], U.mean(0), atol=1e-6)
    # bytes: each client sends u (8 float64) once per neighbour: degrees 1 + 2 + 1
    assert result.bytes_up == 4 * N_BODY * 8
    assert result.extra["bytes_payload"] == N_BODY * 8


def test_evaluated_model_is_mixed_body_with_own_head() -> None:
    """After a round client i is evaluated with (u_i^{t+1}, v_i^{t+1}) = (sum_j W_ij u_j,
    its own trained head); the simulator's test loss is that model's mean cross-entropy on
    each client's own test split. Expected values recomputed by hand in float64."""
    sim = tiny_sim(dtype=torch.float32)
    start = {k: v.double() for k, v in sim.states([0, 1, 2]).items()}
    trained = []
    for c in range(3):
        x, y = sim.data.batch(sim.data.train_idx[c])
        uv = dfedalt_local(start["shared"][c], start["head"][c], x.double(), y, sim.hp, 0.1)
        trained.append(uv)
    U, V = (torch.stack(t) for t in zip(*trained))
    U = W_PATH @ U
    sim.run_round(1)
    theta, _ = sim.client.eval_model(sim.group("mlp", [0, 1, 2], -1), {}, sim.states([0, 1, 2]))
    assert torch.allclose(theta.double(), torch.cat([U, V], 1), atol=1e-5)
    expected = []
    for c in range(3):
        x, y = sim.data.batch(sim.data.test_idx[c])
        expected.append(float(tanh_loss(U[c], V[c], x.double(), y)))
    assert sim.evaluate()["test_loss"] == pytest.approx(sum(expected) / 3, rel=1e-5)
