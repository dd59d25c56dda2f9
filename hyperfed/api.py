"""The Python API: run an experiment from a notebook or a script (issue 56, item 2).

::

    import hyperfed

    result = hyperfed.run(overrides={"rounds": 2, "algorithm.name": "fedavg"})
    result.mean_acc, result.client_acc        # the final round's accuracies
    result.records                            # one metrics row per evaluated round

:func:`run` does what ``hyperfed run`` does -- the same :class:`~hyperfed.runtime.simulate.Simulation`,
the same run directory when ``out`` is given (config, ``metrics.jsonl``, checkpoints, plots,
``summary.md``), through :func:`execute`, which the command line calls too -- and returns a
:class:`RunResult`. ``docs/python.md`` walks through it.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from hyperfed.config import (
    DEFAULT_CONFIG,
    ConfigError,
    ExperimentConfig,
    apply_overrides,
    config_from_dict,
    flat_keys,
    read_file,
    resolve_per_method,
)
from hyperfed.models.adapter import ModelFactory, ModelPartError
from hyperfed.models.zoo import register_model
from hyperfed.progress import LineReporter, Reporter, reporting
from hyperfed.runtime.rundir import RunDir, RunDirError, check_new_run
from hyperfed.runtime.simulate import Simulation
from hyperfed.runtime.tracking import log_artifacts

__all__ = [
    "ConfigLike",
    "Overrides",
    "RunResult",
    "build_simulation",
    "execute",
    "load_config",
    "run",
]

# a config: a TOML / YAML file, a dict of settings (as the file would hold), a config object, or
# None (the packaged default: hyperfed/defaults/default.toml)
ConfigLike = str | Path | Mapping[str, Any] | ExperimentConfig | None
# overrides: {"rounds": 2, "local.lr": 0.1} (or nested dicts), or "key=value" strings as --set
Overrides = Mapping[str, Any] | Sequence[str] | None


@dataclass(frozen=True)
class RunResult:
    """What :func:`run` returns: the final round's accuracies (each client's model on its own
    test split, the headline of DESIGN's "what accuracy means"), every evaluated round's
    metrics row (``records``, the rows of ``metrics.jsonl``; key by key in ``docs/runs.md``),
    the run directory (None without ``out``) and the resolved config."""

    mean_acc: float  # the mean over all clients, final round
    weighted_acc: float  # the sample-weighted mean, final round
    client_acc: tuple[float, ...]  # client i's accuracy, final round (NaN: not evaluated)
    client_arch: tuple[str, ...]  # client i's model name
    run_dir: Path | None
    config: ExperimentConfig = field(repr=False)
    records: tuple[dict[str, Any], ...] = field(repr=False)

    @property
    def final(self) -> dict[str, Any]:
        """The last evaluated round's metrics row."""
        return self.records[-1]

    @property
    def best(self) -> dict[str, Any]:
        """The row with the highest mean accuracy (papers often quote it: label it as such)."""
        return max(self.records, key=lambda r: r["mean_acc"])

    @classmethod
    def of(
        cls, records: Sequence[dict[str, Any]], run_dir: Path | None, cfg: ExperimentConfig
    ) -> RunResult:
        last = records[-1]
        return cls(
            mean_acc=float(last["mean_acc"]),
            weighted_acc=float(last["weighted_acc"]),
            client_acc=tuple(float(a) for a in last["client_acc"]),
            client_arch=tuple(last["client_arch"]),
            run_dir=run_dir,
            config=cfg,
            records=tuple(records),
        )


def _pairs(overrides: Overrides) -> list[tuple[str, Any]]:
    """Overrides as ``(dotted key, value)`` pairs; strings are parsed as ``--set`` parses them."""
    if overrides is None:
        return []
    if isinstance(overrides, Mapping):
        return list(flat_keys(dict(overrides)).items())
    if isinstance(overrides, str):
        overrides = [overrides]
    pairs: list[tuple[str, Any]] = []
    for item in overrides:
        if not isinstance(item, str):
            raise ConfigError(f"overrides: expected 'key=value' strings or a dict; got {item!r}")
        pairs += flat_keys(apply_overrides({}, [item])).items()
    return pairs


def _apply(raw: dict[str, Any], pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    for key, value in pairs:
        *parents, leaf = key.split(".")
        node = raw
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"overrides: {key}: {part} is not a section")
            node = child
        node[leaf] = copy.deepcopy(value)
    return raw


def load_config(config: ConfigLike = None, overrides: Overrides = None) -> ExperimentConfig:
    """A validated config from a file path, a dict of settings (what a config file holds; keys
    it leaves out take the schema's defaults), an :class:`~hyperfed.config.ExperimentConfig`,
    or None (the packaged default, what ``hyperfed run`` runs), with ``overrides`` applied:
    ``{"rounds": 2, "local.lr": 0.1}`` or ``["rounds=2", "local.lr=0.1"]`` (as ``--set``).

    A bad key or value is a :class:`~hyperfed.config.ConfigError` naming the key and what is
    allowed. As on the command line, an override wins over the running method's
    ``[per_method.<name>]`` table."""
    pairs = _pairs(overrides)
    if isinstance(config, ExperimentConfig):
        if not pairs:
            return config
        raw = config.model_dump(exclude_none=True)
    elif config is None or isinstance(config, str | Path):
        raw = read_file(config or DEFAULT_CONFIG)
    elif isinstance(config, Mapping):
        raw = copy.deepcopy(dict(config))
    else:
        raise ConfigError(
            f"config: expected a file path, a dict, an ExperimentConfig or None; got "
            f"{type(config).__name__}"
        )
    raw = resolve_per_method(_apply(raw, pairs))
    return config_from_dict(
        _apply(raw, [(k, v) for k, v in pairs if k.split(".")[0] != "per_method"])
    )


