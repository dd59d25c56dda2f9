"""FedRep (Collins et al., ICML 2021, "Exploiting Shared Representations for Personalized
Federated Learning"): a shared representation, a personal head per client, trained in turn.

The model of client i is ``q_i = h_i o phi``: a representation phi shared by all clients (the
body) and a head h_i of its own. Algorithm 1, round t, for each participating client i:

1. head update, phi^t fixed: ``h_i^{t,s} = GRD(f_i(h_i^{t,s-1}, phi^t), h_i^{t,s-1}, alpha)``
   for s = 1..tau (here ``head_epochs`` epochs of SGD with the body frozen), starting from
   the head the client kept from its last round;
2. representation update, the new head fixed:
   ``phi_i^{t+1} = GRD(f_i(h_i^{t,tau}, phi^t), phi^t, alpha)`` (here ``body_epochs`` epochs
   of SGD with the head frozen);
3. the client sends phi_i^{t+1} and keeps h_i; the server sets
   ``phi^{t+1} = sum_i n_i phi_i^{t+1} / sum_i n_i``.

Only phi crosses the wire. A client is evaluated with the latest phi and its own head, as the
authors' evaluation loads the global representation into each local model.

Budget (issue 35): a round trains the run's ``[local] epochs`` E, like every baseline. §5
trains the head for ten epochs, then the representation for one; the authors' code
(lgcollins/FedRep, ``models/Update.py``) reads the same split from one total:
``head_eps = local_ep - local_rep_ep`` with ``--local_ep 11 --local_rep_ep 1`` in its
scripts. hyperfed takes that total from ``[local] epochs``: ``body_epochs`` = 1 epoch on phi
and ``head_epochs`` = E - 1 on the head. At E = 1 that would leave the head untrained (the
authors' code then trains phi only), so the one epoch is split in half: half an epoch on the
head, then half on phi. In general, with ``head_epochs`` unset, phi gets
``min(body_epochs, E / 2)`` epochs and the head the rest of E; a client with n samples and
batch B then takes ``ceil(e_h * n / B) + ceil(e_phi * n / B)`` steps (at most one more than
the ``ceil(E * n / B)`` of the other baselines). Setting ``head_epochs`` (e.g. 10, with
``body_epochs = 1``: §5's 10 + 1) uses both counts as given, whatever E.

The head is the last (linear) layer, as in §3's model ``h_i`` linear on top of the
representation. ``head_layers`` chooses another split (``"head"``: the model's
``head_prefixes``, FedPer's split; or comma-separated parameter-name prefixes). In each phase
the frozen part is outside the backward pass (the engine's ``frozen_parameters``): a head
epoch back-propagates through the head only, as the authors' ``requires_grad = False``.

What hyperfed does vs the authors' code:

* Aggregation: Algorithm 1 writes 1/(rn) over the participants; the authors' code weights
  each phi_i by the client's training size (``lens[idx]``, divided by their sum), as here.
* Local SGD: hyperfed uses the run's ``[local]`` settings (lr, momentum, weight decay on every
  parameter, batch) and starts each phase with fresh momentum. The authors' code uses lr 0.01,
  momentum 0.5, batch 10, and weight decay 1e-4 on weights only (0 on biases), with one
  optimizer for both phases; under its torch 0.4.1 a frozen head keeps a zeroed (not None)
  gradient, so momentum and weight decay still move it slightly in the representation epoch.
  hyperfed freezes it exactly, as Algorithm 1 does. Set ``[local]`` lr 0.01, momentum 0.5,
  batch 10 for the authors' optimizer up to the bias decay.
* Evaluation: the latest phi with the client's own head (the authors' evaluation loads the
  global representation into each local model).

Homogeneous clients only: the representation is averaged entry by entry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache

from torch import Tensor

from hyperfed.algorithms.base import (
    Algorithm,
    Client,
    ClientGroup,
    Payload,
    Server,
    ServerContext,
    chosen,
    paper,
)
from hyperfed.errors import ConfigError
from hyperfed.hparams import Layers, NonNegInt
from hyperfed.models.layout import FunctionalModel
from hyperfed.models.select import split_by_mask
from hyperfed.models.split import BodyHead, layer_prefixes


@dataclass
class FedRepParams:
    """tau (head epochs), representation epochs, and which layers form the head."""

    head_epochs: NonNegInt | None = chosen(
        None,
        "None: the round's [local] epochs E less the representation's (authors' code: "
        "head_eps = local_ep - local_rep_ep), so FedRep trains E epochs like every baseline; "
        "10 with body_epochs = 1 is §5's 10 + 1",
    )
    body_epochs: NonNegInt = paper(1, "§5 and the authors' --local_rep_ep 1: one epoch on phi")
    head_layers: Layers = chosen(
        "classifier",
        "§3 takes h_i linear on the representation; the zoo's last Linear is `classifier`",
    )

    def __post_init__(self) -> None:
        if self.head_epochs == 0 and self.body_epochs == 0:
            raise ValueError("head_epochs and body_epochs cannot both be 0")

    def phase_epochs(self, epochs: float) -> tuple[float, float]:
        """(head epochs, representation epochs) of a round whose budget is ``epochs`` (E):
        as set when ``head_epochs`` is set; else phi ``min(body_epochs, E / 2)``, the head the
        rest (E >= 2, body_epochs = 1: E - 1 and 1; E = 1: a half and a half)."""
        if self.head_epochs is not None:
            return float(self.head_epochs), float(self.body_epochs)
        body = min(float(self.body_epochs), epochs / 2)
        return epochs - body, body


@cache
def rep_split(fm: FunctionalModel, head_layers: str) -> BodyHead:
    """``body``: the representation phi; ``head``: h_i (``head_layers``)."""
    mask = fm.layout.mask(layer_prefixes(fm, head_layers))
    if not bool(mask.any()) or bool(mask.all()):
        raise ConfigError(
            f"algorithm.head_layers: {head_layers!r} must select some but not all parameters "
            f"of {fm.name}; its parameters are {', '.join(fm.layout.names)}"
        )
    return split_by_mask(mask, fm.initial_params().device)


class FedRepServer(Server):
    def __init__(self, hp: FedRepParams, clients: dict[int, Payload], ctx: ServerContext) -> None:
        super().__init__(hp, clients, ctx)
        assert ctx.shared_model is not None, "fedrep needs one architecture for all clients"
        fm = ctx.shared_model
        self.body = rep_split(fm, hp.head_layers).body(fm.initial_params()).to(ctx.device)

    def configure_train(self, rnd: int, client_ids: list[int]) -> dict[int, Payload]:
        return {c: {"body": self.body} for c in client_ids}

    def configure_eval(self, client_ids: list[int]) -> dict[int, Payload]:
        return self.configure_train(0, client_ids)

    def reply_shapes(self, client_id: int) -> dict[str, tuple[int, ...]]:
        return {"body": (self.body.numel(),)}

    def aggregate(self, rnd: int, replies: dict[int, Payload]) -> None:
        if replies:  # step 3: phi^{t+1} = sum_i n_i phi_i^{t+1} / sum_i n_i
            self.body = self.average_reply(replies, "body")


class FedRepClient(Client):
    def init_state(self, fm: FunctionalModel, num_clients: int) -> dict[str, Tensor]:
        state = super().init_state(fm, num_clients)
        head = rep_split(fm, self.hp.head_layers).head(fm.initial_params())
        state["head"] = head.expand(num_clients, -1).clone()
        return state

    def fit(
        self, group: ClientGroup, msg: Payload, state: dict[str, Tensor]
    ) -> tuple[Payload, dict[str, Tensor], Tensor]:
        hp: FedRepParams = self.hp
        split = rep_split(group.fm, hp.head_layers)
        head_mask = split.head_mask()
        theta, buffers = split.join(msg["body"], state["head"]), state["buffers"]
        head_epochs, body_epochs = hp.phase_epochs(group.sgd.epochs)
        losses = []
        if head_epochs:  # step 1: tau epochs on h_i, phi^t frozen (outside the backward)
            sgd = dataclasses.replace(group.sgd, epochs=head_epochs)
            theta, buffers, loss = group.train(theta, buffers, trainable=head_mask, sgd=sgd, salt=0)
            losses.append(loss)
        if body_epochs:  # step 2: epochs on phi, the new h_i frozen
            sgd = dataclasses.replace(group.sgd, epochs=body_epochs)
            theta, buffers, loss = group.train(
                theta, buffers, trainable=~head_mask, sgd=sgd, salt=1
            )
            losses.append(loss)
        state = {"head": split.head(theta), "buffers": buffers}
        return {"body": split.body(theta)}, state, losses[-1]

    def eval_model(
        self, group: ClientGroup, msg: Payload, state: Mapping[str, Tensor]
    ) -> tuple[Tensor, Tensor]:
        split = rep_split(group.fm, self.hp.head_layers)
        return split.join(msg["body"], state["head"]), state["buffers"]


ALGORITHM = Algorithm(
    name="fedrep",
    summary="FedRep: head epochs then representation epochs; only the representation is averaged",
    hparams=FedRepParams,
    server=FedRepServer,
    client=FedRepClient,
    homogeneous_only=True,
    reference="paper's Alg. 1 + authors' code (lgcollins/FedRep): E - 1 head epochs + 1 on phi "
    "(local_ep - local_rep_ep), n_i-weighted average; SGD is the run's local settings, "
    "not theirs",
)
