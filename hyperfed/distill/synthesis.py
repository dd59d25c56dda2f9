"""Dataset distillation for federated clients: MH-pFedHNDD's distillation phase (seed 003,
Alg. 1, Eq. 4-7) with optional differential privacy (Table 6), and the pieces FedDM and DESA
add (distribution matching around a model, padding by class, server training on S).

* :func:`distill_synthetic` -- ClientDatasetDistillation of Alg. 1 for a group of clients at
  once, with optional differential privacy (Table 6): DP-SGD on the images
  (:func:`dp_sgd_image_grad`, per-sample clipping with
  :func:`hyperfed.privacy.dp_sgd.noisy_clipped_sum`) or noisy clipped per-class feature sums
  (``dp_mechanism``).
* :func:`merge_synthetic` -- the server's merge by label (Eq. 7).
* :func:`distill_matching`, :func:`perturb_within`, :func:`train_on_synthetic` -- FedDM's.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from hyperfed.data.federated import FederatedData
from hyperfed.distill.losses import contrastive_loss, dm_loss, masked_mean, supcon_loss
from hyperfed.engine.local import (
    LossFn,
    SGDConfig,
    cross_entropy_loss,
    plan_batches,
    train_clients,
)
from hyperfed.models.layout import FunctionalModel
from hyperfed.privacy.accounting import gaussian_epsilon, noise_for_epsilon
from hyperfed.privacy.dp_sgd import noisy_clipped_sum
from hyperfed.progress import phase, reporting

# -- progress and cost of the distillation phase ---------------------------------------------


def clients_text(client_ids: list[int], num_clients: int) -> str:
    """``client 3 of 10``, ``clients 0-3 of 10``, ``clients 0, 2, 5 of 10``, ``7 clients of
    10``: who a phase works for, in a progress line."""
    ids = sorted(client_ids)
    if len(ids) == 1:
        return f"client {ids[0]} of {num_clients}"
    if ids == list(range(ids[0], ids[-1] + 1)):
        return f"clients {ids[0]}-{ids[-1]} of {num_clients}"
    if len(ids) <= 6:
        return f"clients {', '.join(map(str, ids))} of {num_clients}"
    return f"{len(ids)} clients of {num_clients}"


def timed_probe(run: Callable[[int], object], iters: int, budget_s: float = 0.5) -> float:
    """Seconds ``run(iters)`` would take (``run(n)``: the phase with ``n`` iterations), from a
    short timed probe: one untimed warm-up iteration (first-call costs are not the phase's),
    then ``run(2)``. A slow iteration (over ``budget_s / 4``) gives the estimate ``iters`` times
    half of that; a fast one is measured again, ``run(1)`` (the fixed cost plus one iteration)
    against ``run(1 + p)`` with ``p`` chosen to take about ``budget_s``: the fixed cost plus
    ``iters`` times the per-iteration cost. Progress is not reported while probing, and the
    global RNG is left as it was."""

    def seconds(n: int) -> float:
        t0 = time.perf_counter()
        run(n)
        return time.perf_counter() - t0

    with reporting(None), torch.random.fork_rng(devices=[]):
        seconds(1)
        per = seconds(2) / 2
        if per > budget_s / 4:
            return per * iters
        t1 = seconds(1)
        p = int(min(max(budget_s / max(per, 1e-6), 2), max(iters - 1, 2)))
        per = max((seconds(1 + p) - t1) / p, 1e-6)
    return max(t1 - per, 0.0) + per * iters


# -- the distillation phase (Alg. 1, ClientDatasetDistillation) ------------------------------


@dataclass(frozen=True)
class DistillConfig:
    """One client's distillation (defaults: seed 003 §4 and DM, Zhao & Bilen 2023)."""

    ipc: int = 10  # synthetic images per class the client holds
    iters: int = 3000  # T
    lr: float = 1.0  # SGD on the images (DM's and FedDM's image learning rate)
    momentum: float = 0.5  # DM's
    batch_real: int = 64  # real samples per class and iteration
    lambda_cc: float = 5e-4  # Eq. 6
    # Eq. 5 sums over the anchors ("sum"); "mean" divides by their number (rescales lambda_cc)
    cc_reduction: str = "mean"
    temperature: float = 0.1  # tau_temp of Eq. 5
    init: str = "real"  # "real": S_i starts from real samples; "noise": Gaussian noise
    resample: bool = False  # DM: a freshly initialized network each iteration after the first
    dp_noise: float = 0.0  # noise multiplier sigma of the Gaussian mechanism (0: no DP)
    dp_epsilon: float = 0.0  # > 0: per-client sigma chosen to reach this epsilon
    # "dp_sgd": per-sample clipped image gradients + noise (Abadi et al. 2016); "features":
    # clipped per-class real feature sums + noise
    dp_mechanism: str = "dp_sgd"
    dp_clip: float = 1.0  # per-sample clipping norm (of the gradient, or of the feature)
    dp_delta: float = 1e-5

    @property
    def private(self) -> bool:
        return self.dp_noise > 0 or self.dp_epsilon > 0


def _fresh_params(fm: FunctionalModel, seed: int, device: torch.device) -> Tensor:
    """A new random initialization of ``fm`` (DM's per-iteration network), seeded."""
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        for m in fm.module.modules():
            reset = getattr(m, "reset_parameters", None)
            if callable(reset):
                reset()
    return fm.initial_params()


def _class_pools(data: FederatedData, client_ids: list[int]) -> tuple[Tensor, Tensor, Tensor]:
    """Per client, the train indices of each class it holds: ``pools [C, H, maxN]`` (padded),
    ``counts [C, H]`` (0 for padding) and ``labels [C, H]`` (-1 for padding)."""
    per_client = []
    for cid in client_ids:
        idx = data.train_idx[cid]
        y = data.y[idx]
        classes = torch.unique(y)
        per_client.append([(int(c), idx[y == c]) for c in classes])
    h = max(1, max(len(p) for p in per_client))
    n_max = max([1] + [int(i.numel()) for p in per_client for _, i in p])
    device = data.y.device
    pools = torch.zeros(len(client_ids), h, n_max, dtype=torch.long, device=device)
    counts = torch.zeros(len(client_ids), h, dtype=torch.long, device=device)
    labels = torch.full((len(client_ids), h), -1, dtype=torch.long, device=device)
    for c, p in enumerate(per_client):
        for j, (cls, i) in enumerate(p):
            pools[c, j, : i.numel()] = i
            pools[c, j, i.numel() :] = i[0]
            counts[c, j] = i.numel()
            labels[c, j] = cls
    return pools, counts, labels


def _pick(
    pools: Tensor, counts: Tensor, k: int, gens: list[torch.Generator], cyclic: bool
) -> tuple[Tensor, Tensor]:
    """``k`` random samples of each (client, class) pool without replacement: indices
    ``[C, H, k]`` and a validity mask (a pool smaller than ``k`` gives all its samples, the
    rest masked; with ``cyclic`` the rest repeats the pool instead and counts as valid)."""
    c, h, n = pools.shape
    scores = torch.stack([torch.rand(h, n, generator=g, device=pools.device) for g in gens])
    pos = torch.arange(n, device=pools.device)
    scores = scores.masked_fill(pos >= counts.unsqueeze(-1), 2.0)  # padding sorts last
    order = scores.argsort(-1)
    slot = torch.arange(k, device=pools.device).expand(c, h, k)
    if cyclic:
        slot = slot % counts.clamp(min=1).unsqueeze(-1)
        valid = (counts > 0).unsqueeze(-1).expand(c, h, k)
    else:
        slot = slot.clamp(max=n - 1)
        valid = slot < counts.unsqueeze(-1)
    return pools.gather(-1, order.gather(-1, slot)), valid


# -- DP-SGD on the synthetic images (Abadi et al. 2016, Alg. 1; clipping and noise:
# hyperfed.privacy.dp_sgd) -----------------------------------------------------------------


def dp_sgd_image_grad(
    fm: FunctionalModel,
    theta: Tensor,
    buffers: Tensor,
    syn: Tensor,
    syn_labels: Tensor,
    real_feats: Tensor,
    real_valid: Tensor,
    *,
    lot: int,
    clip: float,
    sigma: float,
    lambda_cc: float,
    temperature: float,
    cc_reduction: str = "mean",
    generator: torch.Generator | None = None,
    chunk: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The DP-SGD gradient of one client's synthetic images ``syn [H, ipc, ...]`` (classes
    ``syn_labels [H]``, all held) from real features ``real_feats [H, k, d]`` (``real_valid
    [H, k]``: class ``c``'s batch has ``k_c`` samples). Returns (gradient, L_DM, L_CC).

    The objective splits into a part with no real data and one term per real sample:
    ``L(S) = L_syn(S) + sum_i r_i(S)`` with ``L_DM = sum_c ||mu_r,c - mu_s,c||^2 = sum_c
    ||mu_s,c||^2 - sum_i 2/k_c f(x_i).mu_s,c + const`` (Eq. 4) and L_CC (Eq. 5) over the
    anchors ``B_D u S_i`` with the bank ``S_i`` (a real anchor contrasts with the synthetic
    images only, so that each real sample enters one term). The real part goes through DP-SGD
    with per-sample loss ``l_i = lot * r_i``: ``grad = grad L_syn + (sum_i clip(grad l_i, C) +
    N(0, (sigma C)^2 I)) / lot``; with ``sigma = 0`` and a large ``C`` it is ``grad L``.
    Per-sample gradients: ``torch.func.vmap`` of the VJP through the model at ``syn``."""
    from torch.func import grad, vjp, vmap

    h, ipc = syn.shape[:2]
    shape = syn.shape[2:]

    def feats(s: Tensor) -> Tensor:
        (f, _), _ = fm.forward_train(theta, buffers, s.reshape(-1, *shape), return_features=True)
        return f.reshape(h, ipc, -1)

    fs, pull = vjp(feats, syn)[:2]
    fs = fs.detach()
    k_c = real_valid.sum(-1).to(fs.dtype)  # [H]
    n_syn_anchors = h * ipc if ipc > 1 else 0  # a synthetic anchor needs another of its class
    anchors = float(real_valid.sum()) + n_syn_anchors
    cc_w = lambda_cc / max(anchors, 1.0) if cc_reduction == "mean" else lambda_cc
    syn_y = syn_labels.unsqueeze(-1).expand(h, ipc).reshape(-1)

    def syn_part(f: Tensor) -> tuple[Tensor, Tensor]:
        dm = (f.mean(1) ** 2).sum()  # sum_c ||mu_s,c||^2
        if cc_w == 0 or n_syn_anchors == 0:
            return dm, dm.new_zeros(())
        own = torch.arange(h * ipc, device=f.device)
        flat = f.reshape(h * ipc, -1)
        cc = contrastive_loss(flat, syn_y, flat, syn_y, temperature=temperature, exclude=own)
        return dm, cc * n_syn_anchors  # the sum over the synthetic anchors

    def real_part(f: Tensor, fi: Tensor, onehot: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
        """r_i: the DM cross term and the CC term of real anchor f_i (class ``onehot``)."""
        mu = f.mean(1)  # [H, d]
        dm = -2 * w * (fi * (onehot @ mu)).sum()
        if cc_w == 0:
            return dm, dm.new_zeros(())
        z = F.normalize(fi, dim=-1)
        bank = F.normalize(f, dim=-1).reshape(h * ipc, -1)
        logits = bank @ z / temperature
        log_p = logits - logits.logsumexp(0)
        pos = onehot.unsqueeze(-1).expand(h, ipc).reshape(-1)
        return dm, -(log_p * pos).sum() / ipc

    def per_sample_loss(f: Tensor, fi: Tensor, onehot: Tensor, w: Tensor) -> Tensor:
        dm, cc = real_part(f, fi, onehot, w)
        return lot * (dm + cc_w * cc)

    sel = real_valid.reshape(-1)
    fr = real_feats.reshape(h * real_feats.shape[1], -1)[sel]
    onehot = torch.eye(h, dtype=fs.dtype, device=fs.device)
    onehot = onehot.unsqueeze(1).expand(h, real_feats.shape[1], h).reshape(-1, h)[sel]
    w = (1.0 / k_c.clamp(min=1)).unsqueeze(1).expand(h, real_feats.shape[1]).reshape(-1)[sel]

    # the noise-free part: exact gradient of L_syn
    fs_req = fs.clone().requires_grad_(True)
    with torch.enable_grad():
        dm_s, cc_s = syn_part(fs_req)
        (u_syn,) = torch.autograd.grad(dm_s + cc_w * cc_s, fs_req)
    (g,) = pull(u_syn)
    # per-sample cotangents d l_i / d f(S), then per-sample gradients J^T u_i (chunked)
    u = vmap(grad(per_sample_loss), in_dims=(None, 0, 0, 0))(fs, fr, onehot, w)
    if chunk is None:
        chunk = max(1, (1 << 24) // max(1, syn.numel()))
    per = torch.cat([vmap(pull)(u[i : i + chunk])[0] for i in range(0, u.shape[0], chunk)])
    g = g + noisy_clipped_sum(per, clip, sigma, generator) / lot
    with torch.no_grad():
        parts = vmap(real_part, in_dims=(None, 0, 0, 0))(fs, fr, onehot, w)
        mu_r = onehot.T @ (fr * w.unsqueeze(-1))  # [H, d] real class means
        dm = ((mu_r - fs.mean(1)) ** 2).sum()
        cc = cc_s + parts[1].sum()
        if cc_reduction == "mean":
            cc = cc / max(anchors, 1.0)
    return g, dm, cc


def distill_synthetic(
    fm: FunctionalModel,
    theta: Tensor,
    data: FederatedData,
    client_ids: list[int],
    cfg: DistillConfig,
    seeds: list[int],
    net_seed: int = 0,
    label: str = "distilling synthetic sets",
) -> tuple[list[Tensor], list[Tensor], dict[str, Tensor]]:
    """Alg. 1's ClientDatasetDistillation for every client of a group, vectorized over them.

    Each client synthesizes ``ipc`` images for every class it holds (initialized from its own
    real samples, or noise), then for ``iters`` iterations draws ``batch_real`` real samples
    per class and takes one SGD step (momentum) on its images with
    ``L_DM + lambda_CC L_CC`` (Eq. 6): ``L_DM`` summed over classes (Eq. 4, per class as Alg. 1
    and DM do), ``L_CC`` SupCon over the real batch and the synthetic set (Eq. 5). Eq. 6 is
    minimized as one loss; Alg. 1 prints two steps per iteration (DM with lr beta, then CC with
    lr gamma), the same update to first order with ``lambda_CC = gamma / beta``.

    The features come from the received distillation model ``theta`` (fixed, as Alg. 1 reads),
    or with ``resample`` from a fresh random network every iteration after the first (DM;
    seeded by ``net_seed`` and the iteration, so every client of a run sees the same ones).
    ``seeds`` (one per client) drive the client's sampling and noise.

    **Differential privacy** (``dp_noise`` or ``dp_epsilon``, Table 6), two mechanisms; S_i
    starts from noise under both, and each iteration is one release of the subsampled
    Gaussian mechanism with L2 sensitivity ``dp_clip`` and noise std ``sigma * dp_clip``:

    * ``dp_mechanism = "dp_sgd"`` (Abadi et al. 2016, which seed 003 §4.6 cites): DP-SGD on
      the images, :func:`dp_sgd_image_grad` -- each real sample's gradient of its own term of
      the objective w.r.t. S_i is clipped to norm ``dp_clip``, the clipped gradients are summed
      with ``N(0, (sigma C)^2 I)`` noise over the whole of S_i, and divided by the lot size
      ``batch_real``. L_CC's real anchors contrast with S_i only (each real sample must enter
      one term for per-sample clipping); the noise has the dimension of S_i.
    * ``dp_mechanism = "features"``: the real data enter the gradient only through per-class
      sums of their features. Each real feature is clipped to norm ``dp_clip`` and the
      per-class sums get Gaussian noise of std ``sigma * dp_clip`` (one sample changes one class
      sum by at most ``dp_clip``); L_DM and L_CC (which then contrasts S_i with the noisy real
      class means) are post-processing of that release. The noise has the dimension of the
      features (``d`` per class), far below that of S_i.

    Same sensitivity, sampling rate and steps: the same epsilon for the same sigma under both.
    epsilon comes from Opacus' RDP accountant for the iterations taken (``dp_steps``; one
    distillation per client, Alg. 1) at sampling rate ``q = max_c min(1, batch_real / n_c)``;
    the accountant assumes Poisson sampling, we draw fixed-size batches without replacement
    (the usual approximation of DP-SGD implementations). Which classes a client holds, and the
    per-class batch sizes, are treated as public. Only S_i is covered: the training-phase
    uploads (model updates) are not privatized, here or in the paper.

    Returns per client the synthetic images ``[H_i * ipc, ...]`` (normalized input space) and
    labels, and per-client statistics ``[C]`` of the last iteration. The iterations are a
    :func:`~hyperfed.progress.phase` named ``label`` and the clients.
    """
    device = theta.device
    gens = [torch.Generator(device=device).manual_seed(s) for s in seeds]
    pools, counts, labels = _class_pools(data, client_ids)
    held = counts > 0  # [C, H]
    nc, h = held.shape
    shape = tuple(data.input_shape)
    buffers = fm.initial_buffers().to(device)

    # S_i: [C, H, ipc, ...]
    if cfg.init == "real" and not cfg.private:
        idx, _ = _pick(pools, counts, cfg.ipc, gens, cyclic=True)
        syn = data.features(idx.reshape(-1)).reshape(nc, h, cfg.ipc, *shape)
    else:
        init = [torch.randn(h, cfg.ipc, *shape, generator=g, device=device) for g in gens]
        syn = torch.stack(init).to(data.dtype)
    syn = syn.detach().clone().requires_grad_(True)
    momentum = torch.zeros_like(syn)

    k = max(1, min(cfg.batch_real, pools.shape[-1]))
    q = (k / counts.clamp(min=1).to(torch.float64)).clamp(max=1.0)
    q = torch.where(held, q, torch.zeros_like(q)).amax(-1)  # [C]
    sigma = torch.zeros(nc, device=device)
    if cfg.private:
        for c in range(nc):
            s = cfg.dp_noise
            if cfg.dp_epsilon > 0:
                s = noise_for_epsilon(cfg.dp_epsilon, float(q[c]), cfg.iters, cfg.dp_delta)
            sigma[c] = s

    syn_labels = labels.unsqueeze(-1).expand(nc, h, cfg.ipc)
    syn_mask = held.unsqueeze(-1).expand(nc, h, cfg.ipc)
    real_labels = labels.unsqueeze(-1).expand(nc, h, k)
    dm = cc = torch.zeros(nc, device=device)
    steps = 0  # DP releases made (one per iteration): what the accountant composes
    label = f"{label}: {clients_text(client_ids, data.num_clients)}"
    with phase(label, cfg.iters) as tick:
        for t in range(cfg.iters):
            th = theta
            if cfg.resample and t > 0:
                th = _fresh_params(fm, (net_seed * 1_000_003 + t) % (2**63 - 1), device).to(device)
            idx, valid = _pick(pools, counts, k, gens, cyclic=False)
            # only real samples and synthetic images of classes a client holds go through the model
            with torch.no_grad():
                (f, _), _ = fm.forward_train(
                    th, buffers, data.features(idx[valid]), return_features=True
                )
                fr = f.new_zeros(nc, h, k, f.shape[-1])
                fr[valid] = f
            if cfg.private and cfg.dp_mechanism == "dp_sgd":
                grad = torch.zeros_like(syn)
                dms, ccs = [], []
                for c in range(nc):  # per client: its own per-sample gradients, clipping and noise
                    hc = held[c]
                    g_c, dm_c, cc_c = dp_sgd_image_grad(
                        fm,
                        th,
                        buffers,
                        syn.detach()[c][hc],
                        labels[c][hc],
                        fr[c][hc],
                        valid[c][hc],
                        lot=k,
                        clip=cfg.dp_clip,
                        sigma=float(sigma[c]),
                        lambda_cc=cfg.lambda_cc,
                        temperature=cfg.temperature,
                        cc_reduction=cfg.cc_reduction,
                        generator=gens[c],
                    )
                    grad[c][hc] = g_c
                    dms.append(dm_c)
                    ccs.append(cc_c)
                dm, cc = torch.stack(dms).detach(), torch.stack(ccs).detach()
                with torch.no_grad():
                    momentum.mul_(cfg.momentum).add_(grad)
                    syn.sub_(cfg.lr * momentum)
                steps += 1
                tick.advance()
                continue
            (f, _), _ = fm.forward_train(
                th, buffers, syn[held].reshape(-1, *shape), return_features=True
            )
            fs = f.new_zeros(nc, h, cfg.ipc, f.shape[-1])
            fs[held] = f.reshape(-1, cfg.ipc, f.shape[-1])
            if cfg.private:
                norms = fr.norm(dim=-1, keepdim=True).clamp(min=1e-12)
                fr = fr * (cfg.dp_clip / norms).clamp(max=1.0)
                sums = (fr * valid.unsqueeze(-1).to(fr.dtype)).sum(-2)  # [C, H, d]
                noise = torch.stack(
                    [torch.randn(sums.shape[1:], generator=g, device=device) for g in gens]
                )
                sums = sums + noise * (sigma * cfg.dp_clip).view(nc, 1, 1)
                real_means = sums / valid.sum(-1, keepdim=True).clamp(min=1)
            else:
                real_means = masked_mean(fr, valid)
            dm = dm_loss(real_means, fs.mean(-2), held)
            if cfg.lambda_cc > 0:
                if cfg.private:  # the real side of L_CC: the released (noisy) class means
                    real_f, real_y, real_m = real_means, labels, held
                else:
                    real_f = fr.reshape(nc, h * k, -1)
                    real_y, real_m = real_labels.reshape(nc, -1), valid.reshape(nc, -1)
                feats = torch.cat([real_f, fs.reshape(nc, h * cfg.ipc, -1)], 1)
                ys = torch.cat([real_y, syn_labels.reshape(nc, -1)], 1)
                mask = torch.cat([real_m, syn_mask.reshape(nc, -1)], 1)
                cc = supcon_loss(feats, ys, temperature=cfg.temperature, mask=mask)
                if cfg.cc_reduction == "sum":  # Eq. 5 as printed: a sum over the anchors
                    cc = cc * mask.sum(-1).to(cc.dtype)
            total = dm + cfg.lambda_cc * cc
            (grad,) = torch.autograd.grad(total.sum(), syn)
            with torch.no_grad():
                momentum.mul_(cfg.momentum).add_(grad)
                syn.sub_(cfg.lr * momentum)
            steps += 1
            tick.advance()

    out_x, out_y = [], []
    syn = syn.detach()
    for c in range(nc):
        keep = held[c]
        out_x.append(syn[c][keep].reshape(-1, *shape).clone())
        out_y.append(syn_labels[c][keep].reshape(-1).clone())
    stats = {
        "distill_dm_loss": dm.detach(),
        "distill_cc_loss": cc.detach(),
        "synthetic_count": torch.tensor([float(y.numel()) for y in out_y]),
    }
    if cfg.private:
        eps = [
            gaussian_epsilon(float(sigma[c]), float(q[c]), steps, cfg.dp_delta) for c in range(nc)
        ]
        stats["dp_epsilon"] = torch.tensor(eps)
        stats["dp_noise"] = sigma.detach().cpu()
        stats["dp_sample_rate"] = q.detach().cpu()
        stats["dp_steps"] = torch.full((nc,), float(steps))
    return out_x, out_y, stats


def distill_cost(
    fm: FunctionalModel,
    data: FederatedData,
    client_ids: list[int],
    cfg: DistillConfig,
    seeds: list[int],
    matching: bool = False,
) -> float:
    """Seconds :func:`distill_synthetic` (``matching``: :func:`distill_matching`) takes for
    ``client_ids`` with ``cfg`` on this machine (:func:`timed_probe`; at a freshly initialized
    ``fm``, which costs what the received model costs)."""
    theta = fm.initial_params().to(data.x.device)

    def run(n: int) -> object:
        c = dataclasses.replace(cfg, iters=n)
        if matching:
            return distill_matching(fm, lambda t: theta, data, client_ids, c, seeds)
        return distill_synthetic(fm, theta, data, client_ids, c, seeds)

    return timed_probe(run, cfg.iters)


def merge_synthetic(xs: list[Tensor], ys: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Eq. 7: the clients' synthetic sets merged by label, ``S = U_c U_i S_i^c``.

    Eq. 7 prints an intersection over clients inside the union over classes; independently
    synthesized images never coincide, so we read "merging data with the same labels" (§3.4)
    as the union: class ``c`` of ``S`` holds every client's class-``c`` images. ``S`` is
    ordered by label (stable: client order within a class)."""
    x = torch.cat(xs)
    y = torch.cat(ys)
    order = torch.sort(y, stable=True).indices
    return x[order], y[order]


