"""Client-local chunk-id hypernetwork of pFedKT (seed 001, Appendix B-C, Table 2).

A target model's flat parameter vector ``theta in R^K`` is cut into ``n = ceil(K / chunk)``
chunks. Chunk ``j`` has a learnable embedding ``e_j in R^emb_dim``, which an MLP maps to the
chunk's ``chunk`` parameters::

    e_j -> Linear(emb_dim, hidden) -> ReLU -> [Linear(hidden, hidden) -> ReLU] * n_hidden
        -> Linear(hidden, chunk)

and ``theta = concat(chunk_0, ..., chunk_{n-1})[:K]`` (Table 2: emb 13, hidden 100, output
400; n_hidden 1 for CIFAR-10, 2 for CIFAR-100).

Everything is functional with a leading *client* axis: the hypernetworks of ``C`` clients are
one tensor ``phi[C, P]`` (flat, described by :attr:`ChunkedHypernet.layout`), and
:meth:`ChunkedHypernet.generate` runs all chunks of all clients as batched contractions over
``[clients, chunks, ...]`` -- no Python loop over clients or chunks.

Update (Eq. 1 / Eq. 10): with ``delta = theta_generated - theta_trained`` (Eq. 8, the
first-order stand-in for the gradient of the target loss w.r.t. the generated parameters),
the hypernetwork gradient is the vector-Jacobian product ``(d theta / d phi)^T delta``
(:meth:`ChunkedHypernet.grad`), and ``phi <- phi - lr * step(grad)`` with plain SGD
(Eq. 10 literally) or Adam (:func:`optimizer_step`). Descending on this gradient moves the
generated model toward the trained one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.func import vjp

from hyperfed.models.layout import ParamLayout


class ChunkedHypernet:
    """Shape of a chunk-id hypernetwork for a target of ``num_params`` entries.

    Holds no weights: those are the rows of a ``phi[C, P]`` tensor, one per client.
    """

    def __init__(
        self,
        num_params: int,
        *,
        chunk: int = 400,
        emb_dim: int = 13,
        hidden: int = 100,
        n_hidden: int = 1,
        scale: Tensor | None = None,
    ) -> None:
        if scale is not None and scale.shape != (num_params,):
            raise ValueError(f"scale must have shape ({num_params},), got {tuple(scale.shape)}")
        if min(num_params, chunk, emb_dim, hidden) < 1 or n_hidden < 0:
            raise ValueError(
                "num_params, chunk, emb_dim and hidden must be >= 1 and n_hidden >= 0; got "
                f"{num_params}, {chunk}, {emb_dim}, {hidden}, {n_hidden}"
            )
        self.num_params = num_params
        self.chunk = chunk
        self.emb_dim = emb_dim
        self.hidden = hidden
        self.n_hidden = n_hidden
        self.num_chunks = math.ceil(num_params / chunk)
        # fixed (never trained) multiplier of each generated entry: theta = scale * MLP output.
        # One shared output layer gives every layer of the target the same scale; this gives
        # each layer its own (pFedKT's hn_init = "layer")
        self.scale = scale
        shapes: list[tuple[str, tuple[int, ...]]] = [("emb", (self.num_chunks, emb_dim))]
        fan_in = emb_dim
        for i in range(n_hidden + 1):
            shapes += [(f"fc{i}.weight", (hidden, fan_in)), (f"fc{i}.bias", (hidden,))]
            fan_in = hidden
        shapes += [("out.weight", (chunk, hidden)), ("out.bias", (chunk,))]
        self.layout = ParamLayout(shapes)

    @property
    def size(self) -> int:
        """Parameters of one client's hypernetwork (P)."""
        return self.layout.size

    def init(
        self,
        num_clients: int,
        *,
        target_std: float | None = None,
        device: torch.device | str | None = None,
    ) -> Tensor:
        """``phi[C, P]``, independently drawn per client from the global torch RNG.

        Embeddings ~ N(0, 1) (as ``nn.Embedding``); Linear layers as ``nn.Linear``'s default,
        U(+-1/sqrt(fan_in)) for weights and biases. ``target_std`` rescales the output layer
        so each client's initial generated vector has that standard deviation (e.g. the
        target model's own init scale); None keeps the plain ``nn.Linear`` init. The std is
        the MLP's, before ``scale``: with a per-layer ``scale``, ``target_std=1`` gives each
        layer of the generated model the std in ``scale``.
        """
        parts: dict[str, Tensor] = {}
        for seg in self.layout.segments:
            shape = (num_clients, *seg.shape)
            if seg.name == "emb":
                parts[seg.name] = torch.randn(shape)
            else:
                bound = 1.0 / math.sqrt(self._fan_in(seg.name))
                parts[seg.name] = (torch.rand(shape) * 2 - 1) * bound
        phi = torch.cat([parts[s.name].reshape(num_clients, -1) for s in self.layout.segments], 1)
        phi = phi.to(device)
        if target_std is not None:
            std = self._mlp(phi).std(dim=1, keepdim=True)  # before ``scale``
            out = self.layout.mask(("out.",)).to(phi.device)
            scale = torch.where(out, target_std / std.clamp(min=1e-12), torch.ones_like(std))
            phi = phi * scale
        return phi

    def _fan_in(self, name: str) -> int:
        if name.startswith("fc0."):
            return self.emb_dim
        return self.hidden

    def generate(self, phi: Tensor) -> Tensor:
        """``theta[C, K]`` from ``phi[C, P]``: all chunks of all clients in one batched pass."""
        theta = self._mlp(phi)
        # ``scale`` is built from omega^0 on the model's device: ``.to`` is a no-op there
        return theta if self.scale is None else theta * self.scale.to(theta)

    def _mlp(self, phi: Tensor) -> Tensor:
        w = self.layout.unflatten(phi)
        h = w["emb"]  # [C, n, e]
        for i in range(self.n_hidden + 1):
            h = torch.relu(
                torch.einsum("cni,chi->cnh", h, w[f"fc{i}.weight"]) + w[f"fc{i}.bias"][:, None]
            )
        out = torch.einsum("cnh,coh->cno", h, w["out.weight"]) + w["out.bias"][:, None]
        return out.reshape(phi.shape[0], -1)[:, : self.num_params]

    def grad(self, phi: Tensor, delta: Tensor) -> Tensor:
        """``(d theta / d phi)^T delta`` per client (Eq. 9): a VJP with ``delta`` as the
        output gradient; ``delta = theta_generated - theta_trained`` (Eq. 8)."""
        _, pullback = vjp(self.generate, phi)[:2]
        (g,) = pullback(delta.to(phi.dtype))
        return g


