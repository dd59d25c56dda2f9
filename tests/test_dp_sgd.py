"""DP-SGD in MH-pFedHNDD's distillation step (seed 003 §4.6, Table 6; Abadi et al. 2016) and the
RDP accountant: per-sample clipping, noise std sigma * C, the plain gradient without noise,
epsilon of the steps actually taken."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hyperfed.algorithms.mh_pfedhndd import MHPFedHNDDParams
from hyperfed.config import ConfigError, load_config
from hyperfed.data.federated import FederatedData
from hyperfed.distill.synthesis import DistillConfig, distill_synthetic, dp_sgd_image_grad
from hyperfed.models.layout import FunctionalModel
from hyperfed.privacy.accounting import composed_epsilon, gaussian_epsilon, noise_for_epsilon
from hyperfed.privacy.dp_sgd import clip_per_sample, noisy_clipped_sum

F64 = torch.float64


class _Net(nn.Module):
    """features = tanh(W x) (or W x), logits = V f."""

    def __init__(self, d_in: int, d_feat: int, classes: int, act: bool = True) -> None:
        super().__init__()
        self.feat = nn.Linear(d_in, d_feat, bias=False)
        self.fc = nn.Linear(d_feat, classes, bias=False)
        self.act = act

    def forward(self, x: Tensor, return_features: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        f = self.feat(x.flatten(1))
        f = torch.tanh(f) if self.act else f
        return (f, self.fc(f)) if return_features else self.fc(f)


def _fm(
    d_in: int, d_feat: int, classes: int, act: bool = True, dtype: torch.dtype = F64
) -> FunctionalModel:
    torch.manual_seed(0)
    return FunctionalModel(_Net(d_in, d_feat, classes, act).to(dtype), "net")


def _feats(fm: FunctionalModel, theta: Tensor, x: Tensor) -> Tensor:
    return torch.tanh(x.flatten(1) @ fm.layout.unflatten(theta)["feat.weight"].T)


# -- the DP-SGD primitives ---------------------------------------------------------------------


def test_clipping_caps_each_sample_at_exactly_c_and_keeps_small_ones():
    """Abadi et al. Alg. 1: g_i / max(1, ||g_i|| / C). A huge gradient contributes exactly norm
    C in its own direction; one below C is untouched."""
    huge = torch.tensor([[3e6, -4e6], [0.0, 0.0]], dtype=F64)  # norm 5e6
    small = torch.tensor([[0.1, 0.2], [0.0, -0.2]], dtype=F64)  # norm 0.3
    grads = torch.stack([huge, small])
    out = clip_per_sample(grads, 1.5)
    assert math.isclose(float(out[0].norm()), 1.5, rel_tol=1e-12)
    assert torch.allclose(out[0], huge * 1.5 / 5e6, rtol=1e-12, atol=0)
    assert torch.equal(out[1], small)
    total = noisy_clipped_sum(grads, 1.5, 0.0)
    assert torch.allclose(total, huge * 1.5 / 5e6 + small, rtol=1e-12, atol=0)


def test_noise_has_std_sigma_times_clip():
    """sum_i clip(g_i) + N(0, (sigma C)^2 I): with zero gradients the output is the noise. Over
    n = 40000 draws the sample std has relative standard error 1/sqrt(2n) = 0.35%; we allow
    5 standard errors (1.8%), and 5 for the mean (sigma C * 5 / sqrt(n)). sigma alone (3.0)
    or C alone (0.5) would be off by a factor 2 or 3."""
    n, sigma, clip = 40_000, 3.0, 0.5
    g = torch.Generator().manual_seed(0)
    z = noisy_clipped_sum(torch.zeros(2, n, dtype=F64), clip, sigma, g)
    s = sigma * clip
    assert abs(float(z.std()) / s - 1) < 5 / math.sqrt(2 * n)
    assert abs(float(z.mean())) < 5 * s / math.sqrt(n)


# -- the gradient of the synthetic images --------------------------------------------------------


def _example(ipc: int = 2) -> tuple[FunctionalModel, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Two classes, ipc synthetic images each, real batches of 3 and 2 (lot k = 3)."""
    fm = _fm(4, 3, 2)
    theta = torch.randn(fm.num_params, generator=torch.Generator().manual_seed(1), dtype=F64)
    g = torch.Generator().manual_seed(2)
    syn = torch.randn(2, ipc, 4, generator=g, dtype=F64)
    xr = torch.randn(2, 3, 4, generator=g, dtype=F64) * torch.tensor([1.0, 4.0]).view(2, 1, 1)
    valid = torch.tensor([[True, True, True], [True, True, False]])
    return fm, theta, syn, torch.tensor([0, 1]), xr, valid


