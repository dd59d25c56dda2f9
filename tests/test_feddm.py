"""FedDM (Xiong et al., CVPR 2023), defining properties on hand-sized inputs.

A round: the server sends w_t; a client optimizes its synthetic set S_k by per-class
distribution matching ``sum_c ||mean psi_w(x_c) - mean psi_w(s_c)||^2`` (+ the same on the
logits) at a model w sampled on the sphere of radius rho around w_t; it uploads S_k only; the
server trains w_t on the union of the S_k with cross-entropy; everyone is evaluated with w.

Expected values come from a hand-written forward pass of a tiny ``Linear(3, 4) - ReLU -
Linear(4, 3)`` model in float64, never read back from the method.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from toy import tiny_mlp, toy_federation

from hyperfed.algorithms.base import ClientContext, ClientGroup, ServerContext
from hyperfed.algorithms.feddm import (
    FedDMClient,
    FedDMParams,
    FedDMServer,
    sampled_model,
)
from hyperfed.distill.synthesis import DistillConfig, distill_matching, pad_by_class, perturb_within
from hyperfed.engine.local import SGDConfig

CPU = torch.device("cpu")
F64 = torch.float64
D_IN, HIDDEN, CLASSES = 3, 4, 3
SIZES = (D_IN, HIDDEN, CLASSES)
X = torch.tensor(
    [
        [0.5, -1.0, 0.3],
        [1.2, 0.4, -0.7],
        [-0.3, 0.8, 1.1],
        [0.9, -0.2, 0.6],
        [-1.1, 0.5, 0.2],
        [0.4, 1.3, -0.9],
        [0.7, 0.1, 0.8],
        [-0.6, -0.9, 0.4],
    ],
    dtype=F64,
)
Y = torch.tensor([0, 0, 1, 1, 1, 2, 2, 2])
# client 0 holds classes 0 and 1, client 1 classes 1 and 2
IDX = [torch.tensor([0, 1, 2, 3]), torch.tensor([4, 5, 6, 7])]


def mlp(theta: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
    """(features = input of the last Linear, logits) of the tiny MLP, by hand."""
    w1 = theta[:12].view(4, 3)
    b1 = theta[12:16]
    w2 = theta[16:28].view(3, 4)
    b2 = theta[28:31]
    f = (x @ w1.T + b1).relu()
    return f, f @ w2.T + b2


def data():
    return toy_federation(X, Y, IDX, CLASSES)


def hand_dm_grad(theta: Tensor, syn: Tensor, syn_y: Tensor, ids: Tensor, logits: bool) -> Tensor:
    """d/dS of sum_c ||mean_{x in D^c} psi(x) - mean_{s in S^c} psi(s)||^2 (+ the logit term)."""
    s = syn.clone().requires_grad_(True)
    fx, zx = mlp(theta, X[ids])
    fs, zs = mlp(theta, s)
    loss = torch.zeros((), dtype=F64)
    for c in torch.unique(Y[ids]):
        real, mine = Y[ids] == c, syn_y == c
        loss = loss + ((fx[real].mean(0) - fs[mine].mean(0)) ** 2).sum()
        if logits:
            loss = loss + ((zx[real].mean(0) - zs[mine].mean(0)) ** 2).sum()
    (g,) = torch.autograd.grad(loss, s)
    return g


def test_sample_lies_on_the_sphere_of_radius_rho_around_w():
    theta = torch.randn(31, dtype=F64)
    for rho in (0.5, 3.0):
        w = perturb_within(theta, rho, seed=7)
        assert math.isclose(float((w - theta).norm()), rho, rel_tol=1e-12)
    assert torch.equal(perturb_within(theta, 0.0, seed=7), theta)
    # a fresh direction for another seed (iteration)
    assert not torch.allclose(perturb_within(theta, 1.0, 7), perturb_within(theta, 1.0, 8))


def _one_step(fm, theta, logits: bool, lr: float = 0.3):
    cfg = DistillConfig(ipc=1, iters=0, lr=lr, momentum=0.0, batch_real=8, lambda_cc=0.0)
    d = data()
    x0, y0, _ = distill_matching(fm, lambda t: theta, d, [0, 1], cfg, [3, 4])
    cfg1 = DistillConfig(ipc=1, iters=1, lr=lr, momentum=0.0, batch_real=8, lambda_cc=0.0)
    x1, y1, _ = distill_matching(fm, lambda t: theta, d, [0, 1], cfg1, [3, 4], match_logits=logits)
    return x0, y0, x1, y1


def test_distribution_matching_step_is_minus_lr_times_the_dm_gradient():
    fm = tiny_mlp(D_IN, HIDDEN, CLASSES, seed=0)
    theta = fm.initial_params()
    for logits in (False, True):
        x0, y0, x1, y1 = _one_step(fm, theta, logits)
        for c in range(2):
            assert torch.equal(y0[c], torch.unique(Y[IDX[c]]))  # one image per held class
            # the initialization is a real sample of the client, of the image's class
            for img, lab in zip(x0[c], y0[c]):
                own = X[IDX[c]][Y[IDX[c]] == lab]
                assert (own - img).abs().sum(1).min() < 1e-12
            g = hand_dm_grad(theta, x0[c], y0[c], IDX[c], logits)
            assert torch.allclose(x1[c], x0[c] - 0.3 * g, atol=1e-12)


def test_logit_term_changes_the_step():
    fm = tiny_mlp(D_IN, HIDDEN, CLASSES, seed=0)
    theta = fm.initial_params()
    _, _, a, _ = _one_step(fm, theta, False)
    _, _, b, _ = _one_step(fm, theta, True)
    assert not torch.allclose(a[0], b[0])


def _group(fm, rnd=2, seed=5):
    sgd = SGDConfig(lr=0.1, momentum=0.0, weight_decay=0.0, epochs=1, batch_size=8)
    return ClientGroup(fm, [0, 1], data(), rnd=rnd, seed=seed, sgd=sgd, vectorize=False)


def _hp(**kw):
    base = dict(ipc=1, distill_iters=1, distill_lr=0.3, distill_momentum=0.0)
    base["distill_batch_real"] = 8
    return FedDMParams(**{**base, **kw})


def test_client_matches_at_a_model_sampled_around_the_received_global_model():
    """The DM gradient is taken at w = w_t + rho u / ||u|| (not at w_t, nor at a random net)."""
    fm = tiny_mlp(D_IN, HIDDEN, CLASSES, seed=0)
    w_t = fm.initial_params() * 1.5
    hp = _hp(radius=0.8, match_logits=True)
    client = FedDMClient(hp, ClientContext(0, CPU, CLASSES, (D_IN,)))
    group = _group(fm)
    state = client.init_state(fm, 2)
    reply, _, _ = client.fit(group, {"theta": w_t.expand(2, -1)}, state)
    hp0 = _hp(radius=0.8, distill_iters=0)
    init, _, _ = FedDMClient(hp0, client.ctx).fit(group, {"theta": w_t.expand(2, -1)}, state)
    w = sampled_model(w_t, 0.8, group.seed, group.rnd, 0)
    assert math.isclose(float((w - w_t).norm()), 0.8, rel_tol=1e-9)
    for c in range(2):
        keep = reply["syn_y"][c] >= 0
        s0 = init["syn_x"][c][keep]
        y = reply["syn_y"][c][keep]
        want = s0 - 0.3 * hand_dm_grad(w, s0, y, IDX[c], True)
        assert torch.allclose(reply["syn_x"][c][keep], want, atol=1e-12)
        at_w_t = s0 - 0.3 * hand_dm_grad(w_t, s0, y, IDX[c], True)
        assert not torch.allclose(reply["syn_x"][c][keep], at_w_t, atol=1e-6)


def test_every_distillation_iteration_matches_at_a_fresh_model_on_the_sphere(monkeypatch):
    """Step 2: each of the K iterations samples its own w with ||w - w_t|| = rho, so the K
    models the matching loss is taken at (both forwards of an iteration, real and synthetic,
    at the same w) are K distinct points of the sphere, none of them w_t; the same seed, round
    and iteration give the same point (a rerun draws the same K models)."""
    K, rho = 4, 0.8
    fm = tiny_mlp(D_IN, HIDDEN, CLASSES, seed=0)
    w_t = fm.initial_params() * 1.5
    seen: list[Tensor] = []
    forward = fm.forward_train

    def spy(theta, *args, **kwargs):
        seen.append(theta.detach().clone())
        return forward(theta, *args, **kwargs)

    monkeypatch.setattr(fm, "forward_train", spy)
    client = FedDMClient(_hp(radius=rho, distill_iters=K), ClientContext(0, CPU, CLASSES, (D_IN,)))
    client.fit(_group(fm), {"theta": w_t.expand(2, -1)}, {})
    assert len(seen) == 2 * K
    models = seen[::2]
    for t in range(K):
        assert torch.equal(seen[2 * t + 1], models[t])  # real and synthetic: one w
        assert math.isclose(float((models[t] - w_t).norm()), rho, rel_tol=1e-9)
        for s in range(t):
            assert float((models[t] - models[s]).norm()) > 0.1 * rho, (s, t)
    first = models
    seen.clear()
    client.fit(_group(fm), {"theta": w_t.expand(2, -1)}, {})
    assert all(torch.equal(a, b) for a, b in zip(seen[::2], first, strict=True))


def test_reply_is_the_padded_synthetic_set_only():
    fm = tiny_mlp(D_IN, HIDDEN, CLASSES, seed=0)
    hp = _hp(radius=0.0, distill_iters=0)
    client = FedDMClient(hp, ClientContext(0, CPU, CLASSES, (D_IN,)))
    reply, _, _ = client.fit(_group(fm), {"theta": fm.initial_params().expand(2, -1)}, {})
    assert set(reply) == {"syn_x", "syn_y"}
    assert reply["syn_x"].shape == (2, CLASSES * 1, D_IN)
    # client 0 holds classes 0, 1: two images, then one empty slot (label -1, zero image)
    assert reply["syn_y"][0].tolist() == [0, 1, -1]
    assert reply["syn_y"][1].tolist() == [1, 2, -1]
    assert torch.equal(reply["syn_x"][0][2], torch.zeros(D_IN, dtype=F64))
    px, py = pad_by_class(X[:2], torch.tensor([2, 0]), 3, 1)
    assert py.tolist() == [2, 0, -1] and torch.equal(px[:2], X[:2])


def _server(fm, **kw):
    ctx = ServerContext(seed=0, device=CPU, num_classes=CLASSES, input_shape=(D_IN,))
    ctx.models = {"tiny": fm}
    clients = {c: {"num_params": torch.tensor(31), "num_samples": torch.tensor(4)} for c in (0, 1)}
    hp = FedDMParams(
        ipc=2,
        server_epochs=1,
        server_lr=0.5,
        server_momentum=0.0,
        server_weight_decay=0.0,
        server_batch_size=5,
        **kw,
    )
    return FedDMServer(hp, clients, ctx)


def test_server_trains_the_global_model_on_the_union_of_the_synthetic_sets():
    """w_{t+1} = w_t - lr * grad CE(w_t; S_0 u S_1), one full-batch step; empty slots unused."""
    fm = tiny_mlp(D_IN, HIDDEN, CLASSES, seed=1)
    server = _server(fm)
    w_t = server.theta.clone()
    s0 = torch.randn(6, D_IN, dtype=F64)
    replies = {
        0: {"syn_x": s0[:6], "syn_y": torch.tensor([0, 0, 1, 1, -1, -1])},
        1: {"syn_x": s0[[5, 4, 3, 2, 1, 0]], "syn_y": torch.tensor([2, -1, -1, -1, -1, 1])},
    }
    for c, r in replies.items():
        assert server.check_reply(c, r) is None
    server.aggregate(1, replies)
    xs = torch.cat([s0[:4], s0[[5, 0]]])
    ys = torch.tensor([0, 0, 1, 1, 2, 1])
    assert server.syn_y.numel() == 6 and sorted(server.syn_y.tolist()) == sorted(ys.tolist())
    w = w_t.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(F.cross_entropy(mlp(w, xs)[1], ys), w)
    # one epoch of batch 5 over 6 samples is two steps; recompute them by hand
    server2 = _server(fm)
    server2.hp.server_batch_size = 6
    server2.aggregate(1, replies)
    assert torch.allclose(server2.theta, w_t - 0.5 * g, atol=1e-12)
    assert not torch.allclose(server.theta, w_t)


def test_everyone_is_evaluated_with_the_global_model():
    fm = tiny_mlp(D_IN, HIDDEN, CLASSES, seed=1)
    server = _server(fm)
    server.theta = server.theta + 0.25
    msgs = server.configure_eval([0, 1])
    client = FedDMClient(_hp(), ClientContext(0, CPU, CLASSES, (D_IN,)))
    stacked = {k: torch.stack([msgs[c][k] for c in (0, 1)]) for k in msgs[0]}
    theta, _ = client.eval_model(_group(fm), stacked, {})
    assert torch.equal(theta[0], server.theta) and torch.equal(theta[1], server.theta)
    train = server.configure_train(1, [0, 1])
    assert set(train[0]) == {"theta"} and torch.equal(train[1]["theta"], server.theta)


def test_server_rejects_a_label_outside_the_classes():
    fm = tiny_mlp(D_IN, HIDDEN, CLASSES, seed=1)
    server = _server(fm)
    good = {"syn_x": torch.zeros(6, D_IN, dtype=F64), "syn_y": torch.tensor([0, 1, 2, -1, -1, 0])}
    assert server.check_reply(0, good) is None
    bad = {**good, "syn_y": torch.tensor([0, 1, 3, -1, -1, 0])}
    assert "outside" in str(server.check_reply(0, bad))


def test_images_stay_inside_the_value_range_of_the_clients_own_images():
    """A step of lr 1e3 would throw the images far outside the data (FedDM at a trained LeNet
    reached 1e23 by round 5): every step is clamped to [min, max] of the clients' own inputs."""
    fm = tiny_mlp(D_IN, HIDDEN, CLASSES, seed=0)
    theta = fm.initial_params()
    cfg = DistillConfig(ipc=1, iters=3, lr=1e3, momentum=0.0, batch_real=8, lambda_cc=0.0)
    own = X[torch.cat(IDX)]
    x, _, _ = distill_matching(fm, lambda t: theta, data(), [0, 1], cfg, [3, 4])
    images = torch.cat(x)
    assert float(images.min()) >= float(own.min()) and float(images.max()) <= float(own.max())
    assert float(images.max()) == float(own.max()) or float(images.min()) == float(own.min())
    free, _, _ = distill_matching(fm, lambda t: theta, data(), [0, 1], cfg, [3, 4], clamp=False)
    assert float(torch.cat(free).abs().max()) > 10 * float(own.abs().max())
