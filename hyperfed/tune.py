"""``hyperfed tune``: a method's hyperparameters tuned on the clients' validation split.

Every method gets the same search: its local learning rate plus the one or two hyperparameters
its paper tunes, declared beside its hyperparameters (``Algorithm.tune``, a name -> :class:`Space`
map), with the same number of trials for every method. A trial is one run of the config with
the trial's values; its score is the mean over clients of their validation accuracy at the
final round (intermediate validation accuracies feed Optuna's median pruner). **The test split
is never evaluated while tuning**: the trial runs only evaluate ``"val"``. A trial whose training
diverges (a client's loss non-finite, or an update rejected) is pruned at that round instead of
running its remaining rounds: ``reproduce`` would not rank such a run ("unsound"), so its score
cannot be the best; ``trials.json`` records the round (``diverged_round``). A new study's trial 0
runs the config's own values (``config_default`` in ``trials.json``, ``default_trial`` in
``tune.json``), so a tuned row is never below the default row on validation; the sampler draws
the rest.

The study lives in its folder (``study.db``, SQLite), so a killed study resumes: finished and
pruned trials are kept, a trial that was running when the study died is run again with the same
values. ``--parallel K`` runs K worker processes on the same storage, drawing trials from one
budget (a worker whose trial was pruned early takes the next; none starts more than the study
lacks). Output in the folder:
``best.toml`` (a config fragment: ``hyperfed run --config best.toml`` runs on top of nothing, so
merge it or pass its lines with ``--set``), ``trials.json`` and Optuna's own plots
(``optimization_history.png``, ``param_importances.png``).
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import math
import multiprocessing as mp
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hyperfed.errors import HyperfedError
from hyperfed.hparams import Space

if TYPE_CHECKING:
    import optuna

    from hyperfed.config import ExperimentConfig

STUDY_DB = "study.db"
CLAIM_LOCK = "claim.lock"  # workers take trials one at a time under it (claim_trial)
STUDY_NAME = "hyperfed"
# every method tunes its local learning rate on this log-uniform range (the papers' lrs span
# 1e-3 .. 0.1; the CPU configs use 0.01 .. 0.05)
LOCAL_LR = Space(1e-3, 0.3, log=True)
# trials.json / user attribute marking trial 0: the config's own values
CONFIG_DEFAULT = "config_default"
# the validation share a config without one is given for tuning
DEFAULT_VAL_FRACTION = 0.15


class TuneError(HyperfedError, ValueError):
    """A bad tuning request (one line, for the CLI)."""


class TrainingDiverged(Exception):
    """A trial's round ended with a non-finite client loss or a rejected update."""

    def __init__(self, round: int, reason: str) -> None:
        super().__init__(f"round {round}: {reason}")
        self.round = round


def search_space(algorithm_name: str, hparams: Any = None) -> dict[str, Space]:
    """The ``--set`` keys a method's study varies: ``local.lr`` (where its training reads it
    under ``hparams``, the method's defaults when None) and its ``Algorithm.tune``."""
    from hyperfed.algorithms import get_algorithm

    alg = get_algorithm(algorithm_name)
    hp = alg.hparams() if hparams is None else hparams
    local = {"local.lr": LOCAL_LR} if alg.tunes_local_lr(hp) else {}
    return local | {f"algorithm.{alg.name}.{k}": space for k, space in alg.tune.items()}


@dataclass(frozen=True)
class TuneRequest:
    """What a study tunes: the config (file + ``--set``), the trials and the pruning."""

    config: str | Path | None
    sets: tuple[str, ...]
    trials: int
    seed: int = 0  # the sampler's seed (the runs use the config's seed)

    def base_config(self) -> ExperimentConfig:
        from hyperfed.config import load_config

        cfg = load_config(self.config, list(self.sets))
        if cfg.partition.val_fraction == 0:
            cfg = load_config(
                self.config, [*self.sets, f"partition.val_fraction={DEFAULT_VAL_FRACTION}"]
            )
        return cfg

    def trial_config(self, values: dict[str, Any]) -> ExperimentConfig:
        from hyperfed.config import load_config

        base = self.base_config()
        sets = [*self.sets, f"partition.val_fraction={base.partition.val_fraction}"]
        return load_config(self.config, sets + [f"{k}={v}" for k, v in values.items()])