# -- additions for the federated dataset-distillation baselines (FedDM, FedAF, DESA) ---------


def perturb_within(theta: Tensor, radius: float, seed: int) -> Tensor:
    """``theta + radius * u / ||u||`` with ``u ~ N(0, I)`` drawn from a generator seeded by
    ``seed``: a model on the sphere of radius ``radius`` around ``theta`` (``radius = 0``:
    ``theta`` itself). FedDM samples the model it matches distributions with like this."""
    if radius <= 0:
        return theta
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(theta.shape, generator=g, dtype=torch.float64).to(theta)
    return theta + radius * u / u.norm().clamp(min=1e-12)


# per-iteration loss on the synthetic logits: (logits [C, H, ipc, K], labels [C, H],
# held [C, H]) -> [C]
SyntheticLogitLoss = Callable[[Tensor, Tensor, Tensor], Tensor]


def distill_matching(
    fm: FunctionalModel,
    theta_at: Callable[[int], Tensor],
    data: FederatedData,
    client_ids: list[int],
    cfg: DistillConfig,
    seeds: list[int],
    *,
    match_logits: bool = False,
    logit_loss: SyntheticLogitLoss | None = None,
    clamp: bool = True,
    label: str = "distilling synthetic sets",
) -> tuple[list[Tensor], list[Tensor], dict[str, Tensor]]:
    """Distribution matching (Eq. 4, per class) for every client of a group, with the model of
    iteration ``t`` given by ``theta_at(t)`` (the same for every client of the group).

    The same scheme as :func:`distill_synthetic` (``ipc`` images per held class, initialized
    from the client's real samples or noise, ``batch_real`` real samples per class and
    iteration, SGD with momentum on the images) without its contrastive and DP parts, and with
    two optional terms: ``match_logits`` adds the DM loss on the model's logits next to the
    one on its features (``sum_c ||mean f(x_c) - mean f(s_c)||^2``), and ``logit_loss`` adds
    any loss of the synthetic images' logits (FedAF's collaborative term). ``clamp`` keeps the
    images inside the value range of the clients' own (normalized) images after every step,
    so they stay images: matching at a *trained* model without normalization layers (LeNet)
    has a curvature that grows with training, and at the DM image lr of 1.0 the unclamped
    images of FedDM grew to 1e23 by round 5 (chosen here; DM's ConvNet has instance norm). Returns what
    :func:`distill_synthetic` returns (per client images ``[H_i * ipc, ...]`` and labels); the
    iterations are a :func:`~hyperfed.progress.phase` named ``label`` and the clients."""
    theta0 = theta_at(0)
    device = theta0.device
    gens = [torch.Generator(device=device).manual_seed(s) for s in seeds]
    pools, counts, labels = _class_pools(data, client_ids)
    held = counts > 0
    nc, h = held.shape
    shape = tuple(data.input_shape)
    buffers = fm.initial_buffers().to(device)
    if cfg.init == "real":
        idx, _ = _pick(pools, counts, cfg.ipc, gens, cyclic=True)
        syn = data.features(idx.reshape(-1)).reshape(nc, h, cfg.ipc, *shape)
    else:
        init = [torch.randn(h, cfg.ipc, *shape, generator=g, device=device) for g in gens]
        syn = torch.stack(init).to(data.dtype)
    syn = syn.detach().clone().requires_grad_(True)
    own = data.features(torch.cat([data.train_idx[c] for c in client_ids]))
    lo, hi = float(own.min()), float(own.max())  # the value range of the clients' own images
    momentum = torch.zeros_like(syn)
    k = max(1, min(cfg.batch_real, pools.shape[-1]))
    dm = extra = torch.zeros(nc, device=device)
    label = f"{label}: {clients_text(client_ids, data.num_clients)}"
    with phase(label, cfg.iters) as tick:
        for t in range(cfg.iters):
            th = theta0 if t == 0 else theta_at(t)
            idx, valid = _pick(pools, counts, k, gens, cyclic=False)
            with torch.no_grad():
                (f, z), _ = fm.forward_train(
                    th, buffers, data.features(idx[valid]), return_features=True
                )
                fr = f.new_zeros(nc, h, k, f.shape[-1])
                fr[valid] = f
                zr = z.new_zeros(nc, h, k, z.shape[-1])
                zr[valid] = z
            (f, z), _ = fm.forward_train(
                th, buffers, syn[held].reshape(-1, *shape), return_features=True
            )
            fs = f.new_zeros(nc, h, cfg.ipc, f.shape[-1])
            fs[held] = f.reshape(-1, cfg.ipc, f.shape[-1])
            zs = z.new_zeros(nc, h, cfg.ipc, z.shape[-1])
            zs[held] = z.reshape(-1, cfg.ipc, z.shape[-1])
            dm = dm_loss(masked_mean(fr, valid), fs.mean(-2), held)
            if match_logits:
                dm = dm + dm_loss(masked_mean(zr, valid), zs.mean(-2), held)
            total = dm
            if logit_loss is not None:
                extra = logit_loss(zs, labels, held)
                total = total + extra
            (grad,) = torch.autograd.grad(total.sum(), syn)
            with torch.no_grad():
                momentum.mul_(cfg.momentum).add_(grad)
                syn.sub_(cfg.lr * momentum)
                if clamp:
                    syn.clamp_(lo, hi)
            tick.advance()

    syn = syn.detach()
    syn_labels = labels.unsqueeze(-1).expand(nc, h, cfg.ipc)
    out_x = [syn[c][held[c]].reshape(-1, *shape).clone() for c in range(nc)]
    out_y = [syn_labels[c][held[c]].reshape(-1).clone() for c in range(nc)]
    stats = {"distill_dm_loss": dm.detach(), "distill_extra_loss": extra.detach()}
    return out_x, out_y, stats


