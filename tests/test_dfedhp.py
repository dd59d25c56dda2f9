"""DFedHP, the filter hypernetwork and the decentralized round (DFedAvg, DFedAlt) + FedPer, Ditto."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor
from torch.func import vmap
from toy import W_PATH, block_data, gd, path_sim, tanh_loss, tanh_net

from hyperfed.algorithms.base import (
    ClientContext,
    ClientGroup,
    GossipServer,
    ServerContext,
    payload_bytes,
    stack_payloads,
)
from hyperfed.algorithms.dfedhp import DFedHPClient, DFedHPParams
from hyperfed.config import load_config
from hyperfed.engine.local import SGDConfig
from hyperfed.engine.topology import GossipParams
from hyperfed.hypernet.filter import FilterHypernet
from hyperfed.models.layout import FunctionalModel
from hyperfed.models.split import body_head
from hyperfed.runtime.driver import BEFORE_GOSSIP_KEYS, EvalCounts, Exchange, RoundDriver
from hyperfed.runtime.gossip import Gossip
from hyperfed.runtime.simulate import Simulation

BASE = [
    "device=cpu",
    "dataset.name=digits",
    "dataset.subsample=240",
    "partition.name=iid",
    "clients.models=lenet",
    "clients.count=4",
    "local.epochs=1",
    "local.batch_size=64",  # ~45 training samples per client: one step per epoch
    "local.lr=0.05",
    "eval_every=1",
    "seed=2",
]
SMALL_HN = [  # a hypernetwork sized for lenet's 4,800-entry body
    "algorithm.embed_dim=8",
    "algorithm.hidden=4",
    "algorithm.rows=8",
    "algorithm.cols=64",
]


@pytest.fixture(autouse=True)
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _sim(alg: str, *overrides: str) -> Simulation:
    extra = SMALL_HN if alg == "dfedhp" else []
    return Simulation(load_config(None, [*BASE, f"algorithm.name={alg}", *extra, *overrides]))


ALL = [0, 1, 2, 3]


def test_filter_hypernet_shapes_batching_and_init() -> None:
    hn = FilterHypernet(1000, embed_dim=6, hidden=5, rows=4, cols=32)
    assert hn.num_blocks == math.ceil(1000 / 128)
    assert hn.num_phi == 6 * 20 + 20 + 5 * 32 + 32 and hn.num_z == hn.num_blocks * 6
    phi, z = hn.init(torch.Generator().manual_seed(0))
    assert torch.equal(hn.generate(phi, z), torch.zeros(1000))  # W2 = b2 = 0 at the start
    phis = torch.randn(3, hn.num_phi)
    zs = torch.randn(3, hn.num_z)
    batched = hn.generate(phis, zs)
    assert batched.shape == (3, 1000)
    assert torch.allclose(batched, vmap(hn.generate)(phis, zs), atol=1e-6)
    assert torch.allclose(batched[1], hn.generate(phis[1], zs[1]), atol=1e-6)


def test_only_phi_and_z_leave_a_dfedhp_client() -> None:
    sim = _sim("dfedhp")
    assert sim.joins == {c: {} for c in ALL}  # no server, nothing sent before training
    _, hn, _ = sim.client.parts(sim.models["lenet"])
    reply, state, _ = sim.client.fit(sim.group("lenet", ALL, 1), {}, sim.states(ALL))
    assert set(reply) == {"phi", "z"}
    assert reply["phi"].shape == (4, hn.num_phi) and reply["z"].shape == (4, hn.num_z)
    assert set(state) == {"phi", "z", "head", "buffers"}
    start = sim.states(ALL)
    for key in ("phi", "z", "head"):  # each of Alg. 1's three steps moved its part
        assert not torch.equal(state[key], start[key])
    record = sim.run()[0]
    assert record["bytes_payload"] == (hn.num_phi + hn.num_z) * 4
    assert hn.num_phi + hn.num_z < sim.models["lenet"].num_params


def test_dfedhp_full_graph_gossip_is_exact_averaging() -> None:
    sim = _sim("dfedhp", 'algorithm.topology="full"')
    reply, _, _ = sim.client.fit(sim.group("lenet", ALL, 1), {}, sim.states(ALL))
    result = sim.run_round(1)
    for key in ("phi", "z"):
        mean = reply[key].mean(0)
        for c in ALL:
            assert torch.allclose(sim.store[c][key], mean, atol=1e-6)
    payload = payload_bytes({k: v[0] for k, v in reply.items()})
    assert result.bytes_up == result.bytes_down == 4 * 3 * payload  # 3 neighbours each
    assert result.extra["active_neighbors"] == 3
    assert result.extra["spectral_gap_round"] == pytest.approx(1.0)


def test_dfedavg_full_graph_equals_fedavg_unweighted_average() -> None:
    dec, cen = _sim("dfedavg", 'algorithm.topology="full"'), _sim("fedavg")
    msgs = cen.server.configure_train(1, ALL)
    assert torch.equal(dec.store[0]["theta"], msgs[0]["theta"])  # same initialization
    group = cen.group("lenet", ALL, 1)
    reply, _, _ = cen.client.fit(group, stack_payloads([msgs[c] for c in ALL]), cen.states(ALL))
    dec.run_round(1)
    for c in ALL:
        assert torch.allclose(dec.store[c]["theta"], reply["theta"].mean(0), atol=1e-6)


def test_ring_gossip_partial_participation_and_bytes() -> None:
    sim = _sim("dfedavg", 'algorithm.topology="ring"', "clients.count=6")
    before = {c: sim.store[c]["theta"].clone() for c in range(6)}
    result = sim.run_round(1)
    assert result.clients == list(range(6))
    k = sim.models["lenet"].num_params
    assert result.bytes_up == 6 * 2 * k * 4  # each client sends its model to 2 neighbours
    assert result.extra["bytes_payload"] == k * 4
    # partial participation: only the active clients train and mix, among themselves
    sim = _sim("dfedavg", 'algorithm.topology="ring"', "clients.count=6", "participation=0.5")
    result = sim.run_round(1)
    for c in set(range(6)) - set(result.clients):
        assert torch.equal(sim.store[c]["theta"], before[c])
    assert len(result.clients) == 3


def test_dfedhp_vectorized_equals_client_loop() -> None:
    on, off = _sim("dfedhp", "local.vectorize=on"), _sim("dfedhp", "local.vectorize=off")
    on.run_round(1)
    off.run_round(1)
    for c in ALL:
        for key in ("phi", "z", "head"):
            assert torch.allclose(on.store[c][key], off.store[c][key], atol=1e-5)


def test_dfedhp_resumes_from_a_checkpoint() -> None:
    full = _sim("dfedhp", "rounds=2")
    full.run()
    first = _sim("dfedhp", "rounds=2")
    first.run_round(1)
    state = first.state_dict(1)
    resumed = _sim("dfedhp", "rounds=2")
    assert resumed.load_state_dict(state) == 1
    resumed.run_round(2)
    for c in ALL:
        assert torch.allclose(resumed.store[c]["phi"], full.store[c]["phi"], atol=1e-6)


@pytest.mark.parametrize("alg", ["dfedavg", "dfedalt", "dfedhp", "fedper", "ditto"])
def test_two_rounds_complete(alg: str) -> None:
    records = _sim(alg, "rounds=2").run()
    assert [r["round"] for r in records] == [1, 2]
    assert all(math.isfinite(r["train_loss"]) for r in records)
    assert records[-1]["bytes_up_per_client"] > 0


def test_personal_parts_stay_home() -> None:
    """FedPer uploads only the body, DFedAlt gossips only the body, Ditto only w."""
    for alg, keys in [("fedper", {"body"}), ("dfedalt", {"shared"}), ("ditto", {"theta"})]:
        sim = _sim(alg)
        msgs = sim.server.configure_train(1, ALL)
        reply, _, _ = sim.client.fit(
            sim.group("lenet", ALL, 1), stack_payloads([msgs[c] for c in ALL]), sim.states(ALL)
        )
        assert set(reply) == keys
    fm = _sim("fedper").models["lenet"]
    head = fm.layout.mask(fm.module.head_prefixes)
    assert reply["theta"].shape[1] == fm.num_params and int((~head).sum()) == 4800


def test_bad_hyperparameters_are_config_errors() -> None:
    from hyperfed.config import ConfigError

    with pytest.raises(ConfigError, match="topology"):
        load_config(None, [*BASE, "algorithm.name=dfedhp", 'algorithm.topology="star"'])
    with pytest.raises(ConfigError, match="unknown key"):
        load_config(None, [*BASE, "algorithm.name=dfedavg", "algorithm.embed_dim=3"])


# ============================================================================================
# Defining properties of DFedHP (seed 004, Eq. 2 and Algorithm 1) on a hand-sized model.
#
# theta_i = (h(phi_i, z_i), v_i) (Eq. 2; here with the fixed offset theta0_body, filter.py);
# round t of client i (Alg. 1): K_v epochs on v at h(phi^t, z^t) (lines 7-10), then K_phi
# epochs on phi at v^{t+1} (lines 12-14), then K_z epochs on z at (phi^{t,K_phi}, v^{t+1})
# (lines 16-18), then phi_i, z_i <- sum_l W_il (phi_l, z_l) (lines 20-22); v never leaves.
# Model: Linear(3, 2) + tanh body (8 generated entries), Linear(2, 2) head (6 personal
# entries), float64, full-batch momentum-free SGD (one epoch = one gradient step); the
# expected values are plain-torch gradient descent written here from those lines.
# ============================================================================================

N_BODY, N_HEAD = 8, 6
TINY_HN = dict(embed_dim=2, hidden=2, rows=2, cols=3)  # blocks of 2x3: B = 2, 12 -> [:8]
HN_TINY = FilterHypernet(N_BODY, **TINY_HN)


def hand_h(phi: Tensor, z: Tensor, embed_dim: int, hidden: int, rows: int, cols: int) -> Tensor:
    """The filter hypernetwork written out block by block (filter.py's formula): for block b,
    ``a_b = ReLU(z_b W1 + b1)`` as rows x hidden, ``blk_b = a_b W2 / sqrt(B R H) +
    b2 / sqrt(B R)``; ``h = concat(blk_0, ...)[:N_BODY]``."""
    E, H, R, S = embed_dim, hidden, rows, cols
    B = math.ceil(N_BODY / (R * S))
    sizes = [E * R * H, R * H, H * S, S]
    w1, b1, w2, b2 = torch.split(phi, sizes)
    blocks = []
    for b in range(B):
        a = torch.relu(z[b * E : (b + 1) * E] @ w1.view(E, R * H) + b1).view(R, H)
        blk = a @ w2.view(H, S) / math.sqrt(B * R * H) + b2 / math.sqrt(B * R)
        blocks.append(blk.reshape(-1))
    return torch.cat(blocks)[:N_BODY]


def alg1_local(
    phi: Tensor,
    z: Tensor,
    v: Tensor,
    x: Tensor,
    y: Tensor,
    hp: DFedHPParams,
    base: Tensor,
    lr: float,
    steps_per_epoch: int = 1,
) -> tuple[Tensor, Tensor, Tensor]:
    """Alg. 1 lines 7-18 for one client: v at h(phi^t, z^t); phi at v^{t+1}; z at
    (phi^{t,K_phi}, v^{t+1})."""

    def body(p: Tensor, zz: Tensor) -> Tensor:
        return base + hand_h(p, zz, **TINY_HN)

    fixed = body(phi, z).detach()
    v = gd(lambda q: tanh_loss(fixed, q, x, y), v, hp.lr_v or lr, hp.epochs_v * steps_per_epoch)
    phi = gd(
        lambda q: tanh_loss(body(q, z), v, x, y),
        phi,
        hp.lr_phi or lr,
        hp.epochs_phi * steps_per_epoch,
    )
    z = gd(
        lambda q: tanh_loss(body(phi, q), v, x, y), z, hp.lr_z or lr, hp.epochs_z * steps_per_epoch
    )
    return phi, z, v


def tiny_state(n: int, hp: DFedHPParams, dtype: torch.dtype = torch.float64) -> dict[str, Tensor]:
    """Every client at its own (phi, z, v), W2 and b2 non-zero so that every gradient is."""
    hn = FilterHypernet(N_BODY, **TINY_HN)
    g = torch.Generator().manual_seed(1)

    def rand(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    return {
        "buffers": torch.zeros(n, 0),
        "phi": rand(n, hn.num_phi),
        "z": rand(n, hn.num_z),
        "head": rand(n, N_HEAD),
    }


def tiny_client(hp: DFedHPParams) -> DFedHPClient:
    return DFedHPClient(hp, ClientContext(0, torch.device("cpu"), 2, (3,)))


def full_batch(n: int, lr: float = 0.1) -> SGDConfig:
    return SGDConfig(lr=lr, momentum=0.0, weight_decay=0.0, epochs=1, batch_size=n)


HP_ALG1 = DFedHPParams(
    generation="residual",
    **TINY_HN,
    epochs_v=2,
    epochs_phi=2,
    epochs_z=3,
    lr_v=0.5,
    lr_phi=0.3,
    lr_z=0.4,
)


def test_filter_hypernet_is_the_two_layer_block_generator() -> None:
    """§3.2 "Hypernetwork Structure": two linear layers with an activation, fed one learnable
    embedding per block; blocks concatenated and cut to the target size."""
    hn = FilterHypernet(N_BODY, **TINY_HN)
    assert hn.num_blocks == 2 and hn.num_z == 2 * 2
    state = tiny_state(3, HP_ALG1)
    for c in range(3):
        expected = hand_h(state["phi"][c], state["z"][c], **TINY_HN)
        assert torch.allclose(hn.generate(state["phi"][c], state["z"][c]), expected, atol=1e-14)
    # a block's embedding reaches only that block: z_1 does not touch entries 0..5
    phi = state["phi"][0].clone()
    phi[8:12] += 5.0  # b1: every ReLU active, so that z_1 shows in block 1
    z = state["z"][0].clone()
    z[2:] += 1.0
    moved = hn.generate(phi, z) != hn.generate(phi, state["z"][0])
    assert not bool(moved[:6].any()) and bool(moved[6:].all())


def test_shared_part_is_generated_and_personal_part_is_local() -> None:
    """Eq. 2: theta_i = (h(phi_i, z_i), v_i): the body (features.*, every entry outside the
    head) is theta0_body + h(phi_i, z_i); the head (classifier.*) is v_i itself. Changing phi
    or z moves only body entries; changing v only head entries."""
    fm = tanh_net()
    client = tiny_client(HP_ALG1)
    group = ClientGroup(fm, [0, 1], block_data(2), 1, 0, full_batch(4))
    state = tiny_state(2, HP_ALG1)
    theta, _ = client.eval_model(group, {}, state)
    base = fm.initial_params()[:N_BODY]
    for c in range(2):
        body = base + hand_h(state["phi"][c], state["z"][c], **TINY_HN)
        assert torch.allclose(theta[c, :N_BODY], body, atol=1e-14)
        assert torch.equal(theta[c, N_BODY:], state["head"][c])
    for key, size in (("phi", HN_TINY.num_phi), ("z", HN_TINY.num_z), ("head", N_HEAD)):
        bumped = {**state, key: state[key] + torch.linspace(0.1, 1.0, size)}
        moved = client.eval_model(group, {}, bumped)[0] != theta
        generated = key != "head"
        assert bool(moved[:, :N_BODY].any()) == generated
        assert bool(moved[:, N_BODY:].any()) != generated
    # round 1 starts from the model's initialization: W2 = b2 = 0 makes h(phi^0, z^0) = 0
    init = client.init_state(fm, 2)
    assert torch.equal(client.eval_model(group, {}, init)[0][0], fm.initial_params())


def test_generated_part_of_a_zoo_model_is_its_feature_extractor() -> None:
    """§3.2 "Partial Personalized Models": the hypernetwork generates the convolutional
    feature extractor; the fully connected layers near the output are personal."""
    sim = _sim("dfedhp")
    fm = sim.models["lenet"]
    _, hn, _ = sim.client.parts(fm)
    conv = sum(s.numel for s in fm.layout.segments if s.name.startswith("features."))
    assert hn.num_params == conv and conv < fm.num_params
    assert sim.store[0]["head"].numel() == fm.num_params - conv


def test_local_update_is_v_then_phi_then_z() -> None:
    """Alg. 1 lines 7-18, to the last bit: K_v = 2 epochs on v with h(phi^t, z^t) fixed,
    K_phi = 2 epochs on phi with v^{t+1}, then K_z = 3 epochs on z with the *updated* phi,
    each at its own rate. Fails if z is trained before phi, if phi and z are trained jointly,
    if the body is trainable in the v step, or if epochs / rates are swapped."""
    fm, data = tanh_net(), block_data(2)
    client = tiny_client(HP_ALG1)
    group = ClientGroup(fm, [0, 1], data, 1, 0, full_batch(4), vectorize=False)
    state = tiny_state(2, HP_ALG1)
    reply, new, _ = client.fit(group, {}, state)
    assert set(reply) == {"phi", "z"}
    base = fm.initial_params()[:N_BODY]
    for c in range(2):
        x, y = data.batch(data.train_idx[c])
        start = (state["phi"][c], state["z"][c], state["head"][c])
        phi, z, v = alg1_local(*start, x, y, HP_ALG1, base, 0.1)
        assert torch.allclose(new["head"][c], v, atol=1e-12)
        assert torch.allclose(new["phi"][c], phi, atol=1e-12)
        assert torch.allclose(new["z"][c], z, atol=1e-12)
        assert torch.equal(reply["phi"][c], new["phi"][c])
        assert torch.equal(reply["z"][c], new["z"][c])
        for got, was in zip((phi, z, v), start):
            assert not torch.allclose(got, was, atol=1e-6)  # every step moved its part

    # the order and the separation are visible on this example
    x, y = data.batch(data.train_idx[0])
    phi0, z0, v1 = state["phi"][0], state["z"][0], new["head"][0]

    def body(p: Tensor, zz: Tensor) -> Tensor:
        return base + hand_h(p, zz, **TINY_HN)

    z_first = gd(lambda q: tanh_loss(body(phi0, q), v1, x, y), z0, 0.4, 3)
    assert not torch.allclose(new["z"][0], z_first, atol=1e-6)
    n = phi0.numel()
    joint = gd(lambda q: tanh_loss(body(q[:n], q[n:]), v1, x, y), torch.cat([phi0, z0]), 0.3, 2)
    assert not torch.allclose(new["phi"][0], joint[:n], atol=1e-6)


def test_joint_phi_z_is_the_dfedalt_plus_hp_variant() -> None:
    """``joint_phi_z`` ("DFedAlt + HP", Table 1): after the same v step, (phi, z) take
    K_phi epochs together at eta_phi -- DFedAlt's single shared step on the pair."""
    hp = DFedHPParams(
        generation="residual",
        **TINY_HN,
        epochs_v=1,
        epochs_phi=2,
        lr_v=0.5,
        lr_phi=0.3,
        joint_phi_z=True,
    )
    fm, data = tanh_net(), block_data(1)
    state = tiny_state(1, hp)
    group = ClientGroup(fm, [0], data, 1, 0, full_batch(4), vectorize=False)
    _, new, _ = tiny_client(hp).fit(group, {}, state)
    x, y = data.batch(data.train_idx[0])
    base = fm.initial_params()[:N_BODY]
    phi0, z0 = state["phi"][0], state["z"][0]
    fixed = base + hand_h(phi0, z0, **TINY_HN)
    v = gd(lambda q: tanh_loss(fixed, q, x, y), state["head"][0], 0.5, 1)
    n = phi0.numel()

    def joint_loss(q: Tensor) -> Tensor:
        return tanh_loss(base + hand_h(q[:n], q[n:], **TINY_HN), v, x, y)

    pz = gd(joint_loss, torch.cat([phi0, z0]), 0.3, 2)
    assert torch.allclose(new["head"][0], v, atol=1e-12)
    assert torch.allclose(new["phi"][0], pz[:n], atol=1e-12)
    assert torch.allclose(new["z"][0], pz[n:], atol=1e-12)


def test_phase_epochs_are_passes_over_the_local_data() -> None:
    """K_v, K_phi, K_z count local *epochs* (Alg. 1 "for local epoch"; §5.1: 4 epochs a
    round): with batch n/2 an epoch is 2 steps. All samples of the client are equal here, so
    every mini-batch gradient is the full one and K epochs are 2K steps whatever the shuffle.
    Unset phase rates are the [local] lr."""
    hp = DFedHPParams(
        generation="residual", **TINY_HN, epochs_v=1, epochs_phi=2, epochs_z=1
    )  # lrs: [local] lr
    fm, data = tanh_net(), block_data(1)
    data.x[data.train_idx[0]] = data.x[data.train_idx[0][0]].clone()
    data.y[data.train_idx[0]] = 1
    state = tiny_state(1, hp)
    sgd = SGDConfig(lr=0.2, momentum=0.0, weight_decay=0.0, epochs=7, batch_size=2)
    _, new, _ = tiny_client(hp).fit(ClientGroup(fm, [0], data, 1, 0, sgd, False), {}, state)
    x, y = data.batch(data.train_idx[0])
    start = (state["phi"][0], state["z"][0], state["head"][0])
    base = fm.initial_params()[:N_BODY]
    phi, z, v = alg1_local(*start, x, y, hp, base, 0.2, steps_per_epoch=2)
    assert torch.allclose(new["head"][0], v, atol=1e-12)
    assert torch.allclose(new["phi"][0], phi, atol=1e-12)
    assert torch.allclose(new["z"][0], z, atol=1e-12)


def test_defaults_follow_section_5_1() -> None:
    """§5.1: embedding size 128, kernel multiple 64, 4 local epochs a round (1 + 2 + 1)."""
    hp = DFedHPParams(generation="residual")
    assert hp.embed_dim == 128 and hp.rows == 64 and hp.cols % 64 == 0
    assert hp.epochs_v + hp.epochs_phi + hp.epochs_z == 4
    assert not hp.joint_phi_z  # Algorithm 1: phi, then z


def _tiny_dfedhp_sim(dtype: torch.dtype = torch.float64) -> Simulation:
    """DFedHP on the tiny model and data, 3 clients on the path 0 - 1 - 2, Alg. 1 settings
    of ``HP_ALG1``, full-batch SGD without momentum."""
    hn = [f"algorithm.{k}={v}" for k, v in TINY_HN.items()]
    phases = [
        f"algorithm.{k}={getattr(HP_ALG1, k)}"
        for k in ("epochs_v", "epochs_phi", "epochs_z", "lr_v", "lr_phi", "lr_z")
    ]

    def store() -> dict[int, dict[str, Tensor]]:
        state = tiny_state(3, HP_ALG1, dtype)
        return {c: {k: v[c] for k, v in state.items()} for c in range(3)}

    # the hand formulas below add theta0_body
    sets = ["algorithm.generation=residual", *hn, *phases]
    return path_sim("dfedhp", 3, store, dtype, *sets)


def test_gossip_mixes_phi_and_z_through_w_never_v() -> None:
    """Alg. 1 lines 20-22 on a hand-made path 0 - 1 - 2: phi_i <- sum_l W_il phi_l and
    z_i <- sum_l W_il z_l with W's row weights and self-weights (2/3, 1/3 | 1/3, 1/3, 1/3 |
    1/3, 2/3), after the local steps; v_i stays the client's own trained head."""
    sim = _tiny_dfedhp_sim()
    start = sim.states([0, 1, 2])
    base = sim.models["mlp"].initial_params()[:N_BODY]
    trained = []
    for c in range(3):
        x, y = sim.data.batch(sim.data.train_idx[c])
        s = (start["phi"][c], start["z"][c], start["head"][c])
        trained.append(alg1_local(*s, x, y, HP_ALG1, base, 0.1))
    phi, z, v = (torch.stack(t) for t in zip(*trained))
    result = sim.run_round(1)
    assert torch.allclose(sim.gossip.mixing(1, [0, 1, 2]), W_PATH, atol=1e-15)
    for c in range(3):
        assert torch.allclose(sim.store[c]["phi"], (W_PATH @ phi)[c], atol=1e-12)
        assert torch.allclose(sim.store[c]["z"], (W_PATH @ z)[c], atol=1e-12)
        assert torch.allclose(sim.store[c]["head"], v[c], atol=1e-12)  # never mixed
    assert not torch.allclose(sim.store[0]["phi"], phi.mean(0), atol=1e-6)  # 0 !~ 2
    hn = FilterHypernet(N_BODY, **TINY_HN)
    assert result.extra["bytes_payload"] == (hn.num_phi + hn.num_z) * 8
    assert result.bytes_up == 4 * (hn.num_phi + hn.num_z) * 8  # degrees 1 + 2 + 1


def test_evaluated_model_is_generated_from_the_mixed_hypernetwork() -> None:
    """Alg. 1 output: after round t client i is evaluated with (h(phi_i^{t+1}, z_i^{t+1}),
    v_i^{t+1}) -- generated from the gossiped hypernetwork and embeddings, with its own head;
    the simulator's test loss is that model's cross-entropy on each client's own test split.
    Expected values recomputed by hand in float64."""
    sim = _tiny_dfedhp_sim(torch.float32)
    start = {k: v.double() for k, v in sim.states([0, 1, 2]).items()}
    base = sim.models["mlp"].initial_params()[:N_BODY].double()
    trained = []
    for c in range(3):
        x, y = sim.data.batch(sim.data.train_idx[c])
        s = (start["phi"][c], start["z"][c], start["head"][c])
        trained.append(alg1_local(*s, x.double(), y, HP_ALG1, base, 0.1))
    phi, z, v = (torch.stack(t) for t in zip(*trained))
    phi, z = W_PATH @ phi, W_PATH @ z
    sim.run_round(1)
    expected = []
    for c in range(3):
        body = base + hand_h(phi[c], z[c], **TINY_HN)
        x, y = sim.data.batch(sim.data.test_idx[c])
        expected.append(float(tanh_loss(body, v[c], x.double(), y)))
    assert sim.evaluate()["test_loss"] == pytest.approx(sum(expected) / 3, rel=1e-5)


def test_literal_generation_is_eq2_without_a_fixed_offset() -> None:
    """Eq. 2 as written: the shared part *is* h(phi, z) (``generation = "literal"``), started
    at the scale of the model's own initialization (the default, chosen on a validation split);
    "residual" adds theta0_body and starts with W2 = b2 = 0, i.e. exactly the initial model."""
    from hyperfed.models.zoo import build_model

    torch.manual_seed(0)
    fm = FunctionalModel(build_model("mlp", (1, 8, 8), 10), "mlp")
    ctx = ClientContext(0, torch.device("cpu"), 10, (1, 8, 8))
    small = {"embed_dim": 4, "hidden": 4, "rows": 8, "cols": 16}
    for generation in ("residual", "literal"):
        client = DFedHPClient(DFedHPParams(generation=generation, **small), ctx)
        split, hnet, base = client.parts(fm)
        state = client.init_state(fm, 2)
        h = hnet.generate(state["phi"], state["z"])
        body0 = split.body(fm.initial_params())
        if generation == "residual":
            assert torch.equal(base, body0) and not bool(h.abs().sum())
        else:
            assert not bool(base.abs().sum())  # no offset: body = h(phi, z)
            assert math.isclose(float(h[0].std()), float(body0.std()), rel_tol=1e-4)
        group = ClientGroup(fm, [0, 1], None, 1, 0, None)  # type: ignore[arg-type]
        assert torch.allclose(client.body(group, state), base + h)


def test_each_device_starts_from_its_own_draw_and_the_same_one_everywhere() -> None:
    """Alg. 1 line 3: every device initializes (phi, z) at random, its own draw; the draw
    depends on the client id only, so the simulator and a Flower node (a group of one) give
    client i the same start. ``init = "shared"`` (the default, chosen on validation): one
    start for all."""
    sim = _sim("dfedhp", "algorithm.init=per_device")
    phi = torch.stack([sim.store[c]["phi"] for c in ALL])
    z = torch.stack([sim.store[c]["z"] for c in ALL])
    assert all(not torch.equal(phi[0], phi[c]) for c in (1, 2, 3))
    assert all(not torch.equal(z[0], z[c]) for c in (1, 2, 3))
    fm = sim.models["lenet"]
    for c in ALL:  # alone (a node), or in another order: the same draw for client c
        alone = sim.client.init_states(fm, [c])
        assert torch.equal(alone["phi"][0], phi[c]) and torch.equal(alone["z"][0], z[c])
    shared = _sim("dfedhp")
    assert all(torch.equal(shared.store[0]["phi"], shared.store[c]["phi"]) for c in ALL)
    assert all(torch.equal(shared.store[0]["z"], shared.store[c]["z"]) for c in ALL)
    # heads start as the model's initial head in both (the personal part is not drawn)
    assert torch.equal(sim.store[1]["head"], shared.store[1]["head"])


# -- when a decentralized model is scored: after mixing (mean_acc) and before (issue 54) -----
class _TwoScalarClients:
    """A transport of two hand-made clients, each a 1-d classifier ``predict 1 iff v (x + u) >
    0`` with a shared part u (gossiped) and a personal head v. Local training sets u to
    ``TRAINED[c]``; ``relay`` writes ``sum_j W[i, j] u_j``; evaluation counts by the rule."""

    name = "simulation"
    reference = False
    TRAINED = {0: 1.0, 1: -3.0}
    HEAD = {0: 1.0, 1: 1.0}
    TEST = {0: ([-0.5, 0.5, 2.0], [1, 1, 1]), 1: ([2.0, 4.0, 5.0], [0, 1, 1])}

    def __init__(self) -> None:
        self.u = {0: 0.0, 1: 0.0}
        self.W: Tensor | None = None

    def reachable(self) -> set[int] | None:
        return None

    def fit(self, rnd: int, msgs: dict) -> Exchange:
        for c in msgs:
            self.u[c] = self.TRAINED[c]
        return Exchange({c: {"shared": torch.tensor([self.u[c]])} for c in msgs})

    def relay(self, rnd: int, W: Tensor, payloads: dict) -> None:
        self.W = W
        ids = list(payloads)
        sent = [float(payloads[j]["shared"][0]) for j in ids]
        for i, c in enumerate(ids):
            self.u[c] = sum(float(W[i, j]) * sent[j] for j in range(len(ids)))

    def evaluate(self, msgs: dict, split: str) -> EvalCounts:
        correct = []
        for c in (0, 1):
            xs, ys = self.TEST[c]
            preds = [int(self.HEAD[c] * (x + self.u[c]) > 0) for x in xs]
            correct.append(float(sum(p == y for p, y in zip(preds, ys))))
        return EvalCounts(
            torch.tensor(correct, dtype=torch.float64),
            torch.tensor([3.0, 3.0], dtype=torch.float64),
            torch.zeros(2, dtype=torch.float64),
        )


class _ScalarGossipServer(GossipServer):
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {"shared": (1,)}


def test_gossip_records_score_before_and_after_mixing_by_hand() -> None:
    """Two clients on the full graph (Metropolis: W = [[1/2, 1/2], [1/2, 1/2]]). Trained shared
    parts u = (1, -3), heads v = (1, 1). Before mixing (DisPFL's moment): client 0 on x = (-0.5,
    0.5, 2), y = (1, 1, 1) has x + 1 = (0.5, 1.5, 3) > 0: 3/3; client 1 on x = (2, 4, 5),
    y = (0, 1, 1) has x - 3 = (-1, 1, 2): 3/3; mean 1. After mixing both hold u = -1: client 0
    x - 1 = (-1.5, -0.5, 1): 1/3; client 1 x - 1 = (1, 3, 4): 2/3; mean 1/2 (``mean_acc``)."""
    hp = GossipParams(topology="full")
    ctx = ServerContext(0, torch.device("cpu"), 2, (1,), {})
    transport = _TwoScalarClients()
    driver = RoundDriver(
        _ScalarGossipServer(hp, {0: {}, 1: {}}, ctx),
        transport,
        num_clients=2,
        participation=1.0,
        seed=0,
        arch_of=["scalar", "scalar"],
        order=[0, 1],
        gossip=Gossip(hp, 2, 0),
    )
    (record,) = driver.run(rounds=1, eval_every=1)
    assert transport.W is not None and torch.allclose(transport.W, torch.full((2, 2), 0.5).double())
    assert transport.u == {0: -1.0, 1: -1.0}
    assert record["mean_acc_before_gossip"] == pytest.approx(1.0)
    assert record["client_acc_before_gossip"] == [1.0, 1.0]
    assert record["mean_acc"] == pytest.approx(0.5)
    assert record["client_acc"] == [round(1 / 3, 5), round(2 / 3, 5)]
    assert set(BEFORE_GOSSIP_KEYS) <= set(record)
    # a round that is not evaluated scores nothing before mixing
    assert not set(BEFORE_GOSSIP_KEYS) & set(driver.run_round(2).extra)


def _acc_by_hand(sim: Simulation, c: int, theta: Tensor, buffers: Tensor) -> float:
    fm, data = sim.models["lenet"], sim.data
    idx = data.test_idx[c]
    logits = fm.forward(theta, buffers, data.features(idx))
    return float((logits.argmax(1) == data.y[idx]).double().mean())


def test_dfedhp_pre_gossip_score_uses_the_locally_trained_body() -> None:
    """DFedHP, two clients, full graph, one round. Before mixing client i is scored with the
    body h(phi_i, z_i) of its own trained (phi_i, z_i) and its trained head v_i; after mixing
    with h(phi, z) of the averages (Metropolis on two clients: 1/2 each) and the same head."""
    sim = _sim(
        "dfedhp",
        'algorithm.topology="full"',
        "clients.count=2",
        "rounds=1",
        "dataset.subsample=600",
        "local.batch_size=16",
        "local.lr=0.3",  # so that one round learns enough for mixing to move the scores
        "algorithm.epochs_v=3",
    )
    start = sim.states([0, 1])
    _, trained, _ = sim.client.fit(sim.group("lenet", [0, 1], 1), {}, start)
    _, hn, base = sim.client.parts(sim.models["lenet"])
    split = body_head(sim.models["lenet"])
    mixed_body = base + hn.generate(trained["phi"].mean(0), trained["z"].mean(0))
    before, after = [], []
    for c in (0, 1):
        own_body = base + hn.generate(trained["phi"][c], trained["z"][c])
        head, buf = trained["head"][c], trained["buffers"][c]
        before.append(_acc_by_hand(sim, c, split.join(own_body, head), buf))
        after.append(_acc_by_hand(sim, c, split.join(mixed_body, head), buf))
    (record,) = sim.run()
    assert before != after, "the example must make mixing change some client's score"
    assert record["client_acc_before_gossip"] == pytest.approx(before, abs=1e-5)
    assert record["client_acc"] == pytest.approx(after, abs=1e-5)
    assert record["mean_acc_before_gossip"] == pytest.approx(sum(before) / 2, abs=1e-6)
    assert record["mean_acc"] == pytest.approx(sum(after) / 2, abs=1e-6)
