"""FedPer (Arivazhagan et al., 2019): FedAvg on the body, a personal head per client.

Round t: the server sends the body (every parameter outside ``head_prefixes``); each client
joins it with its own head, trains the whole model for E epochs and returns the body; the
server sets ``body = sum_k n_k body_k / sum_k n_k`` (FedAvg's rule on the shared part). The
head never leaves the client. A client is evaluated with the latest body and its own head.
A baseline of seed 004 (Table 1), where the head is the classifier of ResNet-18.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torch import Tensor

from hyperfed.algorithms.base import Algorithm, Client, ClientGroup, Payload, Server, ServerContext
from hyperfed.models.layout import FunctionalModel
from hyperfed.models.split import body_head


@dataclass
class FedPerParams:
    """FedPer has no hyperparameters beyond the local SGD settings (head = ``head_prefixes``)."""


class FedPerServer(Server):
    def __init__(self, hp: FedPerParams, clients: dict[int, Payload], ctx: ServerContext) -> None:
        super().__init__(hp, clients, ctx)
        assert ctx.shared_model is not None, "fedper needs one architecture for all clients"
        init = ctx.shared_model.initial_params()
        self.body = body_head(ctx.shared_model).body(init).to(ctx.device)

    def configure_train(self, rnd: int, client_ids: list[int]) -> dict[int, Payload]:
        return {c: {"body": self.body} for c in client_ids}

    def configure_eval(self, client_ids: list[int]) -> dict[int, Payload]:
        return self.configure_train(0, client_ids)

    def reply_shapes(self, client_id: int) -> dict[str, tuple[int, ...]]:
        return {"body": (self.body.numel(),)}

    def model_updates(self) -> dict[str, str]:
        return {"body": "body"}  # the trained body itself

    def aggregate(self, rnd: int, replies: dict[int, Payload]) -> None:
        if not replies:
            return
        self.body = self.average_reply(replies, "body")


class FedPerClient(Client):
    def init_state(self, fm: FunctionalModel, num_clients: int) -> dict[str, Tensor]:
        state = super().init_state(fm, num_clients)
        head = body_head(fm).head(fm.initial_params())
        state["head"] = head.expand(num_clients, -1).clone()
        return state

    def fit(
        self, group: ClientGroup, msg: Payload, state: dict[str, Tensor]
    ) -> tuple[Payload, dict[str, Tensor], Tensor]:
        split = body_head(group.fm)
        theta = split.join(msg["body"], state["head"])
        theta, buffers, loss = group.train(theta, state["buffers"])
        return {"body": split.body(theta)}, {"head": split.head(theta), "buffers": buffers}, loss

    def eval_model(
        self, group: ClientGroup, msg: Payload, state: Mapping[str, Tensor]
    ) -> tuple[Tensor, Tensor]:
        split = body_head(group.fm)
        return split.join(msg["body"], state["head"]), state["buffers"]


ALGORITHM = Algorithm(
    name="fedper",
    summary="FedPer: FedAvg on the body, personal head layers kept on each client",
    hparams=FedPerParams,
    server=FedPerServer,
    client=FedPerClient,
    homogeneous_only=True,
)
