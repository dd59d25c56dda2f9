"""The experiment schema: one validated object from TOML/YAML + ``--set key=value`` overrides.

Every error is a :class:`ConfigError` whose message is one line naming the key and what is
allowed; the CLI prints it and exits with code 2 before any work or any file is written.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np
import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from hyperfed.algorithms import get_algorithm, registry
from hyperfed.data.sources import ArrayDataset, dataset_names, load_dataset
from hyperfed.engine.robust import RobustRule
from hyperfed.errors import ConfigError
from hyperfed.hparams import field_rules, hparam_sources
from hyperfed.models.zoo import model_names

DEFAULT_CONFIG = Path(__file__).parent / "defaults" / "default.toml"


__all__ = ["ConfigError", "ExperimentConfig", "load_config", "to_toml"]


# Upper bounds of the integer settings that drive loops and allocations: far above any real
# experiment (docs/config.md), far below a value that would run forever or exhaust memory
# (rounds = 1e15 was accepted and looped for ever).
MAX_ROUNDS = 1_000_000  # rounds, eval_every, checkpoint_every
MAX_CLIENTS = 1_000_000  # clients.count, defense.byzantine, defense.krum_keep
MAX_EPOCHS = 10_000  # local.epochs
MAX_BATCH = 1_000_000  # local.batch_size
MAX_WORKERS = 1024  # local.workers
MAX_SAMPLES = 10**12  # dataset.subsample, defense.max_samples
MAX_CLASSES = 1_000_000  # partition.classes_per_client
# an algorithm's integer hyperparameters (iterations, widths, epochs): 0 to this
MAX_HPARAM_INT = 10**9


class _Section(BaseModel):
    # NaN / Inf are refused for every float setting (lr = nan, participation = inf)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class DatasetConfig(_Section):
    name: str = "digits"
    data_dir: str | None = None
    # your own data (name = folder | npz | hf_disk): the folder or file to read
    path: str | None = None
    # keyword options of the dataset's loader, e.g. {image_size = 32} for folder,
    # {label_column = "fine_label"} for hf_disk, {num_users = 50} for synthetic
    options: dict[str, Any] | None = None
    # keep a random subset of this many samples
    subsample: int | None = Field(None, ge=10, le=MAX_SAMPLES)

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in dataset_names():
            raise ValueError(f"unknown dataset {v!r}; allowed: {', '.join(dataset_names())}")
        return v

    @field_validator("path")
    @classmethod
    def _absolute(cls, v: str | None) -> str | None:
        # the run directory's config.toml must name the same data from any working directory
        return None if v is None else str(Path(v).expanduser().absolute())

    def load(self) -> ArrayDataset:
        """The :class:`~hyperfed.data.sources.ArrayDataset` this section names (``path`` and
        ``options`` passed to its loader)."""
        extra = {"path": self.path} if self.path is not None else {}
        return load_dataset(self.name, self.data_dir, **{**(self.options or {}), **extra})


SEED_MAX = 2**32 - 1  # the largest run seed (ExperimentConfig.seed)
PARTITION_NAMES = ("quantity", "dirichlet", "pathological", "iid", "natural")


class PartitionConfig(_Section):
    # one of PARTITION_NAMES, or "flwr:<Partitioner>" for a flwr-datasets partitioner
    name: str = "quantity"
    classes_per_client: int = Field(2, ge=1, le=MAX_CLASSES)
    alpha: float = Field(0.5, gt=0)
    test_fraction: float = Field(0.25, gt=0, lt=1)
    val_fraction: float = Field(0.0, ge=0, lt=1)
    # keyword arguments of the flwr-datasets partitioner, e.g. {alpha = 0.3} for
    # flwr:DirichletPartitioner (num_partitions = clients.count, seed = the run's seed and
    # partition_by = "label" are filled in)
    flwr: dict[str, Any] | None = None

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in PARTITION_NAMES and not (v.startswith("flwr:") and len(v) > 5):
            raise ValueError(
                f"allowed: {', '.join(PARTITION_NAMES)} or flwr:<Partitioner> "
                "(e.g. flwr:DirichletPartitioner)"
            )
        return v

    @model_validator(mode="after")
    def _flwr_args(self) -> PartitionConfig:
        if self.flwr and not self.name.startswith("flwr:"):
            raise ValueError(
                f"partition.flwr holds a flwr-datasets partitioner's arguments, but "
                f"partition.name = {self.name}; set partition.name = flwr:<Partitioner>"
            )
        return self


class ClientsConfig(_Section):
    count: int = Field(10, ge=1, le=MAX_CLIENTS)
    # one name, or a mix; a list as long as ``count`` assigns each client its model explicitly
    models: str | list[str] = "lenet"
    # how a mix is spread: client i gets models[i % len] (round_robin), or a seeded random draw
    # per client (random: pFedES, seed 002 §6.1, assigns models to clients at random)
    assign: Literal["round_robin", "random"] = "round_robin"
    # the last ``len(new_models) and new_count`` clients run these instead (round robin): models
    # no other client has, for held-out clients that join later (seed 000 Fig. 5 with the MH
    # family's new_clients = new_count / count)
    new_models: list[str] = []
    new_count: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _new_clients(self) -> ClientsConfig:
        if bool(self.new_models) != bool(self.new_count):
            raise ValueError("new_models and new_count go together (the held-out clients' models)")
        if self.new_count >= self.count:
            raise ValueError(
                f"new_count {self.new_count} leaves no other client (count {self.count})"
            )
        return self

    @field_validator("models", "new_models")
    @classmethod
    def _known(cls, v: str | list[str], info: ValidationInfo) -> str | list[str]:
        names = [v] if isinstance(v, str) else v
        if not names and info.field_name == "models":
            raise ValueError("give at least one model name")
        for n in names:
            if n not in model_names():
                raise ValueError(f"unknown model {n!r}; allowed: {', '.join(model_names())}")
        return v

    def assignment(self, seed: int = 0) -> list[str]:
        """Each client's model: ``models[i % len(models)]`` (a mix spread evenly, as in the
        papers; a list of ``count`` names is an explicit assignment), or with ``assign =
        "random"`` a uniform draw per client seeded by ``seed``; the last ``new_count`` clients
        run ``new_models`` instead."""
        names = [self.models] if isinstance(self.models, str) else list(self.models)
        n_old = self.count - self.new_count
        if self.assign == "random":
            rng = np.random.default_rng([seed, 1237])
            arch = [names[int(i)] for i in rng.integers(0, len(names), size=n_old)]
        else:
            arch = [names[i % len(names)] for i in range(n_old)]
        return arch + [self.new_models[i % len(self.new_models)] for i in range(self.new_count)]


def _method_schemas(schema: dict[str, Any]) -> None:
    """``hyperfed schema``: each registered method's hyperparameters as ``algorithm.<method>``
    (type, choices, bounds, default; the description says where the default comes from)."""
    props = schema.setdefault("properties", {})
    for name, alg in sorted(registry().items()):
        sub = _hparams_adapter(alg.hparams).json_schema()
        sources = hparam_sources(alg.hparams)
        for field, prop in sub.get("properties", {}).items():
            prop["description"] = sources[field]
        sub.update(title=name, description=alg.summary, additionalProperties=False)
        props[name] = sub


class AlgorithmConfig(BaseModel):
    """``name`` plus the method's hyperparameters (checked against its dataclass).

    Hyperparameters may also sit in a per-method table, ``[algorithm.mh_pfedhngd]``: it
    applies only when that method runs, so one file can serve a sweep over
    ``--set algorithm.name=...``.
    """

    model_config = ConfigDict(extra="allow", json_schema_extra=_method_schemas)
    name: str = "fedavg"

    @property
    def params(self) -> dict[str, Any]:
        extra = dict(self.model_extra or {})
        sections = set(self.sections)
        flat = {k: v for k, v in extra.items() if k not in sections}
        section = extra.get(self.name, {})
        return {**flat, **(section if isinstance(section, dict) else {})}

    @property
    def sections(self) -> list[str]:
        """Per-method tables: tables named after an algorithm (any other table, such as
        ``graph_args``, is a hyperparameter whose value is a table)."""
        extra = self.model_extra or {}
        return [k for k, v in extra.items() if isinstance(v, dict) and k in registry()]


class LocalConfig(_Section):
    """Local SGD; unset values take the algorithm's paper defaults."""

    epochs: int | None = Field(None, ge=1, le=MAX_EPOCHS)
    batch_size: int = Field(64, ge=1, le=MAX_BATCH)
    lr: float | None = Field(None, gt=0)
    momentum: float | None = Field(None, ge=0, lt=1)
    weight_decay: float | None = Field(None, ge=0)
    # on: clients of one architecture in one vmapped step; off: client after client, same
    # functional step; reference: nn.Module + torch.optim.SGD per client (the papers' way)
    vectorize: Literal["auto", "on", "off", "reference"] = "auto"
    # GPU only: replay each local step as one captured CUDA graph (same arithmetic, no
    # per-kernel launch cost); a loss that cannot be captured runs eagerly with a warning.
    # auto: for groups of at most 32 clients, where launches bound the step (a group of 50 is
    # GPU-bound and pays the capture each round; docs/performance.md)
    cuda_graphs: Literal["auto", "on", "off"] = "auto"
    # channels-last (NHWC) activations in the non-vmapped forwards (client loop, evaluation):
    # same arithmetic, faster oneDNN kernels on a CPU (docs/performance.md); auto: on for CPU
    # runs. Not used on a GPU, where the vmapped step cannot use it.
    channels_last: Literal["auto", "on", "off"] = "auto"
    # CPU only: train each round's clients in N worker processes (one torch thread each, the
    # client data in shared memory), each architecture group split into N chunks; the replies
    # are identical to workers = 1 (one process). auto (the default): one per physical core
    # (capped by HYPERFED_CORES), at most one per client trained in a round. On a CPU every
    # hyperfed computation runs on one torch thread, so results do not depend on the worker
    # or thread count (docs/scaling.md)
    workers: int | str = "auto"

    @field_validator("workers", mode="before")
    @classmethod
    def _workers(cls, v: Any) -> int | str:
        if v == "auto" or (
            isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_WORKERS
        ):
            return v  # type: ignore[no-any-return]
        if isinstance(v, str) and v.isdigit() and 1 <= int(v) <= MAX_WORKERS:
            return int(v)
        raise ValueError(f"allowed: auto or a whole number from 1 to {MAX_WORKERS}")

    @model_validator(mode="before")
    @classmethod
    def _removed_compile(cls, data: Any) -> Any:
        """``compile`` (a torch.compile'd client step) was removed: it was slower than the eager
        step wherever measured (docs/performance.md). Its "auto" and "off" ran the eager step,
        so a recorded run's config (``compile = "auto"``) still loads and resumes unchanged."""
        if not isinstance(data, dict) or "compile" not in data:
            return data
        if data["compile"] not in ("auto", "off"):
            raise ValueError(
                "compile was removed (the compiled step measured slower than the eager one, "
                "docs/performance.md); delete the key"
            )
        return {k: v for k, v in data.items() if k != "compile"}