def _hand_objective(
    s: Tensor, fm: FunctionalModel, theta: Tensor, xr: Tensor, valid: Tensor, lcc: float, t: float
) -> tuple[Tensor, Tensor]:
    """Eq. 4 per class + lambda_CC * Eq. 5 with the bank S_i (real anchors against S_i, each
    synthetic anchor against the others), mean over the anchors; written out in loops.
    Returns (L_syn, sum_i r_i): the part without real data and the real samples' terms."""
    h, ipc = s.shape[:2]
    fs = _feats(fm, theta, s.reshape(h * ipc, -1)).reshape(h, ipc, -1)
    mu_s = fs.mean(1)
    real = [(c, _feats(fm, theta, xr[c, j : j + 1])[0]) for c in range(h) for j in range(3)]
    real = [(c, f) for (c, f), v in zip(real, valid.reshape(-1)) if v]
    k_c = valid.sum(1).to(F64)
    bank = F.normalize(fs.reshape(h * ipc, -1), dim=-1)
    labels = [c for c in range(h) for _ in range(ipc)]
    n_anchor = len(real) + h * ipc
    l_syn = sum(mu_s[c] @ mu_s[c] for c in range(h))
    l_real = 0.0
    for c, f in real:
        l_real = l_real - 2 / k_c[c] * (f @ mu_s[c])  # the cross term of ||mu_r - mu_s||^2
        z = F.normalize(f, dim=-1)
        log_den = torch.logsumexp(bank @ z / t, 0)
        pos = [bank[a] @ z / t - log_den for a in range(h * ipc) if labels[a] == c]
        l_real = l_real - lcc / n_anchor * sum(pos) / len(pos)
    for j in range(h * ipc):
        others = [a for a in range(h * ipc) if a != j]
        log_den = torch.logsumexp(torch.stack([bank[a] @ bank[j] / t for a in others]), 0)
        pos = [bank[a] @ bank[j] / t - log_den for a in others if labels[a] == labels[j]]
        l_syn = l_syn - lcc / n_anchor * sum(pos) / len(pos)
    return l_syn, l_real


def _grad(fn, s: Tensor) -> Tensor:  # type: ignore[no-untyped-def]
    leaf = s.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad(fn(leaf), leaf)
    return g


@pytest.mark.parametrize("lcc", [0.0, 0.7])
def test_no_noise_and_a_huge_clip_give_the_plain_gradient(lcc):
    """sigma = 0 and C = 1e12: DP-SGD's step is the plain gradient of L_DM + lambda_CC L_CC
    (lambda_CC = 0: Eq. 4 exactly, ||mu_r,c - mu_s,c||^2 per class, by autograd on a
    hand-written loss)."""
    fm, theta, syn, labels, xr, valid = _example()
    fr = _feats(fm, theta, xr.reshape(6, 4)).reshape(2, 3, -1)
    got, dm, _ = dp_sgd_image_grad(
        fm, theta, fm.initial_buffers(), syn, labels, fr, valid,
        lot=3, clip=1e12, sigma=0.0, lambda_cc=lcc, temperature=0.5,
    )  # fmt: skip
    want = _grad(lambda s: sum(_hand_objective(s, fm, theta, xr, valid, lcc, 0.5)), syn)
    assert torch.allclose(got, want, atol=1e-12, rtol=1e-10)
    if lcc == 0:  # Eq. 4 itself, with the real class means

        def eq4(s: Tensor) -> Tensor:
            fs = _feats(fm, theta, s.reshape(4, 4)).reshape(2, 2, -1)
            mu_r = torch.stack([fr[0].mean(0), fr[1, :2].mean(0)])
            return ((mu_r - fs.mean(1)) ** 2).sum()

        assert torch.allclose(got, _grad(eq4, syn), atol=1e-12, rtol=1e-10)
        assert math.isclose(float(dm), float(eq4(syn)), rel_tol=1e-10)


