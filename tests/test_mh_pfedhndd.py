"""MH-pFedHNDD (seed 003): DM / SupCon / UniCon losses, distillation, DP accounting, setup."""

import dataclasses
import math
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hyperfed.algorithms.base import ClientContext, ClientGroup, ServerContext
from hyperfed.algorithms.mh_pfedhndd import (
    ALGORITHMS,
    DISTILL,
    FedAvgDDClient,
    FedAvgDDParams,
    FedAvgDDServer,
    MHPFedHNDDClient,
    MHPFedHNDDParams,
    MHPFedHNDDServer,
    PFedHNDDParams,
)
from hyperfed.config import ConfigError, load_config
from hyperfed.data.federated import FederatedData
from hyperfed.distill.component import DDParams
from hyperfed.distill.losses import (
    dm_loss,
    draw_batches,
    masked_mean,
    supcon_loss,
    synthetic_objective,
    unicon_loss,
    universum,
)
from hyperfed.distill.synthesis import DistillConfig, distill_synthetic, merge_synthetic
from hyperfed.engine.local import SGDConfig
from hyperfed.models.layout import FunctionalModel
from hyperfed.models.zoo import build_model
from hyperfed.runtime.simulate import Simulation


def test_dm_loss_zero_at_class_means_positive_otherwise():
    torch.manual_seed(0)
    real = torch.randn(3, 8, 5)  # [H classes, B samples, d]
    valid = torch.ones(3, 8, dtype=torch.bool)
    valid[2, 5:] = False  # a class with fewer real samples
    means = masked_mean(real, valid)
    syn = means.unsqueeze(1).expand(3, 4, 5)  # every synthetic feature at its class mean
    assert dm_loss(means, syn.mean(1)).abs() < 1e-10
    moved = syn.clone()
    moved[1, 0] += 0.3
    expected = ((0.3 / 4) ** 2) * 5
    assert math.isclose(float(dm_loss(means, moved.mean(1))), expected, rel_tol=1e-5)
    # a padded class (mask False) does not count
    assert dm_loss(means, moved.mean(1), torch.tensor([True, False, True])).abs() < 1e-10


def test_dm_loss_with_a_model_is_zero_when_synthetic_equals_real(digits_data):
    module = build_model("lenet", digits_data.input_shape, digits_data.num_classes)
    fm = FunctionalModel(module)
    theta, buffers = fm.initial_params(), fm.initial_buffers()
    x, y = digits_data.batch(digits_data.train_idx[0][:40])
    classes = torch.unique(y)
    feats = fm.forward(theta, buffers, x, return_features=True)[0]
    real = torch.stack([feats[y == c].mean(0) for c in classes])
    assert float(dm_loss(real, real.clone())) == 0.0
    shifted = fm.forward(theta, buffers, x + 0.5, return_features=True)[0]
    syn = torch.stack([shifted[y == c].mean(0) for c in classes])
    assert float(dm_loss(real, syn)) > 0


def _hand_contrastive(anchors, a_lab, bank, b_lab, exclude, t):
    a = F.normalize(anchors, dim=-1)
    b = F.normalize(bank, dim=-1)
    losses = []
    for j in range(len(a)):
        others = [k for k in range(len(b)) if k != exclude[j]]
        denom = sum(math.exp(float(a[j] @ b[k]) / t) for k in others)
        pos = [k for k in others if b_lab[k] == a_lab[j]]
        if not pos:
            continue
        m = torch.stack([b[k] for k in pos]).mean(0)  # Eq. 8's class mean m
        losses.append(-(float(a[j] @ m) / t - math.log(denom)))
    return sum(losses) / len(losses)


def test_supcon_matches_hand_computation():
    torch.manual_seed(1)
    f = torch.randn(6, 4, dtype=torch.float64)
    y = torch.tensor([0, 1, 0, 2, 1, 0])  # class 2 has no positive: left out
    got = float(supcon_loss(f, y, temperature=0.5))
    # Eq. 5 by hand: mean over positives of log-softmax over all others
    fn = F.normalize(f, dim=-1)
    per = []
    for j in range(6):
        others = [k for k in range(6) if k != j]
        log_den = math.log(sum(math.exp(float(fn[j] @ fn[k]) / 0.5) for k in others))
        pos = [k for k in others if y[k] == y[j]]
        if pos:
            per.append(-sum(float(fn[j] @ fn[p]) / 0.5 - log_den for p in pos) / len(pos))
    assert math.isclose(got, sum(per) / len(per), rel_tol=1e-9)
    assert math.isclose(got, _hand_contrastive(f, y, f, y, list(range(6)), 0.5), rel_tol=1e-9)


def test_unicon_matches_hand_computation():
    torch.manual_seed(2)
    real = torch.randn(4, 3, dtype=torch.float64)
    y = torch.tensor([0, 1, 1, 0])
    syn = torch.randn(2, 3, dtype=torch.float64)
    ys = torch.tensor([1, 2])
    uni = torch.randn(4, 3, dtype=torch.float64)  # features of u_j, labelled y_j
    got = float(unicon_loss(real, y, syn, ys, uni, temperature=0.2))
    anchors, a_lab = torch.cat([real, syn]), torch.cat([y, ys])
    bank, b_lab = torch.cat([uni, syn]), torch.cat([y, ys])
    # anchor j excludes bank entry j: its own mixup u_j, or a synthetic anchor itself
    want = _hand_contrastive(anchors, a_lab, bank, b_lab, list(range(6)), 0.2)
    assert math.isclose(got, want, rel_tol=1e-9)
    # without universum negatives the bank is B itself (SupCon over real u synthetic)
    plain = float(unicon_loss(real, y, syn, ys, None, temperature=0.2))
    assert math.isclose(plain, float(supcon_loss(anchors, a_lab, temperature=0.2)), rel_tol=1e-9)


