"""MOON (Li, He & Song, CVPR 2021, "Model-Contrastive Federated Learning"), a baseline of
seed 001 (pFedKT, Table 1).

Round t (the paper's Algorithm 1; the loss of its §3.3, Eq. 2-3), for every sampled client i:

1. receive the global model ``w^t`` (FedAvg's payload ``theta``; nothing else crosses);
2. train it locally with ``l = l_sup + mu * l_con`` (Eq. 3), where ``l_sup`` is the
   cross-entropy and (Eq. 2)
   ``l_con = -log( exp(sim(z, z_glob)/tau) / (exp(sim(z, z_glob)/tau) + exp(sim(z, z_prev)/tau)) )``
   with ``sim`` the cosine similarity and ``z``, ``z_glob``, ``z_prev`` the representations of
   the same sample by the model in training, by the received global model ``w^t`` and by this
   client's model of its previous round ``w_i^{t-1}`` (the positive and the negative pair);
3. keep the trained ``w_i^t`` as next round's ``w_i^{t-1}`` and upload it; the server sets
   ``w^{t+1} = sum_i n_i w_i^t / sum_i n_i`` (FedAvg's rule).

``l_con`` is averaged over the batch, as ``l_sup`` is. ``-log(e^a / (e^a + e^b))`` is computed
as ``softplus(b - a)`` (the same number, without overflow).

Choices the paper leaves open, or that hyperfed's setting forces:

* **Representation.** The paper's networks end in a projection head (a 2-layer MLP to 256
  dimensions) whose output is ``z``; hyperfed's zoo models have none, so ``z`` is the
  representation the zoo defines: the input of the last Linear layer
  (``forward(..., return_features=True)``), as FL libraries (PFLlib) do for MOON without a
  projection head.
* **Global and previous models' forward.** The paper's code runs them in inference mode; here
  too, with the client's own BatchNorm statistics (only parameters cross the wire, so the
  global model has no statistics of its own). The representations are constants (no
  gradient reaches the global or previous model).
* **First participation.** The previous model of a client that has not trained yet is the
  initial global model ``w^0`` (as pFedKT's Alg. 1 initializes it). In round 1 positive and
  negative are then the same model, ``l_con = log 2`` is a constant with no gradient, and the
  round is plain FedAvg (the paper's code does the same: its model pool is empty in round 1).
* **Which model is evaluated** (``evaluate``). MOON is a method for a better *global* model:
  its paper reports the global model's top-1 accuracy (§4, Table 1) and its code
  (QinbinLi/MOON ``experiments.py``) tests ``global_model`` after aggregation, so the default
  scores the global model on each client's test split. Seed 001's text agrees: it places
  MOON with the global-model methods that "fail to improve" the personalized model (§1).
  ``evaluate="local"`` scores each client's model after its latest local training ``w_i``
  (``w^0`` for a client never sampled), the reading of seed 001's PM@Acc as "a local model
  after local training"; the two score far apart on the same training run (docs/methods.md),
  so they must never share a table unlabeled (every record says which: ``scores``).
* **Heterogeneous clients.** MOON contrasts a model with versions of itself, so with a mix
  of architectures it runs one federation per architecture, as ``fedavg`` does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, get_args

import torch.nn.functional as F
from torch import Tensor

from hyperfed.algorithms.base import (
    Algorithm,
    Client,
    ClientContext,
    ClientGroup,
    Payload,
    ServerContext,
    paper,
)
from hyperfed.algorithms.fedavg import FedAvgServer
from hyperfed.algorithms.local_settings import SEED001
from hyperfed.engine.local import LossFn
from hyperfed.hparams import NonNeg, Positive, Space
from hyperfed.models.layout import FunctionalModel

Evaluated = Literal["local", "global"]
EVALUATED = get_args(Evaluated)


@dataclass
class MoonParams:
    """MOON's hyperparameters (Eq. 3: ``l_sup + mu * l_con``; Eq. 2: temperature ``tau``)."""

    mu: NonNeg = paper(
        1.0, "§4.1: tuned in {0.1, 1, 5, 10}; 1 for CIFAR-100 and Tiny-ImageNet, 5 for CIFAR-10"
    )
    temperature: Positive = paper(0.5, "§4.1")
    evaluate: Evaluated = paper(
        "global",
        "§4 / official code: the global model is tested; 'local' scores each client's "
        "locally trained model (one reading of seed 001's PM@Acc)",
    )