def test_each_real_samples_gradient_is_clipped_before_the_sum():
    """Per-sample loss l_i = k r_i (r_i: sample i's terms of L); the step is grad L_syn +
    (sum_i clip(grad l_i, C)) / k. With C below most per-sample norms the hand value differs
    from the unclipped gradient, and the DP-SGD gradient equals the clipped one."""
    fm, theta, syn, labels, xr, valid = _example()
    fr = _feats(fm, theta, xr.reshape(6, 4)).reshape(2, 3, -1)
    lcc, clip, k = 0.7, 0.05, 3
    got, _, _ = dp_sgd_image_grad(
        fm, theta, fm.initial_buffers(), syn, labels, fr, valid,
        lot=k, clip=clip, sigma=0.0, lambda_cc=lcc, temperature=0.5,
    )  # fmt: skip
    want = _grad(lambda s: _hand_objective(s, fm, theta, xr, valid, lcc, 0.5)[0], syn)
    norms, clipped = [], torch.zeros_like(syn)
    for c, j in [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]:
        one = torch.zeros_like(valid)
        one[c, j] = True
        mask = valid & one
        # sample (c, j) alone: its terms of L, with the k_c and anchor count of the full batch
        gi = _grad(lambda s, m=mask: k * _hand_real_subset(s, fm, theta, xr, valid, m, lcc), syn)
        norms.append(float(gi.norm()))
        clipped += gi * min(1.0, clip / float(gi.norm()))
    assert sum(n > clip for n in norms) >= 3 and min(norms) > 0  # clipping is active
    want = want + clipped / k
    assert torch.allclose(got, want, atol=1e-12, rtol=1e-10)
    plain = _grad(lambda s: sum(_hand_objective(s, fm, theta, xr, valid, lcc, 0.5)), syn)
    assert (got - plain).abs().max() > 1e-3


def _hand_real_subset(
    s: Tensor, fm: FunctionalModel, theta: Tensor, xr: Tensor, valid: Tensor, keep: Tensor, lcc
) -> Tensor:
    """sum of r_j over the samples in ``keep`` (k_c and anchor count from ``valid``)."""
    h, ipc = s.shape[:2]
    fs = _feats(fm, theta, s.reshape(h * ipc, -1)).reshape(h, ipc, -1)
    bank = F.normalize(fs.reshape(h * ipc, -1), dim=-1)
    k_c, n_anchor = valid.sum(1).to(F64), int(valid.sum()) + h * ipc
    total = s.new_zeros(())
    for c in range(h):
        for j in range(3):
            if not keep[c, j]:
                continue
            f = _feats(fm, theta, xr[c, j : j + 1])[0]
            total = total - 2 / k_c[c] * (f @ fs[c].mean(0))
            z = F.normalize(f, dim=-1)
            log_p = bank @ z / 0.5 - torch.logsumexp(bank @ z / 0.5, 0)
            total = total - lcc / n_anchor * log_p[c * ipc : (c + 1) * ipc].mean()
    return total


# -- through distill_synthetic / the client's hyperparameters -----------------------------------