class DefenseConfig(_Section):
    """What the server accepts from a client (docs/config.md, ``[defense]``): bounds on the
    model updates of methods that declare them (``Server.model_updates``: FedAvg's model,
    the MH family's delta) and on the sample count a client declares at join."""

    # reject an update whose L2 norm (a whole model: minus the model sent) exceeds this; auto:
    # 1e6 * (1 + the sent model's norm), far above any trained update, far below 1e12; off: none
    max_update_norm: float | Literal["auto", "off"] = "auto"
    # reject an update whose norm exceeds this multiple of the median norm of the round's
    # updates (rounds with at least 3 updates); off: none
    max_norm_ratio: float | Literal["off"] = 100.0
    # scale every accepted update longer than this down to it (Sun et al. 2019); median: to
    # the median norm of the round's accepted updates; off: none
    clip_update_norm: float | Literal["median", "off"] = "off"
    # the largest sample count a client may declare at join (its FedAvg weight)
    max_samples: int = Field(10**9, ge=1, le=MAX_SAMPLES)
    # how the server combines the clients' models where a method uses FedAvg's rule
    # (Server.average_reply): mean (FedAvg's weighted mean), median / trimmed_mean
    # (coordinate-wise, Yin et al. 2018), krum / multi_krum (Blanchard et al. 2017)
    aggregation: Literal["mean", "median", "trimmed_mean", "krum", "multi_krum"] = "mean"
    # trimmed_mean: the fraction beta dropped at each end, per coordinate
    trim_fraction: float = Field(0.1, ge=0, lt=0.5)
    # krum / multi_krum: f, the number of Byzantine clients assumed (n - f - 2 neighbours)
    byzantine: int = Field(1, ge=0, le=MAX_CLIENTS)
    # multi_krum: m, how many lowest-score models are averaged; auto: n - f of the round
    krum_keep: int | Literal["auto"] = "auto"

    @field_validator("max_update_norm", "max_norm_ratio", "clip_update_norm")
    @classmethod
    def _positive(cls, v: float | str) -> float | str:
        if isinstance(v, str):
            return v
        if isinstance(v, bool) or not v > 0 or v != v or v == float("inf"):
            raise ValueError("must be a number > 0 or off")
        return float(v)

    @field_validator("krum_keep")
    @classmethod
    def _keep(cls, v: int | str) -> int | str:
        if isinstance(v, int) and (isinstance(v, bool) or not 1 <= v <= MAX_CLIENTS):
            raise ValueError(f"must be a whole number from 1 to {MAX_CLIENTS} or auto")
        return v

    def rule(self) -> RobustRule:
        """The aggregation rule a server is built with (``ServerContext.aggregation``)."""
        keep = None if self.krum_keep == "auto" else int(self.krum_keep)
        return RobustRule(self.aggregation, self.trim_fraction, self.byzantine, keep)


