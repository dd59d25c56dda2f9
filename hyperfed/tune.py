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
import os
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hyperfed.errors import HyperfedError
from hyperfed.hparams import Space
from hyperfed.runtime.cores import CORES_ENV, available_cores

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
# user attribute of a trial that raised (a bug or a crash, not a user error): its one-line cause
TRIAL_ERROR = "error"


class TuneError(HyperfedError, ValueError):
    """A bad tuning request (one line, for the CLI)."""


class NoTrialCompleted(TuneError):
    """Every trial of the study was pruned or failed; ``failed`` names the failed ones."""

    def __init__(self, message: str, failed: list[tuple[str, str]]) -> None:
        super().__init__(message)
        self.failed = failed


class TrialFailed(Exception):
    """A trial raised something other than a :class:`HyperfedError` (recorded, not fatal)."""


def one_line_cause(e: BaseException) -> str:
    """``RuntimeError: <first line> (at hyperfed/x.py:12)``: an exception in one line, with
    the innermost frame it came from."""
    lines = str(e).strip().splitlines()
    text = f"{type(e).__name__}: {lines[0].strip()}" if lines else type(e).__name__
    frames = traceback.extract_tb(e.__traceback__)
    if frames:
        path = frames[-1].filename
        path = path[path.rfind("hyperfed/") :] if "hyperfed/" in path else Path(path).name
        text += f" (at {path}:{frames[-1].lineno})"
    return text


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
        except (HyperfedError, optuna.TrialPruned):
            raise  # a user error stops the study in one line; a pruned trial is pruned
        except Exception as e:  # a bug or a crash in this trial: recorded, the study goes on
            trial.set_user_attr(TRIAL_ERROR, one_line_cause(e))
            raise TrialFailed(str(e)) from e
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


def _ended(trial: optuna.trial.FrozenTrial) -> bool:
    """Whether ``trial`` counts in the budget as ended: completed, pruned, or failed with a
    recorded cause (a trial left failed by a killed study is run again instead)."""
    from optuna.trial import TrialState

    if trial.state == TrialState.FAIL:
        return TRIAL_ERROR in trial.user_attrs
    return trial.state in (TrialState.COMPLETE, TrialState.PRUNED)


def _done(study: optuna.Study) -> int:
    return sum(_ended(t) for t in study.get_trials(deepcopy=False))


