"""Gradient inversion: what an honest-but-curious server can read from a client's upload.

Seed 000 (Appendix C.8, Fig. 6) attacks MH-pFedHNGD with iDLG (Zhao, Mopuri & Bilen 2020).
iDLG has two parts:

* **the label** (:func:`infer_label`): with cross-entropy on one sample, the gradient of the
  last layer's weight row j is ``(p_j - 1[j = y]) h``. The features ``h`` entering the last
  layer come out of a ReLU, so ``h >= 0`` and the true label is the only row whose gradient
  sums to a negative number.
* **the input** (:func:`invert_gradient`): a dummy input ``x'`` is optimized until the
  gradient it produces, ``g' = dCE(f(x'; theta), y) / dtheta``, matches the observed one ``g``.
  ``distance = "l2"`` is iDLG as published: ``||g' - g||^2`` with L-BFGS. On ReLU / max-pool
  networks (every zoo model) that objective is piecewise linear in the activations and L-BFGS
  stalls near its start, so ``"cosine"`` (Geiping et al. 2020, "Inverting Gradients") is the
  default: ``1 - cos(g', g) + tv * TV(x')`` minimized by Adam on the sign of its gradient,
  which is scale-free and recovers images from the same models.

A client that trains E epochs before it uploads (every method here) does not send one
gradient: the attack experiment (:mod:`hyperfed.attack`) reads the update as
the attacker would, as ``-delta / (lr * steps)``, the mean gradient of one step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from hyperfed.models.layout import FunctionalModel, Segment

DISTANCES = ("cosine", "l2")


@dataclass
class Inversion:
    """A reconstructed input (``[1, *input_shape]``, in the model's normalized input space),
    the label it was optimized for, and the objective (gradient distance, + TV for cosine) at
    the start and the end."""

    x: Tensor
    label: int
    distance: float
    initial_distance: float


def last_layer_weight(fm: FunctionalModel, num_classes: int) -> Segment:
    """The ``[num_classes, d]`` weight of the classifier (the last such segment)."""
    found = [s for s in fm.layout.segments if s.shape[:1] == (num_classes,) and len(s.shape) == 2]
    if not found:
        raise ValueError(f"{fm.name} has no [{num_classes}, d] classifier weight to read")
    return found[-1]


def infer_label(fm: FunctionalModel, grad: Tensor, num_classes: int) -> int:
    """iDLG's rule: the class whose classifier-weight gradient row has the smallest (the only
    negative) sum. Exact for one sample when the classifier's inputs are non-negative."""
    seg = last_layer_weight(fm, num_classes)
    rows = grad[seg.offset : seg.end].view(seg.shape)
    return int(rows.sum(dim=1).argmin())


def model_gradient(
    fm: FunctionalModel,
    theta: Tensor,
    buffers: Tensor,
    x: Tensor,
    y: Tensor,
    create_graph: bool = False,
) -> Tensor:
    """``dCE(f(x; theta), y) / dtheta`` as a flat ``[K]`` vector (inference-mode BatchNorm,
    the statistics a single sample cannot provide)."""
    theta = theta.detach().requires_grad_(True)
    loss = F.cross_entropy(fm.forward(theta, buffers, x), y)
    (grad,) = torch.autograd.grad(loss, theta, create_graph=create_graph)
    return grad


def starting_point(input_shape: tuple[int, ...], seed: int) -> Tensor:
    """The dummy input ``[1, *input_shape]`` an inversion with ``seed`` starts from."""
    return torch.randn((1, *input_shape), generator=torch.Generator().manual_seed(seed))


def total_variation(x: Tensor) -> Tensor:
    """Mean absolute difference of neighbouring pixels (images ``[N, C, H, W]``); 0 for vectors."""
    if x.dim() < 4:
        return x.new_zeros(())
    return (x[..., 1:, :] - x[..., :-1, :]).abs().mean() + (
        x[..., :, 1:] - x[..., :, :-1]
    ).abs().mean()


def invert_gradient(
    fm: FunctionalModel,
    theta: Tensor,
    buffers: Tensor,
    target: Tensor,
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    label: int | None = None,
    distance: str = "cosine",
    iters: int = 500,
    lr: float = 0.1,
    tv: float = 1e-2,
    seed: int = 0,
    progress: Callable[[], None] | None = None,
) -> Inversion:
    """Reconstruct one input whose gradient at ``theta`` matches ``target`` (``[K]``).

    ``label``: the class to optimize for; None takes iDLG's :func:`infer_label`. ``iters``:
    Adam steps (``cosine``; the step size drops 10x at 60% and 90% of them) or L-BFGS
    iterations (``l2``). ``progress``: called with no arguments after each step (a progress
    bar's advance)."""
    if distance not in DISTANCES:
        raise ValueError(f"distance must be one of {DISTANCES}, got {distance!r}")
    if target.shape != theta.shape:
        raise ValueError(f"target has shape {tuple(target.shape)}, theta {tuple(theta.shape)}")
    if label is None:
        label = infer_label(fm, target, num_classes)
    y = torch.tensor([label], device=theta.device)
    dummy = starting_point(input_shape, seed).to(theta.device, theta.dtype).requires_grad_(True)
    target = target.detach()

    def gap() -> Tensor:
        g = model_gradient(fm, theta, buffers, dummy, y, create_graph=True)
        if distance == "l2":
            return (g - target).pow(2).sum()
        return 1 - F.cosine_similarity(g, target, dim=0) + tv * total_variation(dummy)

    value = initial = gap().detach()
    if distance == "l2":
        lbfgs = torch.optim.LBFGS(
            [dummy], lr=1.0, max_iter=1, history_size=100, line_search_fn="strong_wolfe"
        )
        last = [value]

        def closure() -> Tensor:
            lbfgs.zero_grad()
            d = gap()
            d.backward()
            last[0] = d.detach()
            return d

        for _ in range(iters):
            lbfgs.step(closure)  # type: ignore[arg-type]
            if progress is not None:
                progress()
        value = last[0]
    else:
        opt = torch.optim.Adam([dummy], lr=lr)
        milestones = [int(0.6 * iters), int(0.9 * iters)]
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones, gamma=0.1)
        for _ in range(iters):
            opt.zero_grad()
            d = gap()
            d.backward()
            assert dummy.grad is not None
            dummy.grad.sign_()  # Geiping et al.: signed gradient steps
            opt.step()
            sched.step()
            value = d.detach()
            if progress is not None:
                progress()
    return Inversion(dummy.detach(), label, float(value), float(initial))


def psnr(x: Tensor, reference: Tensor) -> float:
    """Peak signal-to-noise ratio in dB of ``x`` against ``reference``, both in [0, 1]."""
    return psnr_of_mse(float((x - reference).pow(2).mean()))


PSNR_MAX = 100.0  # dB, what identical images score (keeps the reports finite JSON)


def psnr_of_mse(mse: float) -> float:
    """PSNR in dB of a mean squared error between images in [0, 1], at most ``PSNR_MAX``."""
    return PSNR_MAX if mse <= 10 ** (-PSNR_MAX / 10) else 10.0 * math.log10(1.0 / mse)