ATTACK_KINDS = ("none", "scale", "sign_flip", "gaussian_noise", "label_flip", "sample_count_lie")


class AttackConfig(_Section):
    """A poisoning harness for simulation (docs/robustness.md): which clients attack and how.
    Update attacks change what the attackers' replies carry as model updates
    (``Server.model_updates``); ``label_flip`` their training labels; ``sample_count_lie`` the
    sample count they declare at join."""

    # none | scale (update x scale) | sign_flip (update x -1) | gaussian_noise (update +
    # N(0, noise_std^2) per coordinate) | label_flip (train labels y -> C-1-y) |
    # sample_count_lie (declared num_samples x scale)
    kind: Literal[
        "none", "scale", "sign_flip", "gaussian_noise", "label_flip", "sample_count_lie"
    ] = "none"
    # a fraction of the clients (drawn with the run's seed), or a list of client ids
    clients: float | list[int] = 0.1
    scale: float = 10.0
    noise_std: float = Field(1.0, gt=0)

    @field_validator("clients")
    @classmethod
    def _clients(cls, v: float | list[int]) -> float | list[int]:
        if isinstance(v, list):
            if any(c < 0 for c in v) or len(set(v)) != len(v):
                raise ValueError("client ids must be distinct and >= 0")
            return sorted(v)
        if not 0 <= v < 1:
            raise ValueError("a fraction in [0, 1) or a list of client ids")
        return v

    @field_validator("scale")
    @classmethod
    def _finite(cls, v: float) -> float:
        if v != v or abs(v) == float("inf"):
            raise ValueError("must be a finite number")
        return v


