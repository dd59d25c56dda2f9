"""DESA (Huang et al., ICML 2024), defining properties on hand-sized inputs.

Anchors: the clients' DM-distilled sets mixed class by class (mean of the clients' j-th image
of class c); local loss ``CE(D_i u D^Syn) + lambda_REG SupCon(f(real), f(anchor).detach())
+ lambda_KD L_KD`` on the anchors, with the official code's (ubc-tea/DESA) reductions: SupCon
averaged over all samples (one without a positive counts 0), ``L_KD = 0.1 CE(z, y) + 0.9 T^2
KLDivLoss()(log_softmax(z/T), softmax(teacher/T))``, the KL averaged over batch x classes;
teacher = mean of the *other* clients' logits on the anchors, relayed by the server; each
client keeps and is evaluated with its own model. Expected values by hand, in float64, from a
tiny ``Linear(3, 4) - ReLU - Linear(4, 3)``.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from toy import tiny_mlp, toy_federation

from hyperfed.algorithms.base import ClientContext, ClientGroup, ServerContext
from hyperfed.algorithms.desa import (
    DESAClient,
    DESAParams,
    DESAServer,
    desa_kd_loss,
    desa_objective,
    mix_anchors,
)
from hyperfed.config import validate_hparams
from hyperfed.engine.local import SGDConfig

CPU = torch.device("cpu")
F64 = torch.float64
D_IN, HIDDEN, CLASSES = 3, 4, 3


def mlp(theta: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
    w1, b1 = theta[:12].view(4, 3), theta[12:16]
    w2, b2 = theta[16:28].view(3, 4), theta[28:31]
    f = (x @ w1.T + b1).relu()
    return f, f @ w2.T + b2


def hand_supcon(f: Tensor, y: Tensor, t: float) -> Tensor:
    """The official SupConLoss: the mean over *all* samples, 0 for one without a positive."""
    z = F.normalize(f, dim=-1)
    per = []
    for j in range(len(z)):
        others = [k for k in range(len(z)) if k != j]
        log_den = torch.logsumexp(torch.stack([z[j] @ z[k] / t for k in others]), 0)
        pos = [k for k in others if y[k] == y[j]]
        if pos:
            per.append(-torch.stack([z[j] @ z[p] / t - log_den for p in pos]).mean())
        else:
            per.append(torch.zeros((), dtype=f.dtype))
    return torch.stack(per).mean()


def hand_kd(z: Tensor, teacher: Tensor, y: Tensor, t: float, alpha: float = 0.9) -> Tensor:
    """The official calculate_kd_loss: (1 - alpha) CE + alpha T^2 KL, KL mean over B x K."""
    p = F.softmax(teacher / t, -1)
    kl = (p * (p.log() - F.log_softmax(z / t, -1))).mean()  # over batch x classes
    return (1 - alpha) * F.cross_entropy(z, y) + alpha * t * t * kl


def test_kd_term_is_the_official_one_on_a_hand_example():
    """2 samples, 3 classes, T = 2: ``0.1 CE + 0.9 T^2 * (sum of the 6 KL terms) / 6``."""
    s = [[1.0, 0.0, -1.0], [0.5, 2.0, 0.0]]  # student logits
    tch = [[0.0, 1.0, 0.0], [2.0, -1.0, 1.0]]  # teacher logits
    y = [0, 1]
    t = 2.0

    def softmax(v: list[float], temp: float) -> list[float]:
        e = [math.exp(a / temp) for a in v]
        return [a / sum(e) for a in e]

    kl_terms = []
    for i in range(2):
        p, q = softmax(tch[i], t), softmax(s[i], t)
        kl_terms += [p[k] * (math.log(p[k]) - math.log(q[k])) for k in range(3)]
    ce = -sum(math.log(softmax(s[i], 1.0)[y[i]]) for i in range(2)) / 2
    want = 0.1 * ce + 0.9 * t * t * sum(kl_terms) / 6
    st, tt, yt = torch.tensor(s, dtype=F64), torch.tensor(tch, dtype=F64), torch.tensor(y)
    got = desa_kd_loss(st, tt, yt, temperature=t, alpha=0.9, reduction="mean")
    assert math.isclose(float(got), want, rel_tol=1e-12)
    # the same number as the official call: PyTorch's nn.KLDivLoss() with its default reduction
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PyTorch warns that 'mean' is not the KL's definition
        official = torch.nn.KLDivLoss()(F.log_softmax(st / t, 1), F.softmax(tt / t, 1))
    assert math.isclose(0.1 * ce + 0.9 * t * t * float(official), want, rel_tol=1e-12)
    # "batchmean": the KL summed over the classes, K = 3 times the official term
    got_b = desa_kd_loss(st, tt, yt, temperature=t, alpha=0.9, reduction="batchmean")
    assert math.isclose(float(got_b), 0.1 * ce + 0.9 * t * t * sum(kl_terms) / 2, rel_tol=1e-12)
    # alpha = 1: the KL alone; alpha = 0: the CE alone
    got1 = desa_kd_loss(st, tt, yt, temperature=t, alpha=1.0, reduction="mean")
    assert math.isclose(float(got1), t * t * sum(kl_terms) / 6, rel_tol=1e-12)
    got0 = desa_kd_loss(st, tt, yt, temperature=t, alpha=0.0, reduction="mean")
    assert math.isclose(float(got0), ce, rel_tol=1e-12)


def test_defaults_are_the_official_codes_and_bad_values_are_refused():
    hp = DESAParams()
    assert (hp.kd_alpha, hp.kd_reduction, hp.kd_temperature) == (0.9, "mean", 20.0)
    assert (hp.lambda_reg, hp.lambda_kd, hp.tau_reg, hp.ipc) == (1.0, 1.0, 0.07, 50)
    with pytest.raises(ValueError, match=r"kd_alpha: allowed: a number >= 0 and <= 1"):
        validate_hparams(DESAParams, {"kd_alpha": 1.5})
    with pytest.raises(ValueError, match="kd_reduction: allowed: one of mean, batchmean"):
        validate_hparams(DESAParams, {"kd_reduction": "sum"})


def test_anchors_mix_the_clients_images_class_by_class():
    a = torch.arange(12, dtype=F64).view(4, 3)  # client 0: classes 0, 0, 1, 1 (ipc 2)
    b = -torch.arange(12, dtype=F64).view(4, 3)  # client 1: classes 1, 1, 2, 2
    x, y = mix_anchors([a, b], [torch.tensor([0, 0, 1, 1]), torch.tensor([1, 1, 2, 2])], 2, 3)
    assert y.tolist() == [0, 0, 1, 1, 2, 2]
    assert torch.equal(x[:2], a[:2])  # class 0: only client 0 holds it
    assert torch.allclose(x[2], (a[2] + b[0]) / 2) and torch.allclose(x[3], (a[3] + b[1]) / 2)
    assert torch.equal(x[4:], b[2:])


def test_local_synthesis_is_dm_from_noise_with_fresh_networks():
    cfg = DESAParams().distill_config()
    assert cfg.init == "noise" and cfg.resample and cfg.lambda_cc == 0.0


def _ctx(theta, anchors, ya, teacher, weight=1.0):
    return {
        "syn_x": anchors,
        "syn_y": ya,
        "anc_idx": torch.arange(len(ya)),
        "teacher": teacher,
        "teacher_weight": torch.tensor(weight, dtype=F64),
    }


def _inputs():
    torch.manual_seed(3)
    x = torch.randn(4, D_IN, dtype=F64)
    y = torch.tensor([0, 1, 1, 2])
    anchors = x[[0, 1, 3]] * 0.9 + 0.05  # features not all zero after the ReLU
    ya = torch.tensor([0, 1, 2])
    teacher = torch.randn(3, CLASSES, dtype=F64)
    return x, y, anchors, ya, teacher


def test_local_objective_is_ce_plus_reg_plus_kd():
    fm = tiny_mlp(D_IN, HIDDEN, CLASSES, seed=0)
    theta = fm.initial_params()
    x, y, anchors, ya, teacher = _inputs()
    kw = dict(lambda_reg=0.7, lambda_kd=0.4, tau_reg=0.5, kd_temperature=3.0)
    kw.update(kd_alpha=0.8, kd_reduction="mean")
    got, _ = desa_objective(
        fm, theta, fm.initial_buffers(), x, y, _ctx(theta, anchors, ya, teacher), **kw
    )
    fx, zx = mlp(theta, x)
    fa, za = mlp(theta, anchors)
    ce = F.cross_entropy(torch.cat([zx, za]), torch.cat([y, ya]))
    reg = hand_supcon(torch.cat([fx, fa]), torch.cat([y, ya]), 0.5)
    kl = hand_kd(za, teacher, ya, 3.0, alpha=0.8)
    assert math.isclose(float(got), float(ce + 0.7 * reg + 0.4 * kl), rel_tol=1e-10)
    # no other client's logits yet: no KD term
    got0, _ = desa_objective(
        fm, theta, fm.initial_buffers(), x, y, _ctx(theta, anchors, ya, teacher, 0.0), **kw
    )
    assert math.isclose(float(got0), float(ce + 0.7 * reg), rel_tol=1e-10)


def test_reg_averages_over_all_samples_one_without_a_positive_counting_zero():
    """Real labels 0, 1, 1, 2 and anchor labels 0, 1, 1: the class-2 sample has no positive;
    the official SupConLoss divides the other six samples' losses by all seven."""
    fm = tiny_mlp(D_IN, HIDDEN, CLASSES, seed=0)
    theta = fm.initial_params()
    x, y, anchors, _, teacher = _inputs()
    ya = torch.tensor([0, 1, 1])
    kw = dict(lambda_reg=1.0, lambda_kd=0.0, tau_reg=0.5, kd_temperature=3.0)
    kw.update(kd_alpha=0.9, kd_reduction="mean")
    got, _ = desa_objective(
        fm, theta, fm.initial_buffers(), x, y, _ctx(theta, anchors, ya, teacher), **kw
    )
    fx, zx = mlp(theta, x)
    fa, za = mlp(theta, anchors)
    ce = F.cross_entropy(torch.cat([zx, za]), torch.cat([y, ya]))
    reg = hand_supcon(torch.cat([fx, fa]), torch.cat([y, ya]), 0.5)
    assert math.isclose(float(got), float(ce + reg), rel_tol=1e-10)