def build_simulation(cfg: ExperimentConfig) -> Simulation:
    """The :class:`~hyperfed.runtime.simulate.Simulation` of ``cfg`` (``hyperfed run`` and
    :func:`run`); a model that lacks what the method needs is a one-line error naming both."""
    try:
        return Simulation(cfg)
    except ModelPartError as e:
        raise ModelPartError(f"{cfg.algorithm.name}: {e}") from None


def execute(
    sim: Simulation,
    run_dir: RunDir | None,
    start: int = 0,
    *,
    on_round: Callable[[int, Any, dict[str, Any] | None], None] | None = None,
    phases: Reporter | None = None,
) -> list[dict[str, Any]]:
    """Run ``sim`` from round ``start`` (``hyperfed run`` and :func:`run`): with a run
    directory, the label-distribution plot first and ``summary.md`` (with its plots) after;
    ``phases`` shows long phases (:mod:`hyperfed.progress`). Returns the evaluation records."""
    from hyperfed.report import LABEL_PLOT, plot_label_distribution, write_summary

    if run_dir is not None:
        plot_label_distribution(sim.data.label_counts(), run_dir.path / LABEL_PLOT)
    try:
        with reporting(phases):
            records = sim.run(run_dir, start_round=start, on_round=on_round)
    except ModelPartError as e:  # e.g. a method that asks a wrapped module for its features
        raise ModelPartError(f"{sim.cfg.algorithm.name}: {e}") from None
    if run_dir is not None:
        write_summary(run_dir.path)
        log_artifacts(sim.cfg, run_dir.path)  # [tracking]: summary.md, plots into MLflow
    return records


@contextlib.contextmanager
def _claimed(out: str | Path | None, force: bool) -> Iterator[RunDir | None]:
    """``out`` held as a new run directory for the run (None: no directory)."""
    if out is None:
        yield None
        return
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise RunDirError(f"out={str(path)!r} is a file; choose a folder")
    run_dir = RunDir(path)
    with run_dir.locked():
        check_new_run(path, force, resume=f"hyperfed run --resume {path}")
        yield run_dir


def _model_name(model: ModelFactory) -> str:
    return str(getattr(model, "__name__", None) or type(model).__name__)


def run(
    config: ConfigLike = None,
    *,
    overrides: Overrides = None,
    out: str | Path | None = None,
    model: str | ModelFactory | None = None,
    progress: bool = True,
    force: bool = False,
) -> RunResult:
    """Run one experiment in this process and return its :class:`RunResult`.

    :param config: a config file, a dict of settings, an ExperimentConfig, or None for the
        packaged default (:func:`load_config`).
    :param overrides: settings over the config, ``{"rounds": 2, "local.lr": 0.1}`` or
        ``["rounds=2"]``.
    :param out: a run directory to write (as ``hyperfed run --out``: config.toml,
        metrics.jsonl, checkpoints, plots, summary.md); None writes nothing.
    :param model: every client's model: a model name, or a factory ``(input_shape,
        num_classes) -> nn.Module`` (e.g. an ``nn.Module`` class), registered under its
        ``__name__`` as :func:`~hyperfed.models.zoo.register_model` does (default head: its
        last ``nn.Linear``; register it yourself to name another).
    :param progress: print one line per evaluated round (and for long phases).
    :param force: write over a run already in ``out``.
    """
    pairs = _pairs(overrides)
    if model is not None:
        if isinstance(model, nn.Module):
            raise ConfigError(
                "model: pass a factory (input_shape, num_classes) -> nn.Module, e.g. the "
                "class, not a built module: every client gets its own"
            )
        name = model if isinstance(model, str) else register_model(_model_name(model), model)
        pairs.append(("clients.models", name))
    cfg = load_config(config, dict(pairs) if pairs else None)
    with _claimed(out, force) as run_dir:
        sim = build_simulation(cfg)
        on_round, phases = _printer(sim) if progress else (None, None)
        try:
            records = execute(sim, run_dir, on_round=on_round, phases=phases)
        finally:
            if isinstance(phases, LineReporter):
                phases.close()
    return RunResult.of(records, None if run_dir is None else run_dir.path, cfg)


def _printer(
    sim: Simulation,
) -> tuple[Callable[[int, Any, dict[str, Any] | None], None], LineReporter]:
    """Plain lines (a notebook's output cell, a log): the setting, then one per evaluation."""
    cfg = sim.cfg
    groups = ", ".join(f"{len(c)}x {n}" for n, c in sim.groups.items())
    print(
        f"{cfg.algorithm.name} on {cfg.dataset.name}: {cfg.clients.count} clients ({groups}), "
        f"{cfg.rounds} rounds, device {sim.device}",
        flush=True,
    )
    t0 = time.perf_counter()

    def on_round(rnd: int, result: Any, record: dict[str, Any] | None) -> None:
        if record is not None:
            print(
                f"round {rnd}/{cfg.rounds}: mean acc {record['mean_acc']:.4f} "
                f"({time.perf_counter() - t0:.1f} s)",
                flush=True,
            )

    return on_round, LineReporter(lambda line: print(line, flush=True))
