"""pFedES (seed 002): the extractor, the two frozen steps, what crosses the wire, Eq. 10."""

import pytest
import torch

from hyperfed.algorithms.base import ClientContext, ClientGroup, ServerContext
from hyperfed.algorithms.pfedes import (
    Extractor,
    PFedESClient,
    PFedESParams,
    PFedESServer,
    build_extractor,
    extractor_loss,
    model_loss,
)
from hyperfed.config import ConfigError, load_config, validate_hparams
from hyperfed.data.federated import FederatedData
from hyperfed.engine.local import SGDConfig
from hyperfed.models.layout import FunctionalModel
from hyperfed.models.zoo import build_model
from hyperfed.runtime.simulate import Simulation

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _one_thread():
    # on a shared 2-core machine two intra-op threads per process are 10-20x slower
    torch.set_num_threads(1)


@pytest.mark.parametrize("shape", [(1, 8, 8), (3, 32, 32), (1, 28, 28)])
def test_extractor_keeps_the_input_shape(shape):
    fm = build_extractor(PFedESParams(), shape, seed=0)
    x = torch.randn(5, *shape)
    assert fm.forward(fm.initial_params(), fm.initial_buffers(), x).shape == x.shape
    # the default (the authors' Generator) C -> 8 -> C, 3x3: 8*C*9 + 8 + C*8*9 + C parameters
    c = shape[0]
    assert fm.num_params == 8 * c * 9 + 8 + c * 8 * 9 + c
    assert isinstance(fm.module, Extractor)


def test_mu_outside_zero_half_is_a_one_line_config_error():
    for bad in (0.0, 0.6, -0.1):
        with pytest.raises(ValueError, match=r"mu: allowed: a number > 0 and <= 0.5"):
            validate_hparams(PFedESParams, {"mu": bad})
    with pytest.raises(ConfigError, match=r"mu: allowed: a number > 0 and <= 0.5") as e:
        load_config(None, ["algorithm.name=pfedes", "algorithm.mu=0.7"])
    assert "\n" not in str(e.value)
    PFedESParams(mu=0.5)  # the closed end is allowed


def _group(digits_data, clients=(0, 1)):
    torch.manual_seed(0)
    fm = FunctionalModel(build_model("lenet", digits_data.input_shape, digits_data.num_classes))
    sgd = SGDConfig(lr=0.05, momentum=0.9, weight_decay=1e-3, epochs=1, batch_size=32)
    return ClientGroup(fm, list(clients), digits_data, rnd=1, seed=0, sgd=sgd)


def _client(digits_data, **hp):
    ctx = ClientContext(0, CPU, digits_data.num_classes, digits_data.input_shape)
    return PFedESClient(PFedESParams(extractor_epochs=1, **hp), ctx)


def test_step1_freezes_the_extractor_and_step2_freezes_the_model(digits_data):
    group = _group(digits_data)
    client = _client(digits_data)
    pair = client.pair(group.fm)
    state = client.init_state(group.fm, group.size)
    g0 = client.extractor_fm.initial_params().expand(group.size, -1)
    theta = pair.join(state["theta"], g0)
    buffers = pair.join_buffers(state["buffers"], torch.zeros(group.size, 0))

    t1, b1, loss = client.train_model(group, theta, buffers)
    f0, g_before = pair.split(theta)
    f1, g1 = pair.split(t1)
    assert torch.equal(g1, g_before), "step 1 must not change the extractor"
    assert not torch.allclose(f1, f0), "step 1 trains the model"
    assert torch.isfinite(loss).all() and loss.shape == (2,)

    t2, _, _ = client.train_extractor(group, t1, b1)
    f2, g2 = pair.split(t2)
    assert torch.equal(f2, f1), "step 2 must not change the model"
    assert not torch.allclose(g2, g1), "step 2 trains the extractor"


def test_only_the_extractor_crosses_the_wire(digits_data):
    group = _group(digits_data)
    client = _client(digits_data)
    assert set(client.join(group.fm, 100)) == {"num_samples"}  # nothing about F_k
    kg = client.extractor_fm.num_params
    msg = {"extractor": client.extractor_fm.initial_params().expand(group.size, -1)}
    reply, state, loss = client.fit(group, msg, client.init_state(group.fm, group.size))
    assert set(reply) == {"extractor"}
    assert reply["extractor"].shape == (group.size, kg)
    assert state["theta"].shape == (group.size, group.fm.num_params)  # F_k stays home


