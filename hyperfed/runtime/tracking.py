"""Experiment tracking beside ``metrics.jsonl`` and TensorBoard: MLflow and Weights & Biases
(``[tracking]`` in the config; ``pip install 'hyperfed[tracking]'``; docs/runs.md, "Tracking").

A run logs its resolved config as parameters (flattened keys: ``local.lr``) and every evaluated
round's scalar metrics (the numbers of its ``metrics.jsonl`` row, step = round); after
``summary.md`` is written, MLflow gets it and the plots as artifacts. The tracked runs' ids are
kept in the run directory (``tracking.json``), so ``hyperfed run --resume`` continues the same
MLflow run and the same W&B run id. :class:`Tracking` is opened by
:meth:`hyperfed.runtime.simulate.Simulation.run` (not yet by the Flower ServerApp).
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hyperfed.errors import ConfigError

if TYPE_CHECKING:
    from hyperfed.config import ExperimentConfig

log = logging.getLogger(__name__)

TRACKING_FILE = "tracking.json"  # in the run directory: {"mlflow": {...}, "wandb": {...}}
EXTRA = "pip install 'hyperfed[tracking]'"


def check_tracking(cfg: ExperimentConfig) -> None:
    """A one-line :class:`~hyperfed.errors.ConfigError` naming the extra when a tracker the
    config asks for is not installed (called before any work is done)."""
    wanted = [name for name in ("mlflow", "wandb") if getattr(cfg.tracking, name)]
    for name in wanted:
        try:
            __import__(name)
        except ImportError:
            raise ConfigError(f"tracking.{name}: the {name} package is missing; {EXTRA}") from None


def mlflow_uri(uri: str) -> str:
    """The tracking URI to use: ``""`` is ``./mlruns`` (absolute, so that a resume from
    another directory finds it); a bare path is made a ``file:`` URI."""
    if not uri:
        return Path("mlruns").resolve().as_uri()
    if "://" not in uri and not uri.startswith("file:"):
        return Path(uri).expanduser().resolve().as_uri()
    return uri


def flat_params(cfg: ExperimentConfig) -> dict[str, str]:
    """The resolved config as ``{"local.lr": "0.05", ...}`` (None as "None")."""
    from hyperfed.config import flat_keys

    return {
        k: json.dumps(v) if isinstance(v, list | dict) else str(v)
        for k, v in flat_keys(cfg.model_dump(mode="json")).items()
    }


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The scalar metrics of a metrics row: numbers (bools as 0 / 1), not ``round``."""
    return {k: float(v) for k, v in record.items() if isinstance(v, int | float) and k != "round"}