def pad_by_class(x: Tensor, y: Tensor, num_classes: int, ipc: int) -> tuple[Tensor, Tensor]:
    """A client's synthetic set (``[H * ipc, ...]``, labels ``[H * ipc]``) in a fixed-size
    payload of ``num_classes * ipc`` slots: its images first, then zero images labelled -1.
    A round's reply must keep one shape for every client (``Client.fit`` stacks a group's
    replies), while clients hold different numbers of classes."""
    m = num_classes * ipc
    if y.numel() > m:
        raise ValueError(f"{y.numel()} synthetic images do not fit {num_classes} x {ipc} slots")
    px = x.new_zeros(m, *x.shape[1:])
    py = torch.full((m,), -1, dtype=torch.long, device=y.device)
    px[: y.numel()] = x
    py[: y.numel()] = y
    return px, py


def check_padded_synthetic(
    reply: dict[str, Tensor], num_classes: int, input_shape: tuple[int, ...], slots: int
) -> str | None:
    """Why a padded synthetic-set payload (``syn_x [slots, ...]``, ``syn_y [slots]`` integer,
    -1 = empty slot) is malformed, or None."""
    x, y = reply["syn_x"], reply["syn_y"]
    if tuple(x.shape) != (slots, *input_shape) or not x.is_floating_point():
        return f"syn_x has shape {tuple(x.shape)}, expected {(slots, *input_shape)}"
    if tuple(y.shape) != (slots,) or y.is_floating_point():
        return f"syn_y has shape {tuple(y.shape)}, expected integer ({slots},)"
    if y.numel() and (int(y.min()) < -1 or int(y.max()) >= num_classes):
        return f"syn_y holds a class outside [-1, {num_classes})"
    if not bool(torch.isfinite(x).all()):
        return "syn_x contains NaN or Inf"
    return None


