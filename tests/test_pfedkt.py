"""pFedKT (seed 001): triplet loss, local hypernetwork update, FedAvg equivalence, payloads."""

from __future__ import annotations

import math

import pytest
import torch

from hyperfed.algorithms.base import ClientContext, ClientGroup, ServerContext
from hyperfed.algorithms.fedavg import FedAvgClient, FedAvgParams
from hyperfed.algorithms.pfedkt import (
    PFedKTClient,
    PFedKTParams,
    PFedKTServer,
    contrastive_loss,
    logit_distance,
)
from hyperfed.config import ConfigError, load_config
from hyperfed.engine.local import SGDConfig
from hyperfed.engine.simulate import Simulation
from hyperfed.hypernet.chunked import ChunkedHypernet, HNOptimizer, update
from hyperfed.models.layout import FunctionalModel
from hyperfed.models.zoo import build_model

SGD = SGDConfig(lr=0.05, momentum=0.9, weight_decay=5e-5, epochs=1, batch_size=32)


@pytest.fixture(autouse=True)
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _softmax(row):
    z = [math.exp(v) for v in row]
    return [v / sum(z) for v in z]


def _kl(p_logits, q_logits):
    """d_KL(softmax(p) || softmax(q)) by hand."""
    p, q = _softmax(p_logits), _softmax(q_logits)
    return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))


def test_triplet_loss_on_hand_made_logits():
    anchor = [[2.0, 0.0, -1.0], [0.5, 0.5, 0.0]]
    pos = [[-1.0, 3.0, 0.0], [0.0, 0.0, 2.0]]
    neg = [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]
    d_pos = [_kl(pos[i], anchor[i]) for i in range(2)]  # Eq. 2: d_KL(L_global || L_anchor)
    d_neg = [_kl(neg[i], anchor[i]) for i in range(2)]
    a, p, n = (torch.tensor(t, dtype=torch.float64) for t in (anchor, pos, neg))
    assert torch.allclose(logit_distance(a, p, "kl"), torch.tensor(d_pos, dtype=torch.float64))

    hp = PFedKTParams(alpha=0.1)
    expected = max(sum(d_pos) / 2 - sum(d_neg) / 2 + 0.1, 0.0)
    assert expected > 0
    assert float(contrastive_loss(a, p, n, hp)) == pytest.approx(expected, rel=1e-12)
    # swapping positive and negative puts the margin out of reach: the hinge is 0
    assert float(contrastive_loss(a, n, p, hp)) == 0.0
    # first round: omega_k^0 = omega^0, positive == negative, so l_con = alpha, a constant
    a.requires_grad_(True)
    con = contrastive_loss(a, p, p, PFedKTParams(alpha=5.0))
    (g,) = torch.autograd.grad(con, a)
    assert float(con.detach()) == pytest.approx(5.0) and float(g.abs().max()) == 0.0


@pytest.mark.parametrize("distance", ["kl", "cosine", "l2", "mse"])
@pytest.mark.parametrize("loss", ["triplet", "moon", "l2reg"])
def test_table10_losses_are_finite_and_differentiable(distance, loss):
    torch.manual_seed(0)
    a = torch.randn(5, 4, requires_grad=True)
    con = contrastive_loss(
        a, torch.randn(5, 4), torch.randn(5, 4), PFedKTParams(distance=distance, loss=loss)
    )
    (g,) = torch.autograd.grad(con, a)
    assert torch.isfinite(con) and torch.isfinite(g).all()


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_hypernetwork_update_moves_generated_model_toward_trained(optimizer):
    torch.manual_seed(0)
    hn = ChunkedHypernet(1000, chunk=64, emb_dim=5, hidden=16, n_hidden=1)
    assert hn.num_chunks == 16
    phi = hn.init(3)
    gen = hn.generate(phi)
    assert gen.shape == (3, 1000)
    trained = gen + 0.05 * torch.randn_like(gen)  # what local training returned
    opt = HNOptimizer(optimizer, lr=1e-4)
    new_phi, state = update(hn, opt, phi, gen, trained, opt.init_state(phi))
    new_gen = hn.generate(new_phi)
    before = (gen - trained).norm(dim=1)
    after = (new_gen - trained).norm(dim=1)
    assert (after < before).all(), (before, after)
    assert (((new_gen - gen) * (trained - gen)).sum(1) > 0).all()
    if optimizer == "adam":
        assert torch.equal(state["hn_t"], torch.ones(3))