def config_default_trial(
    cfg: ExperimentConfig, space: dict[str, Space]
) -> tuple[dict[str, Any] | None, str]:
    """The values the config itself runs with, for every key the study searches: a new study's
    trial 0, so that the tuned row is never below the default one on validation. ``(None,
    why)`` where a value cannot be a trial (unset, or outside its search space)."""
    from hyperfed.algorithms import get_algorithm
    from hyperfed.runtime.federation import resolve_sgd

    alg = get_algorithm(cfg.algorithm.name)
    hp = cfg.hparams()
    local_lr = resolve_sgd(cfg, alg.local_defaults).lr
    values: dict[str, Any] = {}
    for key, s in space.items():
        name = key.rsplit(".", 1)[1]
        value = local_lr if key == "local.lr" else getattr(hp, name)
        if value is None and alg.unset_value is not None:
            value = alg.unset_value(hp, name, local_lr)
        if not s.contains(value):
            return None, f"{key} = {value!r} is outside its search space {s.describe()}"
        values[key] = value if s.choices or s.integer else float(value)
    return values, ""


def optuna_distribution(space: Space) -> Any:
    """The Optuna distribution of a :class:`Space`."""
    from optuna.distributions import (
        CategoricalDistribution,
        FloatDistribution,
        IntDistribution,
    )

    if space.choices:
        return CategoricalDistribution(list(space.choices))
    if space.integer:
        return IntDistribution(int(space.low), int(space.high), log=space.log)
    return FloatDistribution(space.low, space.high, log=space.log)


def suggest(trial: optuna.Trial, space: dict[str, Space]) -> dict[str, Any]:
    """The trial's value for every key of ``space``."""
    out: dict[str, Any] = {}
    for key, s in space.items():
        if s.choices:
            out[key] = trial.suggest_categorical(key, list(s.choices))
        elif s.integer:
            out[key] = trial.suggest_int(key, int(s.low), int(s.high), log=s.log)
        else:
            out[key] = trial.suggest_float(key, s.low, s.high, log=s.log)
    return out


def validation_curve(
    cfg: ExperimentConfig,
    report: Callable[[int, float], None] | None = None,
    stop_on_divergence: bool = True,
) -> float:
    """Run ``cfg`` without a run directory, evaluating only the validation split every
    ``eval_every`` rounds and after the last; ``report(round, val_mean_acc)`` after each (it
    may raise to stop the run). Returns the final round's validation mean accuracy. With
    ``stop_on_divergence``, raises :class:`TrainingDiverged` after the first round whose
    training loss was non-finite or whose updates were rejected."""
    from hyperfed.runtime.simulate import Simulation

    if cfg.partition.val_fraction <= 0:
        raise TuneError("partition.val_fraction is 0: tuning needs a validation split")
    sim = Simulation(cfg)
    try:
        sim.run_setup()
        acc = math.nan
        for rnd in range(1, cfg.rounds + 1):
            result = sim.run_round(rnd)
            if stop_on_divergence and (result.nonfinite_loss or result.rejected):
                reason = (
                    "non-finite training loss"
                    if result.nonfinite_loss
                    else f"{len(result.rejected)} update(s) rejected"
                )
                raise TrainingDiverged(rnd, reason)
            if rnd % cfg.eval_every == 0 or rnd == cfg.rounds:
                acc = float(sim.evaluate("val")["mean_acc"])
                if report is not None:
                    report(rnd, acc)
        return acc
    finally:
        sim.close()


def _objective(request: TuneRequest, space: dict[str, Space]) -> Callable[[Any], float]:
    import optuna

    def objective(trial: optuna.Trial) -> float:
        values = suggest(trial, space)

        def report(rnd: int, acc: float) -> None:
            trial.report(acc, rnd)
            if trial.should_prune():
                raise optuna.TrialPruned(f"round {rnd}: val acc {acc:.4f} below the median")

        try:
            acc = validation_curve(request.trial_config(values), report)
        except TrainingDiverged as diverged:
            trial.set_user_attr("diverged_round", diverged.round)
            raise optuna.TrialPruned(f"training diverged at {diverged}") from None
        if not math.isfinite(acc):
            raise optuna.TrialPruned("non-finite validation accuracy")
        return acc

    return objective