def test_reg_pulls_real_features_towards_fixed_anchor_features():
    """L_REG's gradient flows through the real batch only (anchor features detached)."""
    fm = tiny_mlp(D_IN, HIDDEN, CLASSES, seed=0)
    theta = fm.initial_params()
    x, y, anchors, ya, teacher = _inputs()
    kw = dict(lambda_reg=1.0, lambda_kd=0.0, tau_reg=0.1, kd_temperature=3.0)
    kw.update(kd_alpha=0.9, kd_reduction="mean")
    ctx = _ctx(theta, anchors, ya, teacher)
    w = theta.clone().requires_grad_(True)
    loss, _ = desa_objective(fm, w, fm.initial_buffers(), x, y, ctx, **kw)
    (g,) = torch.autograd.grad(loss, w)

    def hand(detach: bool | None) -> Tensor:
        v = theta.clone().requires_grad_(True)
        fx, zx = mlp(v, x)
        fa, za = mlp(v, anchors)
        fa = fa.detach() if detach else fa
        total = F.cross_entropy(torch.cat([zx, za]), torch.cat([y, ya]))
        if detach is not None:
            total = total + hand_supcon(torch.cat([fx, fa]), torch.cat([y, ya]), 0.1)
        return torch.autograd.grad(total, v)[0]

    g_reg = g - hand(None)  # the REG term's part of the gradient
    assert torch.allclose(g_reg, hand(True) - hand(None), atol=1e-12)
    assert (g_reg - (hand(False) - hand(None))).abs().max() > 1e-3 * g_reg.abs().max()


