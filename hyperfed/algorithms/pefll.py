"""PeFLL (Scott, Zakerinia and Lampert, ICLR 2024, "PeFLL: Personalized Federated Learning by
Learning to Learn"). A baseline of seed 000 (Tables 1-2, [53]); one architecture only.

Two networks are learned jointly. The embedding network phi maps a labelled sample to R^d; a
client's descriptor is the mean over a batch B_i of its data, ``v_i = 1/|B_i| sum phi(x, y)``
(computed on the client: the data never leave it). The hypernetwork h (on the server) maps a
descriptor to a whole model, ``theta_i = h(v_i)``. The paper's round, per sampled client:

1. server -> client: phi;  client -> server: v_i;
2. server -> client: theta_i = h(v_i); the client trains it (local SGD on cross-entropy) to
   theta~_i and returns ``Delta theta_i = theta~_i - theta_i``;
3. the server back-propagates ``-Delta theta_i`` through h: the hypernetwork gradient
   ``(d theta_i / d eta_h)^T (-Delta theta_i)`` and the descriptor gradient
   ``g_i = (d theta_i / d v_i)^T (-Delta theta_i)``; server -> client: g_i;
4. the client back-propagates g_i through its descriptor, ``(d v_i / d phi)^T g_i``, and
   returns it; the server averages both gradients over the round's clients and takes one
   step of its optimizer on (eta_h, phi) jointly (Adam, gradient norm clipped).

Only phi, v_i, theta_i, Delta theta_i, g_i and phi's gradient cross the wire; h stays on the
server. **Pipelining.** hyperfed's round is one exchange (server message, client reply), so
the paper's three round trips are folded into one exchange per participation: the message
carries theta_i generated from the descriptor the client sent at its previous participation
(the first one from a setup exchange before round 1), the current phi, and the descriptor
gradient g_i of the previous participation; the reply carries Delta theta_i, a fresh
descriptor computed with the received phi, and phi's gradient for the descriptor that g_i
belongs to (the client keeps that descriptor's phi and batch for it). The bytes per
participation are the paper's; the descriptor a model is generated from is one participation
old, and phi's gradient arrives one participation after its descriptor was used (computed
exactly, at the phi and batch that produced the descriptor). A reply's phi gradient is zero
until the client's second participation.

**Evaluation** (``eval_descriptor="fresh"``, the authors' ``evaluate()`` with its default
``--embed-split train``): before every evaluation the server sends the current phi to every
client (an evaluation request, ``Server.configure_eval_request``); each client returns
``v_i = mean over its whole train split of phi(x, y)``; the server sends ``theta_i = h(v_i)``,
which is what the client is scored with. ``"last_sent"`` (this file's earlier reading) scores
``h`` of the descriptor the client sent at its last participation instead: one batch, from a
phi several rounds old under partial participation. The request's bytes are not counted, like
the evaluation's own messages.

**New clients** (the paper's generalization to clients unseen in training): ``new_clients``
holds the last fraction of clients (by id) out of training; in the final ``adapt_rounds``
rounds only they take part, nothing is learned (h and phi frozen, no local training), and
each sends a descriptor computed with the final phi, from which the server generates its
model -- PeFLL's inference for a new client (with ``eval_descriptor="fresh"`` every evaluation
does this for every client). Metrics add ``mean_acc_old`` / ``_new``.

**h's depth** follows the authors' ``CNNHyper(n_hidden=--hyper-nhid)``: ``Linear(d, hidden)``,
then ``n_hidden`` times ``ReLU, Linear(hidden, hidden)``, then the output layer to the K
parameters (the authors' one Linear per target tensor, here one Linear of K: the same map);
``--hyper-nhid 3`` (their default) is 4 Linear layers before the output. It learns more slowly
than ``n_hidden=2`` on a small digits task (docs/methods.md); the default stays the authors'.

Choices: the embedding network is a zoo model (``embed_model``, LeNet-style by default, as the
authors' CNN) whose input is the sample with its one-hot label appended as constant channels;
the paper's weight decay terms are not used. The descriptor h reads is standardized as in the
authors' code (``standardize``): ``(v - m) / s`` with m, s the mean and standard deviation of
the entries of the first descriptor the server receives (here: the lowest client id's in the
setup exchange), fixed for the run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Literal, get_args

import torch
import torch.nn.functional as F
from annotated_types import Ge, Lt
from torch import Tensor

from hyperfed.algorithms.base import (
    EVAL_REQUEST,
    Algorithm,
    Client,
    ClientContext,
    ClientGroup,
    Payload,
    Server,
    ServerContext,
    chosen,
)
from hyperfed.engine.local import client_seed, plan_batches
from hyperfed.engine.metering import FlopMeter
from hyperfed.engine.optim import adam
from hyperfed.errors import ConfigError
from hyperfed.hparams import Count, NonNegInt, Positive, Space
from hyperfed.hypernet.multihead import MultiHeadHypernet, concat_chunks
from hyperfed.models.layout import FunctionalModel
from hyperfed.models.zoo import ClientNet, build_model

CODE = "the authors' PeFLL code / FL-bench's port (the paper's text was not reachable here)"
AUTHORS = "authors' code (pefllauthors/PeFLL, train.py / models.py)"
EvalDescriptor = Literal["fresh", "last_sent"]
EVAL_DESCRIPTORS = get_args(EvalDescriptor)


@dataclass
class PeFLLParams:
    hn_lr: Positive = chosen(2e-4, f"Adam lr of h and phi, {CODE}")
    embed_dim: Count | None = chosen(None, f"d; None: 1 + N/4 (pFedHN's rule), {CODE}")
    hidden: Count = chosen(100, f"width of h's MLP, {CODE}")
    n_hidden: NonNegInt = chosen(
        3,
        f"hidden-to-hidden layers of h after its input layer: {AUTHORS}, --hyper-nhid 3, "
        "CNNHyper(n_hidden): Linear(d, hidden) + n_hidden x Linear(hidden, hidden)",
    )
    clip_norm: Positive = chosen(50.0, f"gradient norm clip of (h, phi), {CODE}")
    embed_model: str = chosen("lenet", "zoo model for phi: the authors use a LeNet-style CNN")
    embed_batch: Count = chosen(
        64,
        f"samples per descriptor (one batch); 32 in the {AUTHORS}, --batch-size, and in "
        "docs/crosscheck.md; 64 kept so that earlier runs mean what they did",
    )
    new_clients: Annotated[float, Ge(0), Lt(1)] = chosen(
        0.0, "fraction held out for the new-client evaluation"
    )
    adapt_rounds: NonNegInt = chosen(0, "final rounds in which only new clients send descriptors")
    standardize: bool = chosen(
        True,
        f"{AUTHORS}: h reads (v - m) / s, m and s the mean and std of the entries of the first "
        "descriptor, fixed for the run (cross-check, docs/crosscheck.md: 91.7 with it, 81.9 "
        "without, 81.0 here before); False: h reads v",
    )
    eval_descriptor: EvalDescriptor = chosen(
        "fresh",
        f"{AUTHORS}, evaluate(): the current phi over the client's train split; 'last_sent': "
        "the descriptor of its last participation",
    )

    def __post_init__(self) -> None:
        if (self.new_clients > 0) != (self.adapt_rounds > 0):
            raise ValueError("new_clients and adapt_rounds must be set together")


def embedding_input_shape(input_shape: tuple[int, ...], num_classes: int) -> tuple[int, ...]:
    """phi's input: an image with ``num_classes`` label channels appended, or a vector with the
    one-hot label appended."""
    if len(input_shape) == 3:
        return (input_shape[0] + num_classes, *input_shape[1:])
    return (input_shape[0] + num_classes,)


def with_labels(x: Tensor, y: Tensor, num_classes: int) -> Tensor:
    """(x, y) as phi's input: the one-hot label as constant extra channels (or entries)."""
    onehot = F.one_hot(y, num_classes).to(x.dtype)
    if x.dim() == 4:
        onehot = onehot[:, :, None, None].expand(-1, -1, *x.shape[2:])
    return torch.cat([x, onehot], dim=1)


