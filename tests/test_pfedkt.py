"""pFedKT (seed 001): triplet loss, local hypernetwork update, FedAvg equivalence, payloads."""

from __future__ import annotations

import math

import pytest
import torch

from hyperfed.algorithms.base import ClientContext, ClientGroup, ServerContext
from hyperfed.algorithms.fedavg import FedAvgClient, FedAvgParams
from hyperfed.algorithms.pfedkt import (
    HN_DEFAULTS,
    PFedKTClient,
    PFedKTParams,
    PFedKTServer,
    contrastive_loss,
    logit_distance,
    pfedkt_loss,
)
from hyperfed.config import ConfigError, load_config, validate_hparams
from hyperfed.data.federated import FederatedData
from hyperfed.engine.local import SGDConfig
from hyperfed.engine.metering import FlopMeter
from hyperfed.hypernet.chunked import ChunkedHypernet, HNOptimizer, update
from hyperfed.models.layout import FunctionalModel
from hyperfed.models.zoo import build_model
from hyperfed.runtime.simulate import Simulation

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


def test_table10_distances_and_losses_on_hand_made_logits():
    """App. C / Table 10 by hand: 1 - cosine similarity, the L2 norm, MSE (its square), and
    MOON's loss -log(e^{cos+/tau} / (e^{cos+/tau} + e^{cos-/tau})) with cosine similarity."""
    a = torch.tensor([[1.0, 0.0], [3.0, 4.0]], dtype=torch.float64)
    r = torch.tensor([[0.0, 1.0], [6.0, 8.0]], dtype=torch.float64)
    # row 0: orthogonal, |a - r| = sqrt 2; row 1: parallel, |a - r| = 5
    assert logit_distance(a, r, "cosine").tolist() == pytest.approx([1.0, 0.0])
    assert logit_distance(a, r, "l2").tolist() == pytest.approx([2**0.5, 5.0])
    assert logit_distance(a, r, "mse").tolist() == pytest.approx([2.0, 25.0])
    # MOON with cosine: positive parallel to the anchor (cos 1), negative orthogonal (cos 0)
    anchor = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    pos = torch.tensor([[2.0, 0.0]], dtype=torch.float64)
    neg = torch.tensor([[0.0, 1.0]], dtype=torch.float64)
    hp = PFedKTParams(loss="moon", distance="cosine", tau=0.5)
    expected = -math.log(math.exp(1 / 0.5) / (math.exp(1 / 0.5) + math.exp(0 / 0.5)))
    assert float(contrastive_loss(anchor, pos, neg, hp)) == pytest.approx(expected, rel=1e-12)
    # l2 regularization with the L2 norm: the positive distance alone, averaged over the batch
    hp = PFedKTParams(loss="l2reg", distance="l2")
    got = float(contrastive_loss(a, r, torch.zeros_like(a), hp))
    assert got == pytest.approx((2**0.5 + 5.0) / 2, rel=1e-12)


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


def test_hn_momentum_steps_each_clients_phi_as_torch_sgd_with_momentum():
    """The stabilised Alg. 1 reading steps phi with heavy-ball momentum 0.9, as the group's
    pFedES code does with ``torch.optim.SGD(momentum=0.9)``: v <- 0.9 v + g, phi <- phi - lr v,
    each client with its own buffer. Three steps against torch's SGD, one per client."""
    from hyperfed.hypernet.chunked import optimizer_step

    torch.manual_seed(3)
    phi = torch.randn(2, 5)
    grads = [torch.randn(2, 5) for _ in range(3)]
    opt = PFedKTParams(hn_training="first_order", hn_lr=0.05, hn_momentum=0.9).hn_opt()
    ours, state = phi.clone(), opt.init_state(phi)
    for g in grads:
        ours, state = optimizer_step(opt, ours, g, state)
    for c in range(2):
        ref = phi[c].clone().requires_grad_(True)
        sgd = torch.optim.SGD([ref], lr=0.05, momentum=0.9)
        for g in grads:
            ref.grad = g[c].clone()
            sgd.step()
        torch.testing.assert_close(ours[c], ref.detach())
    # by hand, the third step of client 0: v3 = g3 + 0.9 g2 + 0.81 g1
    v3 = grads[2][0] + 0.9 * grads[1][0] + 0.81 * grads[0][0]
    torch.testing.assert_close(state["hn_m"][0], v3)


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


def test_chunked_generator_confines_the_model_to_a_hidden_dimensional_subspace():
    """App. B's generator makes chunk j = W_out g(e_j) + b_out with W_out [chunk, hidden], so
    the chunks minus b_out span at most ``hidden`` dimensions whatever phi is (the structural
    difference docs/claims/001.md C5 probes); a one-chunk hypernetwork (App. G.1's HN(large))
    has no such limit: its b_out alone is a free copy of the model."""
    torch.manual_seed(0)
    hn = ChunkedHypernet(24 * 10, chunk=10, emb_dim=4, hidden=3)
    phi = hn.init(1)
    chunks = hn.generate(phi)[0].reshape(hn.num_chunks, hn.chunk)
    bias = hn.layout.unflatten(phi[0])["out.bias"]
    assert int(torch.linalg.matrix_rank(chunks - bias)) <= 3  # 24 chunks in R^10, rank <= 3
    # a target whose chunks span all 10 directions is out of reach of the chunked generator
    target = torch.randn(24, 10)
    assert int(torch.linalg.matrix_rank(target - target.mean(0))) == 10
    large = ChunkedHypernet(240, chunk=240, emb_dim=4, hidden=3)
    w = large.layout.unflatten(large.init(1)[0])
    w["out.weight"].zero_()
    w["out.bias"].copy_(target.flatten())
    phi_large = torch.cat([w[n].flatten() for n in large.layout.names])[None]
    assert torch.allclose(large.generate(phi_large)[0], target.flatten())


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
    hp = PFedKTParams(hn_lr=1e-4, mu=0.1, hn_training="first_order")
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
    assert len(records) == 2
    # the evaluated model is each client's trained private model
    assert set(sim.store[0]) >= {"hn", "theta_prev", "buffers"}