class TrackingConfig(_Section):
    """Experiment tracking beside ``metrics.jsonl`` (docs/runs.md, "Tracking"): the resolved
    config as parameters and every evaluated round's scalar metrics (step = round) to MLflow
    and / or Weights & Biases; ``pip install 'hyperfed[tracking]'``."""

    mlflow: bool = False
    # an MLflow tracking URI; "" = a local file store in ./mlruns (the current directory when the
    # run starts, kept for its resumes in the run directory's tracking.json)
    mlflow_uri: str = ""
    wandb: bool = False
    # offline: W&B's files in <run dir>/wandb/ (upload later with `wandb sync`); online: upload
    wandb_mode: Literal["offline", "online"] = "offline"
    # the MLflow experiment and the W&B project
    experiment: str = Field("hyperfed", min_length=1)


class ExperimentConfig(_Section):
    dataset: DatasetConfig = DatasetConfig()
    partition: PartitionConfig = PartitionConfig()
    clients: ClientsConfig = ClientsConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    local: LocalConfig = LocalConfig()
    rounds: int = Field(20, ge=1, le=MAX_ROUNDS)
    participation: float = Field(1.0, gt=0, le=1)
    eval_every: int = Field(5, ge=1, le=MAX_ROUNDS)
    checkpoint_every: int | None = Field(None, ge=1, le=MAX_ROUNDS)
    # numpy's seeded generators take no negative seeds; torch's take < 2**64, and seeds derived
    # from this one (seed * 1_000_003 + ...) must stay below that: 32 bits, as numpy's legacy
    seed: int = Field(0, ge=0, le=SEED_MAX)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    tensorboard: bool = False
    tracking: TrackingConfig = TrackingConfig()
    defense: DefenseConfig = DefenseConfig()
    attack: AttackConfig = AttackConfig()

    @model_validator(mode="after")
    def _attackers_exist(self) -> ExperimentConfig:
        ids = self.attack.clients
        if isinstance(ids, list) and ids and max(ids) >= self.clients.count:
            raise ValueError(
                f"attack.clients: client {max(ids)} does not exist "
                f"(clients.count = {self.clients.count})"
            )
        return self

    def hparams(self) -> Any:
        """The algorithm's hyperparameter dataclass, filled from ``[algorithm]``."""
        return build_hparams(self.algorithm)


