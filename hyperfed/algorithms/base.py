"""The protocol every algorithm implements (DESIGN contracts 1-3).

An algorithm is a :class:`Server` role and a :class:`Client` role that exchange *payloads*:
dicts of named tensors, and nothing else. The simulator passes them in memory; the Flower
adapter serializes the same dicts. A round is

1. ``Server.configure_train(rnd, ids)`` -> one payload per sampled client;
2. ``Client.fit(group, payload, state)`` for each group of same-architecture clients, with a
   leading client axis on every tensor (a real single client is a group of one);
3. ``Server.aggregate(rnd, replies)`` with the replies that passed validation.

Before the first round each client sends ``Client.join`` (its parameter count and sample
count by default), which is all a server learns about a client's model. An algorithm with a
one-off phase before round 1 (MH-pFedHNDD's distillation) adds *setup* exchanges with every
client: ``Server.configure_setup(stage, ids)`` -> ``Client.setup`` -> ``Server.aggregate_setup``
for stage 0, 1, ... until ``configure_setup`` returns nothing (the default: no setup). The
simulator runs them once, never when resuming; their bytes count into the totals.
Decentralized algorithms replace the server by ``Client.mix`` over a mixing matrix.

**Core and capabilities.** Every method has the core hooks (:data:`SERVER_CORE`,
:data:`CLIENT_CORE`). The rest are opt-in capabilities (:data:`SERVER_CAPABILITIES`,
:data:`CLIENT_CAPABILITIES`): a setup stage, an exchange before evaluation, eligibility and
evaluation groups, inspection for the gradient-inversion harness, heavy phases. ``Server`` and
``Client`` answer a capability's hooks with "not present" (no setup, every client eligible, no
groups, nothing to inspect); a method *has* a capability when it defines one of its hooks
(:meth:`Capability.held_by`). A wrapper that holds another method's role (``plug_in``) forwards
the core and exactly the capabilities the wrapped role has (:func:`forward_hooks`), so a new
hook needs no forwarder written by hand.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from hyperfed.data.federated import FederatedData
from hyperfed.engine.codec import nonfinite_tensor as nonfinite_tensor
from hyperfed.engine.local import (
    BatchPlan,
    LossFn,
    SGDConfig,
    client_seed,
    cross_entropy_loss,
    local_steps,
    plan_batches,
    train_clients,
    train_reference,
)
from hyperfed.engine.representations import shared_join_value as shared_join_value
from hyperfed.engine.robust import RobustRule, robust_average
from hyperfed.hparams import Space as Space
from hyperfed.hparams import chosen as chosen  # re-exported for method files
from hyperfed.hparams import hparam_sources as hparam_sources
from hyperfed.hparams import paper as paper
from hyperfed.models.layout import FunctionalModel

Payload = dict[str, Tensor]
# the setup stage of the exchange run before every evaluation (Server.configure_eval_request)
EVAL_REQUEST = -1


def payload_bytes(payload: Payload) -> int:
    """Bytes a payload occupies on the wire (tensor data only)."""
    return sum(t.numel() * t.element_size() for t in payload.values())


def stack_payloads(payloads: list[Payload]) -> Payload:
    """Every key of the payloads stacked on a leading client axis (:class:`StackedOnRead`, read
    whole)."""
    return dict(StackedOnRead(payloads))


def unstack_payload(payload: Payload, n: int) -> list[Payload]:
    return [{k: v[i] for k, v in payload.items()} for i in range(n)]


class StackedOnRead(Mapping[str, Tensor]):
    """Payloads stacked key by key when a key is first read, not all at once: an evaluation
    reads a client's model and buffers, not its optimizer moments or local hypernetwork
    (pFedKT's HN(large) state is ~220 MB a client, stacked for nothing on every evaluation)."""

    def __init__(self, payloads: list[Payload]) -> None:
        self._payloads = payloads
        self._keys = list(payloads[0]) if payloads else []
        self._stacked: dict[str, Tensor] = {}

    def __getitem__(self, key: str) -> Tensor:
        if key not in self._stacked:
            if key not in self._keys:
                raise KeyError(key)
            self._stacked[key] = torch.stack([p[key] for p in self._payloads])
        return self._stacked[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


@dataclass
class ClientGroup:
    """Participating clients of one architecture, with what local training needs."""

    fm: FunctionalModel
    client_ids: list[int]
    data: FederatedData
    rnd: int
    seed: int
    sgd: SGDConfig
    vectorize: bool = True
    reference: bool = False  # the papers' per-client nn.Module + torch.optim.SGD loop

    @property
    def size(self) -> int:
        return len(self.client_ids)

    @property
    def num_samples(self) -> Tensor:
        sizes = [self.data.train_sizes[c] for c in self.client_ids]
        return torch.tensor(sizes, dtype=torch.float32, device=self.data.x.device)

    def steps(self, epochs: float | None = None) -> int:
        """The group's number of local steps (its longest client's), without drawing a plan."""
        e, b = epochs or self.sgd.epochs, self.sgd.batch_size
        return max(local_steps(len(self.data.train_idx[c]), e, b) for c in self.client_ids)

    def plan(self, epochs: float | None = None, salt: int = 0) -> BatchPlan:
        seeds = [client_seed(self.seed, self.rnd, c, salt) for c in self.client_ids]
        idx = [self.data.train_idx[c] for c in self.client_ids]
        return plan_batches(idx, epochs or self.sgd.epochs, self.sgd.batch_size, seeds)

    def train(
        self,
        theta: Tensor,
        buffers: Tensor,
        *,
        loss_fn: LossFn = cross_entropy_loss,
        ctx: dict[str, Tensor] | None = None,
        trainable: Tensor | None = None,
        sgd: SGDConfig | None = None,
        salt: int = 0,
        fm: FunctionalModel | None = None,
        step_ctx: dict[str, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Local SGD of every client in the group; returns (theta, buffers, mean loss).

        ``fm`` trains another model than the group's own (e.g. a global model every client
        also holds); ``salt`` gives that training its own batch shuffles; ``step_ctx`` holds
        per-step loss extras ``[steps, C, ...]`` (see :func:`train_clients`)."""
        sgd = sgd or self.sgd
        plan = self.plan(sgd.epochs, salt)
        if self.reference:
            if loss_fn is not cross_entropy_loss or ctx or trainable is not None:
                raise ValueError("the reference loop runs plain cross-entropy SGD only")
            model = fm or self.fm
            t, b = train_reference(model.module, model, theta, buffers, self.data, plan, sgd)
            return t, b, torch.full((theta.shape[0],), float("nan"), device=theta.device)
        return train_clients(
            fm or self.fm,
            theta,
            buffers,
            self.data,
            plan,
            sgd,
            loss_fn=loss_fn,
            ctx=ctx,
            trainable=trainable,
            vectorize=self.vectorize,
            step_ctx=step_ctx,
        )


@dataclass
class ServerContext:
    """What the simulator tells a server at construction (never a client's architecture)."""

    seed: int
    device: torch.device
    num_classes: int
    input_shape: tuple[int, ...]
    # the architectures in this federation, for methods whose server owns a model (FedAvg)
    models: dict[str, FunctionalModel] = dataclasses.field(default_factory=dict)
    rounds: int = 0  # planned number of rounds (for methods with phases)
    # the clients' local SGD settings ([local], resolved), for servers whose reference reuses
    # them (FedTGP's server trains at the client lr and batch); None outside a federation
    local: SGDConfig | None = None
    # how average_reply combines the clients' tensors (config [defense] aggregation; default:
    # FedAvg's weighted mean)
    aggregation: RobustRule = dataclasses.field(default_factory=RobustRule)
    # set once average_reply has run (the driver warns when a robust aggregation was asked of a
    # method that never aggregates through it)
    averaged: bool = False

    @property
    def shared_model(self) -> FunctionalModel | None:
        """The one architecture every client runs, if there is only one."""
        return next(iter(self.models.values())) if len(self.models) == 1 else None

    def model_with(self, num_params: int) -> FunctionalModel:
        """The architecture with this parameter count (what a client reports at join)."""
        found = [fm for fm in self.models.values() if fm.num_params == num_params]
        if len(found) != 1:
            raise ValueError(f"{len(found)} architectures have {num_params} parameters")
        return found[0]


@dataclass
class ClientContext:
    """What every client knows: its data's shape and classes, where it computes.
    Algorithms with auxiliary models (a global model, a shared extractor) build them from it
    with :func:`hyperfed.models.zoo.build_model` and :class:`FunctionalModel`."""

    seed: int
    device: torch.device
    num_classes: int
    input_shape: tuple[int, ...]


class Server:
    """Server role. Subclasses keep their state in attributes; nn.Modules, optimizers and
    tensors among them are checkpointed automatically."""

    def __init__(self, hp: Any, clients: dict[int, Payload], ctx: ServerContext) -> None:
        self.hp = hp
        self.clients = clients
        self.ctx = ctx

    def configure_train(self, rnd: int, client_ids: list[int]) -> dict[int, Payload]:
        return {c: {} for c in client_ids}

    def aggregate(self, rnd: int, replies: dict[int, Payload]) -> None:
        return None

    def configure_eval(self, client_ids: list[int]) -> dict[int, Payload]:
        """What each client needs to build its personalized model for evaluation."""
        return {c: {} for c in client_ids}

    def configure_setup(self, stage: int, client_ids: list[int]) -> dict[int, Payload]:
        """Payloads of one-off setup exchange ``stage`` (0, 1, ...) before round 1; an empty
        dict ends the setup. Default: no setup phase."""
        return {}

    def configure_eval_request(self, client_ids: list[int]) -> dict[int, Payload]:
        """Payloads of an exchange run before every evaluation, for a method whose evaluated
        model needs something the clients compute now (PeFLL: a descriptor from the current
        embedding network). Clients answer in ``Client.setup`` at stage :data:`EVAL_REQUEST`;
        replies pass ``check_setup_reply`` and reach ``aggregate_setup`` with that stage, then
        ``configure_eval`` is asked. Not counted in the run's bytes, like the evaluation's own
        messages. Default: no such exchange."""
        return {}

    def check_setup_reply(self, stage: int, client_id: int, reply: Payload) -> str | None:
        """Why a setup reply must be rejected (None if it is fine); default: finite values."""
        return nonfinite_tensor(reply)

    def aggregate_setup(self, stage: int, replies: dict[int, Payload]) -> None:
        return None

    def round_exchanges(self, rnd: int, client_ids: list[int]) -> list[list[int]]:
        """The exchanges round ``rnd`` runs, in order, each a batch of ``client_ids`` whose
        payloads are configured, trained and aggregated together, so a later exchange is sent
        what the earlier ones' aggregation made (seed 000: Alg. 1's client-after-client loop,
        Alg. 2's global-model exchange before it). Default: one exchange with every client."""
        return [list(client_ids)]

    def eligible_clients(self, rnd: int) -> list[int] | None:
        """Clients that may be sampled this round (None: all). Lets a method hold clients
        out of training, e.g. new clients that join later (seed 000 §4.4)."""
        return None

    def eval_groups(self) -> dict[str, list[int]]:
        """Named client subsets whose mean accuracy is reported beside the overall mean."""
        return {}

    def reply_shapes(self, client_id: int) -> dict[str, tuple[int, ...]] | None:
        """What a reply from ``client_id`` must hold, name -> shape, declared once by a method
        (None: not declared; the method's ``check_reply`` checks it). A declared reply with a
        missing, extra or wrongly shaped tensor is rejected by :meth:`check_reply`."""
        return None

    def model_updates(self) -> dict[str, str]:
        """What in a reply is a locally trained model: ``{reply key: key of the model in this
        server's message it was trained from}``. The same key on both sides means the reply
        holds the trained model itself (FedAvg); another key, its difference to the sent model
        (MH-pFedHN's ``delta``; a pruned upload sends ``<key>_idx`` / ``<key>_val``). The
        gradient-inversion harness (``hyperfed attack``) attacks exactly these. Default: none."""
        return {}

    def shared_synthetic(self) -> tuple[Tensor, Tensor] | None:
        """Synthetic images (and labels) the clients uploaded, as the server holds them
        (dataset-distillation methods); ``hyperfed attack`` scores them against the clients'
        training images. Default: none."""
        return None

    def float_dtypes(self, sent: Payload) -> set[torch.dtype]:
        """The float dtypes this server works in: the default dtype, its models' and what it sent."""
        dtypes = {
            torch.get_default_dtype(),
            *(v.dtype for v in sent.values() if v.is_floating_point()),
        }
        ctx = getattr(self, "ctx", None)
        for fm in getattr(ctx, "models", {}).values():
            dtypes.update(p.dtype for p in fm.module.parameters())
        return dtypes

    def validate_reply(self, client_id: int, reply: Payload, sent: Payload) -> str | None:
        """Every check a training reply passes before ``aggregate`` (what the round driver
        calls; methods override :meth:`check_reply`, not this): dtypes, generic for every method
        (:func:`reply_dtype_problem`, against ``sent``, the message the client was sent), then
        the method's ``check_reply``."""
        updates = self.model_updates()
        return reply_dtype_problem(
            reply, sent, updates, self.float_dtypes(sent)
        ) or self.check_reply(client_id, reply)

    def check_reply(self, client_id: int, reply: Payload) -> str | None:
        """Why a reply must be rejected (None if it is fine). Rejected replies never reach
        ``aggregate``, so server state is left as it was (DESIGN contract 6)."""
        declared = self.reply_shapes(client_id)
        if declared is not None:
            if set(reply) != set(declared):
                return f"expected tensors {sorted(declared)}, got {sorted(reply)}"
            for key, shape in declared.items():
                if tuple(reply[key].shape) != shape:
                    return f"{key} has shape {tuple(reply[key].shape)}, expected {shape}"
        return nonfinite_tensor(reply)

    def average_reply(
        self, replies: dict[int, Payload], key: str, ids: list[int] | None = None
    ) -> Tensor:
        """FedAvg's rule on one named tensor of the replies: ``sum_k n_k v_k / sum_k n_k`` over
        ``ids`` (default: every reply), ``n_k`` the sample count each client sent at join -- or
        the robust rule the server was configured with (``ServerContext.aggregation``, config
        ``defense.aggregation``: coordinate-wise median, trimmed mean, Krum, Multi-Krum;
        :mod:`hyperfed.engine.robust`), for every method that aggregates through here."""
        ids = list(replies) if ids is None else ids
        values = torch.stack([replies[c][key] for c in ids])
        n_k = torch.tensor([float(self.clients[c]["num_samples"]) for c in ids])
        ctx = getattr(self, "ctx", None)
        if isinstance(ctx, ServerContext):
            ctx.averaged = True
        rule = getattr(ctx, "aggregation", None)
        return robust_average(values, n_k.to(values.device), rule)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        for name, value in vars(self).items():
            if isinstance(value, nn.Module | torch.optim.Optimizer):
                state[name] = value.state_dict()
            elif isinstance(value, Tensor):
                state[name] = value
            elif (
                isinstance(value, dict)
                and value
                and all(isinstance(v, Tensor) for v in value.values())
            ):
                state[name] = dict(value)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            current = getattr(self, name)
            if isinstance(current, nn.Module | torch.optim.Optimizer):
                current.load_state_dict(value)
            elif isinstance(current, dict):
                setattr(self, name, {k: v.to(self.ctx.device) for k, v in value.items()})
            else:
                setattr(self, name, value.to(current.device))


# -- what a client sends, validated before it touches server state (DESIGN contract 6) ---------
INDEX_SUFFIX, VALUE_SUFFIX = "_idx", "_val"  # a pruned update (engine/codec.py)


def _is_integer(value: Tensor) -> bool:
    return not value.is_floating_point() and not value.is_complex() and value.dtype != torch.bool


def reply_dtype_problem(
    reply: Payload, sent: Payload, updates: Mapping[str, str], floats: set[torch.dtype]
) -> str | None:
    """Why a reply's dtypes must be refused (None if they are fine): a tensor that is neither a
    float nor an integer (bool, complex); a float of a precision the server does not work in
    (``floats``); a model update (``updates``, :meth:`Server.model_updates`) whose values are
    not of the dtype of the model it was trained from, or whose top-k indices are not integers.
    Other integer tensors (class ids, a cluster index) are the method's ``check_reply``'s."""
    for key, value in reply.items():
        if not isinstance(value, Tensor):
            return f"{key} is a {type(value).__name__}, not a tensor"
        if not (value.is_floating_point() or _is_integer(value)):
            return f"{key} has dtype {value.dtype}; expected a float or integer tensor"
        if value.is_floating_point() and value.dtype not in floats:
            want = ", ".join(sorted(str(d) for d in floats))
            return f"{key} has dtype {value.dtype}; expected {want}"
    for name, source in updates.items():
        model = sent.get(source)
        want_float = model.dtype if model is not None and model.is_floating_point() else None
        for key in (name, name + VALUE_SUFFIX):
            update = reply.get(key)
            if update is None:
                continue
            if not update.is_floating_point():
                return f"{key} has dtype {update.dtype}; expected a float update"
            if want_float is not None and update.dtype != want_float:
                return f"{key} has dtype {update.dtype}; the model sent was {want_float}"
        index = reply.get(name + INDEX_SUFFIX)
        if index is not None and not _is_integer(index):
            return f"{name + INDEX_SUFFIX} has dtype {index.dtype}; expected integer indices"
    return None


def update_norms(updates: Mapping[str, str], reply: Payload, sent: Payload) -> dict[str, float]:
    """The L2 norm of each model update a (validated) reply carries, by update name: a whole
    model minus the model sent (FedAvg's ``theta``), a difference (``delta``), or a pruned
    difference's values (``delta_val``). Computed in float64 (a 1e30 entry does not overflow)."""
    out: dict[str, float] = {}
    for name, source in updates.items():
        if name in reply:
            value = reply[name].double()
            if name == source and source in sent:
                value = value - sent[source].double()
        elif name + VALUE_SUFFIX in reply:
            value = reply[name + VALUE_SUFFIX].double()
        else:
            continue
        out[name] = float(torch.linalg.vector_norm(value))
    return out


def sent_model_norm(updates: Mapping[str, str], name: str, sent: Payload) -> float:
    """The L2 norm of the model update ``name`` was trained from (0 if it was not sent)."""
    model = sent.get(updates[name])
    return 0.0 if model is None else float(torch.linalg.vector_norm(model.double()))


def scale_update(
    updates: Mapping[str, str], reply: Payload, sent: Payload, name: str, factor: float
) -> Payload:
    """A copy of ``reply`` whose update ``name`` is ``factor`` times as long (norm clipping:
    a whole model becomes ``sent + factor * (reply - sent)``); the reply is left as it was."""
    out = dict(reply)
    source = updates[name]
    if name in reply:
        value = reply[name]
        if name == source and source in sent:
            base = sent[source].to(value.dtype)
            out[name] = base + (value - base) * factor
        else:
            out[name] = value * factor
    else:
        out[name + VALUE_SUFFIX] = reply[name + VALUE_SUFFIX] * factor
    return out


def check_join(payload: Payload, max_samples: int) -> str | None:
    """Why a client's join must be refused (None if it is fine): ``num_params`` and
    ``num_samples``, where sent, one integer each, at least 1 (a sample count at most
    ``max_samples``: it is the client's FedAvg weight), and nothing non-finite."""
    for key, cap in (("num_params", None), ("num_samples", max_samples)):
        value = payload.get(key)
        if value is None:
            continue
        if not isinstance(value, Tensor) or value.numel() != 1 or not _is_integer(value):
            kind = f"{value.dtype} {tuple(value.shape)}" if isinstance(value, Tensor) else "?"
            return f"{key} must be one integer (got {kind})"
        n = int(value)
        if n < 1 or (cap is not None and n > cap):
            bound = f"[1, {cap}]" if cap is not None else ">= 1"
            return f"{key} = {n} is outside {bound}"
    return nonfinite_tensor(payload)


class GossipServer(Server):
    """The "server" of a decentralized method: no state, no aggregation; it only validates
    what a client sends its neighbours (``reply_shapes``) before the gossip step mixes it."""

    def shapes(self) -> dict[str, tuple[int, ...]]:
        raise NotImplementedError

    def reply_shapes(self, client_id: int) -> dict[str, tuple[int, ...]] | None:
        return self.shapes()


class Client:
    """Client role, written for a group of clients with a leading client axis."""

    # each client of a group computes as it would alone (no arithmetic across the group), so
    # worker processes may cut a group into chunks with bitwise the same results
    # (``local.workers``); False for a role that batches its clients together
    splits_groups: bool = True

    def __init__(self, hp: Any, ctx: ClientContext) -> None:
        self.hp = hp
        self.ctx = ctx

    def join(self, fm: FunctionalModel, num_samples: int) -> Payload:
        """Sent once before training: all the server learns about this client."""
        return {
            "num_params": torch.tensor(fm.num_params, dtype=torch.int64),
            "num_samples": torch.tensor(num_samples, dtype=torch.int64),
        }

    def init_state(self, fm: FunctionalModel, num_clients: int) -> dict[str, Tensor]:
        """Per-client persistent state (stacked). Default: BatchNorm statistics only."""
        return {"buffers": fm.initial_buffers().expand(num_clients, -1).clone()}

    def init_states(self, fm: FunctionalModel, client_ids: list[int]) -> dict[str, Tensor]:
        """The persistent state of these clients (stacked in this order): what the simulator
        and a Flower node call. Default: :meth:`init_state`, the same for every client; a
        method whose clients start differently (DFedHP's per-device start) overrides this."""
        return self.init_state(fm, len(client_ids))

    def fit(
        self, group: ClientGroup, msg: Payload, state: dict[str, Tensor]
    ) -> tuple[Payload, dict[str, Tensor], Tensor]:
        """Local work for a group; returns (reply, new state, mean training loss per client)."""
        raise NotImplementedError

    def eval_model(
        self, group: ClientGroup, msg: Payload, state: Mapping[str, Tensor]
    ) -> tuple[Tensor, Tensor]:
        """The personalized (theta, buffers) each client is evaluated with."""
        raise NotImplementedError

    def eval_network(self, fm: FunctionalModel) -> Any:
        """The network the (theta, buffers) of :meth:`eval_model` run in: the client's own
        architecture by default; a method that predicts with something else (MAPPER's mixture of
        a local and a global model) returns that, with the same functional interface."""
        return fm

    def mix(
        self, group: ClientGroup, mixed: Payload, state: dict[str, Tensor]
    ) -> dict[str, Tensor]:
        """Decentralized algorithms: write the gossip result ``mixed[k] = sum_j W_ij reply_j[k]``
        into the state (runtime/gossip.py). Default: it replaces the same-named entries."""
        return {**state, **mixed}

    def setup(
        self, stage: int, group: ClientGroup, msg: Payload, state: dict[str, Tensor]
    ) -> tuple[list[Payload], dict[str, Tensor], dict[str, Tensor]]:
        """Setup exchange ``stage`` for a group: (one reply per client, in group order -- their
        shapes may differ between clients --, new state, per-client statistics ``[C]`` to log).
        Only called when the server's ``configure_setup`` sends something."""
        raise NotImplementedError


class PersonalModelClient(Client):
    """A client that keeps its whole model ``theta`` in its own state (starting from the
    architecture's shared initialization) and is evaluated with it: Local, FD, FedProto,
    FML, pFedES, LG-FedAvg, DFedAvg."""

    def init_state(self, fm: FunctionalModel, num_clients: int) -> dict[str, Tensor]:
        state = super().init_state(fm, num_clients)
        state["theta"] = fm.initial_params().expand(num_clients, -1).clone()
        return state

    def eval_model(
        self, group: ClientGroup, msg: Payload, state: Mapping[str, Tensor]
    ) -> tuple[Tensor, Tensor]:
        return state["theta"], state["buffers"]


# -- the protocol: a core every method has, opt-in capabilities ----------------------------------
SERVER_CORE = (
    "configure_train",
    "reply_shapes",
    "check_reply",
    "aggregate",
    "configure_eval",
    "state_dict",
    "load_state_dict",
)
CLIENT_CORE = ("join", "init_state", "init_states", "fit", "eval_model", "eval_network")


@dataclass(frozen=True)
class Capability:
    """An opt-in part of the protocol: hooks a role defines only when it has the feature (the
    base class answers them with "not present")."""

    name: str
    hooks: tuple[str, ...]
    role: type  # Server or Client: whose defaults mean "not present"

    def held_by(self, role: object) -> bool:
        """Whether ``role`` (an instance or a class) defines one of the hooks itself."""
        cls = role if isinstance(role, type) else type(role)
        return any(
            getattr(cls, hook, None) is not getattr(self.role, hook, None) for hook in self.hooks
        )


SETUP_STAGE = Capability(
    "setup stage", ("configure_setup", "check_setup_reply", "aggregate_setup"), Server
)
EVAL_EXCHANGE = Capability("exchange before evaluation", ("configure_eval_request",), Server)
CLIENT_GROUPS = Capability(
    "eligibility and evaluation groups", ("eligible_clients", "eval_groups"), Server
)
INSPECTION = Capability(
    "inspection (hyperfed attack)", ("model_updates", "shared_synthetic"), Server
)
SEVERAL_EXCHANGES = Capability("rounds of several exchanges", ("round_exchanges",), Server)
SERVER_CAPABILITIES = (SETUP_STAGE, EVAL_EXCHANGE, CLIENT_GROUPS, INSPECTION, SEVERAL_EXCHANGES)
CLIENT_SETUP = Capability("setup stage", ("setup",), Client)
HEAVY_PHASES = Capability("heavy phases (timed before a run)", ("heavy_phases",), Client)
GOSSIP = Capability("gossip (decentralized)", ("mix",), Client)
CLIENT_CAPABILITIES = (CLIENT_SETUP, HEAVY_PHASES, GOSSIP)


def _forwarder(attr: str, hook: str) -> Callable[..., Any]:
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(getattr(self, attr), hook)(*args, **kwargs)

    forward.__name__ = hook
    forward.__doc__ = f"``self.{attr}.{hook}``: the wrapped role's own."
    return forward


def forward_hooks(wrapper: type, attr: str, inner: type) -> list[str]:
    """Give the class ``wrapper`` (which holds a role of class ``inner`` as ``self.<attr>``) a
    forwarder for each core hook and each hook of a capability ``inner`` has, except the hooks
    ``wrapper`` defines itself; a capability ``inner`` lacks keeps the base "not present"
    answer. Returns the forwarded hooks."""
    server = issubclass(inner, Server)
    core = SERVER_CORE if server else CLIENT_CORE
    caps = SERVER_CAPABILITIES if server else CLIENT_CAPABILITIES
    hooks = [*core, *(h for cap in caps if cap.held_by(inner) for h in cap.hooks)]
    own = {h for cls in wrapper.__mro__ if cls not in (Server, Client, object) for h in vars(cls)}
    forwarded = [h for h in hooks if h not in own and hasattr(inner, h)]
    for hook in forwarded:
        setattr(wrapper, hook, _forwarder(attr, hook))
    return forwarded


# What a method's evaluation scores on each client's own test split (``Algorithm.scores``): every
# metrics record, summary and table names it per row, so rows scored differently are not ranked
# as if they were the same measurement. (docs/runs.md, "The metrics record", defines the accuracy itself.)
SCORED_MODELS = {
    "global": "one global model (one per architecture) on every client's test split",
    "personalized": "each client's own personalized model (personal parts, generated or mixed)",
    "local": "each client's model after its latest local training from the global model",
}


@dataclass(frozen=True)
class Algorithm:
    """Registry entry: what `hyperfed list algorithms` shows and the simulator builds."""

    name: str
    summary: str
    hparams: type
    server: type[Server]
    client: type[Client]
    homogeneous_only: bool = False
    local_defaults: dict[str, Any] = dataclasses.field(default_factory=dict)
    kind: str = "centralized"  # or "decentralized"
    # which reference implementation the defaults and mechanics follow where the paper is
    # silent or its codes disagree (e.g. "authors' code (NVlabs/FedFomo)", "PFLlib", "HtFLlib")
    reference: str = ""
    # which model its evaluation scores (a key of SCORED_MODELS), or a function of the
    # hyperparameters for a method whose ``evaluate`` option switches it
    scores: str | Callable[[Any], str] = "personalized"
    # hyperfed tune: the hyperparameters its paper tunes, each with its range (every method
    # whose training reads it also tunes the local lr; hyperfed.tune.search_space)
    tune: dict[str, Space] = dataclasses.field(default_factory=dict)
    # what a tuned hyperparameter left unset (None) runs at, a function of (hyperparameters,
    # name, the resolved [local] lr), so a study's trial 0 (the config's own values) can run
    # it: DFedHP's lr_phi / lr_z are the local lr, pFedKT's hn_lr its mode's default
    unset_value: Callable[[Any, str, float], Any] | None = None
    # whether training reads the [local] lr under these hyperparameters: where it does not
    # (pFedKT end to end trains only its hypernetwork), a study does not search it
    uses_local_lr: Callable[[Any], bool] | None = None

    def tunes_local_lr(self, hp: Any) -> bool:
        """Whether ``hyperfed tune`` searches ``local.lr`` for this method under ``hp``."""
        return self.uses_local_lr is None or self.uses_local_lr(hp)

    def scored_model(self, hp: Any) -> str:
        """The key of :data:`SCORED_MODELS` this method's evaluation scores under ``hp``."""
        scored = self.scores(hp) if callable(self.scores) else self.scores
        if scored not in SCORED_MODELS:
            raise ValueError(f"{self.name}: scores={scored!r}; allowed: {', '.join(SCORED_MODELS)}")
        return scored


def hparam_fields(cls: type) -> dict[str, Any]:
    """Each hyperparameter's default (a ``default_factory`` called)."""
    return {
        f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc,operator]
        for f in dataclasses.fields(cls)
    }