def test_hypernetwork_generates_all_clients_in_one_pass_like_a_per_client_mlp():
    """The batched einsum pass equals running each client's MLP chunk by chunk."""
    torch.manual_seed(1)
    hn = ChunkedHypernet(250, chunk=40, emb_dim=3, hidden=8, n_hidden=2)
    phi = hn.init(2)
    out = hn.generate(phi)
    for c in range(2):
        w = hn.layout.unflatten(phi[c])
        chunks = []
        for j in range(hn.num_chunks):
            h = w["emb"][j]
            for i in range(3):
                h = torch.relu(w[f"fc{i}.weight"] @ h + w[f"fc{i}.bias"])
            chunks.append(w["out.weight"] @ h + w["out.bias"])
        assert torch.allclose(out[c], torch.cat(chunks)[:250], atol=1e-6)
    # init is deterministic given the torch seed, and target_std sets the generated scale
    torch.manual_seed(1)
    assert torch.equal(hn.init(2), phi)
    scaled = hn.generate(hn.init(2, target_std=0.02))
    assert torch.allclose(scaled.std(dim=1), torch.full((2,), 0.02), rtol=1e-4)


def _group(digits_data, clients=(0, 1, 2), vectorize=True):
    torch.manual_seed(0)
    fm = FunctionalModel(build_model("mlp", digits_data.input_shape, digits_data.num_classes))
    return ClientGroup(fm, list(clients), digits_data, rnd=1, seed=0, sgd=SGD, vectorize=vectorize)


def _cctx(data):
    return ClientContext(0, torch.device("cpu"), data.num_classes, data.input_shape)


def test_no_hypernet_and_mu_zero_is_exactly_fedavg(digits_data):
    group = _group(digits_data)
    glob = group.fm.initial_params() + 0.01
    msg = {"theta": glob.expand(group.size, -1).clone()}
    fedavg = FedAvgClient(FedAvgParams(), _cctx(digits_data))
    ref, _, ref_loss = fedavg.fit(group, msg, fedavg.init_state(group.fm, group.size))
    hp = PFedKTParams(mu=0.0, use_hypernet=False)
    kt = PFedKTClient(hp, _cctx(digits_data))
    reply, state, loss = kt.fit(group, msg, kt.init_state(group.fm, group.size))
    assert torch.equal(reply["theta"], ref["theta"])
    assert torch.equal(loss, ref_loss)
    assert torch.equal(state["theta_prev"], reply["theta"]), "trained model kept as negative"


def test_client_round_absorbs_trained_model_and_is_vectorized(digits_data):
    """One pFedKT client round (hypernet + contrast): the hypernetwork update moves the
    generated model toward the trained one; vmap over clients equals the per-client loop."""
    hp = PFedKTParams(hn_lr=1e-4, mu=0.1)
    outs = []
    for vectorize in (True, False):
        group = _group(digits_data, vectorize=vectorize)
        client = PFedKTClient(hp, _cctx(digits_data))
        torch.manual_seed(5)
        state = client.init_state(group.fm, group.size)
        state["theta_prev"] = state["theta_prev"] + 0.05 * torch.randn_like(state["theta_prev"])
        msg = {"theta": group.fm.initial_params().expand(group.size, -1).clone()}
        hn = client.hypernet(group.fm)
        gen = hn.generate(state["hn"])
        reply, new_state, loss = client.fit(group, msg, state)
        trained = reply["theta"]
        new_gen = hn.generate(new_state["hn"])
        assert ((new_gen - trained).norm(dim=1) < (gen - trained).norm(dim=1)).all()
        assert (((new_gen - gen) * (trained - gen)).sum(1) > 0).all()
        assert torch.equal(new_state["theta_prev"], trained)
        outs.append((trained, new_state["hn"], loss))
    for a, b in zip(outs[0], outs[1]):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


