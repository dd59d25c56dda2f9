"""DP-SGD's primitives (Abadi et al. 2016, Alg. 1): per-sample clipping and the noisy clipped
sum, beside their accounting (:mod:`hyperfed.privacy.accounting`). The dataset distillation
(:func:`hyperfed.distill.synthesis.dp_sgd_image_grad`) runs them on synthetic images."""

from __future__ import annotations

import torch
from torch import Tensor


def clip_per_sample(grads: Tensor, clip: float) -> Tensor:
    """Each per-sample gradient ``grads[i]`` scaled to L2 norm at most ``clip``:
    ``g_i / max(1, ||g_i|| / C)`` (Abadi et al. 2016, Alg. 1, "clip gradient")."""
    norms = grads.flatten(1).norm(dim=1).clamp(min=1e-30)
    scale = (clip / norms).clamp(max=1.0)
    return grads * scale.view(-1, *[1] * (grads.dim() - 1))


def noisy_clipped_sum(
    grads: Tensor, clip: float, sigma: float, generator: torch.Generator | None = None
) -> Tensor:
    """``sum_i clip(g_i, C) + N(0, (sigma C)^2 I)`` over the leading (sample) axis: the released
    quantity of one DP-SGD step (Abadi et al. 2016, Alg. 1, "add noise"); its L2 sensitivity
    to adding or removing one sample is ``C``."""
    total = clip_per_sample(grads, clip).sum(0)
    if sigma > 0:
        noise = torch.randn(
            total.shape, generator=generator, device=total.device, dtype=total.dtype
        )
        total = total + (sigma * clip) * noise
    return total