def test_universum_mixes_each_anchor_with_a_sample_of_another_class():
    """Eq. 8 (UniCon): u_j = 0.7 x_j + 0.3 x_k with x_k of a different class than x_j -- the
    next real sample of another class, else a synthetic one of another class, else (one class
    everywhere) the batch neighbour."""
    x = torch.tensor([[0.0], [1.0], [2.0], [3.0]])
    y = torch.tensor([0, 0, 1, 0])
    u = universum(x, y, 0.7)
    # j=0 (class 0) -> k=2 (class 1, first other class after 0); j=1 -> 2; j=2 (class 1) -> 3;
    # j=3 -> 2 (wraps around: 0 and 1 are class 0)
    want = 0.7 * x.flatten() + 0.3 * torch.tensor([2.0, 2.0, 3.0, 2.0])
    assert torch.allclose(u.flatten(), want)
    # all real samples of one class: the synthetic sample of another class is the partner
    same = torch.zeros(4, dtype=torch.long)
    xs, ys = torch.tensor([[10.0], [20.0]]), torch.tensor([0, 1])
    u = universum(x, same, 0.7, xs, ys)
    assert torch.allclose(u.flatten(), 0.7 * x.flatten() + 0.3 * 20.0)
    # one class everywhere: the neighbour j - 1
    u = universum(x, same, 0.7)
    assert torch.allclose(u.flatten(), 0.7 * x.flatten() + 0.3 * torch.tensor([3.0, 0, 1, 2]))


def _distill(data, **kw):
    module = build_model("mlp", data.input_shape, data.num_classes)
    fm = FunctionalModel(module)
    cfg = DistillConfig(**{"ipc": 3, "iters": 4, "batch_real": 8, **kw})
    return distill_synthetic(fm, fm.initial_params(), data, [0, 1], cfg, [11, 12])


def test_distillation_keeps_shape_and_labels(digits_data):
    xs, ys, stats = _distill(digits_data)
    xs0, _, _ = _distill(digits_data, iters=0)  # the real-sample initialization
    for c, (x, y, x0) in enumerate(zip(xs, ys, xs0)):
        held = torch.unique(digits_data.y[digits_data.train_idx[c]])
        assert x.shape == (3 * len(held), *digits_data.input_shape)
        assert torch.equal(torch.unique(y), held)
        assert torch.equal(y.bincount(minlength=10)[held], torch.full((len(held),), 3))
        assert torch.isfinite(x).all() and not torch.equal(x, x0)  # the images moved
    assert set(stats) >= {"distill_dm_loss", "distill_cc_loss"}
    x, y = merge_synthetic(xs, ys)
    assert len(y) == sum(len(t) for t in ys) and bool((y[1:] >= y[:-1]).all())


def test_dp_epsilon_grows_as_noise_shrinks(digits_data):
    pytest.importorskip("opacus")
    eps = []
    for sigma in (3.0, 1.0, 0.6):
        xs, _, stats = _distill(digits_data, dp_noise=sigma, init="noise")
        assert all(torch.isfinite(x).all() for x in xs)
        eps.append(float(stats["dp_epsilon"].max()))
    assert 0 < eps[0] < eps[1] < eps[2] < math.inf


def test_step_ctx_vectorized_matches_client_loop(digits_data):
    """Per-step synthetic batches through step_ctx: vmap and the per-client loop agree."""
    module = build_model("mlp", digits_data.input_shape, digits_data.num_classes)
    fm = FunctionalModel(module.double())
    # a few steps are enough; client 1 takes fewer steps than client 0 (masked steps)
    short = [t[: 40 - 16 * i] for i, t in enumerate(digits_data.train_idx)]
    data = dataclasses.replace(digits_data, train_idx=short, dtype=torch.float64)
    syn_x = torch.randn(12, *data.input_shape, dtype=torch.float64)
    syn_y = torch.arange(12) % 10
    sgd = SGDConfig(lr=0.05, epochs=1, batch_size=16)
    out = []
    for vec in (True, False):
        group = ClientGroup(fm, [0, 1], data, rnd=1, seed=0, sgd=sgd, vectorize=vec)
        steps = group.plan().steps
        idx = torch.stack([draw_batches(12, steps, 5, s, syn_y.device) for s in (3, 4)], 1)
        loss_fn = partial(
            synthetic_objective,
            lambda_s=0.1,
            lambda_reg=0.1,
            mixup=0.7,
            use_universum=True,
            temperature=0.1,
        )
        theta = fm.initial_params().expand(2, -1).clone()
        out.append(
            group.train(
                theta,
                fm.initial_buffers().expand(2, -1).clone(),
                loss_fn=loss_fn,
                ctx={"syn_x": syn_x.expand(2, -1, -1, -1, -1), "syn_y": syn_y.expand(2, -1)},
                step_ctx={"syn_idx": idx},
            )
        )
    assert torch.allclose(out[0][0], out[1][0], atol=1e-9)
    assert torch.allclose(out[0][2], out[1][2], atol=1e-9)


def _sim(algorithm="mh_pfedhndd", **extra):
    sets = [
        f"algorithm.name={algorithm}",
        "device=cpu",
        "rounds=2",
        "eval_every=1",
        "dataset.name=digits",
        "dataset.subsample=450",
        "partition.name=quantity",
        "clients.count=3",
        'clients.models=["lenet","mlp"]',
        "local.epochs=1",
        "local.batch_size=32",
        "algorithm.distill_model=lenet",
        "algorithm.distill_iters=3",
        "algorithm.distill_batch_real=16",
        "algorithm.ipc=2",
        "algorithm.syn_batch=8",
    ] + [f"{k}={v}" for k, v in extra.items()]
    if algorithm != "fedavg_dd":
        sets += ["algorithm.out_dim=512", "algorithm.hidden=16"]
    return Simulation(load_config(None, sets))