@functools.cache
def _hparams_adapter(cls: type) -> TypeAdapter[Any]:
    return TypeAdapter(cls)


def build_hparams(algorithm: AlgorithmConfig) -> Any:
    """The method's hyperparameter dataclass from ``[algorithm]``: each value checked against
    its field's annotation (type, ``Literal`` choices, ``Annotated`` bounds), then the
    dataclass's ``__post_init__`` (rules across fields); a :class:`ConfigError` naming the
    key otherwise."""
    alg = get_algorithm(algorithm.name)
    for section in algorithm.sections:
        if section not in registry():
            raise ConfigError(
                f"algorithm.{section}: not an algorithm name; per-method tables are "
                f"named after one of: {', '.join(registry())}"
            )
    allowed = {f.name for f in dataclasses.fields(alg.hparams)}
    for key, value in algorithm.params.items():
        if key not in allowed:
            close = difflib.get_close_matches(key, allowed, n=3)
            if isinstance(value, dict):  # a per-method table with a mistyped name?
                close += difflib.get_close_matches(key, registry(), n=3)
            hint = f"did you mean {' or '.join(close)}? " if close else ""
            raise ConfigError(
                f"algorithm.{key}: unknown key for {alg.name}; {hint}allowed: "
                f"{', '.join(sorted(allowed)) or '(none)'}"
            )
    table = (algorithm.model_extra or {}).get(algorithm.name)
    keys = {k: f"algorithm.{alg.name}.{k}" for k in table} if isinstance(table, dict) else {}
    hp = validate_hparams(alg.hparams, algorithm.params, keys)
    for f in dataclasses.fields(hp):
        value = getattr(hp, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(
                f"algorithm.{f.name}: must be a finite number (not nan or inf; got {value!r})"
            )
        # counts, sizes, iterations, epochs: no method gives a negative one a meaning
        is_int = isinstance(value, int) and not isinstance(value, bool)
        if is_int and not 0 <= value <= MAX_HPARAM_INT:
            raise ConfigError(
                f"algorithm.{f.name}: allowed: a whole number from 0 to {MAX_HPARAM_INT} "
                f"(got {value})"
            )
        is_rate = f.name == "lr" or f.name.endswith("_lr")
        if is_rate and isinstance(value, int | float) and not value > 0:
            raise ConfigError(f"algorithm.{f.name}: a learning rate must be > 0 (got {value!r})")
    return hp


# pydantic's error types of a value outside a field's Literal or Annotated bounds
_RULE_ERRORS = (
    "literal_error",
    "greater_than",
    "greater_than_equal",
    "less_than",
    "less_than_equal",
)


def validate_hparams(
    cls: type, values: Mapping[str, Any], keys: Mapping[str, str] | None = None
) -> Any:
    """Hyperparameter dataclass ``cls`` from ``values``: each value checked against its field's
    annotation (type, ``Literal`` choices, ``Annotated`` bounds), then ``cls.__post_init__``
    (rules across fields). A :class:`ConfigError` of one line otherwise, naming the key as
    ``keys`` spells it (default ``algorithm.<field>``)."""
    try:
        return _hparams_adapter(cls).validate_python(dict(values))
    except ValidationError as err:
        e = err.errors()[0]
        if not e["loc"]:  # a rule across fields (the dataclass's __post_init__)
            raise ConfigError(f"algorithm: {e['msg'].removeprefix('Value error, ')}") from None
        field = str(e["loc"][0])
        key = (keys or {}).get(field, f"algorithm.{field}")
        rule = field_rules(cls).get(field)
        got = e.get("input")
        if isinstance(got, float) and not math.isfinite(got):
            raise ConfigError(
                f"{key}: must be a finite number (not nan or inf; got {got!r})"
            ) from None
        if (
            rule is not None
            and rule.integer
            and "le" not in rule.bounds
            and "lt" not in rule.bounds
        ):
            # every integer hyperparameter is capped at MAX_HPARAM_INT (build_hparams)
            rule = dataclasses.replace(rule, bounds={**rule.bounds, "le": MAX_HPARAM_INT})
        if rule is not None and e["type"] in _RULE_ERRORS:
            msg = f"allowed: {rule.describe()} (got {e['input']!r})"
        else:
            msg = _one_line(err).split(": ", 1)[1]
        raise ConfigError(f"{key}: {msg}") from None
    except (TypeError, ValueError) as e:  # raised in a __post_init__ outside pydantic's reach
        raise ConfigError(f"algorithm: {e}") from None


def _section_keys(loc: tuple[Any, ...]) -> list[str]:
    """The keys the config section holding ``loc`` accepts (for "did you mean")."""
    model: Any = ExperimentConfig
    for part in loc[:-1]:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        model = field.annotation
    return list(getattr(model, "model_fields", {}))


def _field(loc: tuple[Any, ...]) -> Any:
    """The pydantic field at ``loc`` (None where there is none: an extra key, a list item)."""
    model: Any = ExperimentConfig
    field = None
    for part in loc:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return None
        model = field.annotation
    return field


def _allowed_range(loc: tuple[Any, ...]) -> str | None:
    """The range of an integer field with both bounds, in words (None for any other field)."""
    field = _field(loc)
    if field is None or field.annotation not in (int, int | None):
        return None
    low = high = None
    for m in field.metadata:
        low = getattr(m, "ge", low)
        high = getattr(m, "le", high)
    if low is None or high is None:
        return None
    return f"a whole number from {low} to {high}"


# pydantic's error types of a number out of a field's range, or an integer too large to parse
_RANGE_ERRORS = ("greater_than_equal", "less_than_equal", "int_parsing_size", "int_from_float")


def _one_line(err: ValidationError) -> str:
    e = err.errors()[0]
    key = ".".join(str(p) for p in e["loc"]) or "config"
    msg = e["msg"].removeprefix("Value error, ")
    bounds = _allowed_range(tuple(e["loc"])) if e["type"] in _RANGE_ERRORS else None
    if bounds is not None:
        msg = f"allowed: {bounds}"
    elif e["type"] == "finite_number":
        msg = "must be a finite number (not nan or inf)"
    elif e["type"] == "int_parsing_size":  # beyond 64 bits, in a field without a declared range
        msg = "a whole number far too large"
    elif e["type"] == "extra_forbidden":
        allowed = _section_keys(tuple(e["loc"]))
        close = difflib.get_close_matches(str(e["loc"][-1]), allowed, n=3)
        msg = "unknown key"
        if close:
            msg += f"; did you mean {' or '.join(close)}?"
        if allowed:
            msg += f"{'' if close else ';'} allowed: {', '.join(allowed)}"
    elif e["type"] == "literal_error":
        msg = msg.replace("Input should be", "allowed:")
    got = e.get("input")
    if e["type"] != "extra_forbidden" and not isinstance(got, dict):
        msg += f" (got {got!r})"
    return f"{key}: {msg}"


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b=c`` strings to a nested dict (values parsed as TOML, else kept as text)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key=value, e.g. --set rounds=10")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(p.strip() for p in parts):
            raise ConfigError(f"--set {item!r}: expected key=value, e.g. --set rounds=10")
        node = raw
        for p in parts[:-1]:
            child = node.setdefault(p, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {key}: {p} is not a section")
            node = child
        node[parts[-1]] = _parse_value(value.strip())
    return raw


def read_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        raise ConfigError(
            f"config file {path} is a directory; --config expects a TOML or YAML file"
        )
    if path.exists() and not path.is_file():
        raise ConfigError(f"config file {path} is not a regular file; give a TOML or YAML file")
    if not path.is_file():
        raise ConfigError(f"config file {path} not found")
    try:
        text = path.read_bytes().decode("utf-8-sig")  # a byte-order mark is allowed
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"config file {path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} on line {line}); "
            "save it as UTF-8"
        ) from None
    except OSError as e:
        raise ConfigError(f"config file {path}: cannot read it ({e.strerror})") from None
    try:
        if path.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text) or {}
        else:
            data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:  # its message names line and column
        raise ConfigError(f"config file {path}: {str(e).splitlines()[0]}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"config file {path}{where}: {problem}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a table of settings at the top level")
    return data


# What a ``[per_method.<name>]`` table may set: the method's schedule and local SGD.
PER_METHOD_KEYS = ("rounds", "eval_every", "participation", "local")


def resolve_per_method(raw: dict[str, Any]) -> dict[str, Any]:
    """Merge the running method's ``[per_method.<name>]`` table into ``raw`` and drop the
    tables (every one is checked). Its keys replace the file's: ``rounds`` and the others
    whole, ``local`` key by key. One file can so give each method of a paper table its own
    schedule (seed 003 §4: FedAvg 200 rounds x 10 epochs, pFedHN 500 x 1, ...)."""
    tables = raw.pop("per_method", None)
    if tables is None:
        return raw
    if not isinstance(tables, dict):
        raise ConfigError(
            "per_method: expected tables named after methods, e.g. [per_method.fedavg]"
        )
    allowed = ", ".join(PER_METHOD_KEYS)
    for name, table in tables.items():
        if name not in registry():
            raise ConfigError(
                f"per_method.{name}: not an algorithm name; per-method tables are named after "
                f"one of: {', '.join(registry())}"
            )
        if not isinstance(table, dict):
            raise ConfigError(f"per_method.{name}: expected a table of {allowed}")
        for key in table:
            if key not in PER_METHOD_KEYS:
                raise ConfigError(f"per_method.{name}.{key}: unknown key; allowed: {allowed}")
        try:  # types and ranges, with the main schema's messages
            ExperimentConfig.model_validate(table)
        except ValidationError as e:
            raise ConfigError(f"per_method.{name}.{_one_line(e)}") from None
    algorithm = raw.get("algorithm", {})
    name = algorithm.get("name", AlgorithmConfig().name) if isinstance(algorithm, dict) else None
    for key, value in tables.get(name, {}).items():
        local = raw.get("local")
        raw[key] = {**local, **value} if key == "local" and isinstance(local, dict) else value
    return raw


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None
) -> ExperimentConfig:
    """The file (default: the package's default config) with ``--set`` overrides; the running
    method's ``[per_method.<name>]`` table applies, and an explicit ``--set`` of the same key
    (``--set rounds=10``) wins over it."""
    overrides = overrides or []
    raw = resolve_per_method(apply_overrides(read_file(path or DEFAULT_CONFIG), overrides))
    again = [o for o in overrides if not o.strip().startswith("per_method")]
    return config_from_dict(apply_overrides(raw, again))


