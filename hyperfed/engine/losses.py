"""Pieces several methods share, written once: distillation, two-model vectors, per-class means.

* :func:`kd_loss` -- Hinton's soft-target loss, used by FML, FedKD and FD.
* :class:`ModelPair` -- two functional models trained as *one* flat vector
  ``theta = [theta_a | theta_b]`` by :meth:`ClientGroup.train`, with masks to freeze either half
  (pFedES: model + extractor; FML / FedKD: private + shared model).
* :func:`class_means`, :func:`pack_classes`, :func:`class_sums`, :func:`check_class_payload` --
  per-class averages of a model's features or logits on a client's data, the compact payload
  that carries them (only the classes a client holds) and their per-class aggregation on the
  server (FedProto's prototypes, FD's per-label logits).
* :func:`weighted_average` -- ``sum_k n_k v_k / sum_k n_k`` (FedAvg's rule, Eq. (10) of pFedES).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from hyperfed.data.federated import FederatedData
from hyperfed.engine.metering import FlopMeter
from hyperfed.models.layout import FunctionalModel


def kd_loss(
    student_logits: Tensor,
    teacher_logits: Tensor,
    temperature: float = 1.0,
    reduction: str = "mean",
    scale_t2: bool = True,
) -> Tensor:
    """``T^2 * KL(softmax(teacher / T) || softmax(student / T))``, mean over the batch
    (``reduction="none"``: one value per sample). ``scale_t2=False`` drops Hinton's ``T^2``
    factor (which keeps the gradient's size independent of T): the plain KL.

    The teacher is detached: each side of a mutual-learning pair learns from the other's
    current prediction as a fixed target (Zhang et al., deep mutual learning).
    """
    t = temperature
    log_p_student = F.log_softmax(student_logits / t, dim=-1)
    log_p_teacher = F.log_softmax(teacher_logits.detach() / t, dim=-1)
    kl = (log_p_teacher.exp() * (log_p_teacher - log_p_student)).sum(-1)
    if scale_t2:
        kl = kl * (t * t)
    return kl if reduction == "none" else kl.mean()


@dataclass(frozen=True)
class ModelPair:
    """Two functional models trained as one flat vector ``theta = [theta_a | theta_b]``.

    Buffers (BatchNorm statistics) are joined the same way. A ``loss_fn`` for
    :meth:`ClientGroup.train` splits the vector with :meth:`split`; ``trainable=pair.mask("a")``
    freezes model b (its entries get no update, no momentum and no weight decay).
    """

    a: FunctionalModel
    b: FunctionalModel

    @property
    def num_params(self) -> int:
        return self.a.num_params + self.b.num_params

    def join(self, theta_a: Tensor, theta_b: Tensor) -> Tensor:
        return torch.cat([theta_a, theta_b], dim=-1)

    def split(self, theta: Tensor) -> tuple[Tensor, Tensor]:
        k = self.a.num_params
        return theta[..., :k], theta[..., k:]

    def join_buffers(self, buffers_a: Tensor, buffers_b: Tensor) -> Tensor:
        return torch.cat([buffers_a, buffers_b], dim=-1)

    def split_buffers(self, buffers: Tensor) -> tuple[Tensor, Tensor]:
        k = self.a.num_buffers
        return buffers[..., :k], buffers[..., k:]

    def forward_train_both(
        self, theta: Tensor, buffers: Tensor, x: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Both models' training forward on the same batch (mutual learning, FML / FedKD):
        ``(logits_a, logits_b, new joined buffers)``."""
        th_a, th_b = self.split(theta)
        bu_a, bu_b = self.split_buffers(buffers)
        z_a, bu_a = self.a.forward_train(th_a, bu_a, x)
        z_b, bu_b = self.b.forward_train(th_b, bu_b, x)
        return z_a, z_b, self.join_buffers(bu_a, bu_b)

    def mask(self, part: str, device: torch.device | None = None) -> Tensor:
        """Boolean ``[K_a + K_b]``: True on the entries of ``part`` ("a" or "b")."""
        if part not in ("a", "b"):
            raise ValueError(f"part must be 'a' or 'b', got {part!r}")
        m = torch.zeros(self.num_params, dtype=torch.bool, device=device)
        k = self.a.num_params
        if part == "a":
            m[:k] = True
        else:
            m[k:] = True
        return m


@torch.no_grad()
def class_means(
    fm: FunctionalModel,
    theta: Tensor,
    buffers: Tensor,
    data: FederatedData,
    client_ids: list[int],
    *,
    features: bool,
    chunk: int = 2048,
) -> tuple[Tensor, Tensor]:
    """Per-class means of each client's model outputs on its own training split.

    ``features=True`` averages the representation (the input of the last Linear layer:
    FedProto's prototypes), ``False`` the logits (FD). The models run in inference mode.
    Returns ``(means [C, num_classes, d], counts [C, num_classes])``; classes a client does
    not hold have mean 0 and count 0.

    The pass is the client's per-round work (FedProto, FD, FedTGP, FedGH run it every round):
    its forward FLOPs go into the active :class:`FlopMeter` (one whole-model forward per
    training sample; at E = 1 about a quarter of the round's client FLOPs).
    """
    with FlopMeter.counting():  # the client's per-round work
        nc = data.num_classes
        means, counts = [], []
        for c, cid in enumerate(client_ids):
            idx = data.train_idx[cid]
            sums: Tensor | None = None
            cnt = torch.zeros(nc, device=theta.device)
            for start in range(0, int(idx.numel()), chunk):
                x, y = data.batch(idx[start : start + chunk])
                out = fm.forward(theta[c], buffers[c], x, return_features=features)
                v = out[0] if features else out
                if sums is None:
                    sums = torch.zeros(nc, v.shape[-1], device=theta.device, dtype=v.dtype)
                sums.index_add_(0, y, v)
                cnt.index_add_(0, y, torch.ones_like(y, dtype=cnt.dtype))
            assert sums is not None, f"client {cid} has no training samples"
            means.append(sums / cnt.clamp(min=1).unsqueeze(1))
            counts.append(cnt)
        return torch.stack(means), torch.stack(counts)


def pack_classes(means: Tensor, counts: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Keep only the classes each client holds, so the payload is what the papers send.

    ``means [C, num_classes, d]``, ``counts [C, num_classes]`` -> ``classes int32 [C, S]``,
    ``values [C, S, d]``, ``counts [C, S]`` with ``S`` the most classes any client of the group
    holds; a client holding fewer is padded with class ``-1`` (count 0, values 0). Under the
    ``quantity`` partition every client holds the same number of classes, so nothing is padded.
    """
    held = counts > 0
    s = max(1, int(held.sum(1).max()))
    # held classes first (stable: ascending class id), then the padding
    order = torch.sort((~held).to(torch.int8), dim=1, stable=True).indices[:, :s]
    keep = torch.gather(held, 1, order)
    classes = torch.where(keep, order, torch.full_like(order, -1)).to(torch.int32)
    values = torch.gather(means, 1, order.unsqueeze(-1).expand(-1, -1, means.shape[-1]))
    values = values * keep.unsqueeze(-1)
    return classes, values, torch.gather(counts, 1, order) * keep


def class_sums(
    classes: Tensor, values: Tensor, counts: Tensor, num_classes: int
) -> tuple[Tensor, Tensor]:
    """One packed reply -> count-weighted sums ``[num_classes, d]`` and counts ``[num_classes]``."""
    valid = classes >= 0
    cls = classes[valid].long()
    sums = torch.zeros(num_classes, values.shape[-1], device=values.device, dtype=values.dtype)
    total = torch.zeros(num_classes, device=values.device, dtype=counts.dtype)
    sums.index_add_(0, cls, values[valid] * counts[valid].unsqueeze(1))
    total.index_add_(0, cls, counts[valid])
    return sums, total


def check_class_payload(
    reply: dict[str, Tensor], keys: tuple[str, str, str], num_classes: int, dim: int
) -> str | None:
    """Why a packed (classes, values, counts) reply is malformed, or None."""
    k_cls, k_val, k_cnt = keys
    for k in keys:
        if k not in reply:
            return f"missing {k}"
    cls, val, cnt = reply[k_cls], reply[k_val], reply[k_cnt]
    s = cls.shape[0] if cls.dim() == 1 else -1
    if cls.dim() != 1 or val.shape != (s, dim) or cnt.shape != (s,):
        return (
            f"{k_cls}/{k_val}/{k_cnt} have shapes {tuple(cls.shape)}/{tuple(val.shape)}/"
            f"{tuple(cnt.shape)}, expected (S,)/(S, {dim})/(S,)"
        )
    if bool(((cls < -1) | (cls >= num_classes)).any()):
        return f"{k_cls} holds a class outside [0, {num_classes})"
    if not bool(torch.isfinite(val).all()) or not bool(torch.isfinite(cnt).all()):
        return f"{k_val} or {k_cnt} contains NaN or Inf"
    if bool((cnt < 0).any()):
        return f"{k_cnt} holds a negative count"
    return None


def weighted_average(vectors: Tensor, weights: Tensor) -> Tensor:
    """``sum_k w_k v_k / sum_k w_k`` over the first axis of ``vectors [M, ...]``."""
    w = weights.to(vectors.dtype)
    return torch.tensordot(w / w.sum(), vectors, dims=1)
