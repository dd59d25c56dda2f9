"""DFedAlt (Shi et al., 2023, decentralized partial model training), a baseline of seed 004.

Each client's model is a shared part u_i (the body: every parameter outside ``head_prefixes``)
and a personal part v_i (the head, never sent). Round t, every active client alternates

1. ``epochs_v`` epochs of SGD on v_i with u_i fixed:   v_i <- v_i - eta_v grad_v F_i(u_i, v_i);
2. ``epochs_u`` epochs of SGD on u_i with v_i fixed:   u_i <- u_i - eta_u grad_u F_i(u_i, v_i);
3. gossip of the shared part: ``u_i <- sum_j W_ij u_j`` over its active neighbours.

Only u_i crosses the wire. The defaults split seed 004's 4 local epochs (§5.1) as 1 personal +
3 shared (seed 004 does not give the split).

DFedHP plugs into this client (``dfedhp.py``): it subclasses :class:`DFedAltClient`, keeps step
1, and replaces the shared part u_i by the output of a client-local hypernetwork h(phi_i, z_i),
so that step 2 trains (phi_i, z_i) and step 3 gossips them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from hyperfed.algorithms.base import (
    Algorithm,
    Client,
    ClientGroup,
    GossipServer,
    Payload,
    chosen,
)
from hyperfed.engine.local import SGDConfig
from hyperfed.engine.topology import GossipParams
from hyperfed.hparams import NonNegInt, Positive
from hyperfed.models.layout import FunctionalModel
from hyperfed.models.split import body_head


@dataclass
class DFedAltParams(GossipParams):
    """Personal / shared local epochs and learning rates (None: the ``[local]`` lr)."""

    epochs_v: NonNegInt = chosen(1, "seed 004's 4 local epochs (§5.1), split not given")
    epochs_u: NonNegInt = chosen(3, "seed 004's 4 local epochs (§5.1), split not given")
    lr_v: Positive | None = chosen(None, "the [local] lr; seed 004 tuned, values not given")
    lr_u: Positive | None = chosen(None, "the [local] lr; seed 004 tuned, values not given")


class DFedAltServer(GossipServer):
    def shapes(self) -> dict[str, tuple[int, ...]]:
        assert self.ctx.shared_model is not None, "dfedalt needs one architecture for all"
        return {"shared": (body_head(self.ctx.shared_model).num_body,)}  # the body u


class DFedAltClient(Client):
    shared_keys: tuple[str, ...] = ("shared",)  # the payload sent to neighbours

    @staticmethod
    def phase(sgd: SGDConfig, epochs: int, lr: float | None) -> SGDConfig:
        """The local SGD settings of one alternating phase (DFedHP's client uses it too)."""
        return dataclasses.replace(sgd, epochs=epochs, lr=sgd.lr if lr is None else lr)

    def join(self, fm: FunctionalModel, num_samples: int) -> Payload:
        return {}

    def init_state(self, fm: FunctionalModel, num_clients: int) -> dict[str, Tensor]:
        state = super().init_state(fm, num_clients)
        split = body_head(fm)
        theta = fm.initial_params().expand(num_clients, -1)
        state["shared"] = split.body(theta).clone()
        state["head"] = split.head(theta).clone()
        return state

    def body(self, group: ClientGroup, state: Mapping[str, Tensor]) -> Tensor:
        """The shared part u_i of each client ``[C, K_body]``."""
        return state["shared"]

    def personal_update(
        self, group: ClientGroup, state: dict[str, Tensor]
    ) -> tuple[dict[str, Tensor], Tensor]:
        """Step 1: SGD on the head with the shared part fixed."""
        split = body_head(group.fm)
        theta = split.join(self.body(group, state).detach(), state["head"])
        theta, buffers, loss = group.train(
            theta,
            state["buffers"],
            trainable=split.head_mask(),
            sgd=self.phase(group.sgd, self.hp.epochs_v, self.hp.lr_v),
            salt=0,
        )
        return {**state, "head": split.head(theta), "buffers": buffers}, loss

    def shared_update(
        self, group: ClientGroup, state: dict[str, Tensor]
    ) -> tuple[dict[str, Tensor], Tensor | None]:
        """Step 2: SGD on the shared part with the head fixed."""
        if not self.hp.epochs_u:
            return state, None
        split = body_head(group.fm)
        theta = split.join(state["shared"], state["head"])
        theta, buffers, loss = group.train(
            theta,
            state["buffers"],
            trainable=~split.head_mask(),
            sgd=self.phase(group.sgd, self.hp.epochs_u, self.hp.lr_u),
            salt=1,
        )
        return {**state, "shared": split.body(theta), "buffers": buffers}, loss

    def fit(
        self, group: ClientGroup, msg: Payload, state: dict[str, Tensor]
    ) -> tuple[Payload, dict[str, Tensor], Tensor]:
        losses = []  # the last phase's mean loss is the round's training loss
        if self.hp.epochs_v:
            state, loss = self.personal_update(group, state)
            losses.append(loss)
        state, shared_loss = self.shared_update(group, state)
        if shared_loss is not None:
            losses.append(shared_loss)
        loss = losses[-1] if losses else torch.zeros(group.size)
        return {k: state[k] for k in self.shared_keys}, state, loss

    def eval_model(
        self, group: ClientGroup, msg: Payload, state: Mapping[str, Tensor]
    ) -> tuple[Tensor, Tensor]:
        split = body_head(group.fm)
        return split.join(self.body(group, state), state["head"]), state["buffers"]


ALGORITHM = Algorithm(
    name="dfedalt",
    summary="DFedAlt: alternate personal-head / shared-body updates, gossip the body",
    hparams=DFedAltParams,
    server=DFedAltServer,
    client=DFedAltClient,
    homogeneous_only=True,
    kind="decentralized",
)