def test_heterogeneous_models_and_bad_options_are_config_errors():
    with pytest.raises(ConfigError, match="clients.models"):
        Simulation(load_config(None, [*BASE, 'clients.models=["mlp", "lenet"]']))
    with pytest.raises(ConfigError, match="distance"):
        load_config(None, [*BASE, "algorithm.distance=hamming"])
    with pytest.raises(ConfigError, match="loss"):
        load_config(None, [*BASE, "algorithm.loss=ntxent"])
    with pytest.raises(ConfigError, match="chunk"):
        load_config(None, [*BASE, "algorithm.chunk=-1"])


def test_fixed_scale_multiplies_the_generated_model_and_its_chain_rule():
    """theta = s * MLP(phi): generate scales each entry, and Eq. 9's VJP carries s (the chain
    rule: (d theta/d phi)^T delta = (d MLP/d phi)^T (s * delta))."""
    torch.manual_seed(3)
    plain = ChunkedHypernet(30, chunk=8, emb_dim=2, hidden=4)
    scale = torch.rand(30) + 0.5
    scaled = ChunkedHypernet(30, chunk=8, emb_dim=2, hidden=4, scale=scale)
    phi, delta = plain.init(2), torch.randn(2, 30)
    assert torch.allclose(scaled.generate(phi), plain.generate(phi) * scale)
    assert torch.allclose(scaled.grad(phi, delta), plain.grad(phi, delta * scale), atol=1e-6)
    with pytest.raises(ValueError, match="scale"):
        ChunkedHypernet(30, chunk=8, scale=torch.ones(29))


def test_layer_init_starts_every_generated_layer_at_its_own_init_scale():
    """hn_init="target" matches the whole model's std, which leaves LeNet's first conv ~9x
    smaller than its own init (signals vanish; SGD from there stays at the majority class,
    docs/claims/001.md); "layer" matches each layer's std within a small factor."""
    fm = FunctionalModel(build_model("lenet", (1, 28, 28), 10))
    omega0 = fm.initial_params()
    ctx = ClientContext(0, torch.device("cpu"), 10, (1, 28, 28))

    def ratios(init: str) -> list[float]:
        client = PFedKTClient(PFedKTParams(hn_init=init), ctx)
        torch.manual_seed(0)
        gen = client.hypernet(fm).generate(client.init_state(fm, 1)["hn"])[0]
        return [
            float(gen[s.offset : s.end].std() / omega0[s.offset : s.end].std())
            for s in fm.layout.segments
            if s.end - s.offset > 50
        ]

    assert all(0.5 < r < 2 for r in ratios("layer"))
    assert min(ratios("target")) < 1 / 3
    # None resolves per mode: layer for end_to_end, target for first_order
    assert PFedKTParams().init_kind() == "layer"
    assert PFedKTParams(hn_training="first_order").init_kind() == "target"
    assert PFedKTParams(hn_training="first_order", hn_init="layer").init_kind() == "layer"


def test_chunk_zero_is_app_g1_one_shot_hypernetwork_of_the_whole_model():
    """App. G.1's HN(large): one embedding, fc3 emits every weight of the model at once."""
    fm = FunctionalModel(build_model("mlp", (1, 8, 8), 10))
    ctx = ClientContext(0, torch.device("cpu"), 10, (1, 8, 8))
    large = PFedKTClient(PFedKTParams(chunk=0), ctx).hypernet(fm)
    assert (large.num_chunks, large.chunk) == (1, fm.num_params)
    small = PFedKTClient(PFedKTParams(), ctx).hypernet(fm)
    assert (small.num_chunks, small.chunk) == (math.ceil(fm.num_params / 400), 400)


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
        "algorithm.hn_training=first_order",
    ]
    with_hn = Simulation(load_config(None, base)).run_round(1).flops
    without = Simulation(load_config(None, [*base, "algorithm.use_hypernet=false"]))
    without_flops = without.run_round(1).flops
    hp = PFedKTParams()
    hn = ChunkedHypernet(without.models["lenet"].num_params)
    e, h, k = hp.emb_dim, hp.hidden, hp.chunk
    generation = 2 * hn.num_chunks * (e * h + h * h * hp.n_hidden + h * k)
    assert with_hn - without_flops == 2 * 4 * generation > 0


# -- defining properties on hand-sized examples (issue 19) -----------------------------------
# A linear target model ``logits = x @ W^T + b`` (3 inputs, 3 classes, K = 12) in float64, a
# chunked hypernetwork of chunk 4 (3 chunks) with no hidden layer, and everything the paper's
# equations say recomputed below with plain torch, independently of the method's code.
D_IN, N_CLS = 3, 3
K_LIN = D_IN * N_CLS + N_CLS
HN_SHAPE = {"chunk": 4, "emb_dim": 2, "hidden": 3, "n_hidden": 0}


def _lin_fm() -> FunctionalModel:
    return FunctionalModel(torch.nn.Linear(D_IN, N_CLS).double(), "lin")


