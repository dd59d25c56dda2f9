"""FedFomo (Zhang et al., ICLR 2021): each client mixes in the downloaded models that lower its
validation loss, weighted by a first-order estimate of how much each one helps.

The server keeps every client's latest uploaded model theta_n and an affinity matrix
P (N x N, P_in: how useful client n's model has been to client i). Round t:

1. Model download (§3.3): for each sampled client i the server picks M models among the
   clients that have uploaded one, i itself excluded: slot by slot, with probability
   eps_t = max(0, eps - t * eps_decay) a random remaining client (exploration), otherwise the
   remaining client of highest affinity P_in (ties broken at random).
2. Federated update (§3.2, Eq. 4-6). The reference point theta_i^{t-1} is the model client i
   started its previous local training from (its last federated update; the initialization
   before its first round), and the candidates are the M downloads *and the client's own
   current model* theta_i (theta_i^{t-1} after that local training) -- as in the authors' code
   (NVlabs/FedFomo: the federating set is ``[self] + M others``, compared against
   ``first_model``, the model saved when local training began) and PFLlib (the server's
   affinity row starts as the identity, so a client's own upload is among the models it
   receives, compared against ``old_model``, the model it trained from). On its local
   *validation* split client i computes, for each candidate theta_n,
       w_n = (L_i(theta_i^{t-1}) - L_i(theta_n)) / ||theta_n - theta_i^{t-1}||_2,
   the loss decrease per unit of distance along theta_n - theta_i^{t-1} (a first-order
   approximation of the directional derivative); keeps only helpful models and normalizes,
       w_n <- max(w_n, 0) / sum_m max(w_m, 0),
   and updates
       theta_i^t = theta_i^{t-1} + sum_n w_n (theta_n - theta_i^{t-1}).
   Its own local progress is thus one weighted candidate: a download barely better on
   validation than the client's own model gets about the same share, it does not replace the
   model (a candidate equal to theta_i^{t-1}, e.g. before any training, gets w = 0). If no
   candidate lowers the loss (all w_n <= 0), the client keeps its current model theta_i
   (``fallback="own"``, PFLlib's rule) or returns to theta_i^{t-1} (``fallback="start"``, the
   authors' code: it discards the last local training).
   ``include_own=False`` is the other reading (hyperfed before issue 35): the reference point
   is the current theta_i and only the downloads are candidates, so one download slightly
   better than theta_i gets weight 1 and replaces it; no helpful download keeps theta_i.
3. Local training: E epochs of SGD from theta_i^t on the local train split; theta_i is kept
   (it is what the client is evaluated with) and uploaded, together with the raw w_n of the
   M downloads (the own model's weight stays on the client); theta_i^t is kept as the next
   round's reference point.
4. Server: stores the upload as client i's model and adds the raw w_n to P_in (§3.3, the
   affinity the next selection ranks by; a model that raised i's loss is ranked down).

What crosses the wire: down, M models (padded to M with zeros and a 0/1 ``mask`` while fewer
clients have uploaded); up, theta_i and the M weights.

Choices the paper leaves open (or where hyperfed differs):
* Validation split: ``partition.val_fraction`` > 0 gives every client one (seed 001's 8:1:1).
  Without it (hyperfed's default config) each client holds out a fixed ``val_holdout`` share
  of its training samples (drawn once per client from the run seed) for the weights and trains
  on the rest -- the authors' code also splits the local data into train / val.
* The norm in w_n: Euclidean over all parameters (the paper's ||.||; the authors' code
  offers L1 too). BatchNorm statistics do not cross the wire: a downloaded model is evaluated
  with client i's own statistics.
* Which w_n update P: the raw (signed, unnormalized) ones.
* Exploration: eps and its per-round decay follow the authors' code (0.3, 0.05), M = 5.
* Defaults of ``include_own`` (True, the authors' reading) and ``fallback`` ("own"), chosen
  on a validation split (issue 35): returning to the start discards the last local training
  and scored lower in both settings; with or without the own model no reading was clearly
  better. The runs: docs/methods.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Annotated, Literal, get_args

import torch
from annotated_types import Gt, Lt
from pydantic import Strict
from torch import Tensor

from hyperfed.algorithms.base import (
    Algorithm,
    ClientGroup,
    Payload,
    PersonalModelClient,
    Server,
    ServerContext,
    chosen,
)
from hyperfed.data.federated import FederatedData
from hyperfed.engine.evaluation import evaluate_clients
from hyperfed.engine.local import client_seed
from hyperfed.engine.metering import FlopMeter
from hyperfed.hparams import Count, NonNeg, Unit
from hyperfed.models.layout import FunctionalModel

# what a client keeps when no candidate lowers its validation loss below theta_i^{t-1}'s:
# its own current model (PFLlib) or theta_i^{t-1}, where its last local training began (authors)
Fallback = Literal["own", "start"]
FALLBACKS = get_args(Fallback)


@dataclass
class FedFomoParams:
    """num_models: M, models downloaded per client and round; epsilon / epsilon_decay: the
    exploration probability of the selection at round 1 and its linear decay per round;
    val_holdout: share of the training samples held out for validation when the partition
    has no validation split; include_own: the client's own current model is a weighted
    candidate measured from the model its last local training started from (True, the
    authors' code), or the reference point with only the downloads as candidates (False);
    fallback: what a client keeps when no candidate lowers its validation loss -- "own", its
    current model (PFLlib), or "start", the model its last local training began from (the
    authors' code; differs from "own" only with include_own)."""

    num_models: Count = chosen(5, "PFLlib's FedFomo default (-M 5); no paper default on disk")
    epsilon: Unit = chosen(0.3, "authors' code, CLIENT_WEIGHT.EPSILON")
    epsilon_decay: NonNeg = chosen(0.05, "authors' code, CLIENT_WEIGHT.EPSILON_DECAY")
    val_holdout: Annotated[float, Gt(0), Lt(1)] = chosen(
        0.2, "authors' code, CLIENT.VAL_SPLIT; only without a val split"
    )
    include_own: Annotated[bool, Strict()] = chosen(
        True, "authors' code and PFLlib; validation: no clear winner"
    )
    fallback: Fallback = chosen(
        "own", "PFLlib; val 0.856 vs 0.798 for the authors' 'start' (docs/methods.md)"
    )


def with_validation(
    data: FederatedData, client_ids: list[int], holdout: float, seed: int
) -> FederatedData:
    """``data`` where each of ``client_ids`` without a validation split holds out a fixed
    ``holdout`` share of its training samples as one (drawn once per client from ``seed``;
    at least one sample on each side). Clients with a validation split are left alone."""
    train, val = list(data.train_idx), list(data.val_idx)
    val += [train[0][:0]] * (len(train) - len(val))
    changed = False
    for c in client_ids:
        if val[c].numel() or train[c].numel() < 2:
            continue
        n = int(train[c].numel())
        n_val = min(max(1, round(holdout * n)), n - 1)
        g = torch.Generator().manual_seed(client_seed(seed, 0, c, salt=7))
        order = torch.randperm(n, generator=g).to(train[c].device)
        val[c] = train[c][order[:n_val]].sort().values
        train[c] = train[c][order[n_val:]].sort().values
        changed = True
    return dataclasses.replace(data, train_idx=train, val_idx=val) if changed else data


def validation_loss(
    fm: FunctionalModel, theta: Tensor, buffers: Tensor, data: FederatedData, ids: list[int]
) -> Tensor:
    """Mean cross-entropy of each client's ``theta[c]`` on its validation split, ``[C]``: the
    client's per-round work (Eq. 4), counted by the active FLOP meter."""
    with FlopMeter.counting():
        _, total, loss_sum = evaluate_clients(fm, theta, buffers, data, ids, split="val")
    return loss_sum / total.clamp(min=1)


def fomo_weights(loss_own: Tensor, loss_others: Tensor, dist: Tensor, mask: Tensor) -> Tensor:
    """Eq. 4: ``w_n = (L_i(theta_i) - L_i(theta_n)) / ||theta_n - theta_i||`` per slot,
    ``[C, M]``; 0 where the slot is empty (``mask`` 0) or the models coincide."""
    ok = (mask > 0) & (dist > 0)
    w = (loss_own[:, None] - loss_others) / torch.where(ok, dist, torch.ones_like(dist))
    return torch.where(ok, w, torch.zeros_like(w))


def fomo_update(theta: Tensor, models: Tensor, weights: Tensor) -> Tensor:
    """Eq. 5-6: ``theta + sum_n w+_n (theta_n - theta)`` with ``w+ = max(w, 0) / sum max(w, 0)``;
    ``theta`` unchanged where no weight is positive. ``theta [C, K]``, ``models [C, M, K]``."""
    pos = weights.clamp(min=0)
    total = pos.sum(-1, keepdim=True)
    share = torch.where(total > 0, pos / torch.where(total > 0, total, 1.0), 0.0)
    step = torch.einsum("cm,cmk->ck", share.to(theta.dtype), models - theta[:, None])
    return theta + step


class FedFomoServer(Server):
    def __init__(self, hp: FedFomoParams, clients: dict[int, Payload], ctx: ServerContext) -> None:
        super().__init__(hp, clients, ctx)
        fm = ctx.shared_model
        assert fm is not None, "fedfomo needs one architecture for all clients"
        n = len(clients)
        self.size = fm.num_params
        self.slots = max(0, min(hp.num_models, n - 1))  # M (fewer other clients: all of them)
        dev = ctx.device
        self.models = torch.zeros(n, self.size, device=dev)  # every client's latest upload
        self.uploaded = torch.zeros(n, dtype=torch.bool, device=dev)
        self.affinity = torch.zeros(n, n, device=dev)  # P
        self.sent = torch.full((n, self.slots), -1, dtype=torch.long, device=dev)

    def select(self, rnd: int, client: int) -> list[int]:
        """§3.3: epsilon-greedy over the affinity row P_i, among clients that have uploaded."""
        hp: FedFomoParams = self.hp
        g = torch.Generator().manual_seed(client_seed(self.ctx.seed, rnd, client, salt=3))
        ready = [j for j in range(len(self.uploaded)) if j != client and bool(self.uploaded[j])]
        if not ready:
            return []
        tie = torch.rand(len(ready), generator=g)
        score = self.affinity[client, ready].cpu()
        ranked = [ready[i] for i in sorted(range(len(ready)), key=lambda i: (-score[i], tie[i]))]
        shuffled = [ready[i] for i in torch.randperm(len(ready), generator=g).tolist()]
        eps = max(0.0, hp.epsilon - hp.epsilon_decay * (rnd - 1))
        chosen_ids: list[int] = []
        while len(chosen_ids) < min(self.slots, len(ready)):
            pool = shuffled if float(torch.rand((), generator=g)) < eps else ranked
            pick = next(j for j in pool if j not in chosen_ids)
            chosen_ids.append(pick)
        return chosen_ids

    def configure_train(self, rnd: int, client_ids: list[int]) -> dict[int, Payload]:
        out = {}
        for c in client_ids:
            ids = self.select(rnd, c)
            sent = torch.full((self.slots,), -1, dtype=torch.long)
            sent[: len(ids)] = torch.tensor(ids, dtype=torch.long)
            self.sent[c] = sent.to(self.sent.device)
            models = torch.zeros(self.slots, self.size, device=self.models.device)
            mask = torch.zeros(self.slots, device=self.models.device)
            if ids:
                models[: len(ids)] = self.models[ids]
                mask[: len(ids)] = 1.0
            out[c] = {"models": models, "mask": mask}
        return out

    def reply_shapes(self, client_id: int) -> dict[str, tuple[int, ...]]:
        return {"theta": (self.size,), "weights": (self.slots,)}

    def aggregate(self, rnd: int, replies: dict[int, Payload]) -> None:
        for c, reply in replies.items():
            self.models[c] = reply["theta"].to(self.models)
            self.uploaded[c] = True
            for slot, n in enumerate(self.sent[c].tolist()):
                if n >= 0:  # P_in += w_n (raw weight)
                    self.affinity[c, n] += reply["weights"][slot].to(self.affinity)


class FedFomoClient(PersonalModelClient):
    def init_state(self, fm: FunctionalModel, num_clients: int) -> dict[str, Tensor]:
        state = super().init_state(fm, num_clients)
        state["anchor"] = state["theta"].clone()  # theta_i^{t-1}: where local training began
        return state

    def fit(
        self, group: ClientGroup, msg: Payload, state: dict[str, Tensor]
    ) -> tuple[Payload, dict[str, Tensor], Tensor]:
        hp: FedFomoParams = self.hp
        data = with_validation(group.data, group.client_ids, hp.val_holdout, group.seed)
        theta, buffers = state["theta"], state["buffers"]
        models, mask = msg["models"].to(theta), msg["mask"].to(theta)
        if hp.include_own:  # reference: last round's start; candidates: own model + downloads
            base = state["anchor"].to(theta)
            cands = torch.cat([theta[:, None], models], dim=1)
            cmask = torch.cat([torch.ones_like(mask[:, :1]), mask], dim=1)
        else:  # reference: the current model; candidates: the downloads
            base, cands, cmask = theta, models, mask
        weights = torch.zeros(cmask.shape, device=theta.device, dtype=theta.dtype)
        start = base
        if bool((cmask > 0).any()):
            ids = group.client_ids
            loss_base = validation_loss(group.fm, base, buffers, data, ids)
            loss_cands = torch.stack(
                [validation_loss(group.fm, cands[:, m], buffers, data, ids)
                 for m in range(cands.shape[1])],
                dim=1,
            )  # fmt: skip
            dist = (cands - base[:, None]).norm(dim=-1)
            weights = fomo_weights(loss_base, loss_cands, dist, cmask).to(theta.dtype)
            start = fomo_update(base, cands, weights)  # base where no weight is positive
            if hp.fallback == "own":
                start = torch.where((weights > 0).any(-1, keepdim=True), start, theta)
        local = dataclasses.replace(group, data=data)
        trained, buffers, loss = local.train(start, buffers)
        sent = weights[:, cands.shape[1] - models.shape[1] :]  # the M download slots
        reply = {"theta": trained, "weights": sent}
        return reply, {"theta": trained, "anchor": start, "buffers": buffers}, loss


ALGORITHM = Algorithm(
    name="fedfomo",
    summary="FedFomo: clients mix in downloaded models weighted by validation-loss gain",
    hparams=FedFomoParams,
    server=FedFomoServer,
    client=FedFomoClient,
    homogeneous_only=True,
    reference="authors' code (NVlabs/FedFomo; PFLlib agrees): own model a weighted candidate; "
    "PFLlib's no-gain fallback (keep the own model)",
)
