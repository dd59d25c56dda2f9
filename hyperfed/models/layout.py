"""Flat parameter views of zoo models (DESIGN contract 4).

Every model is trained, generated and exchanged as one flat vector ``theta in R^K``.
:class:`ParamLayout` maps names/shapes/offsets to that vector and back, and
:class:`FunctionalModel` runs a module from a flat vector (plus a flat vector of
BatchNorm running statistics), so the same code works for one client or under
``torch.func.vmap`` over a leading client axis.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch._C._functorch import maybe_current_level
from torch.func import functional_call

# a flat parameter vector ``[..., K]``, or one tensor per parameter in layout order (the
# client loop's per-parameter leaves, engine.local._leaf_sgd_loop)
Params = Tensor | tuple[Tensor, ...]

_NHWC = {"on": False}  # set by channels_last(); read by FunctionalModel._call


@contextmanager
def channels_last(enabled: bool = True) -> Iterator[None]:
    """Run every :class:`FunctionalModel` forward inside the block with channels-last (NHWC)
    activations: 4-D inputs and every Conv2d output are made channels-last, so oneDNN's
    NHWC convolution and pooling kernels run (faster on a CPU: docs/performance.md; `hyperfed
    bench` modes loop, loop-nchw). Same arithmetic, other
    summation order. Not applied under ``vmap`` (functorch cannot batch a memory format)
    nor to the reference loop's own ``nn.Module`` calls."""
    before = _NHWC["on"]
    _NHWC["on"] = enabled
    try:
        yield
    finally:
        _NHWC["on"] = before


def as_channels_last(x: Tensor) -> Tensor:
    """``x`` (4-D) laid out channels-last. A 1-channel tensor counts as contiguous in both
    layouts, so ``contiguous(channels_last)`` keeps its NCHW strides and oneDNN then runs the
    next convolution, and everything after it, in NCHW; its channel stride is set to 1
    explicitly instead (a view: with one channel the same memory order)."""
    if x.shape[1] != 1:
        return x.contiguous(memory_format=torch.channels_last)
    x = x.contiguous()
    _, _, h, w = x.shape
    return x.as_strided(x.shape, (h * w, 1, w, 1))


@dataclass(frozen=True)
class Segment:
    """One named tensor inside a flat vector."""

    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def end(self) -> int:
        return self.offset + self.numel


class ParamLayout:
    """Names, shapes and offsets of a module's parameters (or float buffers) in a flat vector."""

    def __init__(self, named_shapes: Iterable[tuple[str, Sequence[int]]]) -> None:
        segments, offset = [], 0
        for name, shape in named_shapes:
            seg = Segment(name, tuple(int(s) for s in shape), offset)
            segments.append(seg)
            offset = seg.end
        self.segments: tuple[Segment, ...] = tuple(segments)
        self.size = offset

    @classmethod
    def of_parameters(cls, module: nn.Module) -> ParamLayout:
        return cls((n, p.shape) for n, p in module.named_parameters())

    @classmethod
    def of_buffers(cls, module: nn.Module) -> ParamLayout:
        """Float buffers only (BatchNorm running stats); integer counters are not state we keep."""
        return cls((n, b.shape) for n, b in module.named_buffers() if b.is_floating_point())

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.segments]

    def unflatten(self, flat: Tensor) -> dict[str, Tensor]:
        """Views of ``flat[..., K]`` as named tensors (leading dims are kept)."""
        lead = flat.shape[:-1]
        # one split rather than a slice per tensor: the backward is one cat, where slices
        # would each scatter into a zero-filled gradient of size K (a large share of a step)
        parts = flat.split([s.numel for s in self.segments], dim=-1)
        return {s.name: p.reshape(*lead, *s.shape) for s, p in zip(self.segments, parts)}

    def flatten(self, tensors: dict[str, Tensor]) -> Tensor:
        if not self.segments:
            return torch.zeros(0)
        return torch.cat([tensors[s.name].reshape(-1) for s in self.segments])

    def mask(self, prefixes: Iterable[str]) -> Tensor:
        """Boolean ``[K]`` mask of the entries whose name starts with one of ``prefixes``."""
        prefixes = tuple(prefixes)
        m = torch.zeros(self.size, dtype=torch.bool)
        for s in self.segments:
            if prefixes and s.name.startswith(prefixes):
                m[s.offset : s.end] = True
        return m


def _tensor_slots(module: nn.Module) -> list[tuple[dict[str, Any], str, str]]:
    """Every parameter and buffer slot of ``module``'s sub-modules as ``(the sub-module's
    _parameters or _buffers dict, key, the tensor's name in named_parameters/named_buffers)``;
    a tied tensor has several slots and one name."""
    names = {id(p): n for n, p in module.named_parameters()}
    names.update({id(b): n for n, b in module.named_buffers()})
    slots = []
    for mod in module.modules():
        for table in (mod._parameters, mod._buffers):
            slots += [(table, key, names[id(t)]) for key, t in table.items() if t is not None]
    return slots