def open_study(folder: Path, request: TuneRequest, worker: int = 0) -> optuna.Study:
    """The study in ``folder`` (created on first use). Its sampler is seeded from the request's
    seed, the trials already in the study and the worker's index, so a resumed study or a
    second worker draws new points instead of repeating the first ones."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        study_name=STUDY_NAME,
        storage=f"sqlite:///{folder / STUDY_DB}",
        direction="maximize",
        load_if_exists=True,
        pruner=optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=0),
    )
    seed = (request.seed * 1_000_003 + len(study.trials) * 7919 + worker * 104_729) % 2**31
    study.sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=5)
    return study


def _done(study: optuna.Study) -> int:
    from optuna.trial import TrialState

    return sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in study.trials)


def requeue_interrupted(study: optuna.Study) -> int:
    """Trials left RUNNING by a killed study: marked failed and their values queued again (so
    the resumed study runs them, and repeats no finished one). Returns how many."""
    from optuna.trial import TrialState

    stale = [t for t in study.trials if t.state == TrialState.RUNNING]
    for t in stale:
        study._storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
        study.enqueue_trial(t.params, skip_if_exists=False)
    return len(stale)


def claim_trial(study: optuna.Study, folder: Path, trials: int) -> optuna.Trial | None:
    """A new trial of ``study`` for this worker, or None once the study holds ``trials``
    finished or running ones. The count and the ask happen under a lock on ``folder``, so
    workers share one budget: a worker whose trials are pruned early takes the next one
    instead of idling, and together they never start more than ``trials``."""
    from optuna.trial import TrialState

    counted = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)
    with open(folder / CLAIM_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            used = sum(t.state in counted for t in study.get_trials(deepcopy=False))
            return study.ask() if used < trials else None
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _worker(folder: str, request: TuneRequest, space: dict[str, Space], worker: int) -> None:
    """One process of ``--parallel``: claims trials (:func:`claim_trial`) until the study
    holds ``request.trials``, so it ends with exactly that many whatever each trial costs."""
    import optuna
    import torch
    from optuna.trial import TrialState

    torch.set_num_threads(1)
    study = open_study(Path(folder), request, worker)
    objective = _objective(request, space)
    while (trial := claim_trial(study, Path(folder), request.trials)) is not None:
        try:
            value = objective(trial)
        except optuna.TrialPruned:
            study.tell(trial, state=TrialState.PRUNED)
        except BaseException:
            study.tell(trial, state=TrialState.FAIL)
            raise
        else:
            study.tell(trial, value)


def require_optuna() -> None:
    """A one-line TuneError where Optuna (the ``tune`` extra; `make run` does not install it)
    is missing: called before any work, by ``tune`` and by ``reproduce --tuned``."""
    if importlib.util.find_spec("optuna") is None:
        raise TuneError("tuning needs Optuna, which is not installed; pip install 'hyperfed[tune]'")


def study_identity(meta: dict[str, Any]) -> dict[str, Any]:
    """What makes two studies the same: config, search space and the ``--set`` overrides of
    keys the study does not search (every trial sets the searched ones itself, so a target
    whose fixed ``local.lr`` changed still owns its finished lr study)."""
    searched = set(meta.get("space") or ())
    sets = [s for s in meta.get("sets") or () if s.split("=", 1)[0] not in searched]
    return {**meta, "sets": sets}


def tune(
    folder: Path,
    request: TuneRequest,
    parallel: int = 1,
    on_progress: Callable[[int, int, str], None] | None = None,
) -> dict[str, Any]:
    """Run (or resume) the study in ``folder`` until it holds ``request.trials`` finished
    trials; write ``best.toml``, ``trials.json`` and the plots. Returns the best values."""
    require_optuna()
    if request.trials < 1:
        raise TuneError(f"--trials {request.trials}: need at least 1")
    if parallel < 1:
        raise TuneError(f"--parallel {parallel}: need at least 1")
    cfg = request.base_config()  # config errors surface here, before any work
    space = search_space(cfg.algorithm.name, cfg.hparams())
    folder.mkdir(parents=True, exist_ok=True)
    meta = folder / "tune.json"
    wanted = {"config": str(request.config), "sets": list(request.sets), "space": sorted(space)}
    before = json.loads(meta.read_text()) if meta.exists() else {}
    same_study = study_identity({k: before.get(k) for k in wanted}) == study_identity(wanted)
    if before and not same_study:
        raise TuneError(
            f"{folder}: holds a study of another config or search space; "
            "choose another --out or delete it"
        )
    study = open_study(folder, request)
    default_trial = before.get("default_trial")
    if not study.trials:  # a new study: trial 0 runs the config's own values
        values, why = config_default_trial(cfg, space)
        if values is not None:
            study.enqueue_trial(values, user_attrs={CONFIG_DEFAULT: True})
        default_trial = values if values is not None else f"not run: {why}"
    meta.write_text(
        json.dumps({**wanted, "trials": request.trials, "default_trial": default_trial}, indent=1)
    )
    requeue_interrupted(study)
    if on_progress is not None:
        on_progress(_done(study), request.trials, "")
    if parallel == 1:
        from optuna.study import MaxTrialsCallback
        from optuna.trial import FrozenTrial, TrialState

        stop = MaxTrialsCallback(request.trials, states=(TrialState.COMPLETE, TrialState.PRUNED))

        def progress(study: optuna.Study, trial: FrozenTrial) -> None:
            if on_progress is not None:
                on_progress(_done(study), request.trials, _trial_line(trial))

        if _done(study) < request.trials:
            study.optimize(_objective(request, space), callbacks=[stop, progress])
    else:  # K processes on the same storage; this one watches
        ctx = mp.get_context("spawn")
        missing = max(0, request.trials - _done(study))
        procs = [
            ctx.Process(target=_worker, args=(str(folder), request, space, i + 1))
            for i in range(min(parallel, missing))
        ]
        for p in procs:
            p.start()
        try:
            while any(p.is_alive() for p in procs):
                if on_progress is not None:
                    on_progress(_done(study), request.trials, "")
                time.sleep(1.0)
        finally:
            for p in procs:
                p.join()
        if any(p.exitcode for p in procs):
            raise TuneError(f"a tuning worker failed; the same command resumes {folder}")
    return write_outputs(folder, open_study(folder, request), space)


def _trial_line(trial: optuna.trial.FrozenTrial) -> str:
    value = "pruned" if trial.value is None else f"val {trial.value:.4f}"
    if trial.user_attrs.get(CONFIG_DEFAULT):
        value += " (the config's own values)"
    if "diverged_round" in trial.user_attrs:
        value = f"diverged at round {trial.user_attrs['diverged_round']}"
    return f"trial {trial.number}: {value}"


def write_outputs(folder: Path, study: optuna.Study, space: dict[str, Space]) -> dict[str, Any]:
    """``best.toml``, ``trials.json`` and Optuna's plots for the study in ``folder``."""
    from optuna.trial import TrialState

    trials = [
        {"number": t.number, "state": t.state.name, "value": t.value, "params": t.params}
        | {k: v for k, v in t.user_attrs.items() if k in ("diverged_round", CONFIG_DEFAULT)}
        for t in study.trials
    ]
    (folder / "trials.json").write_text(json.dumps(trials, indent=1))
    complete = [t for t in study.trials if t.state == TrialState.COMPLETE]
    if not complete:
        raise TuneError(f"{folder}: no trial completed (all pruned or failed; see trials.json)")
    best = study.best_trial
    lines = [f"# hyperfed tune: best of {len(complete)} completed trials, val acc {best.value:.4f}"]
    lines += _toml_fragment(best.params)
    (folder / "best.toml").write_text("\n".join(lines) + "\n")
    _plots(folder, study, len(space))
    return {"best": best.params, "value": best.value, "completed": len(complete)}