class Tracking:
    """The trackers of one run directory, opened at the run's start (``start_round`` 0: new
    tracked runs; later: the ones ``tracking.json`` names, continued)."""

    def __init__(self, cfg: ExperimentConfig, run_dir: Path, start_round: int = 0) -> None:
        check_tracking(cfg)
        self.cfg, self.path = cfg, Path(run_dir)
        self.ids: dict[str, Any] = {}
        if start_round > 0:
            try:
                self.ids = json.loads((self.path / TRACKING_FILE).read_text())
            except (OSError, ValueError):
                self.ids = {}  # a run started without tracking: new tracked runs
        self.mlflow: Any = None
        self.mlflow_run = ""
        self.wandb: Any = None
        params = flat_params(cfg)
        try:
            if cfg.tracking.mlflow:
                self._open_mlflow(params, start_round)
            if cfg.tracking.wandb:
                self._open_wandb(params)
        except BaseException:
            self.close("FAILED")
            raise
        ids = {k: v for k, v in self.ids.items() if k in ("mlflow", "wandb")}
        (self.path / TRACKING_FILE).write_text(json.dumps(ids, indent=1) + "\n")

    # -- MLflow: its client API (no global active run: a process may run several) ------------
    def _open_mlflow(self, params: dict[str, str], start_round: int) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        kept = self.ids.get("mlflow") or {}
        uri = kept.get("tracking_uri") or mlflow_uri(self.cfg.tracking.mlflow_uri)
        if uri.startswith("file:"):  # MLflow 3 keeps its file store behind this switch
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        client = MlflowClient(uri)
        run_id = kept.get("run_id", "") if start_round > 0 else ""
        if run_id:
            try:
                old = client.get_run(run_id).data.params
            except Exception:  # the store was moved or deleted: a new run
                run_id = ""
        if run_id:
            client.update_run(run_id, status="RUNNING")
            # params cannot change in MLflow: a resume with --set rounds=N tags the new value
            new = [Param(k, v) for k, v in params.items() if k not in old]
            for k, v in params.items():
                if k in old and old[k] != v:
                    client.set_tag(run_id, f"resumed.{k}", v)
        else:
            name = self.cfg.tracking.experiment
            exp = client.get_experiment_by_name(name)
            exp_id = exp.experiment_id if exp is not None else client.create_experiment(name)
            tags = {"hyperfed.run_dir": str(self.path.resolve())}
            run_id = client.create_run(exp_id, run_name=self.path.name, tags=tags).info.run_id
            new = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(new), 100):  # MLflow's batch limit
            client.log_batch(run_id, params=new[i : i + 100])
        self.mlflow, self.mlflow_run = client, run_id
        self.ids["mlflow"] = {"tracking_uri": uri, "run_id": run_id}

    # -- Weights & Biases ------------------------------------------------------------------
    def _open_wandb(self, params: dict[str, str]) -> None:
        import wandb

        kept = self.ids.get("wandb") or {}
        run_id = kept.get("id") or secrets.token_hex(4)  # W&B ids: [a-z0-9]
        self.wandb = wandb.init(
            project=kept.get("project") or self.cfg.tracking.experiment,
            id=run_id,
            resume="allow",
            name=self.path.name,
            dir=str(self.path),
            mode=self.cfg.tracking.wandb_mode,
            config={**params, "run_dir": str(self.path.resolve())},
            settings=wandb.Settings(console="off", quiet=True),
            reinit="create_new",
        )
        self.ids["wandb"] = {
            "id": run_id,
            "project": self.wandb.project or self.cfg.tracking.experiment,
        }

    # -- the run ---------------------------------------------------------------------------
    def log(self, rnd: int, record: dict[str, Any]) -> None:
        """One evaluated round's scalar metrics at step ``rnd``. A tracker that fails (a full
        disk, a server gone) is one warning and left out from then on: the run goes on, its
        ``metrics.jsonl`` complete."""
        values = scalars(record)
        if self.mlflow is not None:
            from mlflow.entities import Metric

            now = int(time.time() * 1000)
            metrics = [Metric(k, v, now, rnd) for k, v in values.items()]
            try:
                for i in range(0, len(metrics), 1000):
                    self.mlflow.log_batch(self.mlflow_run, metrics=metrics[i : i + 1000])
            except Exception as e:  # noqa: BLE001
                log.warning("tracking.mlflow: %s; MLflow logs nothing more in this run", e)
                self.mlflow = None
        if self.wandb is not None:
            try:
                self.wandb.log({k: v for k, v in values.items() if not math.isnan(v)}, step=rnd)
            except Exception as e:  # noqa: BLE001
                log.warning("tracking.wandb: %s; W&B logs nothing more in this run", e)
                self.wandb = None

    def close(self, status: str = "FINISHED") -> None:
        """End the tracked runs (``FINISHED``, ``FAILED`` or ``KILLED``); MLflow's stays
        open to artifacts (:func:`log_artifacts`)."""
        if self.mlflow is not None:
            self.mlflow.set_terminated(self.mlflow_run, status=status)
            self.mlflow = None
        if self.wandb is not None:
            self.wandb.finish(exit_code=0 if status == "FINISHED" else 1)
            self.wandb = None


def open_tracking(cfg: ExperimentConfig, run_dir: Path | None, start_round: int) -> Tracking | None:
    """The run's :class:`Tracking`, or None when the config tracks nothing (or the run has no
    directory: then a warning, as nothing could be resumed)."""
    if not (cfg.tracking.mlflow or cfg.tracking.wandb):
        return None
    if run_dir is None:
        log.warning("tracking: the run has no run directory (out=None); nothing is tracked")
        return None
    return Tracking(cfg, run_dir, start_round)


def log_artifacts(cfg: ExperimentConfig, run_dir: Path) -> None:
    """``summary.md`` and the plots of a finished run into its MLflow run (a file copy for a
    local store); nothing without MLflow. A failure is a logged warning: the run is done."""
    if not cfg.tracking.mlflow:
        return
    try:
        ids = json.loads((run_dir / TRACKING_FILE).read_text())["mlflow"]
        from mlflow.tracking import MlflowClient

        client = MlflowClient(ids["tracking_uri"])
        for path in [run_dir / "summary.md", *sorted(run_dir.glob("*.png"))]:
            if path.is_file():
                client.log_artifact(ids["run_id"], str(path))
    except Exception as e:  # noqa: BLE001 (the run's own files are written: report, go on)
        log.warning("tracking.mlflow: could not log summary.md as an artifact: %s", e)