def test_server_averages_extractors_weighted_by_sample_counts():
    ctx = ServerContext(0, CPU, 10, (1, 8, 8))
    clients = {0: {"num_samples": torch.tensor(10)}, 1: {"num_samples": torch.tensor(30)}}
    server = PFedESServer(PFedESParams(), clients, ctx)
    k = server.extractor.numel()
    a, b = torch.randn(k), torch.randn(k)
    assert server.check_reply(0, {"extractor": a}) is None
    assert server.check_reply(0, {"extractor": a[:-1]}) is not None
    assert server.check_reply(0, {"extractor": a, "theta": a}) is not None
    server.aggregate(1, {0: {"extractor": a}, 1: {"extractor": b}})
    assert torch.allclose(server.extractor, 0.25 * a + 0.75 * b, atol=1e-6)


def test_heterogeneous_run_uploads_extractor_size_times_four_bytes():
    cfg = load_config(
        None,
        [
            "algorithm.name=pfedes",
            "algorithm.extractor_epochs=1",
            "clients.count=4",
            'clients.models=["lenet", "vgg8"]',
            "rounds=2",
            "eval_every=2",
            "local.epochs=1",
            "local.vectorize=off",
        ],
    )
    sim = Simulation(cfg)
    seen = []
    aggregate = sim.server.aggregate

    def spy(rnd, replies):
        seen.extend(sorted(r) for r in replies.values())
        aggregate(rnd, replies)

    sim.server.aggregate = spy  # type: ignore[method-assign]
    record = sim.run()[-1]
    kg = sim.client.extractor_fm.num_params
    assert kg == 153  # 1-channel digits, the default 8-kernel extractor
    assert seen and all(keys == ["extractor"] for keys in seen)
    assert record["bytes_up_per_client"] == kg * 4
    assert record["bytes_down_per_client"] == kg * 4


# -- defining properties on hand-sized examples (issue 19) -----------------------------------
# F_k: Flatten -> Linear(9, 3) on 1x3x3 images; G: Conv(1 -> 2, 3x3, same) -> ReLU ->
# Conv(2 -> 1, 3x3, same) (extractor_width 2). Everything the paper's equations say is
# recomputed with plain torch (F.conv2d, matrix products) in float64.
IMG = (1, 3, 3)
N_CLS = 3
K_F = 9 * N_CLS + N_CLS
K_G = 2 * 9 + 2 + 2 * 9 + 1


def _tiny_fm() -> FunctionalModel:
    return FunctionalModel(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(9, N_CLS)))


def _f_logits(omega: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """F_k(omega; x) by hand: Linear weight [3, 9] then bias [3]."""
    return x.flatten(1) @ omega[:27].view(N_CLS, 9).T + omega[27:]


def _g_by_hand(theta: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """G(theta; x) by hand (§4.3): conv1.weight, conv1.bias, conv2.weight, conv2.bias."""
    w1, b1, w2, b2 = theta.split([18, 2, 18, 1])
    h = torch.relu(torch.nn.functional.conv2d(x, w1.view(2, 1, 3, 3), b1, padding=1))
    return torch.nn.functional.conv2d(h, w2.view(1, 2, 3, 3), b2, padding=1)


def _ce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits, y)


def _tiny_client(mu: float, extractor_epochs: int = 1) -> PFedESClient:
    hp = PFedESParams(
        mu=mu, extractor_epochs=extractor_epochs, extractor_width=2, extractor_relu_out=False
    )
    return PFedESClient(hp, ClientContext(0, CPU, N_CLS, IMG))


def _images(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, *IMG, dtype=torch.float64), torch.randint(0, N_CLS, (n,))


def test_tiny_extractor_is_the_two_same_padded_convolutions():
    """§4.3: G is two 3x3 convolutions with padding "same" (the hand version used below)."""
    client = _tiny_client(0.3)
    g = client.extractor_fm
    assert g.num_params == K_G
    torch.manual_seed(0)
    theta, (x, _) = torch.randn(K_G, dtype=torch.float64), _images(4)
    assert torch.allclose(g.forward(theta, g.initial_buffers(), x), _g_by_hand(theta, x))


def test_step1_loss_is_eq5_on_enhanced_and_raw_inputs():
    """Eqs. 3-5: ``l_omega = mu * CE(F(G(theta; x)), y) + (1 - mu) * CE(F(x), y)`` with G
    frozen: the value, the gradient on omega, and no gradient on theta. mu = 0.3, so swapping
    mu and 1 - mu, or feeding x where Eq. 3 feeds x_hat, gives another value."""
    torch.manual_seed(1)
    client = _tiny_client(0.3)
    pair = client.pair(_tiny_fm())
    omega, theta = torch.randn(K_F, dtype=torch.float64), torch.randn(K_G, dtype=torch.float64)
    x, y = _images(5)
    joint = pair.join(omega, theta).requires_grad_(True)
    got, _ = model_loss(pair.a, joint, torch.zeros(0), x, y, {}, pair=pair, mu=0.3)
    (g_got,) = torch.autograd.grad(got, joint)

    om = omega.clone().requires_grad_(True)
    l1, l2 = _ce(_f_logits(om, _g_by_hand(theta, x)), y), _ce(_f_logits(om, x), y)
    want = 0.3 * l1 + 0.7 * l2
    (g_want,) = torch.autograd.grad(want, om)
    assert abs(float((l1 - l2).detach())) > 1e-2, "x_hat must differ from x for the test to bite"
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=1e-12)
    g_f, g_g = pair.split(g_got)
    assert torch.allclose(g_f, g_want, rtol=1e-10, atol=1e-12)
    assert torch.equal(g_g, torch.zeros_like(g_g)), "step 1: the extractor is frozen"