def model_contrastive_loss(z: Tensor, z_glob: Tensor, z_prev: Tensor, tau: float) -> Tensor:
    """Eq. 2 averaged over the batch: ``-log(e^{s+/tau} / (e^{s+/tau} + e^{s-/tau}))`` with
    ``s+ = cos(z, z_glob)`` and ``s- = cos(z, z_prev)``."""
    pos = F.cosine_similarity(z, z_glob, dim=-1) / tau
    neg = F.cosine_similarity(z, z_prev, dim=-1) / tau
    return F.softplus(neg - pos).mean()


def moon_loss(hp: MoonParams) -> LossFn:
    """Eq. 3 as an engine loss; ``ctx`` carries the ``global`` and ``prev`` parameter vectors
    and the ``buffers`` (BatchNorm statistics) they are run with."""

    def loss_fn(
        fm: FunctionalModel, theta: Tensor, buffers: Tensor, x: Tensor, y: Tensor, ctx: dict
    ) -> tuple[Tensor, Tensor]:
        (z, logits), new_buffers = fm.forward_train(theta, buffers, x, return_features=True)
        sup = F.cross_entropy(logits, y)
        if not ctx:
            return sup, new_buffers
        z_glob = fm.forward(ctx["global"], ctx["buffers"], x, return_features=True)[0]
        z_prev = fm.forward(ctx["prev"], ctx["buffers"], x, return_features=True)[0]
        con = model_contrastive_loss(z, z_glob.detach(), z_prev.detach(), hp.temperature)
        return sup + hp.mu * con, new_buffers

    return loss_fn


class MoonServer(FedAvgServer):
    """FedAvg's server (one global model per architecture). For evaluation it sends the global
    model only when that is what is evaluated."""

    hp: MoonParams

    def __init__(self, hp: MoonParams, clients: dict[int, Payload], ctx: ServerContext) -> None:
        super().__init__(hp, clients, ctx)  # type: ignore[arg-type]  # typed FedAvgParams there

    def configure_eval(self, client_ids: list[int]) -> dict[int, Payload]:
        if self.hp.evaluate == "global":
            return super().configure_eval(client_ids)
        return {c: {} for c in client_ids}


class MoonClient(Client):
    """State per client: ``theta_prev`` (its model after its last local training, ``w_i^{t-1}``:
    the negative of Eq. 2, and the evaluated model under ``evaluate="local"``) and
    ``buffers``."""

    hp: MoonParams

    def __init__(self, hp: MoonParams, ctx: ClientContext) -> None:
        super().__init__(hp, ctx)
        self.loss_fn = moon_loss(hp)

    def init_state(self, fm: FunctionalModel, num_clients: int) -> dict[str, Tensor]:
        state = super().init_state(fm, num_clients)
        state["theta_prev"] = fm.initial_params().expand(num_clients, -1).clone()  # w^0
        return state

    def fit(
        self, group: ClientGroup, msg: Payload, state: dict[str, Tensor]
    ) -> tuple[Payload, dict[str, Tensor], Tensor]:
        glob = msg["theta"]
        ctx = {"global": glob, "prev": state["theta_prev"], "buffers": state["buffers"]}
        theta, buffers, loss = group.train(
            glob, state["buffers"], loss_fn=self.loss_fn, ctx=ctx if self.hp.mu > 0 else None
        )
        return {"theta": theta}, {"theta_prev": theta, "buffers": buffers}, loss

    def eval_model(
        self, group: ClientGroup, msg: Payload, state: Mapping[str, Tensor]
    ) -> tuple[Tensor, Tensor]:
        if self.hp.evaluate == "global":
            return msg["theta"], state["buffers"]
        return state["theta_prev"], state["buffers"]


ALGORITHM = Algorithm(
    name="moon",
    summary="MOON: FedAvg + model-contrastive loss (global positive, previous-model negative)",
    hparams=MoonParams,
    server=MoonServer,
    client=MoonClient,
    # seed 001 §6.1, the same for every method of its Table 1 (MOON's own §4.1: weight decay 1e-5)
    local_defaults=SEED001,
    reference="paper + authors' code (QinbinLi/MOON): global model evaluated",
    scores=lambda hp: "global" if hp.evaluate == "global" else "local",
    tune={"mu": Space(choices=(0.1, 1.0, 5.0, 10.0))},  # MOON §4.1's grid
)