def train_on_synthetic(
    fm: FunctionalModel,
    theta: Tensor,
    buffers: Tensor,
    x: Tensor,
    y: Tensor,
    sgd: SGDConfig,
    seed: int,
    num_classes: int,
    *,
    loss_fn: LossFn = cross_entropy_loss,
    ctx: dict[str, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """A server trains one model (``theta [K]``) on a synthetic set ``x``, ``y`` with local
    SGD's engine (a client axis of 1; ``ctx`` entries without it): ``sgd.epochs`` epochs of
    batch ``sgd.batch_size``, shuffles seeded by ``seed``. Returns (theta, buffers, mean loss)."""
    idx = torch.arange(y.numel(), device=y.device)
    data = FederatedData(
        x=x,
        y=y,
        train_idx=[idx],
        val_idx=[],
        test_idx=[],
        num_classes=num_classes,
        input_shape=tuple(x.shape[1:]),
        mean=torch.zeros(0),
        std=torch.zeros(0),
        dtype=x.dtype,
    )
    plan = plan_batches(data.train_idx, sgd.epochs, sgd.batch_size, [seed])
    cx = {k: v[None] for k, v in (ctx or {}).items()}
    label = f"server: training on {y.numel()} synthetic images, {sgd.epochs} epochs"
    with phase(label):
        out, new_buffers, loss = train_clients(
            fm,
            theta[None],
            buffers[None],
            data,
            plan,
            sgd,
            loss_fn=loss_fn,
            ctx=cx,
            vectorize=False,
        )
    return out[0], new_buffers[0], loss[0]
