"""Any ``nn.Module`` as a client model (issue 56, item 3).

Every client model hyperfed trains is a :class:`ClientNet`: ``forward(x, return_features=False)``
gives the logits ``[B, num_classes]`` (with ``return_features=True`` the pair ``(features,
logits)``), and three facts tell the methods which parts to treat apart:

* ``head_prefixes`` -- the parameter-name prefixes of the *head*, the part that FedPer, FedRep,
  LG-FedAvg, DFedAlt, DFedHP and PartialFed keep personal (or share); the rest is the *body*;
* ``classifier_prefix`` -- the last ``nn.Linear``, ``logits = classifier(features)`` (the
  header FedGH and FedTGP share);
* ``feature_dim`` -- the width of ``features``, the input of that Linear (the representation
  of FedProto, MOON, FedGH, FedTGP, Fed-RoD, the distillation methods...).

The zoo's models (:class:`~hyperfed.models.zoo.ZooNet`) are built that way. Any other module a
model factory returns is wrapped in a :class:`ModuleNet`, whose defaults are found by one dry
run on a zero batch:

* the **classifier** is the last ``nn.Linear`` the forward calls, if its output is the model's
  output width (``num_classes``); the **features** are that Linear's input;
* the **head** is that classifier (one layer), unless the factory was registered with
  ``head="<submodule name>"`` (:func:`hyperfed.models.zoo.register_model`): then it is that
  submodule, e.g. a ``nn.Sequential`` of the last two layers; the body is everything else.

A module without such a Linear still trains under every method that needs no split (FedAvg,
Local, pFedHN, MH-pFedHN, ...); a method that needs a head or features stops with a one-line
:class:`ModelPartError` that names the model and how to name its head. The wrapper keeps the
user's module under ``net``, so its parameter names are the module's own with a ``net.``
prefix (``net.fc.weight``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from hyperfed.errors import HyperfedError

__all__ = ["ClientNet", "ModelFactory", "ModelPartError", "ModuleNet"]

# (input shape, number of classes) -> a model (a ZooNet, or any nn.Module to wrap)
ModelFactory = Callable[[tuple[int, ...], int], nn.Module]


class ModelPartError(HyperfedError, ValueError):
    """A method needs a part of the client model (a head to keep personal, the features before
    the last Linear) that the model lacks, or a model that cannot be used as a client model."""


class ClientNet(nn.Module):
    """The contract of a client model (see the module docstring); subclasses set the fields."""

    arch: str  # the registry name, set by build_model
    in_shape: tuple[int, ...]
    num_classes: int
    feature_dim: int | None  # the width of the features; None: the model has none
    head_prefixes: tuple[str, ...]  # () : no head
    classifier_prefix: str | None  # the last Linear's parameter-name prefix; None: none

    def forward(self, x: Tensor, return_features: bool = False) -> Any:
        raise NotImplementedError


class ModuleNet(ClientNet):
    """A plain ``nn.Module`` (``net``) as a client model: the classifier, features and head are
    found as the module docstring says; ``head`` names the head submodule instead."""

    def __init__(
        self,
        net: nn.Module,
        in_shape: tuple[int, ...],
        num_classes: int,
        head: str | None = None,
        name: str = "",
    ) -> None:
        super().__init__()
        self.arch = name
        self.in_shape = tuple(in_shape)
        self.num_classes = num_classes
        self.net = net
        label = f"model {name!r}" if name else f"model {type(net).__name__}"
        try:
            calls, out = _dry_run(net, self.in_shape)
        except Exception as e:  # the user's forward: any error, said in one line
            why = " ".join(str(e).split())
            raise ModelPartError(
                f"{label}: its forward fails on a zero batch of shape {(2, *self.in_shape)}: "
                f"{type(e).__name__}: {why}"
            ) from None
        if not isinstance(out, Tensor) or tuple(out.shape) != (2, num_classes):
            got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            raise ModelPartError(
                f"{label}: forward must return logits of shape [batch, {num_classes}] "
                f"(input shape {self.in_shape}, {num_classes} classes); got {got}"
            )
        # the classifier: the last Linear called, if it gives the output width
        last = calls[-1] if calls else None
        linear = net.get_submodule(last) if last is not None else None
        self._classifier: str | None = None
        self.feature_dim = None
        self.classifier_prefix = None
        if isinstance(linear, nn.Linear) and linear.out_features == num_classes:
            assert last is not None
            self._classifier = last
            self.feature_dim = linear.in_features
            self.classifier_prefix = _prefix(last)
        if head is not None:
            modules = dict(net.named_modules())
            if not head or head not in modules:
                names = [
                    n
                    for n, m in net.named_modules()
                    if n and next(m.parameters(), None) is not None
                ]
                raise ModelPartError(
                    f"{label}: head={head!r} names no submodule; its submodules with "
                    f"parameters: {', '.join(names) or '(none)'}"
                )
            if next(modules[head].parameters(), None) is None:
                raise ModelPartError(f"{label}: head={head!r} has no parameters")
        head = head if head is not None else self._classifier
        self.head = head  # the head submodule's name inside ``net`` ("": net itself), or None
        self.head_prefixes = (_prefix(head) + ".",) if head is not None else ()

    @property
    def classifier(self) -> nn.Linear | None:
        """The last Linear (``logits = classifier(features)``), or None."""
        if self._classifier is None:
            return None
        return self.net.get_submodule(self._classifier)  # type: ignore[return-value]

    def forward(self, x: Tensor, return_features: bool = False) -> Any:
        if not return_features:
            return self.net(x)
        if self._classifier is None:
            raise ModelPartError(
                f"model {self.arch!r}: this method needs the features before the last "
                f"Linear, but the model's forward calls no nn.Linear that gives the "
                f"{self.num_classes} logits last"
            )
        seen: list[Tensor] = []
        hook = self.net.get_submodule(self._classifier).register_forward_pre_hook(
            lambda _m, inputs: seen.append(inputs[0])
        )
        try:
            logits = self.net(x)
        finally:
            hook.remove()
        return seen[-1], logits


def _prefix(name: str) -> str:
    """The parameter-name prefix of ``net``'s submodule ``name`` inside the wrapper."""
    return f"net.{name}" if name else "net"


def _dry_run(net: nn.Module, in_shape: tuple[int, ...]) -> tuple[list[str], Any]:
    """The names of the Linear layers ``net`` calls on a zero batch of 2, in call order, and
    its output (in eval mode, without gradients: BatchNorm statistics untouched)."""
    calls: list[str] = []
    hooks = [
        m.register_forward_hook(lambda _m, _i, _o, n=name: calls.append(n))
        for name, m in net.named_modules()
        if isinstance(m, nn.Linear)
    ]
    was_training = net.training
    net.eval()
    try:
        with torch.no_grad():
            out = net(torch.zeros(2, *in_shape))
    finally:
        net.train(was_training)
        for h in hooks:
            h.remove()
    return calls, out
