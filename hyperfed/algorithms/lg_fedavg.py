"""LG-FedAvg (Liang et al., 2020, "Think locally, act globally"): local representation, global head.

Every client keeps its whole model; only the *global layers* cross the wire. Round t: the
client overwrites its global layers with the server's average, trains the whole model for E
epochs on its data (representation and head together) and uploads the global layers; the
server sets them to ``sum_k n_k w_k / sum_k n_k`` over the participants (FedAvg on that part).
A client is evaluated with its own representation under the latest global layers, as
LG-FedAvg's "local test" loads the global keys into each local model before testing.

``global_layers``: ``"head"`` shares the model's whole fully connected head (``head_prefixes``:
``fc`` + ``classifier``), LG-FedAvg's choice for its CNNs. Heterogeneous clients can only share
layers whose shapes agree: for pFedES's CNN-1..5 (Tables 2-3) only the last layer
(500 -> classes) does, so heterogeneous configs set ``global_layers = "classifier"`` (any
comma-separated list of parameter-name prefixes works). Clients report the size of their
global part when they join and the server refuses to start if the sizes differ.

Simplifications: LG-FedAvg starts from a FedAvg-pretrained global model; here every part
starts from the clients' own initialization and the global layers are first set after round
1's aggregation (round 1's download is empty).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from hyperfed.algorithms.base import (
    Algorithm,
    ClientGroup,
    Payload,
    PersonalModelClient,
    Server,
    ServerContext,
    chosen,
    shared_join_value,
)
from hyperfed.algorithms.local_settings import SEED002
from hyperfed.errors import ConfigError
from hyperfed.hparams import Layers
from hyperfed.models.layout import FunctionalModel
from hyperfed.models.split import layer_prefixes


@dataclass
class LGFedAvgParams:
    """Which layers are global; local SGD as in pFedES §6.1 (all methods: SGD, eta = 0.01)."""

    # "head" = the model's head_prefixes, or "classifier", "fc,..."
    global_layers: Layers = chosen("head", "LG-FedAvg's code keeps its CNNs' last fc layers global")


def global_mask(fm: FunctionalModel, global_layers: str) -> Tensor:
    """Boolean ``[K]``: the entries of ``fm`` that are averaged by the server."""
    mask = fm.layout.mask(layer_prefixes(fm, global_layers))
    if not bool(mask.any()):
        raise ConfigError(
            f"algorithm.global_layers: {global_layers!r} matches no parameter of {fm.name}; "
            f"its parameters are {', '.join(fm.layout.names)}"
        )
    return mask


class LGFedAvgServer(Server):
    def __init__(self, hp: LGFedAvgParams, clients: dict[int, Payload], ctx: ServerContext) -> None:
        super().__init__(hp, clients, ctx)
        self.num_global = shared_join_value(
            clients,
            "num_global",
            "algorithm.global_layers: clients' global layers differ in size ({values}); "
            'share only layers that match, e.g. global_layers = "classifier"',
        )
        self.head = torch.zeros(0, device=ctx.device)  # set by the first aggregation

    def configure_train(self, rnd: int, client_ids: list[int]) -> dict[int, Payload]:
        msg = {"head": self.head} if self.head.numel() else {}
        return {c: dict(msg) for c in client_ids}

    def configure_eval(self, client_ids: list[int]) -> dict[int, Payload]:
        return self.configure_train(0, client_ids)

    def reply_shapes(self, client_id: int) -> dict[str, tuple[int, ...]]:
        return {"head": (self.num_global,)}

    def aggregate(self, rnd: int, replies: dict[int, Payload]) -> None:
        if not replies:
            return
        self.head = self.average_reply(replies, "head")


class LGFedAvgClient(PersonalModelClient):
    def join(self, fm: FunctionalModel, num_samples: int) -> Payload:
        return {
            "num_samples": torch.tensor(num_samples, dtype=torch.int64),
            "num_global": torch.tensor(int(global_mask(fm, self.hp.global_layers).sum())),
        }

    def with_global(self, fm: FunctionalModel, theta: Tensor, msg: Payload) -> Tensor:
        """The client's model with the server's global layers written in (if any yet)."""
        if "head" not in msg:
            return theta
        theta = theta.clone()
        theta[:, global_mask(fm, self.hp.global_layers).to(theta.device)] = msg["head"]
        return theta

    def fit(
        self, group: ClientGroup, msg: Payload, state: dict[str, Tensor]
    ) -> tuple[Payload, dict[str, Tensor], Tensor]:
        theta = self.with_global(group.fm, state["theta"], msg)
        theta, buffers, loss = group.train(theta, state["buffers"])
        head = theta[:, global_mask(group.fm, self.hp.global_layers).to(theta.device)]
        return {"head": head}, {"theta": theta, "buffers": buffers}, loss

    def eval_model(
        self, group: ClientGroup, msg: Payload, state: Mapping[str, Tensor]
    ) -> tuple[Tensor, Tensor]:
        return self.with_global(group.fm, state["theta"], msg), state["buffers"]


ALGORITHM = Algorithm(
    name="lg_fedavg",
    summary="LG-FedAvg: local representation, globally averaged head layers",
    hparams=LGFedAvgParams,
    server=LGFedAvgServer,
    client=LGFedAvgClient,
    local_defaults=SEED002,
)
