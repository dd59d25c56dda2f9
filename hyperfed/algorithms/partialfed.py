"""PartialFed (Sun et al., NeurIPS 2021, "Cross-Domain Personalized Federated Learning via
Partial Initialization"), the PartialFed-Fix variant.

FedAvg starts every client's local training from the whole global model. PartialFed starts it
from a *partial* initialization: a loading strategy A^c (one binary choice per layer l) says
whether client c loads layer l from the global model theta_t or keeps its own layer from the
model it trained in its last round, theta^c_{t-1}:

    theta^{c,init}_{t,l} = A^c_l * theta_{t,l} + (1 - A^c_l) * theta^c_{t-1,l}.

The client then trains the whole model as in FedAvg and uploads the whole trained model; the
server aggregates with FedAvg, ``theta_{t+1} = sum_c n_c theta^c_t / sum_c n_c``, locally
initialized layers included. PartialFed-Fix uses one hand-chosen strategy for every client
and round; the paper's Fix study compares bottom-up / top-down splits and finds that keeping
the BatchNorm layers and the classifier local (not loading them) helps most, while loading
every layer (FedAvg) is worst.

``local_layers`` is that strategy: the layers *not* loaded from the global model, as
comma-separated tokens: ``norm`` (every normalization layer's affine parameters, found from
the model as in FedBN), ``head`` (the model's ``head_prefixes``), or parameter-name prefixes
(``classifier``, ``features.0``, ...). The default ``norm,classifier`` is the Fix study's
recommendation; on a model without normalization layers it keeps the classifier only.

What is not here, and why: PartialFed-Adaptive (a strategy A^c learned per client) is not
implemented. Its definition (how the per-layer selection is parameterized and optimized) could
not be read from an accessible text of the paper or from the authors' code,
only from its abstract and a secondary summary; implementing it from a guess would put a
method under PartialFed's name that the paper may not define.

Choices: a client is evaluated with its partial initialization from the latest global model
(global layers from theta, its own local layers), i.e. the model it would start from when
next sampled -- the same rule as FedPer / FedBN here. Before a client's first round its own
layers are the architecture's shared initialization. BatchNorm running statistics never
cross the wire in hyperfed, so they are local under every strategy (the paper's "load the
global BN layer" would load them too); ``norm`` decides only about gamma and beta. The upload
is not declared in ``Server.model_updates``: it was trained from the partial initialization,
not from the sent model, which is what the attack harness assumes. Heterogeneous clients: one
FedAvg federation per architecture, as hyperfed's FedAvg (the strategy is applied per
architecture).
"""

from __future__ import annotations

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
)
from hyperfed.errors import ConfigError
from hyperfed.hparams import Layers
from hyperfed.models.layout import FunctionalModel
from hyperfed.models.select import norm_mask, split_by_mask
from hyperfed.models.split import BodyHead, layer_prefixes


@dataclass
class PartialFedParams:
    """The Fix loading strategy: which layers are initialized locally (not loaded)."""

    local_layers: Layers = chosen(
        "norm,classifier",
        "the Fix study's best classification strategy keeps BN and the classifier local; "
        "the per-dataset strategy table could not be checked here",
    )

    def tokens(self) -> tuple[str, ...]:
        return tuple(t.strip() for t in self.local_layers.split(",") if t.strip())


def local_mask(fm: FunctionalModel, local_layers: str) -> Tensor:
    """Bool ``[K]``: True where the strategy keeps the client's own layer (A^c_l = 0)."""
    tokens = PartialFedParams(local_layers).tokens()
    mask = fm.layout.mask(layer_prefixes(fm, ",".join(t for t in tokens if t != "norm")))
    if "norm" in tokens:
        mask = mask | norm_mask(fm)
    return mask


@cache
def partial_split(fm: FunctionalModel, local_layers: str) -> BodyHead:
    """``body``: layers loaded from the global model (A=1); ``head``: kept local (A=0)."""
    return split_by_mask(local_mask(fm, local_layers), fm.initial_params().device)