def test_two_round_run_setup_sends_only_synthetic_sets():
    sim = _sim()
    seen: dict[int, dict] = {}
    original = sim.server.aggregate_setup

    def spy(stage, replies):
        seen[stage] = replies
        return original(stage, replies)

    sim.server.aggregate_setup = spy
    records = sim.run()
    assert set(seen) == {0, 1}
    assert all(set(r) == {"syn_x", "syn_y"} for r in seen[0].values())
    assert all(r == {} for r in seen[1].values())  # stage 1: S goes down, nothing comes up
    assert len(seen[0]) == 3
    m = sum(len(r["syn_y"]) for r in seen[0].values())
    for state in sim.store.values():
        assert state["syn_x"].shape == (m, *sim.data.input_shape)
    setup = records[0]["setup"]
    assert setup["bytes_up"] == sum(
        r["syn_x"].numel() * 4 + r["syn_y"].numel() * 8 for r in seen[0].values()
    )
    assert records[0]["bytes_up_total"] >= setup["bytes_up"] + sim.bytes_join
    assert records[0]["setup_seconds"] > 0
    assert len(records) == 2


def test_one_shot_trains_on_synthetic_set_only():
    sim = _sim(
        "fedavg_dd", **{"clients.models": '"lenet"', "algorithm.one_shot": "true", "rounds": 1}
    )
    sim.server.hp.one_shot_epochs = 2
    theta = sim.server.method.theta  # type: ignore[attr-defined]
    before = {k: v.clone() for k, v in theta.items()}
    records = sim.run()
    assert all(not torch.equal(before[k], v) for k, v in theta.items())
    assert records[-1]["bytes_up_round"] == 0  # clients send nothing in the rounds


def test_fedavg_plug_in_trains_with_the_synthetic_set():
    sim = _sim("fedavg_dd", **{"clients.models": '"mlp"', "rounds": 1})
    records = sim.run()
    assert records[-1]["setup"]["stages"] == 2
    assert all(s["syn_y"].numel() > 0 for s in sim.store.values())


# == defining-property tests (issue 19): every term of Eq. 4-9 against a hand computation ==
#
# A linear "network" (features f = W x, logits = V f + c) in float64 stands in for the client
# and distillation models, so each term of the paper's equations can be written by hand below
# with plain torch and compared with what the method's public functions / roles compute.