def _identity_data(clients: int, d: int, per_class: int, classes: int) -> FederatedData:
    g = torch.Generator().manual_seed(4)
    n = clients * classes * per_class
    x = 3 * torch.randn(n, d, generator=g, dtype=F64)  # norms ~ 3 sqrt(d): clipping is active
    y = torch.arange(classes).repeat_interleave(per_class).repeat(clients)
    block = classes * per_class
    return FederatedData(
        x=x,
        y=y,
        train_idx=[torch.arange(block * c, block * (c + 1)) for c in range(clients)],
        val_idx=[torch.zeros(0, dtype=torch.long)] * clients,
        test_idx=[torch.zeros(0, dtype=torch.long)] * clients,
        num_classes=classes,
        input_shape=(d,),
        mean=torch.zeros(0),
        std=torch.zeros(0),
        dtype=F64,
    )


def test_distillation_step_adds_noise_of_std_sigma_c_over_the_lot():
    """One DP-SGD iteration with f = x (W = I), lambda_CC = 0, every class batch whole (k = 3):
    S1 = S0 - beta (grad L_syn + (sum_i clip(g_i) + sigma C xi) / k), g_i = -2/ipc x_i on the
    images of x_i's class. Recover sigma C xi from S1 and the hand-clipped clean step; its std
    must be sigma C. n = 8 clients x 4 classes x 4 images x 8 pixels = 1024 entries: 5 standard
    errors of the std is 11%; the per-pixel noise of the features mechanism (spread over a
    class mean of k samples, std sigma C / k) would be 3x too small, sigma alone 2x too big."""
    pytest.importorskip("opacus")
    nc, d, ipc, h, per = 8, 8, 4, 4, 3
    sigma, clip, lr = 1.0, 2.0, 0.5
    data = _identity_data(nc, d, per, h)
    fm = _fm(d, d, h, act=False)
    theta = fm.initial_params().clone()
    theta[: d * d] = torch.eye(d, dtype=F64).reshape(-1)
    ids, seeds = list(range(nc)), [100 + c for c in range(nc)]
    cfg = dict(ipc=ipc, batch_real=8, lambda_cc=0.0, lr=lr, momentum=0.0, init="noise")
    s0, _, _ = distill_synthetic(fm, theta, data, ids, DistillConfig(iters=0, **cfg), seeds)
    s1, y1, stats = distill_synthetic(
        fm, theta, data, ids, DistillConfig(iters=1, dp_noise=sigma, dp_clip=clip, **cfg), seeds
    )
    assert float(stats["dp_steps"][0]) == 1 and float(stats["dp_sample_rate"][0]) == 1.0
    z = []
    for c in range(nc):
        x, y = data.batch(data.train_idx[c])
        a, b = s0[c].reshape(h, ipc, d), s1[c].reshape(h, ipc, d)
        assert torch.equal(y1[c], torch.arange(h).repeat_interleave(ipc))
        g_syn = 2 / ipc * a.mean(1, keepdim=True).expand(h, ipc, d)  # grad sum_c ||mu_s,c||^2
        clipped = torch.zeros_like(a)
        for xi, yi in zip(x, y):
            gi = torch.zeros_like(a)
            gi[yi] = -2 * 3 / (3 * ipc) * xi  # l_i = k * (-2 / k_c) x_i . mu_s,c, k = k_c = 3
            clipped += gi * min(1.0, clip / float(gi.norm()))
        clean = a - lr * (g_syn + clipped / 3)
        z.append((clean - b) * 3 / lr)
    z = torch.cat(z).flatten()
    n = z.numel()
    assert abs(float(z.std()) / (sigma * clip) - 1) < 5 / math.sqrt(2 * n)
    assert abs(float(z.mean())) < 5 * sigma * clip / math.sqrt(n)


def _opacus_epsilon(sigma: float, q: float, steps: int, delta: float) -> float:
    from opacus.accountants import RDPAccountant

    acc = RDPAccountant()
    for _ in range(steps):
        acc.step(noise_multiplier=sigma, sample_rate=q)
    return float(acc.get_epsilon(delta=delta))


