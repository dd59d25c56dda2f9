"""The shared / personal split of a zoo model used by partial-personalization methods.

The *personal* part is the model's head (``head_prefixes``: the fully connected layers after the
body, at least the classifier); the *shared* part (the body) is every other parameter. FedPer,
DFedAlt and DFedHP (seed 004 §3.2, "Partial Personalized Models") keep the head on the client
and share, average or generate the body.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
from torch import Tensor

from hyperfed.models.adapter import ModelPartError
from hyperfed.models.layout import FunctionalModel


def head_prefixes(fm: FunctionalModel) -> tuple[str, ...]:
    """The parameter-name prefixes of ``fm``'s head (``head_prefixes``; a model that declares
    none: ``classifier``); a :class:`ModelPartError` for a wrapped module without a head."""
    prefixes = tuple(getattr(fm.module, "head_prefixes", ("classifier",)))
    if not prefixes:
        raise ModelPartError(
            f"model {fm.name!r} has no head for this method's body/head split: no nn.Linear "
            "giving the logits is called last in its forward; name its head with "
            f"hyperfed.register_model({fm.name!r}, factory, head='<submodule>')"
        )
    return prefixes


def layer_prefixes(fm: FunctionalModel, spec: str) -> tuple[str, ...]:
    """Comma-separated parameter-name prefixes, where ``head`` is the model's head
    (:func:`head_prefixes`) and ``classifier`` its last Linear (``classifier_prefix``: the
    zoo's ``classifier``, ``net.fc`` for a wrapped module whose last Linear is ``fc``)."""
    out: list[str] = []
    for token in (t.strip() for t in spec.split(",")):
        if token == "head":
            out += head_prefixes(fm)
        elif token == "classifier":
            prefix = getattr(fm.module, "classifier_prefix", "classifier")
            if prefix is None:
                raise ModelPartError(
                    f"model {fm.name!r} has no classifier: no nn.Linear giving the logits is "
                    "called last in its forward; name its layers by parameter-name prefix"
                )
            out.append(f"{prefix}.")
        elif token:
            out.append(token)
    return tuple(out)


@dataclass(frozen=True)
class BodyHead:
    """Index views of ``theta[..., K]``: ``body`` (shared) and ``head`` (personal) entries."""

    body_idx: Tensor
    head_idx: Tensor
    order: Tensor  # theta == cat(body, head)[..., order]

    @classmethod
    def of(cls, fm: FunctionalModel, device: torch.device | None = None) -> BodyHead:
        prefixes = head_prefixes(fm)
        head = fm.layout.mask(prefixes)
        if not bool(head.any()) or bool(head.all()):
            part = "no body: its head is the whole model" if bool(head.any()) else "an empty head"
            raise ModelPartError(
                f"model {fm.name!r} has {part} (head {', '.join(prefixes)}); a body/head method "
                "needs parameters on both sides"
            )
        body_idx = torch.nonzero(~head).squeeze(1)
        head_idx = torch.nonzero(head).squeeze(1)
        order = torch.argsort(torch.cat([body_idx, head_idx]))
        dev = device or torch.device("cpu")
        return cls(body_idx.to(dev), head_idx.to(dev), order.to(dev))

    @property
    def num_body(self) -> int:
        return int(self.body_idx.numel())

    @property
    def num_head(self) -> int:
        return int(self.head_idx.numel())

    def head_mask(self) -> Tensor:
        """Bool ``[K]``: True on the head (personal) entries."""
        m = torch.zeros(self.num_body + self.num_head, dtype=torch.bool, device=self.order.device)
        m[self.head_idx] = True
        return m

    def body(self, theta: Tensor) -> Tensor:
        return theta[..., self.body_idx]

    def head(self, theta: Tensor) -> Tensor:
        return theta[..., self.head_idx]

    def join(self, body: Tensor, head: Tensor) -> Tensor:
        """The full ``theta`` from its parts (a gather: works under ``vmap`` and autograd)."""
        return torch.cat([body, head], dim=-1)[..., self.order]


@cache
def body_head(fm: FunctionalModel) -> BodyHead:
    """The split of ``fm`` on the device of its parameters (computed once per model)."""
    return BodyHead.of(fm, fm.initial_params().device)
