"""FedBN (Li et al., ICLR 2021, "Federated Learning on Non-IID Features via Local Batch
Normalization"): FedAvg that keeps every normalization layer on the client.

FedBN's Algorithm 1, round t: each client k trains its model for E epochs from its own
parameters; then the server averages every layer l that is *not* a BatchNorm layer,
``w^(l) <- avg_k w_k^(l)``, and sends it back, while each client keeps its BatchNorm layers --
both the affine parameters (gamma, beta) and the running statistics (mu, sigma^2) -- as they
are. The method's point (§3, Fig. 1): with feature shift (same labels, different scanners /
styles), the local BN layers absorb each client's feature distribution and the averaged
layers stay compatible with all of them.

Here, round t: the server sends the shared part (every parameter outside a normalization
layer); client k joins it with its own normalization parameters, trains the whole model for
E epochs and returns the shared part; the server sets
``shared = sum_k n_k shared_k / sum_k n_k``. The normalization parameters and the BatchNorm
running statistics never leave the client (hyperfed's FedAvg already keeps the statistics
local; FedBN adds the affine parameters). A client is evaluated with the latest shared part,
its own normalization parameters and its own statistics.

Which parameters are local is read from the model, not from names: every affine parameter of
a BatchNorm, InstanceNorm or GroupNorm module (InstanceNorm and GroupNorm normalize per sample
and have no running statistics; their affine parameters play BN's role in the ConvNet of the
dataset-distillation literature that seed 003 uses, so they are kept local too).

Choices the paper leaves open, or where hyperfed differs:

* Weights: Algorithm 1 and the authors' code average with 1/K over equally sized clients;
  hyperfed uses FedAvg's n_k weights (identical when the clients are equally sized).
* Local SGD: the run's ``[local]`` settings (lr, momentum, weight decay, batch, epochs E).
  The authors' code (med-air/FedBN, ``federated/fed_digits.py``, ``fed_office.py``) trains
  with plain SGD -- lr 1e-2, no momentum, no weight decay -- batch 32, one local epoch
  (``wk_iters = 1``), a fresh optimizer each round; set ``[local]`` lr 0.01, momentum 0,
  weight_decay 0, batch_size 32, epochs 1 to train as it does.
* Which layers are local: the authors' code keeps every state-dict entry whose key contains
  ``bn`` (affine parameters and running statistics of its BatchNorm layers, by their names);
  hyperfed finds the normalization layers by module type (below), with the same result on
  their models.
* A model without normalization layers (the zoo's ConvNet of seed 003 Table 10, LeNet, VGG8,
  MLP) makes FedBN *exactly* FedAvg. This is allowed, with a warning at start: FedBN's
  definition degenerates to FedAvg there, which is what the baseline rows of seed 003
  (FedBN on ConvNet) can only mean if that ConvNet has no normalization. Refusing it would
  leave those settings unrunnable.
* Heterogeneous clients: as hyperfed's FedAvg, one federation per architecture (clients
  grouped by the parameter count they report at join).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache

from torch import Tensor

from hyperfed.algorithms.base import Algorithm, Client, ClientGroup, Payload, Server, ServerContext
from hyperfed.models.layout import FunctionalModel
from hyperfed.models.select import norm_mask, split_by_mask
from hyperfed.models.split import BodyHead

log = logging.getLogger("hyperfed")


@cache
def norm_split(fm: FunctionalModel) -> BodyHead:
    """``body``: the averaged parameters; ``head``: the normalization parameters (local)."""
    return split_by_mask(norm_mask(fm), fm.initial_params().device)


# -- the method ------------------------------------------------------------------------------


@dataclass
class FedBNParams:
    """FedBN has no hyperparameters beyond the local SGD settings (Algorithm 1: E epochs)."""


class FedBNServer(Server):
    def __init__(self, hp: FedBNParams, clients: dict[int, Payload], ctx: ServerContext) -> None:
        super().__init__(hp, clients, ctx)
        self.size = {c: int(p["num_params"]) for c, p in clients.items()}
        # one shared part per architecture, keyed by its parameter count
        self.shared: dict[str, Tensor] = {}
        for k in sorted(set(self.size.values())):
            fm = ctx.model_with(k)
            split = norm_split(fm)
            if not split.num_head:
                log.warning(
                    "fedbn: %s has no normalization layer; FedBN trains it exactly as FedAvg",
                    fm.name,
                )
            self.shared[str(k)] = split.body(fm.initial_params()).to(ctx.device)

    def configure_train(self, rnd: int, client_ids: list[int]) -> dict[int, Payload]:
        return {c: {"shared": self.shared[str(self.size[c])]} for c in client_ids}

    def configure_eval(self, client_ids: list[int]) -> dict[int, Payload]:
        return self.configure_train(0, client_ids)

    def reply_shapes(self, client_id: int) -> dict[str, tuple[int, ...]]:
        return {"shared": (self.shared[str(self.size[client_id])].numel(),)}

    def aggregate(self, rnd: int, replies: dict[int, Payload]) -> None:
        # Algorithm 1: average every non-BN layer (here with n_k weights), per architecture
        for key in self.shared:
            ids = [c for c in replies if str(self.size[c]) == key]
            if ids:
                self.shared[key] = self.average_reply(replies, "shared", ids)


class FedBNClient(Client):
    def init_state(self, fm: FunctionalModel, num_clients: int) -> dict[str, Tensor]:
        state = super().init_state(fm, num_clients)  # BatchNorm running statistics
        norm = norm_split(fm).head(fm.initial_params())  # gamma, beta of every norm layer
        state["norm"] = norm.expand(num_clients, -1).clone()
        return state

    def fit(
        self, group: ClientGroup, msg: Payload, state: dict[str, Tensor]
    ) -> tuple[Payload, dict[str, Tensor], Tensor]:
        split = norm_split(group.fm)
        theta = split.join(msg["shared"], state["norm"])  # averaged layers + own BN layers
        theta, buffers, loss = group.train(theta, state["buffers"])
        return {"shared": split.body(theta)}, {"norm": split.head(theta), "buffers": buffers}, loss

    def eval_model(
        self, group: ClientGroup, msg: Payload, state: Mapping[str, Tensor]
    ) -> tuple[Tensor, Tensor]:
        return norm_split(group.fm).join(msg["shared"], state["norm"]), state["buffers"]


ALGORITHM = Algorithm(
    name="fedbn",
    summary="FedBN: FedAvg with BatchNorm parameters and statistics kept on each client",
    hparams=FedBNParams,
    server=FedBNServer,
    client=FedBNClient,
    reference="paper's Alg. 1 + authors' code (med-air/FedBN): BN affine + statistics local; "
    "n_k weights (theirs 1/K); SGD is the run's local settings (theirs: lr 1e-2, no "
    "momentum, batch 32)",
)