def check_strategy(models: list[FunctionalModel], local_layers: str) -> None:
    """ConfigError for a strategy that is FedAvg or local training on some architecture, or
    that names a prefix no architecture has (a typo)."""
    for token in PartialFedParams(local_layers).tokens():
        if token not in ("norm", "head") and not any(
            fm.layout.mask([token]).any() for fm in models
        ):
            names = ", ".join(models[0].layout.names)
            raise ConfigError(
                f"algorithm.local_layers: {token!r} matches no parameter; use 'norm', 'head' "
                f"or parameter-name prefixes, e.g. of {models[0].name}: {names}"
            )
    for fm in models:
        mask = local_mask(fm, local_layers)
        if not bool(mask.any()):
            raise ConfigError(
                f"algorithm.local_layers: {local_layers!r} keeps no layer of {fm.name} local, "
                'which is FedAvg; name a layer, e.g. local_layers = "classifier"'
            )
        if bool(mask.all()):
            raise ConfigError(
                f"algorithm.local_layers: {local_layers!r} keeps every layer of {fm.name} "
                'local, which is local training; use algorithm.name = "local" instead'
            )


class PartialFedServer(Server):
    def __init__(
        self, hp: PartialFedParams, clients: dict[int, Payload], ctx: ServerContext
    ) -> None:
        super().__init__(hp, clients, ctx)
        self.size = {c: int(p["num_params"]) for c, p in clients.items()}
        sizes = sorted(set(self.size.values()))
        check_strategy([ctx.model_with(k) for k in sizes], hp.local_layers)
        # one global model per architecture, keyed by its parameter count
        self.theta = {str(k): ctx.model_with(k).initial_params().to(ctx.device) for k in sizes}

    def configure_train(self, rnd: int, client_ids: list[int]) -> dict[int, Payload]:
        return {c: {"theta": self.theta[str(self.size[c])]} for c in client_ids}

    def configure_eval(self, client_ids: list[int]) -> dict[int, Payload]:
        return self.configure_train(0, client_ids)

    def reply_shapes(self, client_id: int) -> dict[str, tuple[int, ...]]:
        return {"theta": (self.size[client_id],)}  # the whole trained model

    def aggregate(self, rnd: int, replies: dict[int, Payload]) -> None:
        # FedAvg over the uploaded models, locally initialized layers included
        for key in self.theta:
            ids = [c for c in replies if str(self.size[c]) == key]
            if ids:
                self.theta[key] = self.average_reply(replies, "theta", ids)


class PartialFedClient(Client):
    def init_state(self, fm: FunctionalModel, num_clients: int) -> dict[str, Tensor]:
        state = super().init_state(fm, num_clients)
        own = partial_split(fm, self.hp.local_layers).head(fm.initial_params())
        state["local"] = own.expand(num_clients, -1).clone()  # theta^c_{t-1} on A=0 layers
        return state

    def init_model(self, fm: FunctionalModel, msg: Payload, state: Mapping[str, Tensor]) -> Tensor:
        """theta^{c,init} = A * theta_t + (1 - A) * theta^c_{t-1}, layer by layer."""
        split = partial_split(fm, self.hp.local_layers)
        return split.join(split.body(msg["theta"]), state["local"])

    def fit(
        self, group: ClientGroup, msg: Payload, state: dict[str, Tensor]
    ) -> tuple[Payload, dict[str, Tensor], Tensor]:
        theta = self.init_model(group.fm, msg, state)
        theta, buffers, loss = group.train(theta, state["buffers"])
        own = partial_split(group.fm, self.hp.local_layers).head(theta)
        return {"theta": theta}, {"local": own, "buffers": buffers}, loss

    def eval_model(
        self, group: ClientGroup, msg: Payload, state: Mapping[str, Tensor]
    ) -> tuple[Tensor, Tensor]:
        return self.init_model(group.fm, msg, state), state["buffers"]


ALGORITHM = Algorithm(
    name="partialfed",
    summary="PartialFed-Fix: start local training from global layers plus own local layers",
    hparams=PartialFedParams,
    server=PartialFedServer,
    client=PartialFedClient,
)