def _toml_fragment(params: dict[str, Any]) -> list[str]:
    """``local.lr = 0.02`` / ``algorithm.moon.mu = 5`` as TOML tables."""
    tables: dict[str, list[str]] = {}
    for key, value in sorted(params.items()):
        table, _, name = key.rpartition(".")
        tables.setdefault(table, []).append(f"{name} = {json.dumps(value)}")
    out = []
    for table, entries in tables.items():
        out += ["", f"[{table}]", *entries]
    return out


def best_sets(folder: Path) -> list[str]:
    """The best trial's values as ``--set key=value`` strings (from ``trials.json``)."""
    trials = json.loads((folder / "trials.json").read_text())
    done = [t for t in trials if t["state"] == "COMPLETE"]
    if not done:
        raise TuneError(f"{folder}: no completed trial")
    best = max(done, key=lambda t: t["value"])
    return [f"{k}={v}" for k, v in sorted(best["params"].items())]


def _plots(folder: Path, study: optuna.Study, params: int) -> None:
    import warnings

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as ovm

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Optuna marks its matplotlib backend experimental
        ovm.plot_optimization_history(study)
        plt.gcf().savefig(folder / "optimization_history.png", dpi=110, bbox_inches="tight")
        plt.close("all")
        values = {t.value for t in study.trials if t.value is not None}
        if params > 1 and len(values) > 1:  # fANOVA needs some variance in the scores
            ovm.plot_param_importances(study)
            plt.gcf().savefig(folder / "param_importances.png", dpi=110, bbox_inches="tight")
            plt.close("all")