def embedding_net(name: str, input_shape: tuple[int, ...], num_classes: int, dim: int) -> ClientNet:
    """phi: zoo model ``name`` on (sample, label) inputs with ``dim`` outputs."""
    return build_model(name, embedding_input_shape(input_shape, num_classes), dim)


class PeFLLServer(Server):
    def __init__(self, hp: PeFLLParams, clients: dict[int, Payload], ctx: ServerContext) -> None:
        super().__init__(hp, clients, ctx)
        fm = ctx.shared_model
        if fm is None:
            raise ConfigError(
                "clients.models: pefll generates one architecture from a descriptor; set "
                "clients.models to a single name"
            )
        ids = sorted(clients)
        n = len(ids)
        self.dim = hp.embed_dim or int(1 + n / 4)
        self.num_params = fm.num_params
        torch.manual_seed(ctx.seed)
        module = embedding_net(hp.embed_model, ctx.input_shape, ctx.num_classes, self.dim)
        embed = FunctionalModel(module.to(ctx.device), hp.embed_model)
        self.phi = embed.initial_params().clone().requires_grad_(True)
        # h: MultiHeadHypernet's extractor (the authors' MLP: 1 + n_hidden Linear layers) and
        # one output layer of K (pFedHN's shape); its input is the client's descriptor v_i
        # instead of a learned embedding
        self.hnet = MultiHeadHypernet(
            {0: fm.num_params},
            embed_dim=self.dim,
            hidden=hp.hidden,
            n_layers=1 + hp.n_hidden,
            out_dim=None,
        ).to(ctx.device)
        self.hnet.embeddings.requires_grad_(False)  # unused: descriptors replace them
        self.opt: torch.optim.Optimizer = adam(
            [*self.hnet.extractor.parameters(), *self.hnet.heads.parameters(), self.phi], hp.hn_lr
        )
        self.descriptors = torch.zeros(n, self.dim, device=ctx.device)  # v_i, latest received
        # (m, s) of the authors' standardization, from the first descriptor received (NaN: none
        # yet); a tensor, so checkpoints carry it
        self.v_stats = torch.full((2,), float("nan"), device=ctx.device)
        self.pending = torch.zeros(n, self.dim, device=ctx.device)  # g_i, not yet sent
        self.fresh: dict[int, Tensor] = {}  # v_i of the evaluation request, used once
        n_new = round(hp.new_clients * n)
        self.new_ids, self.old_ids = ids[n - n_new :], ids[: n - n_new]
        self.adapt_from = ctx.rounds - hp.adapt_rounds + 1 if n_new else None
        if n_new and (not self.old_ids or hp.adapt_rounds >= ctx.rounds):
            raise ConfigError(
                f"algorithm.adapt_rounds: new_clients/adapt_rounds leave no training phase "
                f"(rounds={ctx.rounds}); lower adapt_rounds or new_clients"
            )

    # -- h ---------------------------------------------------------------------------------
    def generate(self, v: Tensor) -> Tensor:
        """theta = h(v) for descriptors ``v[C, d]`` -> ``[C, K]``; with ``standardize`` h reads
        ``(v - m) / s`` (the authors' code; m, s fixed from the first descriptor)."""
        if self.hp.standardize and not torch.isnan(self.v_stats).any():
            m, sd = self.v_stats.to(v.dtype)
            v = (v - m) / sd
        chunks = self.hnet.heads[self.hnet.key[0]](self.hnet.extractor(v[:, None, :]))
        return concat_chunks(chunks, self.num_params)

    def adapting(self, rnd: int) -> bool:
        return self.adapt_from is not None and rnd >= self.adapt_from

    def eligible_clients(self, rnd: int) -> list[int] | None:
        if self.adapt_from is None:
            return None
        return self.new_ids if self.adapting(rnd) else self.old_ids

    def eval_groups(self) -> dict[str, list[int]]:
        return {"old": self.old_ids, "new": self.new_ids} if self.new_ids else {}

    # -- setup: every client's first descriptor ----------------------------------------------
    def configure_setup(self, stage: int, client_ids: list[int]) -> dict[int, Payload]:
        phi = self.phi.detach()
        return {c: {"phi": phi} for c in client_ids} if stage == 0 else {}

    def check_setup_reply(self, stage: int, client_id: int, reply: Payload) -> str | None:
        if set(reply) != {"v"} or tuple(reply["v"].shape) != (self.dim,):
            return f"expected a descriptor 'v' of shape ({self.dim},)"
        return super().check_setup_reply(stage, client_id, reply)

    def aggregate_setup(self, stage: int, replies: dict[int, Payload]) -> None:
        if stage == EVAL_REQUEST:  # for this evaluation only: training is left as it was
            self.fresh = {c: r["v"] for c, r in replies.items()}
            return
        for c, r in replies.items():
            self.descriptors[c] = r["v"]
        if replies and torch.isnan(self.v_stats).any():
            first = replies[min(replies)]["v"].to(self.descriptors.dtype)
            # the authors' m, s: the first descriptor's entries (torch.std: unbiased)
            self.v_stats = torch.stack([first.mean(), first.std().clamp_min(1e-12)])

    # -- evaluation: theta_i = h(v_i), v_i from the current phi over the train split -----------
    def configure_eval_request(self, client_ids: list[int]) -> dict[int, Payload]:
        if self.hp.eval_descriptor != "fresh":
            return {}
        self.fresh = {}
        phi = self.phi.detach()
        return {c: {"phi": phi} for c in client_ids}

    def configure_eval(self, client_ids: list[int]) -> dict[int, Payload]:
        if self.hp.eval_descriptor == "fresh":
            # a client that did not answer the request is not evaluated (eval_missing)
            fresh, self.fresh = self.fresh, {}
            client_ids = [c for c in client_ids if c in fresh]
            if not client_ids:
                return {}
            v = torch.stack([fresh[c] for c in client_ids])
        else:
            v = self.descriptors[torch.tensor(client_ids, device=self.descriptors.device)]
        with torch.no_grad():
            thetas = self.generate(v.to(self.descriptors.dtype))
        return {c: {"theta": thetas[i]} for i, c in enumerate(client_ids)}

    # -- rounds ------------------------------------------------------------------------------
    @torch.no_grad()
    def configure_train(self, rnd: int, client_ids: list[int]) -> dict[int, Payload]:
        if not client_ids:
            return {}
        idx = torch.tensor(client_ids, device=self.descriptors.device)
        thetas = self.generate(self.descriptors[idx])
        phi = self.phi.detach()
        train = torch.tensor(0.0 if self.adapting(rnd) else 1.0, device=phi.device)
        return {
            c: {"theta": thetas[i], "phi": phi, "gv": self.pending[c], "train": train}
            for i, c in enumerate(client_ids)
        }

    def reply_shapes(self, client_id: int) -> dict[str, tuple[int, ...]]:
        return {"delta": (self.num_params,), "v": (self.dim,), "phi_grad": (self.phi.numel(),)}

    def aggregate(self, rnd: int, replies: dict[int, Payload]) -> None:
        if not replies:
            return
        ids = sorted(replies)
        if not self.adapting(rnd):  # new clients learn nothing: h and phi stay frozen
            at = torch.tensor(ids, device=self.descriptors.device)
            v = self.descriptors[at].clone().requires_grad_(True)
            thetas = self.generate(v)
            delta = torch.stack([replies[c]["delta"] for c in ids])
            self.opt.zero_grad(set_to_none=True)
            # -Delta theta_i as d(loss)/d(theta_i) (theta_i moves toward theta~_i); the mean
            # over the round's clients for h, and each client's own g_i = d/dv_i
            (g_v,) = torch.autograd.grad(thetas, v, -delta, retain_graph=True)
            thetas.backward(-delta / len(ids))
            self.phi.grad = torch.stack([replies[c]["phi_grad"] for c in ids]).mean(0)
            params = [p for g in self.opt.param_groups for p in g["params"]]
            torch.nn.utils.clip_grad_norm_(params, self.hp.clip_norm)
            self.opt.step()
            for i, c in enumerate(ids):
                self.pending[c] = g_v[i]
        for c in ids:
            self.descriptors[c] = replies[c]["v"]

    def state_dict(self) -> dict:  # type: ignore[type-arg]
        state = super().state_dict()
        state["phi"] = self.phi.detach().clone()
        return state

    def load_state_dict(self, state: dict) -> None:  # type: ignore[type-arg]
        state = dict(state)
        with torch.no_grad():
            self.phi.copy_(state.pop("phi"))
        super().load_state_dict(state)


