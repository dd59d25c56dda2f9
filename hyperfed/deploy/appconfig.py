"""The Flower app's configuration, read by the ServerApp and the ClientApp and written by the
launcher: hyperfed's run-config keys (:class:`RunSettings`), the experiment carried as
run-config keys, which clients a node serves (its node config), and the app folder.

One run-config key is one field of :class:`RunSettings`: the app folder writes it with its
default, ``flwr run --run-config`` overrides it, and both apps read it from there. This module
imports no ``flwr``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import Field, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hyperfed.config import ConfigError, config_from_dict, flat_keys, nested_keys

if TYPE_CHECKING:
    from hyperfed.algorithms.base import Algorithm
    from hyperfed.config import ExperimentConfig

# the Flower app's components (the ServerApp and ClientApp objects, hyperfed.deploy.flower)
SERVERAPP = "hyperfed.deploy.flower:server_app"
CLIENTAPP = "hyperfed.deploy.flower:client_app"
# node config keys: one client (partition-id), or several (partition-ids: "0-9", "0,3,5")
PARTITION_ID, PARTITION_IDS, NUM_PARTITIONS = "partition-id", "partition-ids", "num-partitions"
BUILD_LOG_ENV = "HYPERFED_BUILD_LOG"  # a file: one line per node built (pid, run, clients)


@dataclass(frozen=True)
class RunSettings:
    """hyperfed's own run-config keys, one field each (the key: the field's name hyphenated;
    the experiment's keys use dots and underscores). Read with :meth:`from_run_config`,
    written with :meth:`to_run_config`."""

    # where the ServerApp writes metrics.jsonl / summary.md on the SuperLink's machine ("":
    # runs/<time>-flower-<algorithm> under the SuperLink's working folder)
    run_dir: str = ""
    # how many SuperNodes the server waits for (0: every client served, ceil(clients.count / G))
    min_nodes: int = 0
    join_timeout: float = 300.0  # seconds the server waits for them
    round_timeout: float = 600.0  # seconds the server waits for one exchange's replies
    resume: bool = False  # continue the run directory's last checkpoint
    # G: a simulated SuperNode k (node config partition-id=k, num-partitions=ceil(N/G)) serves
    # clients k*G .. k*G+G-1: Flower's Simulation Engine numbers its nodes, not their clients
    clients_per_node: int = 1

    def to_run_config(self) -> dict[str, Any]:
        """The run-config keys, each value of its field's type (what a TOML file holds)."""
        return {run_key(f.name): _kind(f)(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> RunSettings:
        """The settings in a run config (a key it lacks: the default; a clients-per-node
        below 1: 1)."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            key, kind = run_key(f.name), _kind(f)
            if key in run_config:
                try:
                    values[f.name] = kind(run_config[key])
                except (TypeError, ValueError):
                    raise ConfigError(
                        f"run config {key}={run_config[key]!r}: not a valid {kind.__name__}"
                    ) from None
        settings = cls(**values)
        if settings.clients_per_node < 1:
            return cls(**{**values, "clients_per_node": 1})
        return settings


def _kind(f: Field[Any]) -> type:
    """A :class:`RunSettings` field's type (that of its default: bool, int, float or str)."""
    return type(f.default)


def run_key(name: str) -> str:
    """The run-config key of a :class:`RunSettings` field."""
    return name.replace("_", "-")


RC_JSON_KEYS = "json-keys"  # experiment keys whose value is JSON text (lists, unset values)
RUN_KEYS = (*(run_key(f.name) for f in fields(RunSettings)), RC_JSON_KEYS)


def experiment_run_config(cfg: ExperimentConfig) -> dict[str, Any]:
    """The experiment as Flower run-config keys, one per setting (``rounds``,
    ``algorithm.name``, ``local.lr``, ...), so ``flwr run APP --run-config "rounds=50"``
    changes it. Flower's values are bool / int / float / str: a list or an unset value is
    JSON text, its key listed under ``json-keys``."""
    flat = flat_keys(cfg.model_dump())
    json_keys = sorted(k for k, v in flat.items() if v is None or isinstance(v, list | tuple))
    out = {k: json.dumps(v) if k in json_keys else v for k, v in flat.items()}
    out[RC_JSON_KEYS] = ",".join(json_keys)
    return out


def experiment_from_run_config(run_config: dict[str, Any]) -> dict[str, Any]:
    """The nested experiment dict back from (flat or nested) run-config keys: hyperfed's run
    keys dropped, JSON text of ``json-keys`` decoded (a plain string stays a string, so
    ``--run-config 'clients.models="lenet"'`` works too)."""
    flat = flat_keys(run_config)
    json_keys = set(filter(None, str(flat.get(RC_JSON_KEYS, "")).split(",")))
    settings: dict[str, Any] = {}
    for key, value in flat.items():
        if key in RUN_KEYS:
            continue
        if key in json_keys and isinstance(value, str):
            with contextlib.suppress(json.JSONDecodeError):
                value = json.loads(value)
        if value is not None:
            settings[key] = value
    return nested_keys(settings)


def config_from_run_config(run_config: dict[str, Any]) -> ExperimentConfig:
    """The experiment config carried in the run config, one key per setting (validated like
    ``hyperfed run``; ``flwr run --run-config "rounds=50"`` overrides one)."""
    cfg = config_from_dict(experiment_from_run_config(run_config))
    check_deployable(cfg)  # flwr run --run-config "attack.kind='scale'": refused here too
    return cfg


def check_deployable(cfg: ExperimentConfig) -> None:
    """Refuse what only the simulator does: the poisoning harness (``[attack]``) changes the
    simulated clients' replies; a deployment's clients are real nodes, so it would be
    silently ignored there. Raises a one-line :class:`~hyperfed.config.ConfigError`."""
    if cfg.attack.kind != "none":
        raise ConfigError(
            f"attack.kind = {cfg.attack.kind}: the poisoning harness ([attack]) is "
            "simulation-only (hyperfed run); a Flower deployment's clients are real nodes. "
            "Remove [attack] (or set attack.kind = none) to deploy"
        )


def flower_algorithm(cfg: ExperimentConfig) -> Algorithm:
    """The config's algorithm; Flower runs every kind: a centralized one with a server that
    aggregates, a decentralized one with a server that only relays neighbours' payloads.
    A config only the simulator can run (:func:`check_deployable`) is refused."""
    from hyperfed.algorithms import get_algorithm
    from hyperfed.runtime.federation import check_architectures

    check_deployable(cfg)
    algorithm = get_algorithm(cfg.algorithm.name)
    check_architectures(algorithm, cfg.clients.assignment(cfg.seed))
    return algorithm


# -- which clients a node serves ---------------------------------------------------------
def parse_partition_ids(text: object, num_partitions: int) -> list[int]:
    """The client ids of a node config's ``partition-ids``: ranges and single ids separated by
    commas ("0-9", "0,3,5", "0-4,9"), each in [0, num_partitions), none twice; sorted.
    Raises :class:`~hyperfed.config.ConfigError` with a one-line message on bad input."""
    spec = str(text).strip()

    def bad(why: str) -> ConfigError:
        return ConfigError(
            f"node config partition-ids={spec!r}: {why}; write ids and ranges in "
            f"[0, {num_partitions}) separated by commas, e.g. '0-9' or '0,3,5' or '0-4,9'"
        )

    if not spec:
        raise bad("empty")
    ids: list[int] = []
    for part in spec.split(","):
        lo, dash, hi = part.strip().partition("-")
        try:
            a = int(lo)
            b = int(hi) if dash else a
        except ValueError:
            raise bad(f"{part.strip()!r} is not an integer or a range a-b") from None
        if b < a:
            raise bad(f"range {part.strip()!r} runs backwards")
        if a < 0 or b >= num_partitions:
            raise bad(f"{part.strip()!r} is out of range")
        ids.extend(range(a, b + 1))
    if len(set(ids)) != len(ids):
        twice = sorted({i for i in ids if ids.count(i) > 1})
        raise bad(f"ids {twice} appear more than once")
    return sorted(ids)


def format_partition_ids(ids: Sequence[int]) -> str:
    """Inverse of :func:`parse_partition_ids` (sorted, runs written as ranges)."""
    out: list[str] = []
    ids = sorted(ids)
    start = 0
    for k in range(1, len(ids) + 1):
        if k == len(ids) or ids[k] != ids[k - 1] + 1:
            a, b = ids[start], ids[k - 1]
            out.append(str(a) if a == b else f"{a}-{b}")
            start = k
    return ",".join(out)


def node_groups(num_clients: int, clients_per_node: int) -> list[list[int]]:
    """Clients 0..N-1 in consecutive groups of ``clients_per_node`` (the last may be shorter):
    node ``k`` serves ``k*G .. min(k*G+G, N)-1``; ceil(N/G) nodes."""
    if clients_per_node < 1:
        raise ValueError(f"clients_per_node={clients_per_node}: must be >= 1")
    g = clients_per_node
    return [list(range(k, min(k + g, num_clients))) for k in range(0, num_clients, g)]


def check_node_config(node_config: Mapping[str, Any]) -> None:
    if NUM_PARTITIONS not in node_config or (
        PARTITION_IDS not in node_config and PARTITION_ID not in node_config
    ):
        raise ConfigError(
            "node config needs partition-id (or partition-ids) and num-partitions, e.g. "
            "flower-supernode --node-config 'partition-id=0 num-partitions=10'"
        )


def node_clients(
    node_config: Mapping[str, Any], cfg: ExperimentConfig, clients_per_node: int = 1
) -> list[int]:
    """The client ids a node serves, from its node config: ``partition-ids`` (a list, e.g.
    "0-9", "0,3,5", "0-4,9"; ``num-partitions`` must be ``clients.count``), or one
    ``partition-id`` -- of ``clients.count`` partitions, or, with the run's
    ``clients-per-node`` G, of ceil(clients.count / G) node groups (Flower's Simulation Engine
    numbers its simulated nodes so): node ``k`` serves ``k*G .. k*G+G-1``."""
    check_node_config(node_config)
    n = cfg.clients.count
    m = int(node_config[NUM_PARTITIONS])
    if PARTITION_IDS in node_config:
        if m != n:
            raise ConfigError(
                f"node config num-partitions={m} but clients.count={n}: every node must "
                "split the data as the config does"
            )
        return parse_partition_ids(node_config[PARTITION_IDS], n)
    cid = int(node_config[PARTITION_ID])
    groups = node_groups(n, clients_per_node) if clients_per_node > 1 else None
    if m == n or groups is None or m != len(groups):
        if m != n:
            grouped = "" if groups is None else f" (nor {len(groups)} node groups)"
            raise ConfigError(
                f"node config num-partitions={m} but clients.count={n}{grouped}: every node "
                "must split the data as the config does"
            )
        if not 0 <= cid < n:
            raise ConfigError(f"node config partition-id={cid} not in [0, {n})")
        return [cid]
    if not 0 <= cid < m:
        raise ConfigError(f"node config partition-id={cid} not in [0, {m})")
    return groups[cid]


# -- the app folder -----------------------------------------------------------------------
def write_app(
    app_dir: str | Path,
    cfg: ExperimentConfig,
    settings: RunSettings | None = None,
) -> Path:
    """Write the Flower app folder for an experiment config; returns the folder.

    The app's ``[tool.flwr.app.config]`` holds every setting of the experiment as its own key
    (:func:`experiment_run_config`) beside hyperfed's run keys (``settings``, default
    :class:`RunSettings`'s; deployed nodes name their clients in ``partition-ids``)."""
    import tomli_w

    app = Path(app_dir)
    app.mkdir(parents=True, exist_ok=True)
    run_config = (settings or RunSettings()).to_run_config()
    nested = nested_keys(experiment_run_config(cfg))
    config_table = tomli_w.dumps({"tool": {"flwr": {"app": {"config": {**run_config, **nested}}}}})
    text = f"""# Flower app for hyperfed (written by `hyperfed flower`); run it with `flwr run`.
# Every experiment setting is a run-config key: flwr run APP --run-config "rounds=50"
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "hyperfed-app"
version = "1.0.0"
description = "hyperfed: personalized federated learning with hypernetworks, on Flower"
license = "Apache-2.0"
# hyperfed[flower] must be installed on the SuperLink's and every SuperNode's machine
dependencies = ["hyperfed[flower]"]

[tool.flwr.app]
publisher = "hyperfed"

[tool.flwr.app.components]
serverapp = "{SERVERAPP}"
clientapp = "{CLIENTAPP}"

{config_table}"""
    (app / "pyproject.toml").write_text(text)
    return app