def _server(n=3, m=2):
    fm = tiny_mlp(D_IN, HIDDEN, CLASSES, seed=0)
    ctx = ServerContext(seed=0, device=CPU, num_classes=CLASSES, input_shape=(D_IN,))
    ctx.models = {"tiny": fm}
    clients = {
        c: {"num_params": torch.tensor(31), "num_samples": torch.tensor(4)} for c in range(n)
    }
    server = DESAServer(DESAParams(ipc=1, distill_model="mlp"), clients, ctx)
    server.logits = torch.zeros(n, m, CLASSES)
    return server


def test_teacher_is_the_mean_of_the_other_clients_logits():
    server = _server()
    z = torch.randn(3, 2, CLASSES)
    server.aggregate(1, {0: {"logits": z[0]}, 2: {"logits": z[2]}})
    msgs = server.configure_train(2, [0, 1, 2])
    assert torch.allclose(msgs[0]["teacher"], z[2])  # client 1 never sent logits
    assert torch.allclose(msgs[1]["teacher"], (z[0] + z[2]) / 2)
    assert torch.allclose(msgs[2]["teacher"], z[0])
    assert all(float(msgs[c]["teacher_weight"]) == 1.0 for c in range(3))
    server.aggregate(2, {1: {"logits": z[1] + 1}})
    assert torch.allclose(server.configure_train(3, [0])[0]["teacher"], (z[1] + 1 + z[2]) / 2)
    lone = _server(n=1)
    assert float(lone.configure_train(1, [0])[0]["teacher_weight"]) == 0.0
    assert server.check_reply(0, {"logits": torch.zeros(2, CLASSES)}) is None
    assert server.check_reply(0, {"logits": torch.zeros(3, CLASSES)}) is not None


