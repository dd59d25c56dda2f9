"""FML, federated mutual learning (Shen et al., 2020).

Every client keeps a private model (its own architecture) and receives a shared *meme* model
(one architecture for everyone: ``shared_model``; pFedES §6.2 uses the smallest, CNN-5, as
the small homogeneous model). Round t: the client trains both models together by deep mutual
learning on its data for E epochs,

* private: ``alpha * CE(p_local, y) + (1 - alpha) * KL(p_meme || p_local)``,
* meme:    ``beta  * CE(p_meme, y)  + (1 - beta)  * KL(p_local || p_meme)``,

each model taking the other's current prediction as a fixed target; then it uploads only the
meme model, and the server averages the meme models weighted by n_k (FedAvg). Clients are
evaluated with their private model. Upload = |meme| float32 values.

Both losses are minimized in one SGD step on the joint vector ``[private | meme]`` (DML
alternates the two updates within a step; with the targets detached the gradients are the
same, only the second update sees the first's result in DML). The meme model's BatchNorm
statistics, if it has any, stay on the client.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from hyperfed.algorithms.base import (
    Algorithm,
    ClientContext,
    ClientGroup,
    Payload,
    PersonalModelClient,
    Server,
    ServerContext,
    chosen,
    paper,
)
from hyperfed.algorithms.local_settings import SEED002
from hyperfed.engine.losses import ModelPair, kd_loss
from hyperfed.errors import ConfigError
from hyperfed.hparams import Space, Unit
from hyperfed.models.layout import FunctionalModel
from hyperfed.models.zoo import ModelInputError, UnknownModelError, build_model


@dataclass
class FMLParams:
    """FML's alpha = beta = 0.5; the shared model as in pFedES §6.2."""

    # private model: weight of its own CE (1 - alpha on the KL)
    alpha: Unit = chosen(0.5, "FML's official code (Args.py); not found in the paper")
    # meme model: weight of its own CE
    beta: Unit = chosen(0.5, "FML's official code (Args.py); not found in the paper")
    shared_model: str = paper("cnn5", "seed 002 §6.2 (CNN-5 as the small model)")


def build_shared(name: str, ctx: ServerContext | ClientContext) -> FunctionalModel:
    """The shared model, with the same initial weights on the server and every client."""
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(ctx.seed)
            module = build_model(name, ctx.input_shape, ctx.num_classes)
    except (ModelInputError, UnknownModelError) as e:
        raise ConfigError(f"algorithm.shared_model: {e}") from None
    return FunctionalModel(module.to(ctx.device), name)


def fml_loss(
    fm: FunctionalModel,
    theta: Tensor,
    buffers: Tensor,
    x: Tensor,
    y: Tensor,
    ctx: dict[str, Tensor],
    *,
    pair: ModelPair,
    alpha: float,
    beta: float,
) -> tuple[Tensor, Tensor]:
    """Private loss + meme loss on the joint vector [private | meme]."""
    z_p, z_s, new_buffers = pair.forward_train_both(theta, buffers, x)
    loss_p = alpha * F.cross_entropy(z_p, y) + (1 - alpha) * kd_loss(z_p, z_s)
    loss_s = beta * F.cross_entropy(z_s, y) + (1 - beta) * kd_loss(z_s, z_p)
    return loss_p + loss_s, new_buffers


class FMLServer(Server):
    """FedAvg on the shared model only (also FedKD's server)."""

    def __init__(self, hp: FMLParams, clients: dict[int, Payload], ctx: ServerContext) -> None:
        super().__init__(hp, clients, ctx)
        self.shared = build_shared(hp.shared_model, ctx).initial_params()

    def configure_train(self, rnd: int, client_ids: list[int]) -> dict[int, Payload]:
        return {c: {"shared": self.shared} for c in client_ids}

    def reply_shapes(self, client_id: int) -> dict[str, tuple[int, ...]]:
        return {"shared": (self.shared.numel(),)}

    def aggregate(self, rnd: int, replies: dict[int, Payload]) -> None:
        if not replies:
            return
        self.shared = self.average_reply(replies, "shared")


class FMLClient(PersonalModelClient):
    """Private + shared model trained together; subclasses change only :meth:`loss_fn`."""

    def __init__(self, hp: FMLParams, ctx: ClientContext) -> None:
        super().__init__(hp, ctx)
        self.shared_fm = build_shared(hp.shared_model, ctx)

    def loss_fn(self, pair: ModelPair) -> Callable:
        return partial(fml_loss, pair=pair, alpha=self.hp.alpha, beta=self.hp.beta)

    def join(self, fm: FunctionalModel, num_samples: int) -> Payload:
        return {"num_samples": torch.tensor(num_samples, dtype=torch.int64)}

    def init_state(self, fm: FunctionalModel, num_clients: int) -> dict[str, Tensor]:
        state = super().init_state(fm, num_clients)
        bufs = self.shared_fm.initial_buffers().to(state["theta"].device)
        state["shared_buffers"] = bufs.expand(num_clients, -1).clone()
        return state

    def fit(
        self, group: ClientGroup, msg: Payload, state: dict[str, Tensor]
    ) -> tuple[Payload, dict[str, Tensor], Tensor]:
        pair = ModelPair(group.fm, self.shared_fm)
        theta = pair.join(state["theta"], msg["shared"])
        buffers = pair.join_buffers(state["buffers"], state["shared_buffers"])
        theta, buffers, loss = group.train(theta, buffers, loss_fn=self.loss_fn(pair))
        th_p, th_s = pair.split(theta)
        bu_p, bu_s = pair.split_buffers(buffers)
        new_state = {"theta": th_p, "buffers": bu_p, "shared_buffers": bu_s}
        return {"shared": th_s}, new_state, loss


ALGORITHM = Algorithm(
    name="fml",
    summary="FML: private model + shared meme model by deep mutual learning",
    hparams=FMLParams,
    server=FMLServer,
    client=FMLClient,
    local_defaults=SEED002,
    tune={"alpha": Space(0.0, 1.0)},
)
