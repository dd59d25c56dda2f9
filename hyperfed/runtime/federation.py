"""A federation built from a config: the one place every runtime builds it (issue 38).

:class:`Federation` turns an :class:`~hyperfed.config.ExperimentConfig` into what each side of a
run needs -- the algorithm and its hyperparameters, local SGD, each client's architecture and
the architecture groups, the models, the seeded client and server roles, the clients' initial
state, a :class:`~hyperfed.algorithms.base.ClientGroup`, and the round driver. The simulator,
its worker processes (``local.workers``), a Flower node and the Flower server all call it, so
a node's client and the server start exactly as in the simulator.

Seeding, the same on every machine for the same config:

* a model: ``seed * 1000 + i``, ``i`` its architecture's position among the sorted names
  (:meth:`Federation.models`);
* a role: ``seed``, right before it is constructed (:meth:`Federation.client_role`,
  :meth:`Federation.server_role`), so a server never depends on whether this process built a
  client role first;
* the clients' initial state: ``seed``, then the architecture groups in order, each group's
  ``Client.init_states`` drawn in one call (:meth:`Federation.initial_states`; the global random
  state around it is left as it was). A Flower node replays the groups up to its own and keeps
  its row, so a method that draws per group position (DisPFL's masks, pFedKT's hypernetworks)
  gives the node the simulator's draw.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from hyperfed.algorithms import get_algorithm
from hyperfed.algorithms.base import (
    Algorithm,
    Client,
    ClientContext,
    ClientGroup,
    Payload,
    Server,
    ServerContext,
)
from hyperfed.config import ConfigError, ExperimentConfig
from hyperfed.data.federated import FederatedData, federate
from hyperfed.engine.local import SGDConfig
from hyperfed.models.layout import FunctionalModel
from hyperfed.models.zoo import ModelInputError, build_model, check_input
from hyperfed.runtime.driver import RoundDriver, Transport
from hyperfed.runtime.gossip import Gossip

__all__ = [
    "SGD_DEFAULTS",
    "Federation",
    "build_models",
    "check_architectures",
    "client_groups",
    "execution_path",
    "load_federation",
    "resolve_device",
    "resolve_sgd",
    "use_channels_last",
]

# Local SGD defaults when neither the config nor the algorithm sets them (seed 000 §4.1).
SGD_DEFAULTS = {"lr": 1e-3, "momentum": 0.9, "weight_decay": 1e-4, "epochs": 2}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device: cuda requested but no CUDA device is available; use auto or cpu")
    return torch.device(name)


def resolve_sgd(cfg: ExperimentConfig, algorithm_defaults: dict[str, Any]) -> SGDConfig:
    values = {**SGD_DEFAULTS, **algorithm_defaults}
    for key in ("lr", "momentum", "weight_decay", "epochs"):
        v = getattr(cfg.local, key)
        if v is not None:
            values[key] = v
    return SGDConfig(
        batch_size=cfg.local.batch_size,
        cuda_graphs=cfg.local.cuda_graphs,
        **values,
    )


def execution_path(cfg: ExperimentConfig, device: torch.device) -> tuple[bool, bool]:
    """(vectorize, reference) for ``local.vectorize``. "auto": one vmapped step per group on
    a GPU; client after client on a CPU, where per-step overhead dominates and batched
    convolutions do not pay (`hyperfed bench`; docs/performance.md)."""
    mode = cfg.local.vectorize
    return mode == "on" or (mode == "auto" and device.type == "cuda"), mode == "reference"


def use_channels_last(cfg: ExperimentConfig, device: torch.device) -> bool:
    """``local.channels_last``; "auto" = on for CPU runs (the only device it was measured on)."""
    mode = cfg.local.channels_last
    return mode == "on" or (mode == "auto" and device.type == "cpu")


def check_architectures(algorithm: Algorithm, arch_of: list[str]) -> None:
    """A method that serves one architecture refuses a mix (one line: how to fix it)."""
    if algorithm.homogeneous_only and len(set(arch_of)) > 1:
        raise ConfigError(
            f"clients.models: {algorithm.name} needs one architecture for all clients "
            f"(got {sorted(set(arch_of))}); set clients.models to a single name"
        )


def load_federation(
    cfg: ExperimentConfig, device: torch.device, clients: list[int] | None = None
) -> FederatedData:
    """The config's dataset split over ``clients.count`` clients: the same partition on every
    machine for the same config and seed (the simulator and each Flower client call this).
    ``clients``: keep only their samples (:meth:`FederatedData.only`; a Flower node's own)."""
    ds = cfg.dataset.load()
    for name in set(cfg.clients.assignment(cfg.seed)):
        try:
            check_input(name, ds.input_shape)
        except ModelInputError as e:
            raise ConfigError(f"clients.models: {e}") from None
    p = cfg.partition
    data = federate(
        ds,
        cfg.clients.count,
        p.name,
        classes_per_client=p.classes_per_client,
        alpha=p.alpha,
        flwr_args=p.flwr,
        test_fraction=p.test_fraction,
        val_fraction=p.val_fraction,
        seed=cfg.seed,
        subsample=cfg.dataset.subsample,
        device=device if clients is None else "cpu",
    )
    return data if clients is None else data.only(clients).to(device)


def build_models(
    cfg: ExperimentConfig,
    input_shape: tuple[int, ...],
    num_classes: int,
    device: torch.device,
    only: str | Iterable[str] | None = None,
) -> dict[str, FunctionalModel]:
    """One model per architecture in the config, seeded by its sorted position (``only``:
    just that architecture, or those, each initialized as in the full set)."""
    wanted = {only} if isinstance(only, str) else None if only is None else set(only)
    models: dict[str, FunctionalModel] = {}
    for i, name in enumerate(sorted(set(cfg.clients.assignment(cfg.seed)))):
        if wanted is not None and name not in wanted:
            continue
        torch.manual_seed(cfg.seed * 1000 + i)
        module = build_model(name, input_shape, num_classes).to(device)
        models[name] = FunctionalModel(module, name)
    return models


def client_groups(arch_of: list[str]) -> dict[str, list[int]]:
    """Client ids per architecture, in order of first appearance."""
    groups: dict[str, list[int]] = {}
    for cid, name in enumerate(arch_of):
        groups.setdefault(name, []).append(cid)
    return groups


class Federation:
    """What a config says about a federation, resolved once for one machine (``device``):
    the algorithm, hyperparameters, local SGD, architectures and groups, execution path; and
    the builders of models, roles, initial client state, client groups and the round driver.
    Nothing here needs the data itself: pass its input shape and number of classes."""

    def __init__(self, cfg: ExperimentConfig, device: torch.device | None = None) -> None:
        self.cfg = cfg
        self.device = resolve_device(cfg.device) if device is None else device
        self.algorithm = get_algorithm(cfg.algorithm.name)
        self.hp = cfg.hparams()
        self.sgd = resolve_sgd(cfg, self.algorithm.local_defaults)
        self.arch_of = cfg.clients.assignment(cfg.seed)
        check_architectures(self.algorithm, self.arch_of)
        self.groups = client_groups(self.arch_of)
        self.vectorize, self.reference = execution_path(cfg, self.device)
        self.nhwc = use_channels_last(cfg, self.device)

    @property
    def decentralized(self) -> bool:
        return self.algorithm.kind == "decentralized"

    @property
    def _rng_devices(self) -> list[torch.device]:
        """The devices whose random state :func:`torch.random.fork_rng` saves and restores."""
        return [self.device] if self.device.type == "cuda" else []

    @property
    def order(self) -> list[int]:
        """The fixed order replies are aggregated in: architecture groups, then client id."""
        return [c for members in self.groups.values() for c in members]

    # -- data and models -------------------------------------------------------------------
    def load_data(self, clients: list[int] | None = None) -> FederatedData:
        """The federation's data on this machine's device (``clients``: only theirs)."""
        return load_federation(self.cfg, self.device, clients)

    def models(
        self,
        input_shape: tuple[int, ...],
        num_classes: int,
        only: str | Iterable[str] | None = None,
    ) -> dict[str, FunctionalModel]:
        """Every architecture's model (``only``: those), seeded as in :func:`build_models`;
        the random state outside is left as it was."""
        with torch.random.fork_rng(devices=self._rng_devices):
            return build_models(self.cfg, input_shape, num_classes, self.device, only)

    def group(
        self, fm: FunctionalModel, cids: list[int], data: FederatedData, rnd: int
    ) -> ClientGroup:
        """The :class:`ClientGroup` of ``cids`` (all of ``fm``'s architecture) in round ``rnd``."""
        return ClientGroup(
            fm, cids, data, rnd, self.cfg.seed, self.sgd, self.vectorize, self.reference
        )

    # -- roles and state -------------------------------------------------------------------
    def client_role(self, input_shape: tuple[int, ...], num_classes: int) -> Client:
        """The algorithm's client role, built right after seeding with the run's seed."""
        torch.manual_seed(self.cfg.seed)
        ctx = ClientContext(self.cfg.seed, self.device, num_classes, input_shape)
        return self.algorithm.client(self.hp, ctx)

    def joins(
        self, client: Client, models: Mapping[str, FunctionalModel], train_sizes: list[int]
    ) -> dict[int, Payload]:
        """Every client's ``Client.join`` payload (what the server learns before round 1)."""
        return {
            cid: client.join(models[arch], train_sizes[cid])
            for cid, arch in enumerate(self.arch_of)
        }

    def server_role(
        self,
        joins: dict[int, Payload],
        models: dict[str, FunctionalModel],
        input_shape: tuple[int, ...],
        num_classes: int,
    ) -> Server:
        """The algorithm's server role for these joins, built right after seeding."""
        cfg = self.cfg
        ctx = ServerContext(
            cfg.seed,
            self.device,
            num_classes,
            input_shape,
            models,
            cfg.rounds,
            self.sgd,
            aggregation=cfg.defense.rule(),
        )
        torch.manual_seed(cfg.seed)
        return self.algorithm.server(self.hp, joins, ctx)

    def groups_through(self, cid: int) -> list[str]:
        """The architecture groups whose initial state is drawn up to (and with) ``cid``'s."""
        names = list(self.groups)
        return names[: names.index(self.arch_of[cid]) + 1]

    def initial_states(
        self,
        client: Client,
        models: Mapping[str, FunctionalModel],
        cids: Iterable[int] | None = None,
    ) -> dict[int, dict[str, Tensor]]:
        """The initial persistent state of every client (``cids``: of those), by client id:
        ``Client.init_states`` of each architecture group in order, after seeding with the
        run's seed; the random state outside is left as it was. ``models`` needs the
        architectures of :meth:`groups_through` the last wanted client."""
        want = set(range(len(self.arch_of)) if cids is None else cids)
        store: dict[int, dict[str, Tensor]] = {}
        with torch.random.fork_rng(devices=self._rng_devices):
            torch.manual_seed(self.cfg.seed)
            for name, members in self.groups.items():
                if not want - store.keys():
                    break
                state = client.init_states(models[name], members)
                for i, cid in enumerate(members):
                    if cid in want:
                        store[cid] = {k: v[i].to(self.device) for k, v in state.items()}
        return dict(sorted(store.items()))

    # -- the round driver ------------------------------------------------------------------
    def driver(self, server: Server, transport: Transport) -> RoundDriver:
        """The round driver of this federation over ``transport`` (a decentralized method
        gossips over the config's graph instead of aggregating: :mod:`hyperfed.runtime.gossip`)."""
        cfg = self.cfg
        gossip = Gossip(self.hp, cfg.clients.count, cfg.seed) if self.decentralized else None
        return RoundDriver(
            server,
            transport,
            num_clients=cfg.clients.count,
            participation=cfg.participation,
            seed=cfg.seed,
            arch_of=self.arch_of,
            order=self.order,
            gossip=gossip,
            groups=list(self.groups.values()),
            validate=cfg.partition.val_fraction > 0,
            scores=self.algorithm.scored_model(self.hp),
            defense=cfg.defense,
        )