def test_step2_loss_is_eq8_through_the_frozen_model():
    """Eqs. 7-8: ``l_theta = CE(F(omega; G(theta; x)), y)``: the value, the gradient on theta,
    and no gradient on omega (F_k frozen)."""
    torch.manual_seed(2)
    client = _tiny_client(0.3)
    pair = client.pair(_tiny_fm())
    omega, theta = torch.randn(K_F, dtype=torch.float64), torch.randn(K_G, dtype=torch.float64)
    x, y = _images(5)
    joint = pair.join(omega, theta).requires_grad_(True)
    got, _ = extractor_loss(pair.a, joint, torch.zeros(0), x, y, {}, pair=pair)
    (g_got,) = torch.autograd.grad(got, joint)
    th = theta.clone().requires_grad_(True)
    want = _ce(_f_logits(omega, _g_by_hand(th, x)), y)
    (g_want,) = torch.autograd.grad(want, th)
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=1e-12)
    g_f, g_g = pair.split(g_got)
    assert torch.allclose(g_g, g_want, rtol=1e-10, atol=1e-12)
    assert torch.equal(g_f, torch.zeros_like(g_f)), "step 2: the model is frozen"


def _tiny_data(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> FederatedData:
    """One client per (x, y) pair; all its samples are training samples (float64)."""
    x, y = torch.cat(xs), torch.cat(ys)
    bounds = torch.tensor([0] + [len(t) for t in ys]).cumsum(0).tolist()
    train = [torch.arange(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    empty = [torch.zeros(0, dtype=torch.long) for _ in train]
    return FederatedData(x, y, train, empty, empty, N_CLS, IMG, torch.zeros(0), torch.ones(0))


def test_client_round_by_hand_step1_then_step2_on_the_trained_model():
    """Algorithm 1 for two clients, recomputed by hand with full-batch SGD (lr 0.2, and
    torch.optim.SGD's momentum 0.5 / weight decay 0.01, so a frozen half must not even decay):
    step 1 (E = 1): omega^t = omega^{t-1} - lr grad_omega l_omega (Eq. 6) with G(theta^{t-1})
    frozen; step 2 (E_fe = 2): theta <- theta - lr grad_theta CE(F(omega^t; G(theta; x)), y)
    (Eq. 9), through the model trained in step 1. Only theta_k^t is uploaded; F_k stays home
    and is what the client is evaluated with (on raw x)."""
    torch.manual_seed(3)
    mu, lr, mom, wd = 0.3, 0.2, 0.5, 0.01
    data_xy = [_images(3), _images(3)]
    data = _tiny_data([d[0] for d in data_xy], [d[1] for d in data_xy])
    fm = _tiny_fm()
    client = _tiny_client(mu, extractor_epochs=2)
    sgd = SGDConfig(lr=lr, momentum=mom, weight_decay=wd, epochs=1, batch_size=3)
    group = ClientGroup(fm, [0, 1], data, rnd=1, seed=0, sgd=sgd)
    state = client.init_state(fm, 2)
    state["theta"] = torch.randn(2, K_F, dtype=torch.float64)
    theta_glob = 0.5 * torch.randn(K_G, dtype=torch.float64)
    msg = {"extractor": theta_glob.expand(2, -1).clone()}

    reply, new_state, loss = client.fit(group, msg, state)
    assert set(reply) == {"extractor"}
    for c, (x, y) in enumerate(data_xy):
        om = state["theta"][c].clone().requires_grad_(True)
        x_hat = _g_by_hand(theta_glob, x)
        l_omega = mu * _ce(_f_logits(om, x_hat), y) + (1 - mu) * _ce(_f_logits(om, x), y)
        (g,) = torch.autograd.grad(l_omega, om)
        omega1 = state["theta"][c] - lr * (g + wd * state["theta"][c])
        th, buf = theta_glob.clone(), torch.zeros(K_G, dtype=torch.float64)
        for _ in range(2):
            leaf = th.clone().requires_grad_(True)
            (g,) = torch.autograd.grad(_ce(_f_logits(omega1, _g_by_hand(leaf, x)), y), leaf)
            buf = mom * buf + g + wd * th
            th = th - lr * buf
        assert float(loss[c]) == pytest.approx(float(l_omega.detach()), rel=1e-10)
        assert torch.allclose(new_state["theta"][c], omega1, rtol=1e-10, atol=1e-12)
        assert torch.allclose(reply["extractor"][c], th, rtol=1e-10, atol=1e-12)
    theta_eval, _ = client.eval_model(group, {}, new_state)
    assert torch.equal(theta_eval, new_state["theta"])
    assert theta_eval.shape == (2, K_F), "F_k alone is evaluated, without the extractor"


def test_server_averages_only_the_extractor_over_the_repliers_by_sample_count():
    """Eq. 10: ``theta^t = sum_k n_k theta_k^t / sum_k n_k`` over the clients that replied
    (client 2 was not sampled); the server holds and broadcasts nothing but the extractor."""
    ctx = ServerContext(0, CPU, N_CLS, IMG)
    clients = {c: {"num_samples": torch.tensor(n)} for c, n in ((0, 2), (1, 6), (2, 100))}
    server = PFedESServer(PFedESParams(extractor_width=2), clients, ctx)
    assert server.extractor.shape == (K_G,)
    torch.manual_seed(4)
    a, b = torch.randn(K_G), torch.randn(K_G)
    server.aggregate(1, {0: {"extractor": a}, 1: {"extractor": b}})
    want = (2 * a + 6 * b) / 8
    assert torch.allclose(server.extractor, want, atol=1e-6)
    msgs = server.configure_train(2, [0, 1, 2])
    for c in (0, 1, 2):
        assert set(msgs[c]) == {"extractor"}
        assert torch.allclose(msgs[c]["extractor"], want, atol=1e-6)
    assert set(server.state_dict()) == {"extractor"}
    server.aggregate(2, {})  # no replies: the extractor stays
    assert torch.allclose(server.extractor, want, atol=1e-6)


def test_step2_leaves_the_frozen_models_batchnorm_statistics_alone():
    """Step 2 freezes F_k (Eqs. 7-9): with a BatchNorm in F_k, step 1 updates its running
    statistics (F_k trains) and step 2 changes neither F_k's parameters nor its statistics."""
    torch.manual_seed(5)
    fm = FunctionalModel(
        torch.nn.Sequential(torch.nn.BatchNorm2d(1), torch.nn.Flatten(), torch.nn.Linear(9, 3))
    )
    x, y = _images(3)
    data = _tiny_data([x.float()], [y])
    sgd = SGDConfig(lr=0.2, momentum=0.0, weight_decay=0.0, epochs=1, batch_size=3)
    group = ClientGroup(fm, [0], data, rnd=1, seed=0, sgd=sgd)
    client = _tiny_client(0.3)
    pair = client.pair(fm)
    state = client.init_state(fm, 1)
    theta = pair.join(state["theta"], client.extractor_fm.initial_params()[None])
    buffers = pair.join_buffers(state["buffers"], torch.zeros(1, 0))
    t1, b1, _ = client.train_model(group, theta, buffers)
    assert not torch.equal(pair.split_buffers(b1)[0], state["buffers"]), "step 1 trains F_k"
    t2, b2, _ = client.train_extractor(group, t1, b1)
    assert torch.equal(pair.split_buffers(b2)[0], pair.split_buffers(b1)[0])
    assert torch.equal(pair.split(t2)[0], pair.split(t1)[0])
    assert not torch.equal(pair.split(t2)[1], pair.split(t1)[1]), "step 2 trains G"


def _conv_same_by_hand(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A 3x3 convolution with padding "same" (zero padding 1) by explicit sums, one image
    ``x [C_in, H, W]``: ``out[o, i, j] = b[o] + sum_{c, u, v} w[o, c, u, v] x[c, i+u-1, j+v-1]``."""
    c_in, h, wd = x.shape
    out = torch.zeros(w.shape[0], h, wd, dtype=x.dtype)
    for o in range(w.shape[0]):
        for i in range(h):
            for j in range(wd):
                total = float(b[o])
                for c in range(c_in):
                    for u in range(3):
                        for v in range(3):
                            r, s = i + u - 1, j + v - 1
                            if 0 <= r < h and 0 <= s < wd:
                                total += float(w[o, c, u, v]) * float(x[c, r, s])
                out[o, i, j] = total
    return out


def test_authors_extractor_has_8_kernels_and_a_relu_after_both_convolutions():
    """Issue 54: the authors' ``Generator`` (LipingYi/pFedES ``Models/CNNs.py``, as described
    there): Conv(C -> 8, 3x3, same) -> ReLU -> Conv(8 -> C, 3x3, same) -> ReLU, the default
    since validation chose it (session 29); the earlier reading is width 16, no output ReLU."""
    assert PFedESParams().extractor_width == 8 and PFedESParams().extractor_relu_out is True
    hp = PFedESParams(extractor_width=8, extractor_relu_out=True)
    theirs = build_extractor(hp, (1, 4, 4), seed=0)
    # structure: 8 * 1 * 9 weights + 8 biases, then 1 * 8 * 9 weights + 1 bias = 153
    assert theirs.num_params == 8 * 9 + 8 + 8 * 9 + 1 == 153
    assert build_extractor(hp, (3, 4, 4), seed=0).num_params == 8 * 3 * 9 + 8 + 3 * 8 * 9 + 3
    convs = [m for m in theirs.module.modules() if isinstance(m, torch.nn.Conv2d)]
    assert [(m.in_channels, m.out_channels, m.kernel_size) for m in convs] == [
        (1, 8, (3, 3)),
        (8, 1, (3, 3)),
    ]
    # hand input, hand weights (drawn, then read back in the layout's order)
    torch.manual_seed(5)
    theta = torch.randn(153, dtype=torch.float64)
    x = torch.randn(2, 1, 4, 4, dtype=torch.float64)
    w1, b1, w2, b2 = theta.split([72, 8, 72, 1])
    w1, w2 = w1.view(8, 1, 3, 3), w2.view(1, 8, 3, 3)
    pre = torch.stack(
        [_conv_same_by_hand(torch.relu(_conv_same_by_hand(xi, w1, b1)), w2, b2) for xi in x]
    )
    assert float(pre.min()) < 0 < float(pre.max())  # the output ReLU has something to cut
    got = theirs.forward(theta.float(), theirs.initial_buffers(), x.float()).double()
    assert got.shape == x.shape and float(got.min()) >= 0
    assert torch.allclose(got, torch.relu(pre), atol=1e-5)
    # the same weights without the output ReLU (the earlier reading) give the signed output
    ours = build_extractor(PFedESParams(extractor_width=8, extractor_relu_out=False), (1, 4, 4), 0)
    plain = ours.forward(theta.float(), ours.initial_buffers(), x.float()).double()
    assert torch.allclose(plain, pre, atol=1e-5)
    # config keys reach the extractor
    cfg = load_config(
        None,
        [
            "algorithm.name=pfedes",
            "algorithm.extractor_width=16",
            "algorithm.extractor_relu_out=false",
        ],
    )
    assert cfg.algorithm.extractor_width == 16 and cfg.algorithm.extractor_relu_out is False