class FunctionalModel:
    """A zoo module run from flat vectors: ``forward(theta, buffers, x)``.

    BatchNorm running statistics are carried as a second flat vector. In training mode
    the new statistics are *returned*, never written into the caller's vector: under a
    ``torch.func`` transform they are computed from the batch statistics each BatchNorm
    layer sees (recorded by a pre-forward hook), so the step is a pure function that
    ``vmap`` and ``grad`` can transform; with plain autograd BatchNorm writes them into a
    copy itself.
    """

    def __init__(self, module: nn.Module, name: str = "") -> None:
        self.module = module
        self.name = name or type(module).__name__
        self.layout = ParamLayout.of_parameters(module)
        self.buffer_layout = ParamLayout.of_buffers(module)
        self._recording: list[tuple[str, Tensor]] | None = None
        self._bn: dict[str, nn.modules.batchnorm._BatchNorm] = {}
        for mod_name, mod in module.named_modules():
            if isinstance(mod, nn.modules.batchnorm._BatchNorm) and mod.track_running_stats:
                self._bn[mod_name] = mod
                mod.register_forward_pre_hook(self._make_hook(mod_name))
            if isinstance(mod, nn.Conv2d):
                mod.register_forward_hook(self._nhwc_hook)
            if isinstance(mod, nn.Flatten):
                mod.register_forward_pre_hook(self._nhwc_grad_hook)
        self._nhwc = False  # inside a channels-last _call
        # BatchNorm's own in-place update equals _updated_buffers when it uses a momentum
        self._bn_in_place = all(bn.momentum is not None for bn in self._bn.values())
        self._counters = {
            n: torch.zeros((), dtype=torch.long)
            for n, b in module.named_buffers()
            if not b.is_floating_point()
        }
        self._slots = _tensor_slots(module)
        # whether a training forward draws from the random stream (dropout with p > 0); read
        # per client and round by engine.local.client_rng, so found once here
        self.stochastic = any(
            isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in module.modules()
        )

    @property
    def num_params(self) -> int:
        return self.layout.size

    @property
    def num_buffers(self) -> int:
        return self.buffer_layout.size

    def _make_hook(self, mod_name: str):  # type: ignore[no-untyped-def]
        def hook(mod: nn.Module, inputs: tuple[Tensor, ...]) -> None:
            if self._recording is not None:
                self._recording.append((mod_name, inputs[0].detach()))

        return hook

    def _nhwc_hook(self, mod: nn.Module, inputs: tuple[Tensor, ...], out: Tensor) -> Tensor:
        return as_channels_last(out) if self._nhwc else out

    def _nhwc_grad_hook(self, mod: nn.Module, inputs: tuple[Tensor, ...]) -> None:
        """Flatten copies an NHWC activation to NCHW order, so its gradient comes back NCHW
        and the layer before (max-pool) would convert its own NHWC input to match; turning
        the smaller gradient channels-last instead saves that copy and one more."""
        x = inputs[0]
        if self._nhwc and x.dim() == 4 and x.requires_grad:
            x.register_hook(as_channels_last)

    def initial_params(self) -> Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.module.parameters()])

    def initial_buffers(self) -> Tensor:
        bufs = [b.detach().reshape(-1) for b in self.module.buffers() if b.is_floating_point()]
        return torch.cat(bufs) if bufs else torch.zeros(0)

    def _call(
        self, theta: Params, buffers: Tensor, x: Tensor, features: bool, copy: bool = True
    ) -> object:
        """``copy=False`` hands ``buffers`` itself to the module: a training-mode BatchNorm
        outside a torch.func transform then writes its new running statistics into it."""
        if isinstance(theta, tuple):  # one tensor per parameter, in layout order
            tensors = dict(zip(self.layout.names, theta))
        else:
            tensors = self.layout.unflatten(theta)
        if self.buffer_layout.size:
            # a copy: outside vmap BatchNorm would update the caller's statistics in place
            tensors.update(self.buffer_layout.unflatten(buffers.clone() if copy else buffers))
        # fresh counters each call: BatchNorm increments them in place, which grad/vmap reject
        tensors.update({n: torch.zeros((), dtype=torch.long) for n in self._counters})
        kwargs = {"return_features": True} if features else {}
        # inside a torch.func transform (vmap), memory formats cannot be batched
        nhwc = _NHWC["on"] and x.dim() == 4 and maybe_current_level() is None
        if nhwc:
            x = as_channels_last(x)
        self._nhwc = nhwc
        try:
            if maybe_current_level() is None:  # plain autograd: the client loop, evaluation
                return self._bound_call(tensors, x, kwargs)
            return functional_call(self.module, tensors, (x,), kwargs)
        finally:
            self._nhwc = False

    def _bound_call(self, tensors: dict[str, Tensor], x: Tensor, kwargs: dict) -> object:
        """``functional_call``'s effect without its per-call bookkeeping (untying, module
        traversal, checked swaps): the views are put straight into the modules' parameter and
        buffer slots and the originals put back (the bookkeeping is a visible share of a small
        step: docs/performance.md)."""
        saved = [slots[key] for slots, key, _ in self._slots]
        try:
            for slots, key, name in self._slots:
                slots[key] = tensors[name]
            return self.module(x, **kwargs)
        finally:
            for (slots, key, _), value in zip(self._slots, saved):
                slots[key] = value

    def forward(
        self, theta: Params, buffers: Tensor, x: Tensor, *, return_features: bool = False
    ) -> Any:
        """Inference forward (BatchNorm uses running statistics)."""
        if self.module.training:  # modes are only ever set on the root (recursing costs)
            self.module.eval()
        return self._call(theta, buffers, x, return_features)  # type: ignore[return-value]

    def forward_train(
        self, theta: Params, buffers: Tensor, x: Tensor, *, return_features: bool = False
    ) -> tuple[Any, Tensor]:
        """Training forward; returns ``(output, new_buffers)``."""
        if not self.module.training:
            self.module.train()
        if not self._bn:
            return self._call(theta, buffers, x, return_features), buffers  # type: ignore[return-value]
        if self._bn_in_place and maybe_current_level() is None:
            # plain autograd (the client loop): BatchNorm updates a copy of the statistics
            # itself, as nn.BatchNorm does; no second pass over its inputs
            new_buffers = buffers.clone()
            out = self._call(theta, new_buffers, x, return_features, copy=False)
            return out, new_buffers
        self._recording = []
        try:
            out = self._call(theta, buffers, x, return_features)
            seen = self._recording
        finally:
            self._recording = None
        return out, self._updated_buffers(buffers, seen)  # type: ignore[return-value]

    def _updated_buffers(self, buffers: Tensor, seen: list[tuple[str, Tensor]]) -> Tensor:
        stats = self.buffer_layout.unflatten(buffers)
        new = dict(stats)
        for mod_name, inp in seen:
            bn = self._bn[mod_name]
            dims = [d for d in range(inp.dim()) if d != 1]
            n = inp.numel() // inp.shape[1]
            mean = inp.mean(dim=dims)
            var = inp.var(dim=dims, unbiased=False) * (n / max(n - 1, 1))
            mom = bn.momentum if bn.momentum is not None else 0.1
            key = f"{mod_name}." if mod_name else ""
            rm, rv = new[key + "running_mean"], new[key + "running_var"]
            new[key + "running_mean"] = (1 - mom) * rm + mom * mean
            new[key + "running_var"] = (1 - mom) * rv + mom * var
        return torch.cat([new[s.name].reshape(-1) for s in self.buffer_layout.segments])

    def load_into(self, module: nn.Module, theta: Tensor, buffers: Tensor | None = None) -> None:
        """Copy flat vectors into a real module (the reference path and exports)."""
        with torch.no_grad():
            tensors = self.layout.unflatten(theta)
            for n, p in module.named_parameters():
                p.copy_(tensors[n])
            if buffers is not None and self.buffer_layout.size:
                bt = self.buffer_layout.unflatten(buffers)
                for n, b in module.named_buffers():
                    if n in bt:
                        b.copy_(bt[n])

    def read_from(self, module: nn.Module) -> tuple[Tensor, Tensor]:
        theta = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
        bufs = [b.detach().reshape(-1) for b in module.buffers() if b.is_floating_point()]
        return theta, (torch.cat(bufs) if bufs else torch.zeros(0, device=theta.device))


def fresh_init(fm: FunctionalModel, seed: int) -> Tensor:
    """A new draw of ``fm``'s default PyTorch initialization (every layer's
    ``reset_parameters``, drawn on the CPU under ``seed``, returned on ``fm``'s device), flat;
    the global RNG is left as it was
    (HypCluster's extra cluster models, pFedLA's per-client starts)."""
    import copy

    module = copy.deepcopy(fm.module).cpu()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for layer in module.modules():
            reset = getattr(layer, "reset_parameters", None)
            if callable(reset):
                reset()
    device = next(fm.module.parameters()).device  # where fm's own parameters live
    return fm.read_from(module)[0].to(device)