def config_from_dict(raw: dict[str, Any]) -> ExperimentConfig:
    """Validate a nested dict of settings (a parsed config file) into an ExperimentConfig
    (with the running method's ``[per_method.<name>]`` table applied)."""
    raw = resolve_per_method(raw)
    try:
        cfg = ExperimentConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_one_line(e)) from None
    try:
        cfg.hparams()
    except KeyError as e:
        raise ConfigError(f"algorithm.name: {e.args[0]}") from None
    if cfg.dataset.subsample is not None and cfg.partition.name == "natural":
        raise ConfigError("dataset.subsample: cannot be combined with partition.name = natural")
    return cfg


def flat_keys(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"local": {"lr": 0.1}}`` -> ``{"local.lr": 0.1}`` (the ``--set`` spelling of keys)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flat_keys(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def nested_keys(flat: dict[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`flat_keys`."""
    tree: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def to_toml(cfg: ExperimentConfig) -> str:
    """Resolved config as TOML (written into every run directory; tomli-w writes it)."""
    import tomli_w

    return tomli_w.dumps(_drop_none(cfg.model_dump(exclude_none=True)))


def _drop_none(value: Any) -> Any:
    """TOML has no null: unset keys are left out (at any depth)."""
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple):
        return [_drop_none(v) for v in value]
    return value