def failed_trials(study: optuna.Study) -> list[tuple[str, str]]:
    """``("trial 3", cause)`` for every trial that failed with a recorded cause."""
    return [
        (f"trial {t.number}", t.user_attrs[TRIAL_ERROR])
        for t in study.get_trials(deepcopy=False)
        if TRIAL_ERROR in t.user_attrs
    ]


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

    with open(folder / CLAIM_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            used = sum(
                _ended(t) or t.state == TrialState.RUNNING for t in study.get_trials(deepcopy=False)
            )
            return study.ask() if used < trials else None
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def run_trials(
    study: optuna.Study,
    folder: Path,
    request: TuneRequest,
    space: dict[str, Space],
    on_trial: Callable[[optuna.trial.FrozenTrial], None] | None = None,
) -> None:
    """Claim trials (:func:`claim_trial`) and run them until the study holds
    ``request.trials``; ``on_trial`` after each. A trial that raises something other than a
    :class:`HyperfedError` is told failed with its one-line cause and counts as ended; a
    :class:`HyperfedError` (a user error, the same for every trial) is raised; an interrupted
    trial stays RUNNING, so the next start runs it again with its values."""
    import optuna
    from optuna.trial import TrialState

    objective = _objective(request, space)
    while (trial := claim_trial(study, folder, request.trials)) is not None:
        try:
            value = objective(trial)
        except optuna.TrialPruned:
            frozen = study.tell(trial, state=TrialState.PRUNED)
        except TrialFailed:
            frozen = study.tell(trial, state=TrialState.FAIL)
        except Exception:
            study.tell(trial, state=TrialState.FAIL)
            raise
        else:
            frozen = study.tell(trial, value)
        if on_trial is not None:
            on_trial(frozen)


def _worker_error(folder: Path, worker: int) -> Path:
    return folder / f".worker-{worker}.error"


def _worker(
    folder: str,
    request: TuneRequest,
    space: dict[str, Space],
    worker: int,
    cores: int | None = None,
) -> None:
    """One process of ``--parallel``: runs trials (:func:`run_trials`) until the study holds
    ``request.trials``, so it ends with exactly that many whatever each trial costs; its
    trials use ``cores`` cores (``local.workers = auto``). What stops it early is written,
    one line, to ``.worker-<i>.error`` for the parent to report."""
    import torch

    if cores is not None:
        os.environ[CORES_ENV] = str(cores)
    torch.set_num_threads(1)
    try:
        study = open_study(Path(folder), request, worker)
        run_trials(study, Path(folder), request, space)
    except BaseException as e:
        cause = str(e) if isinstance(e, HyperfedError) else one_line_cause(e)
        _worker_error(Path(folder), worker).write_text(cause + "\n")
        raise


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
    if folder.exists() and not folder.is_dir():
        raise TuneError(f"--out {folder} is a file; choose a folder for the study")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TuneError(f"--out {folder}: cannot make the study folder ({e.strerror})") from None
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

        def progress(trial: optuna.trial.FrozenTrial) -> None:
            if on_progress is not None:
                on_progress(_done(study), request.trials, _trial_line(trial))

        run_trials(study, folder, request, space, progress)
    else:  # K processes on the same storage; this one watches
        _run_workers(study, folder, request, space, parallel, on_progress)
    return write_outputs(folder, open_study(folder, request), space)


def _run_workers(
    study: optuna.Study,
    folder: Path,
    request: TuneRequest,
    space: dict[str, Space],
    parallel: int,
    on_progress: Callable[[int, int, str], None] | None,
) -> None:
    """``--parallel``: K worker processes on the study's storage; a worker that stops early
    is a one-line :class:`TuneError` naming it and its cause (its own line, or the signal
    that killed it)."""
    ctx = mp.get_context("spawn")
    missing = max(0, request.trials - _done(study))
    workers = range(1, min(parallel, missing) + 1)
    for i in workers:
        _worker_error(folder, i).unlink(missing_ok=True)
    cores = max(1, available_cores() // max(1, len(workers)))  # local.workers = auto's share
    procs = [
        ctx.Process(target=_worker, args=(str(folder), request, space, i, cores)) for i in workers
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
    causes = []
    for i, p in zip(workers, procs):
        if not p.exitcode:
            continue
        note = _worker_error(folder, i)
        if note.exists():
            causes.append(f"worker {i}: {note.read_text().strip()}")
            note.unlink()
        elif p.exitcode < 0:
            sig = signal.Signals(-p.exitcode).name
            hint = " (out of memory?)" if sig == "SIGKILL" else ""
            causes.append(f"worker {i}: killed by {sig}{hint}")
        else:
            causes.append(f"worker {i}: exit status {p.exitcode}")
    if causes:
        raise TuneError(
            f"tuning {'; '.join(causes)}; the same command resumes the study in {folder}"
        )


def _trial_line(trial: optuna.trial.FrozenTrial) -> str:
    if TRIAL_ERROR in trial.user_attrs:
        return f"trial {trial.number}: failed"
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
        | {
            k: v
            for k, v in t.user_attrs.items()
            if k in ("diverged_round", CONFIG_DEFAULT, TRIAL_ERROR)
        }
        for t in study.trials
    ]
    (folder / "trials.json").write_text(json.dumps(trials, indent=1))
    complete = [t for t in study.trials if t.state == TrialState.COMPLETE]
    failed = failed_trials(study)
    if not complete:
        raise NoTrialCompleted(
            f"{folder}: no trial completed ({len(failed)} failed, the others pruned; "
            "see trials.json)",
            failed,
        )
    best = study.best_trial
    lines = [f"# hyperfed tune: best of {len(complete)} completed trials, val acc {best.value:.4f}"]
    lines += _toml_fragment(best.params)
    (folder / "best.toml").write_text("\n".join(lines) + "\n")
    _plots(folder, study, len(space))
    return {
        "best": best.params,
        "value": best.value,
        "completed": len(complete),
        "failed": failed,
        "ended": sum(_ended(t) for t in study.trials),
    }


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