BASE = [
    "device=cpu",
    "dataset.name=digits",
    "dataset.subsample=200",
    "partition.name=quantity",
    "clients.count=4",
    "clients.models=mlp",
    "algorithm.name=pfedkt",
    "local.epochs=1",
    "local.batch_size=32",
    "rounds=2",
    "eval_every=1",
]


def test_only_theta_crosses_the_wire():
    sim = Simulation(load_config(None, BASE))
    seen = []
    aggregate = sim.server.aggregate
    sim.server.aggregate = lambda rnd, replies: (seen.append(replies), aggregate(rnd, replies))
    records = sim.run()
    assert isinstance(sim.server, PFedKTServer)
    msgs = sim.server.configure_train(3, [0, 1])
    assert {k for m in msgs.values() for k in m} == {"theta"}
    assert all(set(r) == {"theta"} for replies in seen for r in replies.values())
    assert sim.server.configure_eval([0, 1]) == {0: {}, 1: {}}
    assert set(sim.joins[0]) == {"num_params", "num_samples"}
    assert len(records) == 2 and all(0 <= r["mean_acc"] <= 1 for r in records)
    # the evaluated model is each client's trained private model
    assert set(sim.store[0]) >= {"hn", "theta_prev", "buffers"}


def test_heterogeneous_models_and_bad_options_are_config_errors():
    with pytest.raises(ConfigError, match="clients.models"):
        Simulation(load_config(None, [*BASE, 'clients.models=["mlp", "lenet"]']))
    with pytest.raises(ConfigError, match="distance"):
        load_config(None, [*BASE, "algorithm.distance=hamming"])
    with pytest.raises(ConfigError, match="loss"):
        load_config(None, [*BASE, "algorithm.loss=ntxent"])


def test_server_is_fedavg_weighted_by_samples():
    fm = FunctionalModel(build_model("mlp", (1, 8, 8), 10))
    joins = {
        c: {"num_params": torch.tensor(fm.num_params), "num_samples": torch.tensor(n)}
        for c, n in ((0, 1), (1, 3))
    }
    ctx = ServerContext(0, torch.device("cpu"), 10, (1, 8, 8), {"mlp": fm})
    server = PFedKTServer(PFedKTParams(), joins, ctx)
    a, b = torch.zeros(fm.num_params), torch.ones(fm.num_params)
    server.aggregate(1, {0: {"theta": a}, 1: {"theta": b}})
    (theta,) = server.configure_train(2, [0])[0].values()
    assert torch.allclose(theta, torch.full_like(a, 0.75))


def test_local_hypernetwork_flops_are_counted_for_the_client():
    """The chunked hypernetwork's FLOPs by hand: one generation F = 2 * chunks * (e*h + h*h +
    h*chunk) per client; the update's VJP recomputes it and back-propagates into both operands
    of each product (3F). With and without the hypernetwork the local training is the same."""
    base = [
        "device=cpu",
        "dataset.name=digits",
        "dataset.subsample=200",
        "clients.count=2",
        "clients.models=lenet",
        "local.epochs=1",
        "algorithm.name=pfedkt",
    ]
    with_hn = Simulation(load_config(None, base)).run_round(1).flops
    without = Simulation(load_config(None, [*base, "algorithm.use_hypernet=false"]))
    without_flops = without.run_round(1).flops
    hp = PFedKTParams()
    hn = ChunkedHypernet(without.models["lenet"].num_params)
    e, h, k = hp.emb_dim, hp.hidden, hp.chunk
    generation = 2 * hn.num_chunks * (e * h + h * h * hp.n_hidden + h * k)
    assert with_hn - without_flops == 2 * 4 * generation > 0