def test_client_trains_its_own_model_and_shares_its_logits_on_the_anchors():
    fm = tiny_mlp(D_IN, HIDDEN, CLASSES, seed=0)
    x, y, anchors, ya, teacher = _inputs()
    data = toy_federation(x, y, [torch.arange(4)], CLASSES)
    hp = DESAParams(ipc=1, distill_model="mlp", anchor_batch=3, lambda_reg=0.5, lambda_kd=0.5)
    hp.tau_reg, hp.kd_temperature, hp.kd_alpha = 0.5, 3.0, 0.7
    client = DESAClient(hp, ClientContext(0, CPU, CLASSES, (D_IN,)))
    state = client.init_state(fm, 1)
    state["syn_x"], state["syn_y"] = anchors[None], ya[None]
    sgd = SGDConfig(lr=0.1, momentum=0.0, weight_decay=0.0, epochs=1, batch_size=4)
    group = ClientGroup(fm, [0], data, rnd=1, seed=0, sgd=sgd, vectorize=False)
    msg = {"teacher": teacher[None], "teacher_weight": torch.ones(1, dtype=F64)}
    reply, new_state, _ = client.fit(group, msg, state)
    # one full-batch step on the hand-computed objective (all 3 anchors in the batch)
    v = state["theta"][0].clone().requires_grad_(True)
    fx, zx = mlp(v, x)
    fa, za = mlp(v, anchors)
    ce = F.cross_entropy(torch.cat([zx, za]), torch.cat([y, ya]))
    reg = hand_supcon(torch.cat([fx, fa.detach()]), torch.cat([y, ya]), 0.5)
    kl = hand_kd(za, teacher, ya, 3.0, alpha=0.7)  # the KL over batch x classes
    (g,) = torch.autograd.grad(ce + 0.5 * reg + 0.5 * kl, v)
    want = state["theta"][0] - 0.1 * g
    assert torch.allclose(new_state["theta"][0], want, atol=1e-12)
    # the reply: the trained model's logits on the anchors, nothing else
    assert set(reply) == {"logits"}
    assert torch.allclose(reply["logits"][0], mlp(want, anchors)[1], atol=1e-12)
    # evaluated with its own model
    theta, _ = client.eval_model(group, {}, new_state)
    assert torch.equal(theta, new_state["theta"])
