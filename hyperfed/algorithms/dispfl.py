"""DisPFL (Dai et al., ICML 2022): decentralized sparse training with personalized masks.

A baseline of seed 004 (Table 1). No server. Client k owns a binary mask ``m_k`` over *all*
its parameters (weights, biases, BatchNorm affine) with a fixed number of ones (density
``density``), and its model is the sparse ``w_k (.) m_k``. Round t (t = 0 .. T-1), every active
client (DisPFL Alg. 1):

1. **local sparse training** -- E epochs of SGD from ``w_k (.) m_k`` where only the entries of
   ``m_k`` move: ``w <- w - eta m_k (.) (grad F_k(w (.) m_k) + wd w)`` (the authors' code steps
   and re-applies the mask after every step; with the masked entries at 0 this is the same);
2. **send** the sparse model and its mask, ``(w_k (.) m_k, m_k)``, to each active neighbour;
3. **mask search** on the trained model, layer by layer (l = one parameter tensor), with the
   cosine-annealed rate ``alpha_t = alpha / 2 * (1 + cos(pi t / T))``:
   *prune* the ``n_l = ceil(alpha_t * |m_{k,l}|)`` active entries of smallest ``|w|``, then
   *regrow* ``n_l`` inactive entries of that pruned mask, those of largest ``|grad F_k|`` (the
   dense gradient on one mini-batch, BatchNorm in inference mode) or, with
   ``regrow = "random"``, uniformly at random; the number of ones never changes;
4. **local aggregation** (coordinate-wise over the clients whose mask holds the entry, the
   client itself included, with the round's masks m_j of step 2)::

       w_k  <-  m_k^new (.) [ sum_j W_kj m_j (.) w_j  /  sum_j W_kj m_j ]     (0 where no m_j = 1)

   Entries no received mask covers (regrown where nobody trained them) start at 0.

Each client is evaluated with its aggregated sparse model ``w_k (.) m_k^new`` after step 4, the
model each round starts from, as the DFedAvg / DFedAlt / DFedHP files here evaluate their mixed
models. The authors' code logs two accuracies, this one ("new mask", before training) and that
of the model right after step 1 ("old mask"); ``evaluate = "trained"`` reports the latter.

**On hyperfed's gossip runtime** (``runtime/gossip.py``), ``Client.mix`` receives only
``sum_j W_kj reply_j`` per key. The reply is therefore ``{"w": w_k (.) m_k, "mask": m_k}``; the
gossip step yields both W-weighted sums and :meth:`DisPFLClient.mix` divides them (step 4).
The authors' aggregation is the plain mean over the covering clients, ``sum_j m_j w_j /
sum_j m_j``; on a regular graph with Metropolis or max-degree weights (ring, grid, exponential,
full: ``W_kj = 1 / (1 + d)`` on the whole neighbourhood) the W-weighted quotient is exactly that
mean; on an irregular graph (``random``) it is the mean with the W weights (renormalised over
the covering clients). The mask crosses the wire as a float tensor of K entries (the sums need
it), so ``bytes_payload`` counts 2K values where the paper counts ``density * K`` values plus
the mask: the byte counts overstate DisPFL's traffic by about a factor 2 / density.

**Where the defaults come from.** The paper's PDF was not readable here; the rules above follow
the authors' reference implementation (github.com/rong-dai/DisPFL: ERK initialization with
per-client random masks, ``anneal_factor`` 0.5, ``dense_ratio`` 0.5, the mask search, the
masked-mean aggregation). Choices: masks differ between clients from the start (their scripts'
``--different_initial``); the annealing horizon T is the run's planned number of rounds,
announced once to every client in a setup exchange (a client is not told the run length
otherwise); no gradient clipping (their SGD clips at norm 10; hyperfed's local SGD has no
clipping) and no learning-rate decay by default (their 0.998 per round is ``lr_decay``), so
that DisPFL trains like seed 004's other baselines.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Literal, get_args

import torch
import torch.nn.functional as F
from annotated_types import Gt, Le
from torch import Tensor

from hyperfed.algorithms.base import (
    Algorithm,
    Client,
    ClientGroup,
    GossipServer,
    Payload,
    chosen,
    paper,
)
from hyperfed.engine.local import client_seed
from hyperfed.engine.metering import FlopMeter
from hyperfed.engine.topology import GossipParams
from hyperfed.hparams import NonNeg, NonNegInt, Unit
from hyperfed.models.layout import FunctionalModel

Init = Literal["erk", "uniform"]
Regrow = Literal["gradient", "random"]
Evaluate = Literal["mixed", "trained"]
INITS = get_args(Init)
REGROWS = get_args(Regrow)
EVALUATES = get_args(Evaluate)
SALT_GRADIENT, SALT_RANDOM = 7, 8  # batch shuffles / random draws of the mask search


@dataclass
class DisPFLParams(GossipParams):
    """DisPFL's sparsity and mask search (``[algorithm]`` keys), beyond the gossip graph of
    GossipParams (seed 004's keys and defaults, as dfedavg / dfedalt / dfedhp)."""

    density: Annotated[float, Gt(0), Le(1)] = paper(
        0.5, "authors' scripts: dense_ratio 0.5 (cifar10/cifar100/tiny.sh)"
    )
    init: Init = paper("erk", "authors' code default: ERK layer densities (not --uniform)")
    erk_power: NonNeg = paper(1.0, "authors' code: erk_power_scale 1")
    anneal: Unit = paper(0.5, "authors' scripts: anneal_factor 0.5 (alpha of alpha_t)")
    anneal_rounds: NonNegInt = chosen(
        0, "0: T of alpha_t is the run's planned rounds (alpha_t -> 0 at the end, as theirs)"
    )
    regrow: Regrow = paper(
        "gradient", "authors' code default (their CIFAR scripts pass --dis_gradient_check: random)"
    )
    evaluate: Evaluate = chosen(
        "mixed", "as dfedavg / dfedalt here: the post-gossip model; 'trained': after step 1"
    )
    lr_decay: Annotated[float, Gt(0), Le(1)] = chosen(
        1.0, "authors' code: lr * 0.998^t; seed 004 trains its baselines with one plain SGD"
    )


# --- the sparse-training mechanics (pure functions on flat vectors) ------------------------------


def erk_densities(shapes: list[tuple[int, ...]], density: float, power: float = 1.0) -> list[float]:
    """Erdos-Renyi-Kernel density of each tensor: ``eps * (sum(shape) / prod(shape))^power``,
    with ``eps`` set so that the whole model keeps ``density`` of its entries; a tensor whose
    density would exceed 1 is made dense and ``eps`` is solved again for the others."""
    if density >= 1:
        return [1.0] * len(shapes)
    sizes = [math.prod(s) for s in shapes]
    raw = [(sum(s) / n) ** power for s, n in zip(shapes, sizes)]
    dense: set[int] = set()
    while True:
        sparse = [i for i in range(len(shapes)) if i not in dense]
        rhs = sum(sizes[i] * density for i in sparse) - sum(sizes[i] * (1 - density) for i in dense)
        eps = rhs / sum(raw[i] * sizes[i] for i in sparse)
        top = max(raw[i] for i in sparse)
        if top * eps <= 1:
            return [1.0 if i in dense else eps * raw[i] for i in range(len(shapes))]
        dense |= {i for i in sparse if raw[i] == top}


def layer_densities(fm: FunctionalModel, hp: DisPFLParams) -> list[float]:
    shapes = [s.shape for s in fm.layout.segments]
    if hp.init == "uniform":
        return [hp.density] * len(shapes)
    return erk_densities(shapes, hp.density, hp.erk_power)


def random_masks(fm: FunctionalModel, densities: list[float], n: int, g: torch.Generator) -> Tensor:
    """``n`` masks ``[n, K]`` (0/1 floats): ``int(d_l * |l|)`` ones at random places per layer."""
    masks = torch.zeros(n, fm.num_params)
    for c in range(n):
        for seg, d in zip(fm.layout.segments, densities):
            ones = torch.randperm(seg.numel, generator=g)[: int(d * seg.numel)]
            masks[c, seg.offset + ones] = 1.0
    return masks


def anneal_rate(alpha: float, t: int, T: Tensor) -> Tensor:
    """``alpha_t = alpha / 2 * (1 + cos(pi t / T))`` per client (t = 0 at the first round; 0
    from t = T on, should a run go on past its horizon)."""
    return alpha / 2 * (1 + torch.cos(math.pi * (t / T.double()).clamp(max=1.0)))


def search_masks(
    fm: FunctionalModel, theta: Tensor, mask: Tensor, regrow_score: Tensor, rate: Tensor
) -> Tensor:
    """Step 3, per client and per layer: drop the ``ceil(rate * nnz)`` active entries of
    smallest ``|theta|``, then turn on as many inactive entries (of the pruned mask) of largest
    ``regrow_score``. ``mask`` is bool ``[C, K]``; returns the new bool mask."""
    new = mask.clone()
    rows = torch.arange(theta.shape[0], device=theta.device)[:, None]
    for seg in fm.layout.segments:
        sl = slice(seg.offset, seg.end)
        m = mask[:, sl]
        k = torch.ceil(rate.to(theta.device) * m.sum(1).double()).long()  # [C]
        ranks = torch.arange(seg.numel, device=theta.device)[None, :]
        # prune: the k smallest magnitudes among the active entries (inactive ones sort last)
        key = torch.where(m, theta[:, sl].abs(), torch.full_like(theta[:, sl], math.inf))
        order = torch.sort(key, dim=1, stable=True).indices
        pruned = m.clone()
        pruned[rows, order] &= ~(ranks < k[:, None])
        # regrow: the k largest scores among the entries the pruned mask leaves at 0
        score = regrow_score[:, sl].to(theta.dtype)
        key = torch.where(pruned, torch.full_like(score, -math.inf), score)
        order = torch.sort(key, dim=1, descending=True, stable=True).indices
        grown = pruned.clone()
        grown[rows, order] |= ranks < k[:, None]
        new[:, sl] = grown
    return new


def dense_gradients(
    fm: FunctionalModel, theta: Tensor, buffers: Tensor, x: Tensor, y: Tensor
) -> Tensor:
    """``grad F_k`` at each client's (sparse) model w.r.t. *every* entry, one mini-batch each
    (``x[C, B, ...]``), BatchNorm with running statistics -- what regrowth ranks."""
    grads = []
    for c in range(theta.shape[0]):
        leaf = theta[c].detach().requires_grad_(True)
        with torch.enable_grad():
            loss = F.cross_entropy(fm.forward(leaf, buffers[c], x[c]), y[c])
            (g,) = torch.autograd.grad(loss, leaf)
        grads.append(g)
    return torch.stack(grads)


# --- roles ---------------------------------------------------------------------------------------


class DisPFLServer(GossipServer):
    """No server: it validates what a client sends its neighbours and, once before round 1,
    tells every client the planned number of rounds (T of the annealing) when not configured."""

    def shapes(self) -> dict[str, tuple[int, ...]]:
        assert self.ctx.shared_model is not None, "dispfl needs one architecture for all"
        k = self.ctx.shared_model.num_params
        return {"w": (k,), "mask": (k,)}  # step 2: the sparse model and its mask

    def configure_setup(self, stage: int, client_ids: list[int]) -> dict[int, Payload]:
        if stage > 0 or self.hp.anneal_rounds:
            return {}
        rounds = torch.tensor(max(self.ctx.rounds, 1), dtype=torch.int64)
        return {c: {"rounds": rounds} for c in client_ids}

    def check_reply(self, client_id: int, reply: Payload) -> str | None:
        problem = super().check_reply(client_id, reply)
        if problem:
            return problem
        w, m = reply["w"], reply["mask"]
        if not bool(((m == 0) | (m == 1)).all()):
            return "mask holds values other than 0 and 1"
        if bool((w[m == 0] != 0).any()):
            return "w is not zero outside its mask"
        return None


class DisPFLClient(Client):
    def join(self, fm: FunctionalModel, num_samples: int) -> Payload:
        return {}  # no server to tell

    def init_state(self, fm: FunctionalModel, num_clients: int) -> dict[str, Tensor]:
        """Client k (k-th of the group) draws its own mask (ERK layer densities, random places)
        from a seeded stream; its model is the shared initialization masked by it."""
        hp: DisPFLParams = self.hp
        state = super().init_state(fm, num_clients)
        theta = fm.initial_params()
        g = torch.Generator().manual_seed(self.ctx.seed * 1_000_003 + 2022)
        mask = random_masks(fm, layer_densities(fm, hp), num_clients, g)
        mask = mask.to(device=theta.device, dtype=theta.dtype)
        state["mask"] = mask
        state["theta"] = theta[None] * mask
        state["trained"] = state["theta"].clone()  # the last locally trained model (step 1)
        state["rounds"] = torch.full((num_clients,), hp.anneal_rounds, dtype=torch.int64)
        return state

    def setup(
        self, stage: int, group: ClientGroup, msg: Payload, state: dict[str, Tensor]
    ) -> tuple[list[Payload], dict[str, Tensor], dict[str, Tensor]]:
        """The planned number of rounds T, kept for alpha_t."""
        new = {**state, "rounds": msg["rounds"].to(state["rounds"])}
        return [{} for _ in range(group.size)], new, {}

    def fit(
        self, group: ClientGroup, msg: Payload, state: dict[str, Tensor]
    ) -> tuple[Payload, dict[str, Tensor], Tensor]:
        hp: DisPFLParams = self.hp
        mask = state["mask"]
        on = mask.bool()
        # step 1: sparse local training, only the mask's entries move
        sgd = group.sgd
        if hp.lr_decay != 1:
            sgd = dataclasses.replace(sgd, lr=sgd.lr * hp.lr_decay ** max(group.rnd - 1, 0))
        theta, buffers, loss = group.train(
            state["theta"] * mask, state["buffers"], trainable=on, sgd=sgd
        )
        theta = theta * mask
        reply = {"w": theta, "mask": mask}  # step 2
        # step 3: prune / regrow with alpha_t
        if bool((state["rounds"] <= 0).any()):
            raise ValueError("dispfl: T of alpha_t unknown (set anneal_rounds or run the setup)")
        rate = anneal_rate(hp.anneal, group.rnd - 1, state["rounds"])
        new_mask = search_masks(group.fm, theta, on, self.regrow_score(group, theta, buffers), rate)
        new_mask = new_mask.to(mask.dtype)
        new = {**state, "theta": theta, "trained": theta, "buffers": buffers, "mask": new_mask}
        return reply, new, loss

    def regrow_score(self, group: ClientGroup, theta: Tensor, buffers: Tensor) -> Tensor:
        """|dense gradient| on one mini-batch (``regrow="gradient"``) or uniform noise."""
        if self.hp.regrow == "random":
            scores = []
            for c in group.client_ids:
                g = torch.Generator().manual_seed(
                    client_seed(group.seed, group.rnd, c, SALT_RANDOM)
                )
                scores.append(torch.rand(theta.shape[1], generator=g, dtype=torch.float64))
            return torch.stack(scores).to(theta.device)
        x, y = group.data.batch(group.plan(epochs=1, salt=SALT_GRADIENT).idx[0])
        with FlopMeter.counting():
            return dense_gradients(group.fm, theta, buffers, x, y).abs()

    def mix(
        self, group: ClientGroup, mixed: Payload, state: dict[str, Tensor]
    ) -> dict[str, Tensor]:
        """Step 4: masked mean ``sum_j W_kj m_j w_j / sum_j W_kj m_j`` on the new mask."""
        num, den = mixed["w"], mixed["mask"]
        mean = torch.where(den > 0, num / torch.where(den > 0, den, 1.0), 0.0)
        return {**state, "theta": state["mask"] * mean}

    def eval_model(
        self, group: ClientGroup, msg: Payload, state: Mapping[str, Tensor]
    ) -> tuple[Tensor, Tensor]:
        if self.hp.evaluate == "trained":
            return state["trained"], state["buffers"]
        return state["theta"] * state["mask"], state["buffers"]


ALGORITHM = Algorithm(
    name="dispfl",
    summary="DisPFL: personalized sparse masks, masked gossip averaging, prune/regrow per round",
    hparams=DisPFLParams,
    server=DisPFLServer,
    client=DisPFLClient,
    homogeneous_only=True,
    kind="decentralized",
)