class _Tiny(nn.Module):
    """features = W x (no bias), logits = V f + c."""

    def __init__(self, d_in: int, d_feat: int, classes: int) -> None:
        super().__init__()
        self.feat = nn.Linear(d_in, d_feat, bias=False)
        self.fc = nn.Linear(d_feat, classes)

    def forward(self, x: Tensor, return_features: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        f = self.feat(x.flatten(1))
        logits = self.fc(f)
        return (f, logits) if return_features else logits


D_IN, D_FEAT, NCLS = 4, 3, 3
F64 = torch.float64


def _tiny_fm(d_in: int = D_IN, d_feat: int = D_FEAT, classes: int = NCLS) -> FunctionalModel:
    torch.manual_seed(0)
    return FunctionalModel(_Tiny(d_in, d_feat, classes).double(), "tiny")


def _feats(fm: FunctionalModel, theta: Tensor, x: Tensor) -> Tensor:
    return x.flatten(1) @ fm.layout.unflatten(theta)["feat.weight"].T


def _logits(fm: FunctionalModel, theta: Tensor, f: Tensor) -> Tensor:
    p = fm.layout.unflatten(theta)
    return f @ p["fc.weight"].T + p["fc.bias"]


def _fed(x: Tensor, y: Tensor, train: list[list[int]], classes: int = NCLS) -> FederatedData:
    """Hand-made float64 FederatedData (float inputs are used as they are)."""
    return FederatedData(
        x=x,
        y=y,
        train_idx=[torch.tensor(t) for t in train],
        val_idx=[torch.zeros(0, dtype=torch.long) for _ in train],
        test_idx=[torch.zeros(0, dtype=torch.long) for _ in train],
        num_classes=classes,
        input_shape=tuple(x.shape[1:]),
        mean=torch.zeros(0),
        std=torch.zeros(0),
        dtype=F64,
    )


def _hand_contrast(
    za: Tensor, ya: Tensor, zb: Tensor, yb: Tensor, tau: float, *, own: bool = True
) -> Tensor:
    """Eq. 5 / Eq. 8 written out: anchor j against the bank without its own entry j
    (``B_{u\\j}``); numerator exp(z_j . m / tau) with m the mean of the bank's class-y_j entries;
    features L2-normalized; mean over the anchors that have a positive (DESIGN reading)."""
    za, zb = F.normalize(za, dim=-1), F.normalize(zb, dim=-1)
    terms = []
    for j in range(len(za)):
        others = [a for a in range(len(zb)) if not (own and a == j)]
        pos = [a for a in others if int(yb[a]) == int(ya[j])]
        if not pos:
            continue
        m = zb[pos].mean(0)
        den = torch.stack([torch.exp(za[j] @ zb[a] / tau) for a in others]).sum()
        terms.append(-(za[j] @ m / tau - torch.log(den)))
    return torch.stack(terms).mean()


def _hand_eq9(
    fm: FunctionalModel,
    theta: Tensor,
    x: Tensor,
    y: Tensor,
    xs: Tensor,
    ys: Tensor,
    *,
    lambda_s: float,
    lambda_reg: float,
    mix: float,
    tau: float,
    use_universum: bool = True,
) -> Tensor:
    """Eq. 9 = CE(B_D) + lambda_S CE(B_S) + lambda_Reg L_Reg (Eq. 8). B_D has two samples, so
    the universum partner x_k (k != j) of x_j is the other one: u_j = mix x_j + (1-mix) x_k."""
    assert len(x) == 2
    u = mix * x + (1 - mix) * x.flip(0)
    f, fs, fu = (_feats(fm, theta, t) for t in (x, xs, u))
    ce = F.cross_entropy(_logits(fm, theta, f), y)
    ce_s = F.cross_entropy(_logits(fm, theta, fs), ys)
    anchors, labels = torch.cat([f, fs]), torch.cat([y, ys])
    bank = torch.cat([fu, fs]) if use_universum else anchors
    reg = _hand_contrast(anchors, labels, bank, labels, tau)
    return ce + lambda_s * ce_s + lambda_reg * reg


def _eq9_example() -> tuple[FunctionalModel, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """A 2-sample real batch (classes 0, 1) and a 3-sample synthetic set (classes 0, 1, 1)."""
    fm = _tiny_fm()
    g = torch.Generator().manual_seed(5)
    theta = torch.randn(fm.num_params, generator=g, dtype=F64)
    x = torch.randn(2, D_IN, generator=g, dtype=F64)
    xs = torch.randn(3, D_IN, generator=g, dtype=F64)
    return fm, theta, x, torch.tensor([0, 1]), xs, torch.tensor([0, 1, 1])


def _grad(fn: Callable[[Tensor], Tensor], theta: Tensor) -> Tensor:
    leaf = theta.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad(fn(leaf), leaf)
    return g


@pytest.mark.parametrize("weights", [(0.3, 0.7, 0.6), "paper"])
def test_eq9_synthetic_objective_equals_hand_loss(weights):
    """Eq. 8-9: synthetic_objective = CE(B_D) + lambda_S CE(B_S) + lambda_Reg UniCon(B, U u B_S)
    with Mixup universum negatives; each term visibly changes the value in this example."""
    hp = DDParams()
    ls, lr_, mix = (hp.lambda_s, hp.lambda_reg, hp.mixup) if weights == "paper" else weights
    fm, theta, x, y, xs, ys = _eq9_example()
    ctx = {"syn_x": xs, "syn_y": ys, "syn_idx": torch.arange(3)}
    kw = dict(lambda_s=ls, lambda_reg=lr_, temperature=hp.tau_temp)
    got, _ = synthetic_objective(
        fm, theta, fm.initial_buffers(), x, y, ctx, mixup=mix, use_universum=True, **kw
    )
    hand = partial(_hand_eq9, fm, theta, x, y, xs, ys, tau=hp.tau_temp)
    want = hand(lambda_s=ls, lambda_reg=lr_, mix=mix)
    assert torch.allclose(got, want, atol=1e-12, rtol=0)
    # the example discriminates: dropping / swapping a term, or no mixup, moves the value
    for other in (
        hand(lambda_s=0.0, lambda_reg=lr_, mix=mix),
        hand(lambda_s=ls, lambda_reg=0.0, mix=mix),
        hand(lambda_s=ls, lambda_reg=lr_, mix=1.0),  # u_j = x_j: negatives without mixup
        hand(lambda_s=ls, lambda_reg=lr_, mix=mix, use_universum=False),
    ):
        assert abs(float(other - want)) > 1e-3
    # Table 3 "w/o UniNeg": the bank is B = B_D u B_S itself
    plain, _ = synthetic_objective(
        fm, theta, fm.initial_buffers(), x, y, ctx, mixup=mix, use_universum=False, **kw
    )
    want_plain = hand(lambda_s=ls, lambda_reg=lr_, mix=mix, use_universum=False)
    assert torch.allclose(plain, want_plain, atol=1e-12, rtol=0)


def _fit_setup(
    client_cls: type, hp_cls: type, **hp_kw: Any
) -> tuple[Any, ClientGroup, dict[str, Tensor], Tensor, tuple]:
    fm, theta, x, y, xs, ys = _eq9_example()
    data = _fed(x, y, [[0, 1]])
    hp = hp_cls(distill_model="mlp", syn_batch=3, **hp_kw)
    client = client_cls(hp, ClientContext(0, torch.device("cpu"), NCLS, (D_IN,)))
    sgd = SGDConfig(lr=0.1, momentum=0.0, weight_decay=0.0, epochs=1, batch_size=2)
    group = ClientGroup(fm, [0], data, rnd=1, seed=0, sgd=sgd, vectorize=False)
    state = {"buffers": torch.zeros(1, 0, dtype=F64), "syn_x": xs[None], "syn_y": ys[None]}
    return client, group, state, theta, (fm, x, y, xs, ys)


_FIT_CASES = [
    (MHPFedHNDDClient, MHPFedHNDDParams, {"out_dim": 64, "hidden": 8}),
    (MHPFedHNDDClient, PFedHNDDParams, {"hidden": 8}),
    (FedAvgDDClient, FedAvgDDParams, {}),
]


@pytest.mark.parametrize("client_cls,hp_cls,extra", _FIT_CASES)
def test_client_fit_takes_one_sgd_step_on_eq9(client_cls, hp_cls, extra):
    """Alg. 1 ClientUpdate: theta~ = theta - eta grad(L(B_D) + lambda_S L(B_S) + lambda_Reg
    L_Reg(B_D, B_S)); MH-pFedHNDD replies Delta theta = theta~ - theta, FedAvg+DD theta~.
    lambda_S != lambda_Reg here, so a swapped weight, a dropped term or the universum left out
    changes the step."""
    kw = dict(lambda_s=0.3, lambda_reg=0.7, mixup=0.6, tau_temp=0.5)
    client, group, state, theta, (fm, x, y, xs, ys) = _fit_setup(client_cls, hp_cls, **kw, **extra)
    reply, new_state, loss = client.fit(group, {"theta": theta[None]}, state)
    hand = partial(_hand_eq9, fm, x=x, y=y, xs=xs, ys=ys, tau=0.5)
    want = theta - 0.1 * _grad(partial(hand, lambda_s=0.3, lambda_reg=0.7, mix=0.6), theta)
    trained = theta + reply["delta"][0] if "delta" in reply else reply["theta"][0]
    assert torch.allclose(trained, want, atol=1e-12, rtol=0)
    assert math.isclose(
        float(loss[0]), float(hand(theta, lambda_s=0.3, lambda_reg=0.7, mix=0.6)), rel_tol=1e-9
    )
    assert torch.equal(new_state["syn_x"], state["syn_x"])  # S is kept for the next rounds
    for wrong in ({"lambda_s": 0.0}, {"lambda_reg": 0.0}, {"lambda_s": 0.7, "lambda_reg": 0.3}):
        args = {"lambda_s": 0.3, "lambda_reg": 0.7, "mix": 0.6, **wrong}
        assert (_grad(partial(hand, **args), theta) * 0.1 - (theta - want)).abs().max() > 1e-4


def test_client_fit_only_synthetic_ablation_is_ce_on_s():
    """Table 9 "only S" (train_on = synthetic): the step follows CE(B_S) alone."""
    client, group, state, theta, (fm, x, y, xs, ys) = _fit_setup(
        MHPFedHNDDClient, MHPFedHNDDParams, out_dim=64, hidden=8, train_on="synthetic"
    )
    reply, _, _ = client.fit(group, {"theta": theta[None]}, state)
    ce_s = lambda t: F.cross_entropy(_logits(fm, t, _feats(fm, t, xs)), ys)  # noqa: E731
    assert torch.allclose(reply["delta"][0], -0.1 * _grad(ce_s, theta), atol=1e-12, rtol=0)


def test_dm_loss_on_hand_made_features():
    """Eq. 4 per class (Alg. 1): sum_c ||mean_{x in D_c} f(x) - mean_{s in S_c} f(s)||^2."""
    real = torch.tensor([[[1.0, 0.0], [3.0, 2.0]], [[0.0, 4.0], [9.0, 9.0]]], dtype=F64)
    valid = torch.tensor([[True, True], [True, False]])  # class 1 has one real sample
    syn = torch.tensor([[[0.0, 0.0], [2.0, 0.0]], [[1.0, 1.0], [1.0, 1.0]]], dtype=F64)
    # class 0: ||(2, 1) - (1, 0)||^2 = 2; class 1: ||(0, 4) - (1, 1)||^2 = 10
    got = dm_loss(masked_mean(real, valid), syn.mean(1))
    assert math.isclose(float(got), 12.0, rel_tol=1e-12)
    assert math.isclose(float(dm_loss(masked_mean(real, valid), syn.mean(1), valid[:, 1])), 2.0)


def test_cc_supcon_loss_closed_form():
    """Eq. 5 on four unit features, two per class, tau = 1: every anchor has one positive
    (dot 1) and denominator e^1 + e^0 + e^0, so L_CC = log(e + 2) - 1 (mean over anchors)."""
    f = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]], dtype=F64)
    y = torch.tensor([0, 0, 1, 1])
    want = math.log(math.e + 2) - 1
    assert math.isclose(float(supcon_loss(f, y, temperature=1.0)), want, rel_tol=1e-12)
    # tau = 0.5 and an anchor (class 2) with no positive, which is left out
    f3 = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]], dtype=F64)
    got = float(supcon_loss(f3, torch.tensor([0, 0, 2]), temperature=0.5))
    assert math.isclose(got, math.log(math.e**2 + 1) - 2, rel_tol=1e-12)


