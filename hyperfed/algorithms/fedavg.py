"""FedAvg (McMahan et al., 2017): average of locally trained models, weighted by n_k.

Round: the server sends the global model theta; each client runs E epochs of SGD from it
and returns theta_k; the server sets theta = sum_k n_k theta_k / sum_k n_k. BatchNorm
running statistics stay on the clients (only parameters cross the wire), so a download and
an upload are each K float32 values: 2*K*4 bytes per participating client per round.

With a mix of architectures FedAvg runs one federation per architecture (clients grouped by
the parameter count they report), as seed 000's Table 2 reports FedAvg for mixed models.

Which model is evaluated (``evaluate``): FedAvg's paper tests the global model (the default).
``evaluate="local"`` scores each client's model after its latest local training from the
global model (the initial model for a client never sampled): seed 001's PM@Acc, "the trained
private models' mean accuracy" (§6.1), which `hyperfed reproduce 001:table1` uses for every row.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from torch import Tensor

from hyperfed.algorithms.base import Algorithm, Client, ClientGroup, Payload, Server, ServerContext
from hyperfed.hparams import paper
from hyperfed.models.layout import FunctionalModel

Evaluated = Literal["global", "local"]
EVALUATED = get_args(Evaluated)


@dataclass
class FedAvgParams:
    """FedAvg has no hyperparameters beyond the local SGD settings and which model is scored."""

    evaluate: Evaluated = paper(
        "global",
        "McMahan et al. §3: the global model is tested; 'local' scores each client's model "
        "after its latest local training (seed 001's PM@Acc)",
    )


class FedAvgServer(Server):
    def __init__(self, hp: Any, clients: dict[int, Payload], ctx: ServerContext) -> None:
        super().__init__(hp, clients, ctx)
        self.size = {c: int(p["num_params"]) for c, p in clients.items()}
        # one global model per architecture, keyed by its parameter count
        self.theta = {
            str(k): ctx.model_with(k).initial_params().to(ctx.device)
            for k in sorted(set(self.size.values()))
        }

    def configure_train(self, rnd: int, client_ids: list[int]) -> dict[int, Payload]:
        return {c: {"theta": self.theta[str(self.size[c])]} for c in client_ids}

    def configure_eval(self, client_ids: list[int]) -> dict[int, Payload]:
        return self.configure_train(0, client_ids)

    def model_updates(self) -> dict[str, str]:
        return {"theta": "theta"}  # the trained model itself

    def reply_shapes(self, client_id: int) -> dict[str, tuple[int, ...]]:
        return {"theta": (self.size[client_id],)}  # the trained model, nothing else

    def aggregate(self, rnd: int, replies: dict[int, Payload]) -> None:
        for key in self.theta:
            ids = [c for c in replies if str(self.size[c]) == key]
            if ids:
                self.theta[key] = self.average_reply(replies, "theta", ids)


class FedAvgClient(Client):
    """State: ``buffers``, and under ``evaluate="local"`` ``theta_local``, the client's model
    after its latest local training (the evaluated one)."""

    def init_state(self, fm: FunctionalModel, num_clients: int) -> dict[str, Tensor]:
        state = super().init_state(fm, num_clients)
        if getattr(self.hp, "evaluate", "global") == "local":
            state["theta_local"] = fm.initial_params().expand(num_clients, -1).clone()
        return state

    def fit(
        self, group: ClientGroup, msg: Payload, state: dict[str, Tensor]
    ) -> tuple[Payload, dict[str, Tensor], Tensor]:
        theta, buffers, loss = group.train(msg["theta"], state["buffers"])
        if "theta_local" in state:
            return {"theta": theta}, {"buffers": buffers, "theta_local": theta}, loss
        return {"theta": theta}, {"buffers": buffers}, loss

    def eval_model(
        self, group: ClientGroup, msg: Payload, state: Mapping[str, Tensor]
    ) -> tuple[Tensor, Tensor]:
        if "theta_local" in state:
            return state["theta_local"], state["buffers"]
        return msg["theta"], state["buffers"]


ALGORITHM = Algorithm(
    name="fedavg",
    summary="FedAvg: weighted average of local models (one federation per architecture)",
    hparams=FedAvgParams,
    server=FedAvgServer,
    client=FedAvgClient,
    scores=lambda hp: getattr(hp, "evaluate", "global"),
)