@dataclass(frozen=True)
class HNOptimizer:
    """Hypernetwork optimizer: ``sgd`` (Eq. 10: phi -= lr * g, optional momentum) or
    ``adam`` (torch.optim.Adam's update), applied to a client axis at once."""

    name: str = "sgd"
    lr: float = 5e-3
    momentum: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if self.name not in ("sgd", "adam"):
            raise ValueError(f"hypernetwork optimizer {self.name!r}; allowed: sgd, adam")

    def init_state(self, phi: Tensor) -> dict[str, Tensor]:
        """Per-client optimizer state, stacked like ``phi``."""
        state = {"hn_m": torch.zeros_like(phi)}
        if self.name == "adam":
            state["hn_v"] = torch.zeros_like(phi)
            state["hn_t"] = torch.zeros(phi.shape[0], device=phi.device)
        return state


def optimizer_step(
    opt: HNOptimizer, phi: Tensor, g: Tensor, state: dict[str, Tensor]
) -> tuple[Tensor, dict[str, Tensor]]:
    """One optimizer step for every client of ``phi[C, P]`` (the same arithmetic as
    ``torch.optim.SGD`` / ``torch.optim.Adam``); returns ``(phi, state)``."""
    if opt.weight_decay:
        g = g + opt.weight_decay * phi
    if opt.name == "sgd":
        if not opt.momentum:
            return phi - opt.lr * g, state
        m = opt.momentum * state["hn_m"] + g
        return phi - opt.lr * m, {**state, "hn_m": m}
    b1, b2 = opt.betas
    t = state["hn_t"] + 1
    m = b1 * state["hn_m"] + (1 - b1) * g
    v = b2 * state["hn_v"] + (1 - b2) * g * g
    m_hat = m / (1 - b1 ** t[:, None])
    v_hat = v / (1 - b2 ** t[:, None])
    phi = phi - opt.lr * m_hat / (v_hat.sqrt() + opt.eps)
    return phi, {"hn_m": m, "hn_v": v, "hn_t": t}


def update(
    hn: ChunkedHypernet,
    opt: HNOptimizer,
    phi: Tensor,
    theta_generated: Tensor,
    theta_trained: Tensor,
    state: dict[str, Tensor],
) -> tuple[Tensor, dict[str, Tensor]]:
    """Eq. 1: ``phi <- phi - lr (d theta/d phi)^T (theta_generated - theta_trained)``."""
    g = hn.grad(phi, theta_generated - theta_trained)
    return optimizer_step(opt, phi, g, state)