# -- the distillation phase (Eq. 4-6, Alg. 1 ClientDatasetDistillation) ----------------------


def _distill_data() -> FederatedData:
    """Client 0 holds classes 0 (3 samples) and 2 (2); client 1 classes 1 (2) and 2 (3)."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(10, D_IN, generator=g, dtype=F64)
    y = torch.tensor([0, 0, 0, 2, 2, 1, 1, 2, 2, 2])
    return _fed(x, y, [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]])


def _setup_client(**hp_kw: Any) -> tuple[MHPFedHNDDClient, ClientGroup, FunctionalModel]:
    hp = MHPFedHNDDParams(distill_model="mlp", out_dim=64, hidden=8, **hp_kw)
    client = MHPFedHNDDClient(hp, ClientContext(0, torch.device("cpu"), NCLS, (D_IN,)))
    fm = _tiny_fm()
    client.distilled.distill_fm = fm  # theta_d's architecture: the linear network
    data = _distill_data()
    group = ClientGroup(fm, [0, 1], data, rnd=0, seed=0, sgd=SGDConfig(), vectorize=False)
    return client, group, fm


def _class_dm(s: Tensor, fr: Tensor, yr: Tensor, fs: Tensor, ys: Tensor) -> Tensor:
    """Eq. 4 per class (Alg. 1): sum_c ||mean f(B_D^c) - mean f(S^c)||^2; ``s`` only for dtype."""
    terms = [((fr[yr == c].mean(0) - fs[ys == c].mean(0)) ** 2).sum() for c in ys.unique()]
    return torch.stack(terms).sum().to(s.dtype)


def _distill_total(
    s: Tensor,
    *,
    fm: FunctionalModel,
    theta_d: Tensor,
    xr: Tensor,
    yr: Tensor,
    ys: Tensor,
    lcc: float = 0.5,
) -> Tensor:
    """Eq. 6: L_DM (Eq. 4, per class) + lambda_CC L_CC (Eq. 5, SupCon over D_i u S_i)."""
    fr, fs = _feats(fm, theta_d, xr), _feats(fm, theta_d, s)
    f, y = torch.cat([fr, fs]), torch.cat([yr, ys])
    return _class_dm(s, fr, yr, fs, ys) + lcc * _hand_contrast(f, y, f, y, 0.5)


def test_distillation_step_descends_eq6_with_the_received_theta_d():
    """Alg. 1: S_i <- S_i - beta grad_S (L_DM + lambda_CC L_CC) with features of the theta_d the
    server sent (batch_real >= class sizes: B_D^c is the whole class). One iteration (momentum
    buffer = gradient) equals the hand step; the total loss goes down."""
    kw = dict(ipc=2, distill_lr=0.05, distill_batch_real=8, lambda_cc=0.5, tau_temp=0.5)
    theta_d = torch.randn(_tiny_fm().num_params, generator=torch.Generator().manual_seed(3))
    theta_d = theta_d.to(F64)
    msg = {"theta_d": theta_d[None].expand(2, -1)}
    client0, group, fm = _setup_client(distill_iters=0, **kw)
    start, _, _ = client0.setup(0, group, msg, client0.init_state(fm, 2))
    client1, group, fm = _setup_client(distill_iters=1, **kw)
    out, _, _ = client1.setup(0, group, msg, client1.init_state(fm, 2))
    data = group.data
    for c in (0, 1):
        s0, ys = start[c]["syn_x"], start[c]["syn_y"]
        assert torch.equal(out[c]["syn_y"], ys) and sorted(set(ys.tolist())) == (
            [0, 2] if c == 0 else [1, 2]
        )
        xr, yr = data.batch(data.train_idx[c])
        total = partial(_distill_total, fm=fm, theta_d=theta_d, xr=xr, yr=yr, ys=ys)
        g = _grad(total, s0)
        want = s0 - 0.05 * g
        assert torch.allclose(out[c]["syn_x"], want, atol=1e-12, rtol=0)
        assert float(total(out[c]["syn_x"])) < float(total(s0))  # descent, not ascent
        # the example discriminates: L_CC's share of the step is visible
        assert (g - _grad(partial(total, lcc=0.0), s0)).abs().max() > 1e-3


def _dm_of_inputs(s: Tensor, *, xr: Tensor, yr: Tensor, ys: Tensor) -> Tensor:
    return _class_dm(s, xr, yr, s, ys)  # features f = x


def test_dp_adds_gaussian_noise_of_std_sigma_clip_to_class_sums():
    """Table 6 (DP, ``dp_mechanism = "features"``): each real feature
    is clipped to norm C and each per-class sum gets N(0, (sigma C)^2) noise. With f = x
    (W = I), lambda_CC = 0 and one iteration, S1 - S1(noise-free) = 2 beta / ipc * noise / n_c,
    so the recovered noise must have std sigma * C (here 2 * 0.5 = 1)."""
    pytest.importorskip("opacus")
    d, sigma, clip, lr = 8, 2.0, 0.5, 0.5
    g = torch.Generator().manual_seed(4)
    x = 3 * torch.randn(48, d, generator=g, dtype=F64)  # norms ~8 > C: clipping is active
    y = torch.arange(4).repeat_interleave(3).repeat(4)  # 4 clients x 4 classes x 3 samples
    data = _fed(x, y, [list(range(12 * i, 12 * i + 12)) for i in range(4)], classes=4)
    fm = _tiny_fm(d, d, 4)
    theta_d = fm.initial_params().clone()
    theta_d[: d * d] = torch.eye(d, dtype=F64).reshape(-1)  # feat.weight = I
    assert torch.equal(fm.layout.unflatten(theta_d)["feat.weight"], torch.eye(d, dtype=F64))
    kw = dict(
        ipc=1,
        distill_lr=lr,
        distill_batch_real=8,
        lambda_cc=0.0,
        dp_noise=sigma,
        dp_mechanism="features",
        dp_clip=clip,
        distill_init="noise",
        distill_model="mlp",
        out_dim=64,
        hidden=8,
    )
    outs = []
    for iters in (0, 1):
        hp = MHPFedHNDDParams(distill_iters=iters, **kw)
        client = MHPFedHNDDClient(hp, ClientContext(0, torch.device("cpu"), 4, (d,)))
        client.distilled.distill_fm = fm
        group = ClientGroup(fm, [0, 1, 2, 3], data, rnd=0, seed=0, sgd=SGDConfig())
        msg = {"theta_d": theta_d[None].expand(4, -1)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            outs.append(client.setup(0, group, msg, client.init_state(fm, 4))[0])
    z = []
    for c in range(4):
        s0, s1 = outs[0][c]["syn_x"], outs[1][c]["syn_x"]
        xr, yr = data.batch(data.train_idx[c])
        xr = xr * (clip / xr.norm(dim=-1, keepdim=True)).clamp(max=1.0)
        ys = outs[0][c]["syn_y"]
        dm = partial(_dm_of_inputs, xr=xr, yr=yr, ys=ys)
        clean = s0 - lr * _grad(dm, s0)
        z.append((s1 - clean) * 3 * 1 / (2 * lr))  # n_c = 3 real samples, ipc = 1
    z = torch.cat(z).flatten()
    assert 0.7 * sigma * clip < float(z.std()) < 1.3 * sigma * clip
    assert abs(float(z.mean())) < 0.3 * sigma * clip


# -- the server: theta_d, merging S (Eq. 7), what each client is evaluated with -----------------


def _dd_server(
    hp: Any, server_cls: type = MHPFedHNDDServer, fm: FunctionalModel | None = None
) -> Any:
    fm = fm or _tiny_fm()
    clients = {
        c: {"num_params": torch.tensor(fm.num_params), "num_samples": torch.tensor(5)}
        for c in (0, 1)
    }
    ctx = ServerContext(0, torch.device("cpu"), NCLS, (D_IN,), models={"tiny": fm})
    return server_cls(hp, clients, ctx)


def _hand_sets() -> dict[int, dict[str, Tensor]]:
    """Client 0 uploads classes 0, 0, 2; client 1 classes 1, 0 (images: distinct constants)."""
    img = lambda v: torch.full((D_IN,), float(v))  # noqa: E731
    return {
        0: {"syn_x": torch.stack([img(1), img(2), img(3)]), "syn_y": torch.tensor([0, 0, 2])},
        1: {"syn_x": torch.stack([img(4), img(5)]), "syn_y": torch.tensor([1, 0])},
    }


@pytest.mark.parametrize(
    "hp,server_cls",
    [
        (MHPFedHNDDParams(distill_model="mlp", out_dim=64, hidden=8), MHPFedHNDDServer),
        (FedAvgDDParams(distill_model="mlp"), FedAvgDDServer),
    ],
)
def test_server_merges_synthetic_sets_by_class_and_sends_s_to_all(hp, server_cls):
    """Eq. 7 / §3.4: S holds, for every class c, every client's class-c images (each with its
    own label); stage 1 sends that S to every client, which keeps it; nothing after."""
    server = _dd_server(hp, server_cls)
    replies = _hand_sets()
    for c, r in replies.items():
        assert server.check_setup_reply(0, c, r) is None
    assert server.check_setup_reply(0, 0, {**replies[0], "theta": torch.zeros(3)}) is not None
    server.aggregate_setup(0, replies)
    down = server.configure_setup(1, [0, 1])
    assert set(down) == {0, 1} and server.configure_setup(2, [0, 1]) == {}
    for msg in down.values():
        x, y = msg["syn_x"], msg["syn_y"]
        got = {int(k): sorted(x[y == k][:, 0].tolist()) for k in y.unique()}
        assert got == {0: [1.0, 2.0, 5.0], 1: [4.0], 2: [3.0]}
        assert torch.equal(x[:, 0], x[:, -1])  # whole images moved, not only first pixels
    # the client keeps S in its state (stage 1 replies nothing)
    client = MHPFedHNDDClient(
        MHPFedHNDDParams(distill_model="mlp", out_dim=64, hidden=8),
        ClientContext(0, torch.device("cpu"), NCLS, (D_IN,)),
    )
    fm = _tiny_fm()
    group = ClientGroup(fm, [0, 1], _distill_data(), rnd=0, seed=0, sgd=SGDConfig())
    msg = {k: torch.stack([down[0][k], down[1][k]]) for k in ("syn_x", "syn_y")}
    up, state, _ = client.setup(1, group, msg, client.init_state(fm, 2))
    assert up == [{}, {}]
    for c in (0, 1):
        assert torch.equal(state["syn_x"][c], down[0]["syn_x"])
        assert torch.equal(state["syn_y"][c], down[0]["syn_y"])


def test_server_sends_theta_d_generated_from_v_d_by_the_hypernetwork():
    """§3.4 / Alg. 1: theta_d = h(v_d; phi)[:K_d], the same for every client, K_d the size of
    ``distill_model``; FedAvg+DD sends a random initialization of it instead (Table 5)."""
    for hp in (
        MHPFedHNDDParams(distill_model="mlp", out_dim=64, hidden=8),
        PFedHNDDParams(distill_model="mlp", hidden=8),
    ):
        server = _dd_server(hp)
        sent = server.configure_setup(0, [0, 1])
        k_d = sum(p.numel() for p in build_model("mlp", (D_IN,), NCLS).parameters())
        assert sent[0]["theta_d"].shape == (k_d,)
        assert torch.equal(sent[0]["theta_d"], sent[1]["theta_d"])
        with torch.no_grad():
            gen = server.method.hnet.generate([DISTILL, 0])
        assert torch.equal(sent[0]["theta_d"], gen[DISTILL])
        # changing v_d (only) changes theta_d: it is the distillation slot's own embedding
        with torch.no_grad():
            hnet = server.method.hnet
            hnet.embeddings[hnet._name(DISTILL)].add_(1.0)
        assert not torch.equal(server.configure_setup(0, [0])[0]["theta_d"], sent[0]["theta_d"])
    fed = _dd_server(FedAvgDDParams(distill_model="mlp"), FedAvgDDServer)
    a, b = fed.configure_setup(0, [0, 1]).values()
    assert torch.equal(a["theta_d"], b["theta_d"]) and a["theta_d"].shape == (k_d,)


def test_mh_pfedhndd_evaluates_the_generated_personalized_model():
    """Alg. 1 output {theta_i}: client i is evaluated with theta_i = h(v_i; phi)[:K_i] as the
    server generates it (not theta_d, not a locally fine-tuned copy) and its own buffers."""
    server = _dd_server(MHPFedHNDDParams(distill_model="mlp", out_dim=64, hidden=8))
    msgs = server.configure_eval([0, 1])
    with torch.no_grad():
        gen = server.method.hnet.generate([0, 1])
    assert torch.equal(msgs[0]["theta"], gen[0]) and torch.equal(msgs[1]["theta"], gen[1])
    assert not torch.equal(gen[0], gen[1])  # personalized: one model per client
    client, group, state, _, _ = _fit_setup(
        MHPFedHNDDClient, MHPFedHNDDParams, out_dim=64, hidden=8
    )
    theta = msgs[0]["theta"].to(F64)[None]
    _, new_state, _ = client.fit(group, {"theta": theta}, state)
    ev_theta, ev_buffers = client.eval_model(group, {"theta": theta}, new_state)
    assert torch.equal(ev_theta, theta) and torch.equal(ev_buffers, new_state["buffers"])


def test_fedavg_dd_evaluates_the_global_model_and_one_shot_the_model_trained_on_s():
    """Table 5: FedAvg+DD clients are evaluated with their architecture's global model.
    Table 9 one-shot: the server trains it on S (SGD, lr one_shot_lr, weight decay 1e-4, batch 64;
    one epoch over the 4 merged images = one step of the full-batch gradient) and clients are
    evaluated with that model."""
    server = _dd_server(FedAvgDDParams(distill_model="mlp"), FedAvgDDServer)
    theta0 = server.method.theta[str(_tiny_fm().num_params)].clone()
    assert all(torch.equal(m["theta"], theta0) for m in server.configure_eval([0, 1]).values())
    fm = _tiny_fm()
    fm32 = FunctionalModel(_Tiny(D_IN, D_FEAT, NCLS), "tiny")  # the server's float32 model
    one = _dd_server(
        FedAvgDDParams(distill_model="mlp", one_shot=True, one_shot_epochs=1, one_shot_lr=0.5),
        FedAvgDDServer,
        fm32,
    )
    key = str(fm.num_params)
    start = one.method.theta[key].clone()
    replies = _hand_sets()
    replies[1] = {"syn_x": replies[1]["syn_x"][:1], "syn_y": replies[1]["syn_y"][:1]}  # M = 4
    one.aggregate_setup(0, replies)
    xs = torch.cat([r["syn_x"] for r in replies.values()]).to(F64)
    ys = torch.cat([r["syn_y"] for r in replies.values()])
    t0 = start.to(F64)
    ce = lambda t: F.cross_entropy(_logits(fm, t, _feats(fm, t, xs)), ys)  # noqa: E731
    want = t0 - 0.5 * (_grad(ce, t0) + 1e-4 * t0)
    msgs = one.configure_eval([0, 1])
    for m in msgs.values():
        assert torch.allclose(m["theta"].to(F64), want, atol=1e-5, rtol=0)
    client = FedAvgDDClient(one.hp, ClientContext(0, torch.device("cpu"), NCLS, (D_IN,)))
    group = ClientGroup(fm32, [0], _distill_data(), rnd=1, seed=0, sgd=SGDConfig())
    state = client.init_state(fm32, 1)
    ev, _ = client.eval_model(group, {k: v[None] for k, v in msgs[0].items()}, state)
    assert torch.equal(ev[0], msgs[0]["theta"])
    assert one.configure_train(1, [0]) == {0: {}}  # clients train nothing in one-shot rounds
    # and every record says so: the plug-in scores FedAvg's global model (issue 36 protocol)
    from hyperfed.algorithms import get_algorithm

    fedavg_dd = get_algorithm("fedavg_dd")
    assert fedavg_dd.scored_model(FedAvgDDParams()) == "global"
    assert fedavg_dd.scored_model(FedAvgDDParams(one_shot=True)) == "global"


def test_paper_weights_and_defaults():
    """§4 / §B.2 / App. D.1: lambda = 0.7, lambda_CC = 5e-4, lambda_S = lambda_Reg = 0.1,
    T = 3000, IPC 10 (CIFAR-100), synthetic batch 50, ConvNet (Table 10), hypernetwork lr 2e-4,
    local lr 1e-3 with weight decay 1e-4 and 1 local epoch; FedAvg (+DD) lr 0.01."""
    hp = MHPFedHNDDParams()
    assert (hp.mixup, hp.lambda_cc, hp.lambda_s, hp.lambda_reg) == (0.7, 5e-4, 0.1, 0.1)
    assert (hp.distill_iters, hp.ipc, hp.syn_batch, hp.distill_model) == (3000, 10, 50, "convnet")
    assert hp.hn_lr == 2e-4 and hp.universum and hp.train_on == "both"
    cfg = hp.distill_config()
    assert (cfg.lambda_cc, cfg.iters, cfg.ipc, cfg.init) == (5e-4, 3000, 10, "real")
    algos = {a.name: a for a in ALGORITHMS}
    assert set(algos) == {"mh_pfedhndd", "pfedhn_dd", "fedavg_dd"}
    for name in ("mh_pfedhndd", "pfedhn_dd"):
        local = algos[name].local_defaults
        assert (local["lr"], local["weight_decay"], local["epochs"]) == (1e-3, 1e-4, 1)
    assert algos["fedavg_dd"].local_defaults["lr"] == 1e-2
    assert PFedHNDDParams().out_dim is None  # pFedHN: one chunk of K_i per client
    assert FedAvgDDParams().lambda_s == 0.1 and FedAvgDDParams().lambda_reg == 0.1


@pytest.mark.parametrize("name", ["mh_pfedhndd", "pfedhn_dd"])
@pytest.mark.parametrize("key", ["personal_layers", "frozen_layers"])
def test_inherited_layer_modes_are_refused_not_ignored(name: str, key: str) -> None:
    """Issue 18 item 4: a parameter inherited from MH-pFedHN that the DD client does not
    serve is refused in one line, never silently ignored."""
    with pytest.raises(ConfigError, match=f"{key}: the MH-pFedHNDD client trains every"):
        load_config(None, [f"algorithm.name={name}", f'algorithm.{key}=["head"]'])


def test_held_out_clients_images_are_not_in_the_merged_set():
    """Fig. 3 (generalization with DD): S is merged from the training clients' S_i only; a
    held-out client (new_clients) joins later and contributes nothing, but receives S."""
    sim = _sim(**{"algorithm.new_clients": 0.34, "algorithm.adapt_rounds": 1})
    assert sim.server.method.new_ids == [2]  # type: ignore[attr-defined]
    info = sim.run_setup()
    held = [torch.unique(sim.data.y[sim.data.train_idx[c]]).numel() for c in (0, 1)]
    assert sim.server.shared_synthetic()[1].numel() == 2 * sum(
        held
    )  # ipc = 2 per class of clients 0 and 1
    assert info["setup"]["rejected"] == []
    assert torch.equal(sim.store[2]["syn_y"], sim.server.shared_synthetic()[1])  # it still gets S


def test_cc_reduction_sum_is_eq5s_sum_over_the_anchors(digits_data):
    """Eq. 5 sums L_CC over the anchors; ``cc_reduction = "mean"`` divides by their number N.
    One plain gradient step: the CC part of the step with "sum" is N times the "mean" one, the
    same N for every pixel of a client (N = its real + synthetic anchors, an integer > 1)."""
    base = dict(iters=1, momentum=0.0, lr=0.1)
    runs = []
    for kw in ({"lambda_cc": 0.0}, {"cc_reduction": "mean"}, {"cc_reduction": "sum"}):
        torch.manual_seed(0)  # _distill builds a fresh model: the same one for the three
        runs.append(_distill(digits_data, **base, **{"lambda_cc": 1.0, **kw})[0])
    none, mean, summed = runs
    for c in range(2):
        d_mean, d_sum = mean[c] - none[c], summed[c] - none[c]
        big = d_mean.abs() > 0.05 * d_mean.abs().max()  # float32: small steps are noise
        ratio = d_sum[big] / d_mean[big]
        n = float(ratio.median())
        assert n > 1 and abs(n - round(n)) < 1e-3
        assert torch.allclose(ratio, torch.full_like(ratio, n), rtol=0.02)  # float32 steps