class PeFLLClient(Client):
    """Computes descriptors with the phi it receives, trains the generated model, and
    back-propagates the server's descriptor gradient through phi."""

    def __init__(self, hp: PeFLLParams, ctx: ClientContext) -> None:
        super().__init__(hp, ctx)
        self.num_classes = ctx.num_classes
        self._embed: dict[int, FunctionalModel] = {}

    def _embed_net(self, dim: int) -> FunctionalModel:
        module = embedding_net(self.hp.embed_model, self.ctx.input_shape, self.num_classes, dim)
        return FunctionalModel(module.to(self.ctx.device), self.hp.embed_model)

    def embed(self, phi_size: int) -> FunctionalModel:
        """phi's architecture, its output size d read from phi's length (the last layer has
        ``(fan_in + 1) * d`` of them); the server never has to send d."""
        if phi_size not in self._embed:
            one, two = self._embed_net(1).num_params, self._embed_net(2).num_params
            dim, rest = divmod(phi_size - one, two - one)
            if rest or dim < 0:
                raise ValueError(
                    f"no {self.hp.embed_model} embedding network has {phi_size} parameters"
                )
            self._embed[phi_size] = self._embed_net(dim + 1)
        return self._embed[phi_size]

    def init_state(self, fm: FunctionalModel, num_clients: int) -> dict[str, Tensor]:
        state = super().init_state(fm, num_clients)
        b = self.hp.embed_batch
        state["idx_used"] = torch.zeros(num_clients, b, dtype=torch.long)
        state["idx_sent"] = torch.zeros(num_clients, b, dtype=torch.long)
        # phi copies are sized at the first message (setup), when phi's length is known
        state["phi_used"] = torch.zeros(num_clients, 0)
        state["phi_sent"] = torch.zeros(num_clients, 0)
        return {k: v.to(self.ctx.device) for k, v in state.items()}

    def descriptor_batch(self, group: ClientGroup, salt: int) -> Tensor:
        """``[C, B]`` sample indices of each client's next descriptor batch."""
        seeds = [client_seed(group.seed, group.rnd, c, salt) for c in group.client_ids]
        idx = [group.data.train_idx[c] for c in group.client_ids]
        return plan_batches(idx, 1, self.hp.embed_batch, seeds).idx[0]

    def descriptors(self, group: ClientGroup, phi: Tensor, idx: Tensor) -> Tensor:
        """``v_c = mean_b phi_c(x_b, y_b)`` over each client's batch ``idx[c]`` -> ``[C, d]``."""
        embed = self.embed(phi.shape[-1])
        out = []
        for c in range(idx.shape[0]):
            x, y = group.data.batch(idx[c])
            z = embed.forward(phi[c], embed.initial_buffers(), with_labels(x, y, self.num_classes))
            assert isinstance(z, Tensor)
            out.append(z.mean(0))
        return torch.stack(out)

    @torch.no_grad()
    def split_descriptors(self, group: ClientGroup, phi: Tensor) -> Tensor:
        """``v_c = mean over client c's whole train split of phi_c(x, y)`` -> ``[C, d]`` (the
        authors' evaluation descriptor)."""
        embed = self.embed(phi.shape[-1])
        out = []
        for i, c in enumerate(group.client_ids):
            total = None
            idx = group.data.train_idx[c]
            for part in idx.split(1024):
                x, y = group.data.batch(part)
                z = embed.forward(
                    phi[i], embed.initial_buffers(), with_labels(x, y, self.num_classes)
                )
                assert isinstance(z, Tensor)
                total = z.sum(0) if total is None else total + z.sum(0)
            assert total is not None
            out.append(total / len(idx))
        return torch.stack(out)

    def setup(
        self, stage: int, group: ClientGroup, msg: Payload, state: dict[str, Tensor]
    ) -> tuple[list[Payload], dict[str, Tensor], dict[str, Tensor]]:
        if stage == EVAL_REQUEST:  # the state is left as it was: evaluation changes nothing
            v = self.split_descriptors(group, msg["phi"])
            return [{"v": v[i]} for i in range(group.size)], state, {}
        idx = self.descriptor_batch(group, salt=7)
        v = self.descriptors(group, msg["phi"], idx).detach()
        new_state = {**state, "phi_sent": msg["phi"].clone(), "idx_sent": idx}
        new_state["phi_used"] = torch.zeros_like(msg["phi"])
        return [{"v": v[i]} for i in range(group.size)], new_state, {}

    def fit(
        self, group: ClientGroup, msg: Payload, state: dict[str, Tensor]
    ) -> tuple[Payload, dict[str, Tensor], Tensor]:
        self.embed(msg["phi"].shape[-1])  # built (once) outside the FLOP meter: not round work
        # step 4 for the descriptor the server used last time: (d v / d phi)^T g at its phi
        phi_grad = torch.zeros_like(msg["phi"])
        if bool(msg["gv"].any()):  # zero until the client's second participation
            phi_used = state["phi_used"].clone().requires_grad_(True)
            with torch.enable_grad(), FlopMeter.counting():
                v_used = self.descriptors(group, phi_used, state["idx_used"])
                (phi_grad,) = torch.autograd.grad(v_used, phi_used, msg["gv"].to(v_used.dtype))
        # step 2: train the generated model (skipped for new clients: nothing is learned)
        if bool(msg["train"].reshape(-1)[0]):
            theta, buffers, loss = group.train(msg["theta"], state["buffers"])
        else:
            theta, buffers = msg["theta"], state["buffers"]
            loss = torch.zeros(group.size, device=theta.device)
        # step 1 for the next participation: a fresh descriptor with the received phi
        idx = self.descriptor_batch(group, salt=7)
        with torch.no_grad(), FlopMeter.counting():
            v = self.descriptors(group, msg["phi"], idx)
        new_state = {
            **state,
            "buffers": buffers,
            "phi_used": state["phi_sent"],
            "idx_used": state["idx_sent"],
            "phi_sent": msg["phi"].clone(),
            "idx_sent": idx,
        }
        reply = {"delta": theta - msg["theta"], "v": v, "phi_grad": phi_grad.detach()}
        return reply, new_state, loss

    def eval_model(
        self, group: ClientGroup, msg: Payload, state: Mapping[str, Tensor]
    ) -> tuple[Tensor, Tensor]:
        return msg["theta"], state["buffers"]


ALGORITHM = Algorithm(
    name="pefll",
    summary="PeFLL: embedding network -> client descriptor -> hypernetwork model (Scott et al.)",
    hparams=PeFLLParams,
    server=PeFLLServer,
    client=PeFLLClient,
    homogeneous_only=True,
    reference=f"{AUTHORS}: h's depth (--hyper-nhid) and the evaluation descriptor (current phi "
    "over the train split); the exchange folded into one per round (module docstring)",
    tune={"hn_lr": Space(1e-5, 1e-2, log=True)},  # Adam lr of h and phi
)
