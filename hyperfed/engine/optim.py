"""Optimizers: the update rules local training applies to a client axis, and Adam for
server-side modules.

An :class:`UpdateRule` turns a step's gradients into new parameters for every client of a
group at once (``theta[C, K]``, ``grads[C, K]``), with a per-client state: a dict of tensors
with a leading client axis (``m[C, K]``, a step count ``t[C]``), made by ``init_state`` and
carried from step to step -- and, where a method keeps it, from round to round
(:func:`hyperfed.engine.local.train_clients`'s ``rule_state``). :class:`SGD` is the local
loop's default (``torch.optim.SGD``'s momentum and weight decay); :class:`Adam` is
``torch.optim.Adam``'s update (pFedKT's hypernetwork, trained through the generated model at
every local step).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

State = dict[str, Tensor]


class UpdateRule(ABC):
    """One optimizer step on a client axis. ``mask`` (``[K]`` or ``[C, K]``, 0/1 in the
    parameters' dtype, or None) marks the entries that train: the others keep their value."""

    @abstractmethod
    def init_state(self, theta: Tensor) -> State:
        """Each client's state before its first step, stacked like ``theta``."""

    @abstractmethod
    def step(
        self, theta: Tensor, grads: Tensor, state: State, mask: Tensor | None
    ) -> tuple[Tensor, State]:
        """``(theta, state)`` after one step, as new tensors (what ``torch.where`` masking of
        finished clients and a captured CUDA graph need); the inputs are left as they are."""

    def step_(self, theta: Tensor, grads: Tensor, state: State, mask: Tensor | None) -> None:
        """The same step in place on ``theta`` and on ``state``'s tensors (``grads`` may be
        consumed). By default :meth:`step` and a copy; a rule may do better."""
        new_theta, new_state = self.step(theta, grads, state, mask)
        theta.copy_(new_theta)
        for k, v in new_state.items():
            if v is not state[k]:
                state[k].copy_(v)


@dataclass(frozen=True)
class SGD(UpdateRule):
    """``torch.optim.SGD``'s step in its own operations: ``d = g + wd*p; m = mu*m + d;
    p -= lr*m`` (``m = d`` on the first step of a fresh state, as the zero buffer gives);
    without momentum ``p -= lr*d`` and the state is left as it is."""

    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0

    def init_state(self, theta: Tensor) -> State:
        return {"m": torch.zeros_like(theta)}

    def step(
        self, theta: Tensor, grads: Tensor, state: State, mask: Tensor | None
    ) -> tuple[Tensor, State]:
        d = grads.add(theta, alpha=self.weight_decay) if self.weight_decay else grads
        if mask is not None:
            d = d * mask
        if not self.momentum:
            return theta.add(d, alpha=-self.lr), state
        m = state["m"].mul(self.momentum).add_(d)
        return theta.add(m, alpha=-self.lr), {"m": m}

    def step_(self, theta: Tensor, grads: Tensor, state: State, mask: Tensor | None) -> None:
        """No new ``[C, K]`` tensors per step, which on a CPU cost more than the arithmetic
        (K = 2 M, 2-core CPU: 7.9 ms as four out-of-place ops, 2.0 ms in place;
        ``benchmarks/sgd_update.py``)."""
        d = grads.add_(theta, alpha=self.weight_decay) if self.weight_decay else grads
        if mask is not None:
            d.mul_(mask)
        if self.momentum:
            d = state["m"].mul_(self.momentum).add_(d)
        theta.add_(d, alpha=-self.lr)


@dataclass(frozen=True)
class Adam(UpdateRule):
    """``torch.optim.Adam``'s step (Kingma & Ba, Alg. 1; L2 weight decay added to the
    gradient, as torch's ``weight_decay``): ``t += 1; m = b1*m + (1-b1)*g;
    v = b2*v + (1-b2)*g^2; p -= lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)``. Each
    client has its own ``m``, ``v`` and step count ``t``; a masked entry is not moved."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    def init_state(self, theta: Tensor) -> State:
        steps = theta.new_zeros(theta.shape[0])  # per client
        return {"m": torch.zeros_like(theta), "v": torch.zeros_like(theta), "t": steps}

    def step(
        self, theta: Tensor, grads: Tensor, state: State, mask: Tensor | None
    ) -> tuple[Tensor, State]:
        g = grads + self.weight_decay * theta if self.weight_decay else grads
        if mask is not None:
            g = g * mask
        b1, b2 = self.betas
        t = state["t"] + 1
        per_client = t.to(theta.dtype).view(-1, *[1] * (theta.dim() - 1))  # the bias correction
        m = b1 * state["m"] + (1 - b1) * g
        v = b2 * state["v"] + (1 - b2) * g * g
        m_hat = m / (1 - b1**per_client)
        v_hat = v / (1 - b2**per_client)
        update = self.lr * m_hat / (v_hat.sqrt() + self.eps)
        if mask is not None:
            update = update * mask
        return theta - update, {"m": m, "v": v, "t": t}

    def step_(self, theta: Tensor, grads: Tensor, state: State, mask: Tensor | None) -> None:
        """The same step in place, with one ``[C, K]`` temporary (the denominator) instead of
        about ten: the update is written into ``grads``' memory. pFedKT's one-shot HN(large)
        (18 M outputs a client) spent most of its round allocating them (`benchmarks/
        sgd_update.py` prints the ratio)."""
        g = grads.add_(theta, alpha=self.weight_decay) if self.weight_decay else grads
        if mask is not None:
            g.mul_(mask)
        b1, b2 = self.betas
        t = state["t"].add_(1)
        per_client = t.to(theta.dtype).view(-1, *[1] * (theta.dim() - 1))
        m, v = state["m"], state["v"]
        m.mul_(b1).add_(g, alpha=1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        denom = v.div(1 - b2**per_client).sqrt_().add_(self.eps)
        update = torch.div(m, 1 - b1**per_client, out=g).mul_(self.lr).div_(denom)
        if mask is not None:
            update.mul_(mask)
        theta.sub_(update)


def adam(params: Iterable[Tensor], lr: float) -> torch.optim.Adam:
    """Adam with the fused kernel where this torch has one (about 9x faster than the default
    per-tensor loop for a hypernetwork head on a 2-core CPU); same update either way."""
    params = list(params)
    try:
        return torch.optim.Adam(params, lr=lr, fused=True)
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.Adam(params, lr=lr)