def test_accountant_grows_with_steps_falls_with_sigma_and_is_opacus_rdp():
    pytest.importorskip("opacus")
    q, delta = 0.1, 1e-5
    by_steps = [gaussian_epsilon(1.0, q, t, delta) for t in (10, 50, 200)]
    assert by_steps[0] < by_steps[1] < by_steps[2]
    by_sigma = [gaussian_epsilon(s, q, 50, delta) for s in (0.7, 1.0, 2.0)]
    assert by_sigma[0] > by_sigma[1] > by_sigma[2] > 0
    for sigma, rate, steps in [(1.0, 0.1, 50), (0.8, 0.5, 20), (2.0, 1.0, 7)]:
        want = _opacus_epsilon(sigma, rate, steps, delta)
        assert math.isclose(gaussian_epsilon(sigma, rate, steps, delta), want, rel_tol=1e-9)
    # two phases compose like stepping through both
    from opacus.accountants import RDPAccountant

    acc = RDPAccountant()
    for s, r, t in [(1.0, 0.1, 30), (2.0, 0.2, 10)]:
        for _ in range(t):
            acc.step(noise_multiplier=s, sample_rate=r)
    got = composed_epsilon([(1.0, 0.1, 30), (2.0, 0.2, 10)], delta)
    assert math.isclose(got, float(acc.get_epsilon(delta=delta)), rel_tol=1e-9)
    assert gaussian_epsilon(0.0, q, 10, delta) == math.inf and composed_epsilon([], delta) == 0


@pytest.mark.parametrize("mechanism", ["dp_sgd", "features"])
def test_distillation_reports_epsilon_of_the_iterations_taken(digits_data, mechanism):
    """epsilon = RDP(sigma, q = k / n_c of the client's smallest class, T iterations, delta);
    the same for both mechanisms (same sensitivity C, q and steps). A target dp_epsilon
    calibrates sigma so that the reported epsilon reaches it."""
    pytest.importorskip("opacus")
    torch.manual_seed(0)
    fm = _fm(64, 6, 10, dtype=torch.float32)
    iters, k, delta = 3, 4, 1e-5
    base = dict(ipc=2, batch_real=k, lambda_cc=5e-4, init="noise", dp_mechanism=mechanism)
    cfg = DistillConfig(iters=iters, dp_noise=1.3, **base)
    data = digits_data
    _, _, stats = distill_synthetic(fm, fm.initial_params(), data, [0, 1], cfg, [1, 2])
    for c in (0, 1):
        n_c = data.y[data.train_idx[c]].bincount()
        q = min(1.0, k / int(n_c[n_c > 0].min()))
        assert math.isclose(float(stats["dp_sample_rate"][c]), q, rel_tol=1e-12)
        assert float(stats["dp_steps"][c]) == iters
        want = _opacus_epsilon(1.3, q, iters, delta)
        assert math.isclose(float(stats["dp_epsilon"][c]), want, rel_tol=1e-5)
    cfg = DistillConfig(iters=iters, dp_epsilon=8.0, **base)
    _, _, stats = distill_synthetic(fm, fm.initial_params(), data, [0, 1], cfg, [1, 2])
    for c in (0, 1):
        sigma = float(stats["dp_noise"][c])
        q = float(stats["dp_sample_rate"][c])
        assert math.isclose(sigma, noise_for_epsilon(8.0, q, iters, delta), rel_tol=1e-6)
        assert 7.9 < float(stats["dp_epsilon"][c]) <= 8.0 + 1e-9


def test_dp_mechanism_defaults_to_dp_sgd_and_is_validated():
    """§4.6 cites Abadi et al. (DP-SGD) for the synthesis step: the default; features on
    request; anything else is refused in one line."""
    hp = MHPFedHNDDParams(dp_noise=1.0)
    assert hp.distill_config().dp_mechanism == "dp_sgd" and hp.distill_config().private
    assert MHPFedHNDDParams(dp_mechanism="features").distill_config().dp_mechanism == "features"
    with pytest.raises(ConfigError, match="dp_mechanism must be dp_sgd or features"):
        load_config(None, ["algorithm.name=mh_pfedhndd", 'algorithm.dp_mechanism="sgd"'])