def _lin_logits(theta: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear's parameters in registration order: weight [out, in], then bias."""
    w = theta[: D_IN * N_CLS].view(N_CLS, D_IN)
    return x @ w.T + theta[D_IN * N_CLS :]


def _kl_rows(ref: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
    """Per-sample d_KL(softmax(ref) || softmax(anchor)), reference first (Eq. 2)."""
    p = torch.softmax(ref, 1)
    return (p * (p.log() - torch.log_softmax(anchor, 1))).sum(1)


def _eq3_by_hand(
    theta: torch.Tensor,
    glob: torch.Tensor,
    prev: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    mu: float,
    alpha: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 3 ``f = mu * l_con + (1 - mu) * l_sup`` with Eq. 2's triplet loss on the batch's
    KL distances; returns (f, d+ - d- + alpha before the hinge)."""
    anchor = _lin_logits(theta, x)
    d_pos = _kl_rows(_lin_logits(glob, x), anchor).mean()
    d_neg = _kl_rows(_lin_logits(prev, x), anchor).mean()
    pre = d_pos - d_neg + alpha
    sup = torch.nn.functional.cross_entropy(anchor, y)
    return mu * torch.clamp(pre, min=0) + (1 - mu) * sup, pre.detach()


def _hn_generate(phi: torch.Tensor, k: int = K_LIN) -> torch.Tensor:
    """Appendix B by hand for one client, n_hidden = 0: chunk j is
    ``out(relu(fc0(e_j)))`` and theta = concat(chunks)[:K]. Segment order: emb, fc0.weight,
    fc0.bias, out.weight, out.bias."""
    c, e, h = HN_SHAPE["chunk"], HN_SHAPE["emb_dim"], HN_SHAPE["hidden"]
    n = math.ceil(k / c)
    sizes = [n * e, h * e, h, c * h, c]
    emb, w0, b0, w1, b1 = phi.split(sizes)
    hidden = torch.relu(emb.view(n, e) @ w0.view(h, e).T + b0)
    return (hidden @ w1.view(c, h).T + b1).reshape(-1)[:k]


def _hn_step_by_hand(phi: torch.Tensor, before: torch.Tensor, after: torch.Tensor, lr: float):
    """Eq. 1 / Eq. 10: ``phi - lr * (d theta / d phi)^T (theta_before - theta_after)``, the
    Jacobian-vector product taken with plain autograd."""
    leaf = phi.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad((_hn_generate(leaf) * (before - after)).sum(), leaf)
    return phi - lr * g


def _tiny_data(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> FederatedData:
    """One client per (x, y) pair; all its samples are training samples (float64)."""
    x, y = torch.cat(xs), torch.cat(ys)
    bounds = torch.tensor([0] + [len(t) for t in ys]).cumsum(0).tolist()
    train = [torch.arange(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    empty = [torch.zeros(0, dtype=torch.long) for _ in train]
    return FederatedData(x, y, train, empty, empty, N_CLS, (D_IN,), torch.zeros(0), torch.ones(0))


def test_eq3_loss_value_and_gradient_match_the_paper_by_hand():
    """Eqs. 2-3 on a 4-sample batch: the engine loss equals ``mu * max(d+ - d- + alpha, 0) +
    (1 - mu) * CE`` with d+ = KL(global || anchor), d- = KL(previous || anchor), in value and
    gradient; mu = 0.3 so swapping mu and 1 - mu changes it, and the hinge is active both ways
    round so swapping positive and negative changes it too."""
    torch.manual_seed(3)
    fm = _lin_fm()
    theta, glob, prev = (torch.randn(K_LIN, dtype=torch.float64) for _ in range(3))
    x, y = torch.randn(4, D_IN, dtype=torch.float64), torch.tensor([0, 1, 2, 1])
    mu, alpha = 0.3, 2.0
    loss_fn = pfedkt_loss(PFedKTParams(mu=mu, alpha=alpha))
    ctx = {"global": glob, "prev": prev}

    leaf = theta.clone().requires_grad_(True)
    got, _ = loss_fn(fm, leaf, torch.zeros(0), x, y, ctx)
    (g_got,) = torch.autograd.grad(got, leaf)
    got = got.detach()
    ref_leaf = theta.clone().requires_grad_(True)
    want, pre = _eq3_by_hand(ref_leaf, glob, prev, x, y, mu, alpha)
    (g_want,) = torch.autograd.grad(want, ref_leaf)
    _, pre_swapped = _eq3_by_hand(theta, prev, glob, x, y, mu, alpha)
    assert float(pre) > 0 and float(pre_swapped) > 0, "the example must keep the hinge active"
    assert float(got) == pytest.approx(float(want.detach()), rel=1e-12)
    assert torch.allclose(g_got, g_want, rtol=1e-10, atol=1e-12)
    # the contrastive term really is there: CE alone (or CE scaled by 1 - mu) is another value
    sup = torch.nn.functional.cross_entropy(_lin_logits(theta, x), y)
    assert abs(float(got) - float(sup)) > 1e-3 and abs(float(got) - (1 - mu) * float(sup)) > 1e-3
    # Eq. 3: with the hinge active, raising the margin alpha by 1 raises f by exactly mu
    more, _ = pfedkt_loss(PFedKTParams(mu=mu, alpha=alpha + 1))(
        fm, theta, torch.zeros(0), x, y, ctx
    )
    assert float(more) - float(got) == pytest.approx(mu, rel=1e-9)
    # without a contrastive context (round 1 with the ablation off) the loss is CE alone
    plain, _ = loss_fn(fm, theta, torch.zeros(0), x, y, {})
    assert float(plain) == pytest.approx(float(sup), rel=1e-12)


def test_triplet_hinge_is_taken_on_the_batch_distances():
    """Alg. 1 computes d+ and d- on the batch's logits, then the hinge: a sample whose own
    ``d+ - d- + alpha`` is negative still counts in the batch average (a per-sample hinge
    would drop it)."""
    anchor = torch.tensor([[0.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    pos = torch.tensor([[3.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    neg = torch.tensor([[0.0, 0.0], [1.0, 0.0]], dtype=torch.float64)
    d_pos, d_neg = _kl_rows(pos, anchor), _kl_rows(neg, anchor)
    alpha = 0.1
    per_sample = d_pos - d_neg + alpha
    assert float(per_sample[0]) > 0 > float(per_sample[1])  # the case the choice matters for
    want = float(d_pos.mean() - d_neg.mean() + alpha)
    got = float(contrastive_loss(anchor, pos, neg, PFedKTParams(alpha=alpha)))
    assert got == pytest.approx(want, rel=1e-12)
    assert got != pytest.approx(float(per_sample.clamp(min=0).mean()), rel=1e-3)


def test_triplet_gradient_pulls_anchor_to_global_and_pushes_from_previous():
    """§4.3: the anchor is kept close to the global model (positive) and away from last
    round's private model (negative). With the anchor at the negative (where d- has a zero
    gradient) a small descent step on l_con lowers d+; at the positive it raises d-; in
    general it lowers the gap d+ - d-."""
    torch.manual_seed(4)
    a = torch.randn(6, 5, dtype=torch.float64)
    pos, neg = torch.randn(6, 5, dtype=torch.float64), torch.randn(6, 5, dtype=torch.float64)
    hp = PFedKTParams(alpha=10.0)  # a wide margin keeps the hinge active

    def step(anchor: torch.Tensor, p: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        leaf = anchor.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(contrastive_loss(leaf, p, n, hp), leaf)
        return anchor - 1e-3 * g

    def gap(anchor: torch.Tensor) -> float:
        return float(_kl_rows(pos, anchor).mean() - _kl_rows(neg, anchor).mean())

    at_neg = step(neg, pos, neg)
    assert _kl_rows(pos, at_neg).mean() < _kl_rows(pos, neg).mean()
    at_pos = step(pos, pos, neg)
    assert _kl_rows(neg, at_pos).mean() > _kl_rows(neg, pos).mean()
    assert gap(step(a, pos, neg)) < gap(a)


def test_hypernetwork_update_is_eq1_with_delta_before_minus_after():
    """Eq. 1 / 10 with Eq. 9: ``phi <- phi - lr_HN (d theta/d phi)^T (theta_generated -
    theta_trained)``; with that sign the generated model moves toward the trained one."""
    torch.manual_seed(6)
    hn = ChunkedHypernet(K_LIN, **HN_SHAPE)
    phi = torch.randn(2, hn.size, dtype=torch.float64)
    gen = hn.generate(phi)
    assert torch.allclose(gen[0], _hn_generate(phi[0]), rtol=1e-12, atol=1e-12)
    trained = gen + 0.1 * torch.randn_like(gen)
    opt = HNOptimizer("sgd", lr=0.01)
    new_phi, _ = update(hn, opt, phi, gen, trained, opt.init_state(phi))
    for c in range(2):
        want = _hn_step_by_hand(phi[c], gen[c], trained[c], 0.01)
        assert torch.allclose(new_phi[c], want, rtol=1e-10, atol=1e-12)
    moved = hn.generate(new_phi) - gen
    assert ((moved * (trained - gen)).sum(1) > 0).all(), "phi moves the model toward trained"


def test_client_rounds_by_hand_train_upload_keep_and_evaluate_the_trained_model():
    """Alg. 1, two rounds of one client group, every number recomputed by hand:
    generate theta_k^{t0} = h(v; phi_k); two full-batch SGD steps on Eq. 3 against the
    received global model (positive) and the stored previous private model (negative);
    upload the trained omega_k^t; keep it as next round's negative and as the evaluated
    model; phi_k moves by Eq. 1 with delta = theta_k^{t0} - omega_k^t."""
    torch.manual_seed(7)
    n = (3, 4)
    xs = [torch.randn(k, D_IN, dtype=torch.float64) for k in n]
    ys = [torch.tensor([0, 1, 2]), torch.tensor([2, 2, 0, 1])]
    data = _tiny_data(xs, ys)
    fm = _lin_fm()
    lr, mu, alpha, hn_lr = 0.5, 0.3, 5.0, 0.02
    hp = PFedKTParams(mu=mu, alpha=alpha, hn_lr=hn_lr, hn_training="first_order", **HN_SHAPE)
    client = PFedKTClient(hp, ClientContext(0, torch.device("cpu"), N_CLS, (D_IN,)))
    state = client.init_state(fm, 2)
    state["hn"] = 0.7 * torch.randn(2, state["hn"].shape[1], dtype=torch.float64)
    state["theta_prev"] = torch.randn(2, K_LIN, dtype=torch.float64)

    phi, prev = state["hn"].clone(), state["theta_prev"].clone()
    for rnd in (1, 2):
        glob = torch.randn(K_LIN, dtype=torch.float64)
        # the whole batch each step (epochs 2 of batch n_k): two steps, order-free
        sgd = SGDConfig(lr=lr, momentum=0.0, weight_decay=0.0, epochs=2, batch_size=3)
        groups = []
        for c, k in enumerate(n):
            sgd_c = SGDConfig(**{**sgd.__dict__, "batch_size": k})
            groups.append(ClientGroup(fm, [c], data, rnd=rnd, seed=0, sgd=sgd_c))
        new_states, replies, losses = [], [], []
        for c, group in enumerate(groups):
            sub = {key: v[c : c + 1] for key, v in state.items()}
            reply, new_state, loss = client.fit(group, {"theta": glob[None]}, sub)
            replies.append(reply["theta"][0])
            new_states.append(new_state)
            losses.append(loss[0])
        state = {key: torch.cat([s[key] for s in new_states]) for key in state}

        for c in range(2):
            theta0 = _hn_generate(phi[c])
            theta, fs = theta0.clone(), []
            for _ in range(2):
                leaf = theta.clone().requires_grad_(True)
                f, pre = _eq3_by_hand(leaf, glob, prev[c], xs[c], ys[c], mu, alpha)
                assert float(pre) > 0, "the example must keep the hinge active"
                (g,) = torch.autograd.grad(f, leaf)
                theta, fs = theta - lr * g, [*fs, float(f.detach())]
            # upload = the trained private model (for FedAvg), not the generated one
            assert torch.allclose(replies[c], theta, rtol=1e-9, atol=1e-12)
            assert not torch.allclose(replies[c], theta0, atol=1e-3)
            assert float(losses[c]) == pytest.approx(sum(fs) / 2, rel=1e-9)
            # kept as next round's negative, and the model each client is evaluated with
            assert torch.allclose(state["theta_prev"][c], theta, rtol=1e-9, atol=1e-12)
            ev, _ = client.eval_model(groups[c], {}, {k: v[c : c + 1] for k, v in state.items()})
            assert torch.allclose(ev[0], theta, rtol=1e-9, atol=1e-12)
            assert not torch.allclose(ev[0], _hn_generate(state["hn"][c]), atol=1e-3)
            # Eq. 1: the local hypernetwork absorbs the trained model
            want_phi = _hn_step_by_hand(phi[c], theta0, theta, hn_lr)
            assert torch.allclose(state["hn"][c], want_phi, rtol=1e-8, atol=1e-11)
            prev = prev.clone()
            prev[c] = theta
        phi = state["hn"].clone()


def test_server_fedavg_weights_replies_by_their_sample_counts():
    """Eq. 6 / Alg. 1: ``omega^{t+1} = sum_k n_k omega_k^t / sum_k n_k`` over the clients that
    replied (client 2, not sampled, weighs nothing); the next round broadcasts it."""
    fm = _lin_fm()
    joins = {
        c: {"num_params": torch.tensor(K_LIN), "num_samples": torch.tensor(n)}
        for c, n in ((0, 2), (1, 3), (2, 5))
    }
    ctx = ServerContext(0, torch.device("cpu"), N_CLS, (D_IN,), {"lin": fm})
    server = PFedKTServer(PFedKTParams(), joins, ctx)
    torch.manual_seed(8)
    a, b = torch.randn(K_LIN, dtype=torch.float64), torch.randn(K_LIN, dtype=torch.float64)
    server.aggregate(1, {0: {"theta": a}, 1: {"theta": b}})
    msgs = server.configure_train(2, [0, 1, 2])
    want = (2 * a + 3 * b) / 5
    for c in (0, 1, 2):
        assert set(msgs[c]) == {"theta"}
        assert torch.allclose(msgs[c]["theta"], want, rtol=1e-12)


# -- end-to-end training of the local hypernetwork (issue 21, item 1) ---------------------------
# Appendix C / §3.2.1: the model is theta = h(v; phi) at every local step and the loss of Eq. 3
# reaches phi by the chain rule of Eq. 7, grad_phi = (d theta / d phi)^T grad_theta f.


def _e2e_setup(hn_optimizer: str | None, hn_lr: float | None = None):
    torch.manual_seed(11)
    n = (3, 4)
    xs = [torch.randn(k, D_IN, dtype=torch.float64) for k in n]
    ys = [torch.tensor([0, 1, 2]), torch.tensor([2, 2, 0, 1])]
    data = _tiny_data(xs, ys)
    fm = _lin_fm()
    hp = PFedKTParams(
        mu=0.3,
        alpha=5.0,
        hn_training="end_to_end",
        hn_optimizer=hn_optimizer,
        hn_lr=hn_lr,
        hn_init="target",  # the by-hand generator below has no per-layer scale
        **HN_SHAPE,
    )
    client = PFedKTClient(hp, ClientContext(0, torch.device("cpu"), N_CLS, (D_IN,)))
    state = client.init_state(fm, 2)
    state = {k: v.double() for k, v in state.items()}
    state["hn"] = 0.7 * torch.randn(2, state["hn"].shape[1], dtype=torch.float64)
    state["theta_prev"] = torch.randn(2, K_LIN, dtype=torch.float64)
    return n, xs, ys, data, fm, hp, client, state


def _fit_each(client, fm, data, n, state, glob, rnd, epochs=2):
    """Each client alone, its whole data as one batch: ``epochs`` full-batch steps."""
    new_states, replies, losses = [], [], []
    for c, k in enumerate(n):
        sgd = SGDConfig(lr=0.5, momentum=0.0, weight_decay=0.0, epochs=epochs, batch_size=k)
        group = ClientGroup(fm, [c], data, rnd=rnd, seed=0, sgd=sgd)
        sub = {key: v[c : c + 1] for key, v in state.items()}
        reply, new_state, loss = client.fit(group, {"theta": glob[None]}, sub)
        replies.append(reply["theta"][0])
        new_states.append(new_state)
        losses.append(loss[0])
    merged = {key: torch.cat([s[key] for s in new_states]) for key in new_states[0]}
    return torch.stack(replies), merged, torch.stack(losses)


def test_end_to_end_gradient_reaching_phi_is_the_chain_rule_of_eq7():
    """hn_training = end_to_end with plain SGD on phi (lr eta): every step is
    ``phi <- phi - eta * J^T grad_theta f(theta)`` at ``theta = h(phi)``, with J = d theta /
    d phi the full Jacobian (torch.autograd.functional.jacobian of the by-hand generator) and
    grad_theta f the gradient of the by-hand Eq. 3 (triplet with the received global model
    as positive and the stored previous model as negative). The trained private model is
    h(phi after training): it is uploaded, kept as next round's negative and evaluated."""
    eta = 0.05
    n, xs, ys, data, fm, hp, client, state = _e2e_setup("sgd", eta)
    assert client.opt.name == "sgd" and client.opt.lr == eta
    phi, prev = state["hn"].clone(), state["theta_prev"].clone()
    glob = torch.randn(K_LIN, dtype=torch.float64)
    replies, new_state, losses = _fit_each(client, fm, data, n, state, glob, rnd=1)
    for c in range(2):
        p, fs = phi[c].clone(), []
        for _ in range(2):
            theta = _hn_generate(p).detach().requires_grad_(True)
            f, pre = _eq3_by_hand(theta, glob, prev[c], xs[c], ys[c], hp.mu, hp.alpha)
            assert float(pre) > 0, "the example must keep the hinge active"
            (g_theta,) = torch.autograd.grad(f, theta)
            jac = torch.autograd.functional.jacobian(_hn_generate, p)  # [K, P]
            assert jac.shape == (K_LIN, phi.shape[1])
            p, fs = p - eta * (jac.T @ g_theta), [*fs, float(f.detach())]
        assert torch.allclose(new_state["hn"][c], p, rtol=1e-9, atol=1e-12)
        assert not torch.allclose(new_state["hn"][c], phi[c], atol=1e-4), "phi was trained"
        assert float(losses[c]) == pytest.approx(sum(fs) / 2, rel=1e-9)
        trained = _hn_generate(p)
        assert torch.allclose(replies[c], trained, rtol=1e-9, atol=1e-12)  # uploaded
        assert not torch.allclose(replies[c], _hn_generate(phi[c]), atol=1e-4)
        assert torch.allclose(new_state["theta_prev"][c], trained, rtol=1e-9, atol=1e-12)
        sub = {k: v[c : c + 1] for k, v in new_state.items()}
        ev, _ = client.eval_model(None, {}, sub)  # type: ignore[arg-type]
        assert torch.allclose(ev[0], trained, rtol=1e-9, atol=1e-12)  # evaluated


def test_end_to_end_uses_adam_on_phi_and_keeps_its_state_across_rounds():
    """Default optimizer of end_to_end: Adam (torch.optim.Adam's update, lr = the mode's
    default) on phi, its moments kept from round to round: two rounds of two full-batch steps
    equal four steps of torch.optim.Adam on the by-hand loss (the negative of round 2 being
    round 1's trained model h(phi))."""
    n, xs, ys, data, fm, hp, client, state = _e2e_setup(None)
    name, lr = HN_DEFAULTS["end_to_end"]
    assert (client.opt.name, client.opt.lr) == (name, lr) == ("adam", hp.hn_opt().lr)
    phi0, prev0 = state["hn"].clone(), state["theta_prev"].clone()
    globs = [torch.randn(K_LIN, dtype=torch.float64) for _ in range(2)]
    for rnd, glob in enumerate(globs, 1):
        _, state, _ = _fit_each(client, fm, data, n, state, glob, rnd=rnd)
    assert torch.equal(state["hn_t"], torch.full((2,), 4.0, dtype=state["hn_t"].dtype))
    for c in range(2):
        leaf = phi0[c].clone().requires_grad_(True)
        adam = torch.optim.Adam([leaf], lr=lr)
        prev = prev0[c]
        for glob in globs:
            for _ in range(2):
                adam.zero_grad()
                f, _ = _eq3_by_hand(_hn_generate(leaf), glob, prev, xs[c], ys[c], 0.3, 5.0)
                f.backward()
                adam.step()
            prev = _hn_generate(leaf).detach()
        assert torch.allclose(state["hn"][c], leaf.detach(), rtol=1e-7, atol=1e-10)
        assert torch.allclose(state["theta_prev"][c], prev, rtol=1e-7, atol=1e-10)


def test_end_to_end_vmapped_group_equals_client_loop_with_unequal_steps(digits_data):
    """A group of clients with different numbers of local steps: the vmapped step over the
    client axis (finished clients masked) equals training each client alone."""
    hp = PFedKTParams(mu=0.1, hn_training="end_to_end", hn_lr=1e-3)
    clients = (0, 1, 2)
    outs = []
    for vectorize in (True, False):
        group = _group(digits_data, clients, vectorize=vectorize)
        client = PFedKTClient(hp, _cctx(digits_data))
        torch.manual_seed(5)
        state = client.init_state(group.fm, group.size)
        state["theta_prev"] = state["theta_prev"] + 0.05 * torch.randn_like(state["theta_prev"])
        msg = {"theta": group.fm.initial_params().expand(group.size, -1).clone()}
        reply, new_state, loss = client.fit(group, msg, state)
        hn = client.hypernet(group.fm)
        assert torch.allclose(reply["theta"], hn.generate(new_state["hn"]), atol=1e-6)
        assert not torch.allclose(new_state["hn"], state["hn"], atol=1e-6)
        outs.append((reply["theta"], new_state["hn"], new_state["hn_t"], loss))
    steps = outs[0][2]
    assert len(set(steps.tolist())) > 1, "the example must give clients different step counts"
    for a, b in zip(outs[0], outs[1]):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


def test_first_order_mode_trains_theta_then_updates_phi_once():
    """hn_training = first_order keeps Alg. 1's literal round (SGD on theta from h(phi), then
    one Eq. 1 step on phi): phi moves by exactly one step (Adam's t = 1 there would be an
    end-to-end run's many), and the defaults per mode are sgd 1e-4 vs adam."""
    assert PFedKTParams(hn_training="first_order").hn_opt().name == "sgd"
    assert PFedKTParams(hn_training="first_order").hn_opt().lr == HN_DEFAULTS["first_order"][1]
    assert PFedKTParams(hn_training="end_to_end").hn_opt().name == "adam"
    assert PFedKTParams(hn_training="end_to_end", hn_optimizer="sgd", hn_lr=0.2).hn_opt() == (
        HNOptimizer("sgd", 0.2)
    )
    n, xs, ys, data, fm, _, _, state = _e2e_setup(None)
    hp = PFedKTParams(mu=0.3, alpha=5.0, hn_training="first_order", hn_optimizer="adam", **HN_SHAPE)
    client = PFedKTClient(hp, ClientContext(0, torch.device("cpu"), N_CLS, (D_IN,)))
    state.update({k: v.double() for k, v in client.opt.init_state(state["hn"]).items()})
    _, new_state, _ = _fit_each(client, fm, data, n, state, torch.zeros(K_LIN).double(), 1)
    assert torch.equal(new_state["hn_t"], torch.ones(2, dtype=new_state["hn_t"].dtype))


def test_several_hypernetwork_steps_each_start_from_the_moved_output():
    """first_order with hn_steps = 3: phi takes three Eq. 1 / Eq. 10 steps, each with
    delta = h(v; phi_i) - omega_k^t from the hypernetwork as moved so far (by hand); the
    trained model itself is the same as with one step, and the regenerated model ends closer
    to it than after one step (what the extra steps are for)."""
    n, xs, ys, data, fm, _, _, state = _e2e_setup(None)
    glob = torch.randn(K_LIN, dtype=torch.float64)
    out = {}
    for steps in (1, 3):
        hp = PFedKTParams(
            mu=0.3, alpha=5.0, hn_training="first_order", hn_lr=0.02, hn_steps=steps, **HN_SHAPE
        )
        client = PFedKTClient(hp, ClientContext(0, torch.device("cpu"), N_CLS, (D_IN,)))
        out[steps] = _fit_each(client, fm, data, n, dict(state), glob, 1)
    (trained1, state1, _), (trained3, state3, _) = out[1], out[3]
    assert torch.allclose(trained1, trained3, rtol=1e-12, atol=1e-14)
    for c in range(2):
        phi = state["hn"][c]
        for _ in range(3):
            phi = _hn_step_by_hand(phi, _hn_generate(phi), trained3[c], 0.02)
        assert torch.allclose(state3["hn"][c], phi, rtol=1e-8, atol=1e-11)
        gap1 = (_hn_generate(state1["hn"][c]) - trained1[c]).norm()
        gap3 = (_hn_generate(state3["hn"][c]) - trained3[c]).norm()
        assert gap3 < gap1
    with pytest.raises(ValueError, match=r"hn_steps: allowed: a whole number from 1 .*\(got 0\)"):
        validate_hparams(PFedKTParams, {"hn_steps": 0})


def test_hn_grad_clip_scales_each_clients_eq10_gradient_to_the_bound():
    """hn_grad_clip = C: each client's Eq. 10 gradient g (autograd by hand) is scaled to
    norm min(||g||, C) before the SGD step (the pFedES code's clip_grad_norm_), per client;
    a bound above ||g|| changes nothing."""
    n, xs, ys, data, fm, _, _, state = _e2e_setup(None)
    glob = torch.randn(K_LIN, dtype=torch.float64)
    lr, out = 0.02, {}
    for clip in (None, 1e-3, 1e9):
        hp = PFedKTParams(
            mu=0.3, alpha=5.0, hn_training="first_order", hn_lr=lr, hn_grad_clip=clip, **HN_SHAPE
        )
        client = PFedKTClient(hp, ClientContext(0, torch.device("cpu"), N_CLS, (D_IN,)))
        out[clip] = _fit_each(client, fm, data, n, dict(state), glob, 1)
    trained, clipped, _ = out[1e-3]
    for c in range(2):
        phi = state["hn"][c]
        g = (phi - _hn_step_by_hand(phi, _hn_generate(phi), trained[c], 1.0)).detach()
        assert g.norm() > 1e-3, "the example must have a gradient above the bound"
        expected = phi - lr * g * (1e-3 / g.norm())
        assert torch.allclose(clipped["hn"][c], expected, rtol=1e-8, atol=1e-12)
    assert torch.allclose(out[1e9][1]["hn"], out[None][1]["hn"], rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match="hn_grad_clip: allowed: a number > 0"):
        validate_hparams(PFedKTParams, {"hn_grad_clip": 0.0})


def test_end_to_end_flops_count_the_hypernetwork_at_every_step():
    """FLOPs by hand: each end-to-end step adds the generation F and its backward into both
    operands of every product (2F) to the target model's step, and the trained model is
    generated once more at the end: with_hn - without = clients * (3F * steps + F)."""
    base = [
        "device=cpu",
        "dataset.name=digits",
        "dataset.subsample=200",
        "clients.count=2",
        "clients.models=lenet",
        "local.epochs=1",
        "algorithm.name=pfedkt",
        "algorithm.hn_training=end_to_end",
    ]
    sim = Simulation(load_config(None, base))
    with_hn = sim.run_round(1).flops
    without = Simulation(load_config(None, [*base, "algorithm.use_hypernet=false"]))
    without_flops = without.run_round(1).flops
    hp = PFedKTParams()
    hn = ChunkedHypernet(without.models["lenet"].num_params)
    e, h, k = hp.emb_dim, hp.hidden, hp.chunk
    generation = 2 * hn.num_chunks * (e * h + h * h * hp.n_hidden + h * k)
    b = sim.cfg.local.batch_size
    steps = [math.ceil(len(sim.data.train_idx[c]) / b) for c in (0, 1)]
    assert with_hn - without_flops == sum(3 * generation * s + generation for s in steps) > 0


def test_end_to_end_flops_come_from_the_engines_cache_keyed_by_what_is_trained():
    """End-to-end training is the engine's loop, its FLOPs counted by the engine's one cache
    (``count_flops``), whose key holds the size of what is trained: two hypernetworks over the
    same model and loss are each counted as they are. By hand (n_hidden 0): a step adds the
    generation F = 2 * chunks * (emb_dim * hidden + hidden * chunk) and its backward 2F to
    the target model's step, and the trained model is generated once more at the end:
    with - without = sum over clients of (3F * steps + F)."""
    n, _, _, data, fm, _, _, _ = _e2e_setup(None)
    group = ClientGroup(fm, [0, 1], data, rnd=1, seed=0, sgd=SGDConfig(epochs=2, batch_size=2))
    steps = [math.ceil(2 * k / 2) for k in n]  # 3 and 4
    msg = {"theta": torch.zeros(2, K_LIN, dtype=torch.float64)}

    def flops(**kw) -> int:
        client = PFedKTClient(PFedKTParams(mu=0.3, alpha=5.0, **kw), _cctx(data))
        state = {k: v.double() for k, v in client.init_state(fm, 2).items()}
        with FlopMeter() as meter:
            client.fit(group, msg, state)
        return meter.total

    without = flops(use_hypernet=False)
    for hidden in (3, 5):
        shape = {**HN_SHAPE, "hidden": hidden}
        e, c = shape["emb_dim"], shape["chunk"]
        generation = 2 * math.ceil(K_LIN / c) * (e * hidden + hidden * c)
        assert flops(**shape) - without == sum(3 * generation * s + generation for s in steps)


def test_each_client_hypernetwork_starts_from_its_own_draw_unless_asked():
    """Alg. 1 / App. B: phi_k^0 is drawn per client (different generated models); with
    hn_same_start every client gets one draw, the same whether clients are initialized together
    (simulation) or one by one (a Flower process each)."""
    fm = _lin_fm()
    ctx = ClientContext(3, torch.device("cpu"), N_CLS, (D_IN,))
    torch.manual_seed(0)
    own = PFedKTClient(PFedKTParams(hn_init="target", **HN_SHAPE), ctx).init_state(fm, 3)["hn"]
    assert not torch.allclose(own[0], own[1]) and not torch.allclose(own[1], own[2])
    same = PFedKTClient(PFedKTParams(hn_same_start=True, hn_init="target", **HN_SHAPE), ctx)
    together = same.init_state(fm, 3)["hn"]
    torch.manual_seed(123)  # another process: another global RNG state
    alone = same.init_state(fm, 1)["hn"]
    assert torch.equal(together, alone.expand(3, -1))
    # the target-std rescaling of hn_init="target" holds for every client's first model
    gen = ChunkedHypernet(K_LIN, **HN_SHAPE).generate(own)
    want = float(fm.initial_params().std())
    assert torch.allclose(gen.std(dim=1), torch.full((3,), want, dtype=gen.dtype), rtol=1e-4)


def test_kl_reduction_sum_is_the_batch_sum_of_the_kl_distances_by_hand():
    """Issue 54: Eq. 2's d+ and d- reduced over a batch of 3 by their mean (default) or their sum
    (the same group's pFedES code, ``reduction='sum'``). Expected values from the definition:
    ``max(R_b d+_b - R_b d-_b + alpha, 0)`` with R = mean or sum, each KL by hand."""
    anchor = [[2.0, 0.0, -1.0], [0.5, 0.5, 0.0], [0.0, 1.0, 1.0]]
    pos = [[-1.0, 3.0, 0.0], [0.0, 0.0, 2.0], [1.0, 0.0, 0.0]]
    neg = [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 1.0, 2.0]]
    d_pos = [_kl(pos[i], anchor[i]) for i in range(3)]  # d_KL(L_global || L_anchor)
    d_neg = [_kl(neg[i], anchor[i]) for i in range(3)]
    a, p, n = (torch.tensor(t, dtype=torch.float64) for t in (anchor, pos, neg))
    alpha = 0.1
    want_mean = max(sum(d_pos) / 3 - sum(d_neg) / 3 + alpha, 0.0)
    want_sum = max(sum(d_pos) - sum(d_neg) + alpha, 0.0)
    assert want_mean > 0 and want_sum > 0  # the hinge is active under both
    assert PFedKTParams().kl_reduction == "mean"  # the default is unchanged
    got_mean = float(contrastive_loss(a, p, n, PFedKTParams(alpha=alpha)))
    got_sum = float(contrastive_loss(a, p, n, PFedKTParams(alpha=alpha, kl_reduction="sum")))
    assert got_mean == pytest.approx(want_mean, rel=1e-12)
    assert got_sum == pytest.approx(want_sum, rel=1e-12)
    # with no margin and the hinge active the sum is exactly B = 3 times the mean
    no_margin = [
        float(contrastive_loss(a, p, n, PFedKTParams(alpha=0.0, kl_reduction=r)))
        for r in ("mean", "sum")
    ]
    assert no_margin[1] == pytest.approx(3 * no_margin[0], rel=1e-12)
    assert no_margin[1] == pytest.approx(sum(d_pos) - sum(d_neg), rel=1e-12)
    # l2reg (Table 10: d+ alone) is reduced the same way
    hp = PFedKTParams(loss="l2reg", kl_reduction="sum")
    assert float(contrastive_loss(a, p, n, hp)) == pytest.approx(sum(d_pos), rel=1e-12)
    # the hinge acts on the reduced distances: swap positive and negative (the difference
    # D = sum d+ - sum d- > 0 changes sign) and take alpha = 2D/3, between D/3 and D: the mean's
    # hinge is open (-D/3 + alpha > 0), the sum's closed (-D + alpha < 0)
    diff = sum(d_pos) - sum(d_neg)
    margin = 2 * diff / 3
    mean_side, sum_side = -diff / 3 + margin, -diff + margin
    assert mean_side > 0 > sum_side
    hp_mean, hp_sum = PFedKTParams(alpha=margin), PFedKTParams(alpha=margin, kl_reduction="sum")
    assert float(contrastive_loss(a, n, p, hp_mean)) == pytest.approx(mean_side, rel=1e-12)
    assert float(contrastive_loss(a, n, p, hp_sum)) == 0.0
    with pytest.raises(ValueError, match="kl_reduction: allowed: one of mean, sum"):
        validate_hparams(PFedKTParams, {"kl_reduction": "batchmean"})
