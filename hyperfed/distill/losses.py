"""The losses of dataset distillation and of training on a distilled set (seed 003, §3.4-3.5).

* :func:`dm_loss` -- distribution matching (Eq. 4, per class as in Alg. 1 and DM):
  ``sum_c || mean_{x in B_c} f(x) - mean_{s in S_c} f(s) ||^2``.
* :func:`contrastive_loss` -- one function for SupCon (Eq. 5, the Contrastive Condensation loss
  L_CC) and UniCon (Eq. 8, the Reg loss L_Reg): anchors against a bank, positives = bank
  members of the anchor's class, the anchor's own entry excluded.
* :func:`universum` -- Mixup negatives ``u_j = lam x_j + (1 - lam) x_k`` (Eq. 8).
* :func:`synthetic_objective` -- the local loss of Eq. 9 as a ``loss_fn`` for local training,
  with per-step synthetic batches from :func:`draw_batches` / :func:`group_batches`.

The readings of the paper these follow are listed in :mod:`hyperfed.distill`.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from hyperfed.data.federated import FederatedData
from hyperfed.engine.local import client_seed
from hyperfed.models.layout import FunctionalModel


class BatchGroup(Protocol):
    """What :func:`group_batches` reads of a group of clients (an algorithm's ClientGroup)."""

    client_ids: list[int]
    data: FederatedData
    rnd: int
    seed: int

    def steps(self, epochs: float | None = None) -> int: ...


# -- losses -------------------------------------------------------------------------------


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``values[..., B, d]`` over the entries where ``mask[..., B]`` holds (0 if none)."""
    m = mask.to(values.dtype).unsqueeze(-1)
    return (values * m).sum(-2) / m.sum(-2).clamp(min=1)


def dm_loss(real_means: Tensor, syn_means: Tensor, class_mask: Tensor | None = None) -> Tensor:
    """Eq. 4 per class: ``sum_c ||mu_real_c - mu_syn_c||^2`` over the classes in ``class_mask``.

    ``real_means`` and ``syn_means`` are ``[..., H, d]`` class-mean features; the result has
    the leading shape ``[...]``."""
    d = ((real_means - syn_means) ** 2).sum(-1)
    if class_mask is not None:
        d = d * class_mask.to(d.dtype)
    return d.sum(-1)


def contrastive_loss(
    anchors: Tensor,
    anchor_labels: Tensor,
    bank: Tensor,
    bank_labels: Tensor,
    *,
    temperature: float,
    exclude: Tensor | None = None,
    anchor_mask: Tensor | None = None,
    bank_mask: Tensor | None = None,
    normalize: bool = True,
) -> Tensor:
    """Supervised contrastive loss of anchors against a bank (Eq. 5 and Eq. 8).

    For anchor ``j`` with label ``y_j``: ``A(j)`` = the bank without entry ``exclude[j]`` (and
    without masked entries), ``P(j)`` = members of ``A(j)`` with label ``y_j``;
    ``l_j = -1/|P(j)| sum_{p in P(j)} log( exp(z_j.b_p/t) / sum_{a in A(j)} exp(z_j.b_a/t) )``.
    Returns the mean of ``l_j`` over the (unmasked) anchors that have a positive.

    SupCon (Eq. 5): ``bank = anchors``, ``exclude = arange``. UniCon (Eq. 8): anchors ``B_D u
    B_S``, bank ``U u B_S`` with ``U`` the universum, ``exclude = arange`` (anchor ``x_j``'s own
    mixup ``u_j``, a synthetic anchor itself). Shapes ``[..., A, d]``, ``[..., A]``,
    ``[..., N, d]``, ``[..., N]``; leading dimensions are batch dimensions of the result.
    """
    if normalize:
        anchors = F.normalize(anchors, dim=-1)
        bank = F.normalize(bank, dim=-1)
    logits = anchors @ bank.transpose(-1, -2) / temperature  # [..., A, N]
    allowed = torch.ones_like(logits, dtype=torch.bool)
    if exclude is not None:
        cols = torch.arange(logits.shape[-1], device=logits.device)
        allowed = allowed & (cols != exclude.unsqueeze(-1))
    if bank_mask is not None:
        allowed = allowed & bank_mask.unsqueeze(-2)
    positive = (anchor_labels.unsqueeze(-1) == bank_labels.unsqueeze(-2)) & allowed
    log_norm = logits.masked_fill(~allowed, -1e9).logsumexp(-1, keepdim=True)
    log_prob = logits - log_norm
    npos = positive.sum(-1)
    per_anchor = -(log_prob * positive).sum(-1) / npos.clamp(min=1)
    valid = npos > 0
    if anchor_mask is not None:
        valid = valid & anchor_mask
    v = valid.to(per_anchor.dtype)
    return (per_anchor * v).sum(-1) / v.sum(-1).clamp(min=1)


def supcon_loss(
    features: Tensor, labels: Tensor, *, temperature: float, mask: Tensor | None = None
) -> Tensor:
    """SupCon (Khosla et al. 2020), the Contrastive Condensation loss of Eq. 5."""
    n = features.shape[-2]
    own = torch.arange(n, device=features.device)
    return contrastive_loss(
        features,
        labels,
        features,
        labels,
        temperature=temperature,
        exclude=own,
        anchor_mask=mask,
        bank_mask=mask,
    )


def universum(
    x: Tensor, y: Tensor, lam: float, xs: Tensor | None = None, ys: Tensor | None = None
) -> Tensor:
    """Mixup universum ``u_j = lam x_j + (1 - lam) x_k`` with ``x_k`` of *another class* than
    ``x_j`` (Eq. 8, UniCon: the universum is a mix with a negative, so it is a negative of
    every class it is compared with); ``u_j`` keeps ``x_j``'s label.

    ``k`` is the first sample after ``j`` in the shuffled batch (cyclically) whose label
    differs; if every real sample has ``x_j``'s class (common under Dirichlet 0.02), the first
    synthetic sample ``xs`` of another class; failing both (one class everywhere), the batch
    neighbour ``j - 1``. One vectorized choice, no host sync (the step may be vmapped)."""
    b = x.shape[0]
    pool = x if xs is None else torch.cat([x, xs])
    labels = y if ys is None else torch.cat([y, ys])
    j = torch.arange(b, device=x.device)
    k = torch.arange(pool.shape[0], device=x.device)
    # order of preference: real samples after j (cyclically), then synthetic ones, in order
    rank = torch.where(k[None, :] < b, (k[None, :] - j[:, None]) % b, b + k[None, :])
    other = labels[None, :] != y[:, None]
    rank = torch.where(other, rank, rank.new_full((), 2 * pool.shape[0] + 1))
    first = rank.argmin(1)
    found = other.gather(1, first[:, None]).squeeze(1)
    partner = torch.where(found, first, (j - 1) % b)  # pool[:b] is x
    return lam * x + (1 - lam) * pool[partner]


def unicon_loss(
    real: Tensor,
    real_labels: Tensor,
    syn: Tensor,
    syn_labels: Tensor,
    uni: Tensor | None,
    *,
    temperature: float,
) -> Tensor:
    """Eq. 8: anchors ``B = B_D u B_S``, bank ``B_u = U u B_S`` (``uni`` holds the features of
    the universum of ``B_D``, in the same order). ``uni=None`` is the "w/o UniNeg" ablation
    (Table 3): the bank is ``B`` itself, i.e. SupCon over real and synthetic samples."""
    anchors = torch.cat([real, syn], -2)
    labels = torch.cat([real_labels, syn_labels], -1)
    bank = anchors if uni is None else torch.cat([uni, syn], -2)
    own = torch.arange(anchors.shape[-2], device=anchors.device)
    return contrastive_loss(anchors, labels, bank, labels, temperature=temperature, exclude=own)


# -- training on D_i and S (Eq. 9) -----------------------------------------------------------


def draw_batches(n: int, steps: int, batch: int, seed: int, device: torch.device) -> Tensor:
    """``[steps, batch]`` indices into ``range(n)``: a stream of independent shuffles cut into
    batches (the same scheme as the local batch plan), from a generator seeded by ``seed``."""
    g = torch.Generator().manual_seed(seed)
    need = steps * batch
    perms = [torch.randperm(n, generator=g) for _ in range(math.ceil(need / n))]
    return torch.cat(perms)[:need].view(steps, batch).to(device)


def group_batches(
    group: BatchGroup, n: int, batch: int, salt: int, steps: int | None = None
) -> Tensor:
    """``[steps, C, batch]`` indices into a synthetic set of ``n`` images for every client of
    ``group`` (default: the group's own number of local steps), each client's stream seeded
    by (run, round, client, ``salt``)."""
    steps = group.steps() if steps is None else steps
    device = group.data.x.device
    idx = [
        draw_batches(n, steps, batch, client_seed(group.seed, group.rnd, c, salt), device)
        for c in group.client_ids
    ]
    return torch.stack(idx, 1)


def synthetic_objective(
    fm: FunctionalModel,
    theta: Tensor,
    buffers: Tensor,
    x: Tensor,
    y: Tensor,
    ctx: dict[str, Tensor],
    *,
    lambda_s: float,
    lambda_reg: float,
    mixup: float,
    use_universum: bool,
    temperature: float,
    use_real: bool = True,
) -> tuple[Tensor, Tensor]:
    """Eq. 9: ``CE(B_D) + lambda_S CE(B_S) + lambda_Reg L_Reg(B_D, B_S)`` for one client.

    ``ctx`` holds the synthetic set (``syn_x [M, ...]``, ``syn_y [M]``) and this step's batch
    indices ``syn_idx [b]``. Real, synthetic and universum samples go through one forward
    pass (BatchNorm, where a model has it, sees their union). ``use_real=False`` is Table 9's
    "only S": ``CE(B_S)`` alone."""
    xs = ctx["syn_x"][ctx["syn_idx"]]
    ys = ctx["syn_y"][ctx["syn_idx"]]
    if not use_real:
        logits, new_buffers = fm.forward_train(theta, buffers, xs)
        return F.cross_entropy(logits, ys), new_buffers
    b, bs = x.shape[0], xs.shape[0]
    with_uni = use_universum and lambda_reg > 0
    parts = [x, xs, universum(x, y, mixup, xs, ys)] if with_uni else [x, xs]
    (feats, logits), new_buffers = fm.forward_train(
        theta, buffers, torch.cat(parts), return_features=True
    )
    loss = F.cross_entropy(logits[:b], y)
    if lambda_s > 0:
        loss = loss + lambda_s * F.cross_entropy(logits[b : b + bs], ys)
    if lambda_reg > 0:
        uni = feats[b + bs :] if with_uni else None
        reg = unicon_loss(feats[:b], y, feats[b : b + bs], ys, uni, temperature=temperature)
        loss = loss + lambda_reg * reg
    return loss, new_buffers
