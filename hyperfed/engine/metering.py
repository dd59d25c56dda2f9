"""FLOP metering: what local training and the server's round work cost in FLOPs.

:class:`FlopMeter` collects, while it is active, the training FLOPs of every local-training
call (:func:`count_flops`: one step measured once per model, loss and shapes, times the
client-steps taken) and of the ops run inside :meth:`FlopMeter.counting` (:class:`FlopSum`,
torch's own flop formulas). :func:`measured_flops` meters one call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, TypeVar

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from hyperfed.data.federated import FederatedData
from hyperfed.models.layout import FunctionalModel, Params

if TYPE_CHECKING:
    from hyperfed.engine.local import BatchPlan, LossFn

T = TypeVar("T")


class FlopMeter:
    """Counts the training FLOPs of every ``train_clients`` (and reference) call made inside
    ``with FlopMeter() as meter:`` -- whatever the loss trains (a second model, an extractor,
    a teacher's forward pass). One step of one client is measured once per (model, loss,
    shapes) with torch's flop counter (forward + backward, batch of ``B``) and multiplied by
    the number of client-steps taken. The optimizer update itself is not counted."""

    active: list[FlopMeter] = []
    exact = False  # inside counting(): every op is counted as it runs, steps are not estimated

    def __init__(self) -> None:
        self.total = 0

    def __enter__(self) -> FlopMeter:
        FlopMeter.active.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        FlopMeter.active.remove(self)

    @staticmethod
    @contextmanager
    def counting() -> Iterator[None]:
        """Count every op run inside (:class:`FlopSum`) into the active meters: for the few
        large ops outside local training (hypernetwork generation and update)."""
        if not FlopMeter.active:
            yield
            return
        outer, FlopMeter.exact = FlopMeter.exact, True
        try:
            with FlopSum() as counter:
                yield
        finally:
            FlopMeter.exact = outer
        for meter in FlopMeter.active:
            meter.total += counter.get_total_flops()


class FlopSum(TorchDispatchMode):
    """The FLOPs of every op run inside ``with FlopSum() as c:`` (``c.get_total_flops()``),
    by torch's own flop formulas (``torch.utils.flop_counter``); ops without one count zero.
    ``FlopCounterMode`` counts the same ops but also tracks the module hierarchy of every op
    and tries to decompose every op without a formula, every time, several times this one's
    cost on a server round (docs/performance.md). No op hyperfed runs needs the decomposition
    (the totals are equal, tests/test_engine_local.py)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in dynamo.disable unless told not to, and
        # that imports torch._dynamo (~2 s of CPU in every process); hyperfed compiles nothing
        return False

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def get_total_flops(self) -> int:
        return self.total

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.total += int(formula(*args, **kwargs, out_val=out))
        return out


def measured_flops(fn: Callable[..., T], *args: object) -> tuple[T, int]:
    """``fn(*args)`` and the FLOPs of its ops (the server's round work, e.g. a hypernetwork)."""
    with FlopMeter() as meter, FlopMeter.counting():
        out = fn(*args)
    return out, meter.total


_STEP_FLOPS: dict[tuple, int] = {}  # (step key, frozen parameters) -> FLOPs


def count_flops(
    loss_fn: LossFn,
    fm: FunctionalModel,
    theta: Tensor,
    buffers: Tensor,
    data: FederatedData,
    plan: BatchPlan,
    ctx: dict[str, Tensor],
    step_ctx: dict[str, Tensor],
    frozen: list[tuple[bool, ...] | None] | None = None,
) -> None:
    """Add the training FLOPs of ``plan``'s client-steps to the active meters: one step of
    ``loss_fn`` w.r.t. ``theta`` (whatever ``theta`` is: a model's parameters, or the
    hypernetwork that generates them) measured once per key, the one cache of every loop.
    ``frozen[c]``: the parameters client ``c``'s steps keep outside the backward pass
    (``local.frozen_parameters``; None: a full backward), so its steps are counted as run."""
    if FlopMeter.exact:  # the surrounding counter sees every op of this training already
        return
    fn = getattr(loss_fn, "func", loss_fn)  # functools.partial
    key = (
        fm.name,
        fm.num_params,
        theta.shape[-1],  # what is trained (a hypernetwork's size when theta is its phi)
        getattr(fn, "__qualname__", repr(fn)),
        _loss_settings(loss_fn),
        tuple(data.input_shape),
        plan.idx.shape[-1],
        tuple((k, tuple(v.shape[1:])) for k, v in sorted(ctx.items())),
        tuple((k, tuple(v.shape[2:])) for k, v in sorted(step_ctx.items())),
    )
    steps: dict[tuple[bool, ...] | None, int] = {}
    for c, n in enumerate(plan.counts):
        fz = frozen[c] if frozen else None
        steps[fz] = steps.get(fz, 0) + n
    for fz, client_steps in steps.items():
        if (key, fz) not in _STEP_FLOPS:
            x, y = data.batch(plan.idx[0, 0])
            cx = {k: v[0] for k, v in ctx.items()} | {k: v[0, 0] for k, v in step_ctx.items()}
            th: Params
            if fz is None:
                th = theta[0].detach().requires_grad_(True)
                inputs: tuple[Tensor, ...] = (th,)
            else:
                views = fm.layout.unflatten(theta[0].detach()).values()  # local._with_constants
                th = tuple(
                    v.detach() if f else v.detach().requires_grad_() for v, f in zip(views, fz)
                )
                inputs = tuple(p for p, f in zip(th, fz) if not f)
            with FlopSum() as counter, torch.enable_grad():
                loss, _ = loss_fn(fm, th, buffers[0], x, y, cx)  # type: ignore[arg-type]
                torch.autograd.grad(loss, inputs)
            _STEP_FLOPS[(key, fz)] = int(counter.get_total_flops())
        for meter in FlopMeter.active:
            meter.total += _STEP_FLOPS[(key, fz)] * client_steps


def _loss_settings(loss_fn: object, depth: int = 0) -> tuple[str, ...]:
    """What a loss function has bound, for the FLOP cache key: a ``functools.partial``'s
    arguments and a closure's captured values (pFedKT's ``hp``, a wrapped loss), scalars,
    strings and dataclasses (hyperparameters) by value, nested losses by their own settings,
    anything else by type. Two losses of one function that differ only in a setting (the
    number of forward passes, say) are measured apart."""
    bound: list[object] = list(getattr(loss_fn, "args", ()))
    bound += [v for _, v in sorted(getattr(loss_fn, "keywords", {}).items())]
    fn = getattr(loss_fn, "func", loss_fn)
    bound += [cell.cell_contents for cell in getattr(fn, "__closure__", None) or ()]
    out: list[str] = []
    for v in bound:
        if isinstance(v, (bool, int, float, str, type(None))) or dataclasses.is_dataclass(v):
            out.append(repr(v))
        elif callable(v) and depth < 3:
            name = getattr(getattr(v, "func", v), "__qualname__", type(v).__name__)
            out.append(f"{name}{_loss_settings(v, depth + 1)}")
        else:
            out.append(type(v).__name__)
    return tuple(out)
