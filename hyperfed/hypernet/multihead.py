"""The server-side multi-head hypernetwork of MH-pFedHN (seed 000 §3.2, Eq. 3).

A client reports only its parameter count ``K_i``. It gets ``tau_i = ceil(K_i / N)``
customized embedding vectors ``v_i = [v_i^1 .. v_i^tau]``; a shared feature extractor (an
MLP) maps each vector to a hidden code, and the head for ``tau_i`` -- shared by every
client with the same ``tau`` -- maps channel ``j``'s code to ``N`` parameters:
``theta_i = concat(theta_i^1 .. theta_i^tau)[:K_i]`` (Eq. 3).

A head is one tensor ``W[tau, hidden, N]``, so all clients of a head are generated in one
contraction ``einsum('ctd,tdn->ctn')``. The same module expresses the ablations of Table 3
(``heads="none"``: no head, one output layer shared by every channel of every client;
``heads="per_client"``: every client its own head), Table 10's red setting
(``heads="per_architecture"``: clients share a head only if they run the same architecture,
given as an opaque tag per client; equal-size models of different architectures then get
separate heads, where ``"per_size"`` -- the green setting -- lets them share one) and pFedHN
(Shamsian et al.: one embedding per client and one output layer per model size, i.e.
``tau=1, N=K``).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence

import torch
from torch import Tensor, nn

HEAD_MODES = ("per_size", "none", "per_client", "per_architecture")


def num_chunks(num_params: int, out_dim: int) -> int:
    """tau_i = ceil(K_i / N)."""
    return max(1, math.ceil(num_params / out_dim))


def concat_chunks(chunks: Tensor, num_params: int) -> Tensor:
    """``[..., tau, N] -> [..., K]``: theta = concat(chunks)[:K] (Eq. 3)."""
    return chunks.flatten(-2)[..., :num_params]


class Head(nn.Module):
    """``tau`` output channels, each a linear map from the hidden code to ``N`` parameters."""

    def __init__(self, channels: int, hidden: int, out_dim: int, shared: bool = False) -> None:
        super().__init__()
        bound = 1.0 / math.sqrt(hidden)  # nn.Linear's default initialization
        n = 1 if shared else channels
        self.weight = nn.Parameter(torch.empty(n, hidden, out_dim).uniform_(-bound, bound))
        # the bias bound of the paper's width (hidden = 100) at most: nn.Linear's 1/sqrt(hidden)
        # at a narrow hidden=16 puts a random offset of std 0.14 on every generated parameter,
        # and a generated VGG8 then diverges (tests/test_conformance.py); chosen here
        bias_bound = min(bound, 0.1)
        self.bias = nn.Parameter(torch.empty(n, out_dim).uniform_(-bias_bound, bias_bound))
        self.shared = shared
        self._grad_buffers: dict[int, Tensor] = {}  # backward_from's, by id of the parameter

    def forward(self, codes: Tensor) -> Tensor:
        """``codes[C, tau, hidden] -> chunks[C, tau, N]``."""
        tau = codes.shape[1]
        if self.shared:
            # squeeze, not [0]: its backward is a view, [0]'s a zero-filled copy of the head
            return codes @ self.weight.squeeze(0) + self.bias.squeeze(0)
        weight: Tensor = self.weight
        bias: Tensor = self.bias
        if tau < len(weight):  # never for the heads built below; a slice's backward would
            weight, bias = weight[:tau], bias[:tau]  # zero-fill a gradient of the whole head
        return torch.einsum("ctd,tdn->ctn", codes, weight) + bias

    def backward_from(
        self, codes: Tensor, grad_chunks: Tensor, weight: bool = True, bias: bool = True
    ) -> Tensor:
        """The gradient of ``sum <forward(codes), grad_chunks>``, by hand: accumulated into
        ``weight.grad`` / ``bias.grad`` (each only if asked), returned for ``codes``.

        ``dW[t] = codes[:, t]^T grad[:, t]`` is written into one buffer kept across calls: the
        weight is large (``tau x hidden x N``: 74 MB for MH-pFedHN's LeNet head) and a fresh
        tensor of that size each round is mapped afresh, whose page faults took 4x the product
        itself (2-core CPU: 35 ms against 7 ms into a kept buffer). The buffer becomes
        ``weight.grad`` whenever that is unset (``zero_grad(set_to_none=True)``), so a
        previous round's gradient must not be held on to across the next backward."""
        with torch.no_grad():
            tau = codes.shape[1]
            if self.shared:
                w = self.weight.squeeze(0)  # [hidden, N]
                if weight:
                    flat_codes = codes.reshape(-1, codes.shape[-1])
                    flat_grad = grad_chunks.reshape(-1, grad_chunks.shape[-1])
                    self._accumulate(self.weight, (flat_codes.T @ flat_grad)[None], None)
                if bias:
                    self._accumulate(self.bias, grad_chunks.sum((0, 1))[None], None)
                return grad_chunks @ w.T
            by_channel = grad_chunks.transpose(0, 1)  # [tau, C, N]
            if weight:
                self._accumulate(self.weight, None, (codes.permute(1, 2, 0), by_channel))
            if bias:
                self._accumulate(self.bias, grad_chunks.sum(0), None)
            return torch.bmm(by_channel, self.weight[:tau].transpose(1, 2)).transpose(0, 1)

    def _accumulate(
        self, param: Tensor, value: Tensor | None, product: tuple[Tensor, Tensor] | None
    ) -> None:
        """``param.grad[:rows] += value`` (or ``+= bmm(*product)``), the rest of the rows
        untouched; an unset grad starts from zeros in the kept buffer."""
        rows = (value if value is not None else product[0]).shape[0]  # type: ignore[index]
        if param.grad is None:
            buf = self._grad_buffers.get(id(param))
            if buf is None or (buf.shape, buf.dtype, buf.device) != (
                param.shape,
                param.dtype,
                param.device,
            ):
                buf = torch.empty_like(param)
                self._grad_buffers[id(param)] = buf
            if rows < len(buf):
                buf[rows:].zero_()
            if value is not None:
                buf[:rows].copy_(value)
            else:
                torch.bmm(*product, out=buf[:rows])  # type: ignore[misc]
            param.grad = buf
            return
        part = value if value is not None else torch.bmm(*product)  # type: ignore[misc]
        param.grad[:rows] += part


class MultiHeadHypernet(nn.Module):
    """Shared extractor + heads keyed by size + one embedding matrix per client.

    Args:
        sizes: parameter count of every client, by client id (``-1`` for the global model).
        out_dim: N, parameters per chunk (3072 in the paper); ``None`` = one chunk of K_i
            per client (pFedHN).
        heads: ``"per_size"`` (MH-pFedHN), ``"none"`` or ``"per_client"`` (Table 3),
            ``"per_architecture"`` (Table 10, red: one head per architecture tag and tau).
        arch: ``"per_architecture"`` only: an opaque architecture tag for every id in ``sizes``.
        embed_std: standard deviation of the N(0, s^2) initial embeddings (1: ``torch.randn``;
            the authors' code of seed 000: 0.002).
        relu_out: a ReLU after the extractor's last linear layer too (the authors' code of
            seed 000), so the heads read non-negative codes.
    """

    def __init__(
        self,
        sizes: dict[int, int],
        *,
        embed_dim: int = 64,
        hidden: int = 100,
        n_layers: int = 3,
        out_dim: int | None = 3072,
        heads: str = "per_size",
        arch: Mapping[int, Hashable] | None = None,
        embed_std: float = 1.0,
        relu_out: bool = False,
    ) -> None:
        super().__init__()
        if heads not in HEAD_MODES:
            raise ValueError(f"heads must be one of {', '.join(HEAD_MODES)} (got {heads!r})")
        if heads == "per_architecture" and (arch is None or not set(sizes) <= set(arch)):
            raise ValueError("heads='per_architecture' needs an architecture tag for every id")
        self.sizes = dict(sizes)
        layers: list[nn.Module] = [nn.Linear(embed_dim, hidden)]
        for _ in range(n_layers - 1):
            layers += [nn.ReLU(), nn.Linear(hidden, hidden)]
        if relu_out:
            layers.append(nn.ReLU())
        self.extractor = nn.Sequential(*layers)
        # head key and chunk shape of every client
        self.chunk = {c: (out_dim or k) for c, k in self.sizes.items()}
        self.tau = {c: num_chunks(k, self.chunk[c]) for c, k in self.sizes.items()}
        if heads == "per_size":
            self.key = {c: f"{self.tau[c]}x{self.chunk[c]}" for c in self.sizes}
        elif heads == "per_client":
            self.key = {c: f"client{c}" for c in self.sizes}
        elif heads == "per_architecture":
            assert arch is not None
            # tags in order of first appearance; tau in the key too, so that two sizes can
            # never share a head even if a tag repeats
            order = dict.fromkeys(arch[c] for c in sorted(self.sizes))
            tags = {t: i for i, t in enumerate(order)}
            self.key = {c: f"arch{tags[arch[c]]}_{self.tau[c]}x{self.chunk[c]}" for c in self.sizes}
        else:
            self.key = dict.fromkeys(self.sizes, "shared")
        self.heads = nn.ModuleDict()
        for c in sorted(self.sizes):
            key = self.key[c]
            channels = max(self.tau[d] for d in self.sizes if self.key[d] == key)
            if key not in self.heads:
                if heads == "none" and out_dim is None:
                    raise ValueError("heads='none' needs a fixed out_dim")
                self.heads[key] = Head(channels, hidden, self.chunk[c], shared=heads == "none")
        # v_i: one small Parameter per client, so Adam only ever moves rows that got a gradient
        self.embeddings = nn.ParameterDict(
            {
                self._name(c): nn.Parameter(embed_std * torch.randn(self.tau[c], embed_dim))
                for c in sorted(self.sizes)
            }
        )

    @staticmethod
    def _name(client: int) -> str:
        return "global" if client < 0 else str(client)

    def head_groups(self, clients: Sequence[int]) -> dict[tuple[str, int], list[int]]:
        """Clients grouped by (head, tau): each group is generated in one pass."""
        groups: dict[tuple[str, int], list[int]] = {}
        for c in clients:
            groups.setdefault((self.key[c], self.tau[c]), []).append(c)
        return groups

    def _chunks(self, key: str, members: list[int]) -> Tensor:
        """``chunks[C, tau, N]`` of clients sharing head ``key`` and one ``tau``."""
        v = torch.stack([self.embeddings[self._name(c)] for c in members])  # [C, tau, e]
        return self.heads[key](self.extractor(v))

    def generate(self, clients: Sequence[int]) -> dict[int, Tensor]:
        """theta_i for each client id (Eq. 3), batched per head."""
        out: dict[int, Tensor] = {}
        for (key, _), members in self.head_groups(clients).items():
            chunks = self._chunks(key, members)
            for i, c in enumerate(members):
                out[c] = concat_chunks(chunks[i], self.sizes[c])
        return out

    def backward(
        self, output_grads: Mapping[int, Tensor], inputs: Sequence[Tensor] | None = None
    ) -> None:
        """Accumulate into ``.grad`` the gradient of ``sum_c <theta_c, output_grads[c]>``,
        i.e. back-propagate ``dL/dtheta_c`` through Eq. 3 (only into ``inputs`` if given;
        parameters no client's theta depends on keep ``grad = None``).

        Each head's gradient is laid out zero-padded as ``[C, tau, N]`` (the ``[:K_i]`` cut
        of Eq. 3 contributes nothing beyond ``K_i``) and taken through the head by hand
        (:meth:`Head.backward_from`), so the head's output is not generated a second time;
        autograd takes the rest from the hidden codes back to the extractor and embeddings.
        """
        wanted = None if inputs is None else {id(t) for t in inputs}
        codes_out: list[Tensor] = []
        codes_grads: list[Tensor] = []
        for (key, tau), members in self.head_groups(list(output_grads)).items():
            head = self.heads[key]
            assert isinstance(head, Head)
            v = torch.stack([self.embeddings[self._name(c)] for c in members])  # [C, tau, e]
            codes = self.extractor(v)
            chunk = self.chunk[members[0]]
            padded = codes.new_zeros(len(members), tau * chunk)
            for i, c in enumerate(members):
                padded[i, : self.sizes[c]] = output_grads[c]
            codes_out.append(codes)
            codes_grads.append(
                head.backward_from(
                    codes.detach(),
                    padded.view(len(members), tau, chunk),
                    weight=wanted is None or id(head.weight) in wanted,
                    bias=wanted is None or id(head.bias) in wanted,
                )
            )
        # the extractor and the embeddings through autograd (the heads are done by hand)
        head_params = {id(p) for p in self.heads.parameters()}
        rest = None if inputs is None else [t for t in inputs if id(t) not in head_params]
        if rest is None:
            torch.autograd.backward(codes_out, codes_grads)
        elif rest:
            torch.autograd.backward(codes_out, codes_grads, inputs=rest)

    def extractor_parameters(self) -> list[nn.Parameter]:
        return list(self.extractor.parameters())
