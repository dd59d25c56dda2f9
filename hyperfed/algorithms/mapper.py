"""MAPPER (Mansour, Mohri, Ro, Suresh 2020, "Three approaches for personalization", §5 model
interpolation): each client predicts with a mixture of its own local model and a FedAvg
global model, mixing weight learned per client.

Client k's personalized hypothesis is the interpolation of two *hypotheses* (their
predictions, not their parameters -- the paper's algorithms are model-agnostic):
    h_k(x) = lam_k * h_{L,k}(x) + (1 - lam_k) * h_G(x),   lam_k in [0, 1],
with h(x) the predicted class distribution, so the loss is the log loss of the mixture,
``-log(lam_k softmax(z_L)_y + (1 - lam_k) softmax(z_G)_y)``. MAPPER minimizes
``sum_k p_k min_{h_L,k, lam_k} L_k(lam_k h_{L,k} + (1 - lam_k) h_G)`` over h_G as well.

Round t: the server sends h_G; each sampled client runs E epochs of SGD on the mixture's loss
over (h_{L,k}, lam_k, h_G) jointly, keeps h_{L,k} and lam_k, and returns its trained h_G; the
server sets ``h_G = sum_k n_k h_G,k / sum_k n_k`` (FedAvg, one global model per architecture
as :mod:`fedavg`). A client is evaluated with its mixture h_k on the latest h_G.

Choices: lam_k = sigmoid(a_k), a_k trained by the same SGD (the engine's step has no
projection onto [0, 1]; a_k = 0, lam_k = 1/2 at the start; weight decay pulls a_k toward 0);
h_{L,k} starts from the architecture's shared initialization, as h_G; the local and the global
copy keep separate BatchNorm statistics.

Evaluation runs the mixture through ``Client.eval_network`` (the network a client's evaluation
vector runs in).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from hyperfed.algorithms.base import Algorithm, Client, ClientGroup, Payload
from hyperfed.algorithms.fedavg import FedAvgServer
from hyperfed.engine.losses import ModelPair
from hyperfed.models.layout import FunctionalModel


@dataclass
class MapperParams:
    """MAPPER has no hyperparameters beyond the local SGD settings (lam_k is learned)."""


class MixtureModel:
    """Client k's personalized model as one flat vector ``[theta_L | theta_G | a]`` (``a``:
    the mixing logit, ``lam = sigmoid(a)``), with buffers ``[local | global]``. ``forward``
    returns the log of the mixture's class probabilities, so argmax and cross-entropy of it
    are the mixture's prediction and log loss (what :func:`evaluate_clients` computes)."""

    def __init__(self, fm: FunctionalModel) -> None:
        self.fm = fm
        self.pair = ModelPair(fm, fm)
        self.name = f"mixture({fm.name})"
        self.num_params = 2 * fm.num_params + 1
        self.num_buffers = 2 * fm.num_buffers

    def split(self, theta: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(theta_L, theta_G, a)``; ``a`` keeps a trailing axis of 1."""
        local, glob = self.pair.split(theta[..., :-1])
        return local, glob, theta[..., -1:]

    def join(self, local: Tensor, glob: Tensor, logit: Tensor) -> Tensor:
        return torch.cat([local, glob, logit], dim=-1)

    @staticmethod
    def mix(z_local: Tensor, z_global: Tensor, logit: Tensor) -> Tensor:
        """``log(lam softmax(z_L) + (1 - lam) softmax(z_G))``, ``lam = sigmoid(logit)``."""
        parts = torch.stack(
            [
                F.logsigmoid(logit) + F.log_softmax(z_local, dim=-1),
                F.logsigmoid(-logit) + F.log_softmax(z_global, dim=-1),
            ]
        )
        return torch.logsumexp(parts, dim=0)

    def forward(self, theta: Tensor, buffers: Tensor, x: Tensor) -> Tensor:
        local, glob, logit = self.split(theta)
        bu_l, bu_g = self.pair.split_buffers(buffers)
        return self.mix(self.fm.forward(local, bu_l, x), self.fm.forward(glob, bu_g, x), logit)

    def forward_train(self, theta: Tensor, buffers: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
        local, glob, logit = self.split(theta)
        z_l, z_g, new_buffers = self.pair.forward_train_both(theta[..., :-1], buffers, x)
        return self.mix(z_l, z_g, logit), new_buffers


def mixture_loss(
    fm: FunctionalModel,
    theta: Tensor,
    buffers: Tensor,
    x: Tensor,
    y: Tensor,
    ctx: dict[str, Tensor],
    *,
    mixture: MixtureModel,
) -> tuple[Tensor, Tensor]:
    """The log loss of the mixture ``lam h_L + (1 - lam) h_G``, mean over the batch."""
    log_p, new_buffers = mixture.forward_train(theta, buffers, x)
    return F.nll_loss(log_p, y), new_buffers


class MapperClient(Client):
    def init_state(self, fm: FunctionalModel, num_clients: int) -> dict[str, Tensor]:
        state = super().init_state(fm, num_clients)
        state["global_buffers"] = state["buffers"].clone()
        state["local"] = fm.initial_params().expand(num_clients, -1).clone()
        state["logit"] = torch.zeros(num_clients, 1, dtype=state["local"].dtype)
        return state

    def eval_network(self, fm: FunctionalModel) -> MixtureModel:
        return MixtureModel(fm)

    def _joined(self, fm: FunctionalModel, glob: Tensor, state: Mapping[str, Tensor]) -> tuple:
        mixture = MixtureModel(fm)
        theta = mixture.join(state["local"], glob.to(state["local"]), state["logit"])
        buffers = mixture.pair.join_buffers(state["buffers"], state["global_buffers"])
        return mixture, theta, buffers

    def fit(
        self, group: ClientGroup, msg: Payload, state: dict[str, Tensor]
    ) -> tuple[Payload, dict[str, Tensor], Tensor]:
        mixture, theta, buffers = self._joined(group.fm, msg["theta"], state)
        theta, buffers, loss = group.train(
            theta, buffers, loss_fn=partial(mixture_loss, mixture=mixture)
        )
        local, glob, logit = mixture.split(theta)
        bu_l, bu_g = mixture.pair.split_buffers(buffers)
        new_state = {"local": local, "logit": logit, "buffers": bu_l, "global_buffers": bu_g}
        return {"theta": glob}, new_state, loss

    def eval_model(
        self, group: ClientGroup, msg: Payload, state: Mapping[str, Tensor]
    ) -> tuple[Tensor, Tensor]:
        """``[theta_L | theta_G | a]`` and ``[local | global]`` buffers: run them in
        :meth:`eval_network` (the mixture)."""
        _, theta, buffers = self._joined(group.fm, msg["theta"], state)
        return theta, buffers


ALGORITHM = Algorithm(
    name="mapper",
    summary="MAPPER: per-client learned mixture of a local model's and a FedAvg model's "
    "predictions",
    hparams=MapperParams,
    server=FedAvgServer,
    client=MapperClient,
)
