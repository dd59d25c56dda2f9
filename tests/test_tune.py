"""``hyperfed tune`` (issue 36 item 3): the study searches the declared space on the validation
split only, beats a deliberately bad learning rate, and a killed study resumes without
repeating a finished trial."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hyperfed import tune as tune_mod
from hyperfed.hparams import Space
from hyperfed.tune import TuneError, TuneRequest, search_space, tune, validation_curve

TINY = (
    "dataset.name=digits",
    "clients.count=4",
    "clients.models=mlp",
    "rounds=3",
    "eval_every=3",
    "algorithm.name=fedavg",
)


def test_every_method_tunes_its_lr_and_the_paper_s_hyperparameters() -> None:
    from hyperfed.algorithms import registry

    for name in registry():
        space = search_space(name)
        if name != "pfedkt":  # end to end it reads no [local] lr (the test below)
            assert space["local.lr"] == tune_mod.LOCAL_LR, name
        # every declared key is a hyperparameter of the method (a typo would tune nothing)
        hp = registry()[name].hparams()
        for key in space:
            if key != "local.lr":
                assert hasattr(hp, key.rsplit(".", 1)[1]), (name, key)
    assert search_space("moon")["algorithm.moon.mu"] == Space(choices=(0.1, 1.0, 5.0, 10.0))
    with pytest.raises(ValueError, match="need low < high"):
        Space(1.0, 0.5)


def test_a_trial_never_evaluates_the_test_split(monkeypatch: pytest.MonkeyPatch) -> None:
    from hyperfed.runtime.simulate import Simulation

    seen: list[str] = []
    evaluate = Simulation.evaluate

    def spy(self: Simulation, split: str = "test") -> dict:
        seen.append(split)
        return evaluate(self, split)

    monkeypatch.setattr(Simulation, "evaluate", spy)
    cfg = TuneRequest(None, TINY, trials=1).trial_config({"local.lr": 0.05})
    assert cfg.partition.val_fraction == tune_mod.DEFAULT_VAL_FRACTION  # added for tuning
    reported: list[tuple[int, float]] = []
    validation_curve(cfg, lambda r, a: reported.append((r, a)))
    assert seen == ["val"] and [r for r, _ in reported] == [3]


def test_tuned_lr_beats_a_bad_starting_lr_on_validation(tmp_path: Path) -> None:
    request = TuneRequest(None, TINY, trials=4)
    bad = validation_curve(request.trial_config({"local.lr": 1e-4}))
    best = tune(tmp_path / "study", request)
    assert best["value"] > bad + 0.1, (best, bad)
    text = (tmp_path / "study" / "best.toml").read_text()
    assert "[local]" in text and f"lr = {best['best']['local.lr']}" in text
    assert (tmp_path / "study" / "optimization_history.png").stat().st_size > 0


def test_a_killed_study_resumes_without_repeating_finished_trials(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[float] = []

    def fake_curve(cfg, report=None) -> float:  # type: ignore[no-untyped-def]
        calls.append(cfg.local.lr)
        return 1.0 - abs(cfg.local.lr - 0.05)  # best at lr 0.05

    monkeypatch.setattr(tune_mod, "validation_curve", fake_curve)
    folder = tmp_path / "study"
    tune(folder, TuneRequest(None, TINY, trials=2))
    assert len(calls) == 2
    # a third trial was running when the process died: RUNNING in the storage
    study = tune_mod.open_study(folder, TuneRequest(None, TINY, trials=3))
    study.enqueue_trial({"local.lr": 0.2})
    killed = study.ask({"local.lr": tune_mod.optuna_distribution(tune_mod.LOCAL_LR)})
    killed_lr = killed.params["local.lr"]
    assert killed_lr == 0.2
    calls.clear()
    result = tune(folder, TuneRequest(None, TINY, trials=3))
    # only the interrupted trial runs again, with its own values; the finished two do not
    assert calls == [killed_lr]
    assert result["completed"] == 3
    # asking for the same number again runs nothing
    calls.clear()
    tune(folder, TuneRequest(None, TINY, trials=3))
    assert calls == []


def test_a_study_ignores_a_changed_fixed_value_of_a_key_it_searches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each trial sets ``local.lr`` itself, so the study of a target whose fixed lr changed is
    still that target's study (resumed, not refused); any other changed --set is refused."""
    monkeypatch.setattr(tune_mod, "validation_curve", lambda cfg, report=None: cfg.local.lr)
    folder = tmp_path / "study"
    tune(folder, TuneRequest(None, (*TINY, "local.lr=0.05"), trials=1))
    again = tune(folder, TuneRequest(None, (*TINY, "local.lr=0.03"), trials=2))
    assert again["completed"] == 2
    with pytest.raises(TuneError, match="holds a study of another config"):
        tune(folder, TuneRequest(None, (*TINY, "local.lr=0.03", "rounds=4"), trials=2))


def test_bad_requests_fail_before_any_work(tmp_path: Path) -> None:
    with pytest.raises(TuneError, match="--trials 0: need at least 1"):
        tune(tmp_path / "s", TuneRequest(None, TINY, trials=0))
    assert not (tmp_path / "s").exists()
    tune_dir = tmp_path / "other"
    tune_dir.mkdir()
    (tune_dir / "tune.json").write_text('{"config": "x.toml", "sets": [], "space": []}')
    with pytest.raises(TuneError, match="holds a study of another config"):
        tune(tune_dir, TuneRequest(None, TINY, trials=1))


def test_without_optuna_tuning_fails_in_one_line_naming_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "optuna", None)  # as if the tune extra were not installed
    with pytest.raises(TuneError, match=r"pip install 'hyperfed\[tune\]'"):
        tune(tmp_path / "s", TuneRequest(None, TINY, trials=1))
    assert not (tmp_path / "s").exists()
    # reproduce --tuned says so before its default sweep, not after it
    from typer.testing import CliRunner

    import hyperfed.sweep
    from hyperfed.cli import app

    def no_sweep(*a: object, **kw: object) -> None:
        raise AssertionError("the default sweep ran before the missing extra was named")

    monkeypatch.setattr(hyperfed.sweep, "run_sweep", no_sweep)
    out = tmp_path / "r"
    result = CliRunner().invoke(app, ["reproduce", "004:table1", "--tuned", "--out", str(out)])
    assert result.exit_code != 0 and "pip install 'hyperfed[tune]'" in result.output
    assert not out.exists()


def test_reproduce_tuned_gives_every_method_the_same_trials_and_runs_its_best(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``reproduce --tuned``: each method is tuned with the same number of trials, then its
    seeds run with that method's best values; the table has default and tuned sections."""
    import json

    import hyperfed.sweep
    from hyperfed.reproduce import Target, compare, markdown, tuned_runs
    from hyperfed.sweep import SweepResult

    def fake_curve(cfg, report=None) -> float:  # type: ignore[no-untyped-def]
        return 1.0 - abs(cfg.local.lr - (0.02 if cfg.algorithm.name == "fedavg" else 0.1))

    swept: dict[str, list[str]] = {}

    def fake_sweep(out: Path, **kw) -> SweepResult:  # type: ignore[no-untyped-def]
        swept[out.name] = kw["sets"]
        return SweepResult([], [], [])

    monkeypatch.setattr(tune_mod, "validation_curve", fake_curve)
    monkeypatch.setattr(hyperfed.sweep, "run_sweep", fake_sweep)
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "tiny.toml").write_text(
        'rounds = 2\n[dataset]\nname = "digits"\n[clients]\ncount = 3\n'
        'models = "mlp"\n[algorithm]\nname = "fedavg"\n'
    )
    # the target fixes the lr the tuner searches (as 000's CPU scale does): the tuned seeds must
    # run at the tuned lr, given once (a repeated --set key stops the sweep)
    cpu = ("rounds=2", "local.lr=0.5")
    target = Target("9:t", "toy", "tiny.toml", ("fedavg", "local"), ("local",), cpu=cpu)
    _, failed = tuned_runs(target, "cpu", configs, tmp_path / "r", target.methods, [0, 1], 3)
    assert not failed
    for m in target.methods:
        trials = json.loads((tmp_path / "r" / "tune" / m / "trials.json").read_text())
        assert len(trials) == 3  # the same budget for every method
        best = max(trials, key=lambda t: t["value"])["params"]["local.lr"]
        assert swept[m] == [f"algorithm.name={m}", "rounds=2", f"local.lr={best}"]
    result = compare(target, [])
    text = markdown(target, result, [0, 1], result, 3)
    assert "### Default hyperparameters" in text and "### Tuned: 3 trials per method" in text


def test_a_diverging_trial_is_pruned_at_its_first_non_finite_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hyperfed.runtime.simulate import Simulation

    rounds_run: list[int] = []
    run_round = Simulation.run_round

    def spy(self: Simulation, rnd: int):  # type: ignore[no-untyped-def]
        rounds_run.append(rnd)
        return run_round(self, rnd)

    monkeypatch.setattr(Simulation, "run_round", spy)
    request = TuneRequest(None, (*TINY, "rounds=6", "eval_every=6"), trials=1)
    with pytest.raises(tune_mod.TrainingDiverged) as stopped:
        validation_curve(request.trial_config({"local.lr": 1e6}))
    assert rounds_run[-1] == stopped.value.round < 6  # stopped where it diverged
    # the reading without the stop runs every round (and scores the wrecked model)
    rounds_run.clear()
    validation_curve(request.trial_config({"local.lr": 1e6}), stop_on_divergence=False)
    assert rounds_run == [1, 2, 3, 4, 5, 6]
    # in a study: the trial is pruned at that round, and trials.json says where
    (tmp_path / "study").mkdir()
    tune_mod.open_study(tmp_path / "study", request).enqueue_trial({"local.lr": 1e6})
    rounds_run.clear()
    with pytest.raises(TuneError, match="no trial completed"):
        tune(tmp_path / "study", request)
    trial = json.loads((tmp_path / "study" / "trials.json").read_text())[0]
    assert trial["state"] == "PRUNED" and trial["diverged_round"] == stopped.value.round
    assert len(rounds_run) == stopped.value.round


def test_a_new_study_runs_the_config_s_own_values_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Trial 0 of a new study is the config as written (so tuned >= default on validation);
    the sampler draws the others; a resumed study does not add it again."""
    seen: list[tuple[float, float]] = []

    def fake_curve(cfg, report=None) -> float:  # type: ignore[no-untyped-def]
        seen.append((cfg.local.lr, cfg.hparams().mu))
        return 0.5

    monkeypatch.setattr(tune_mod, "validation_curve", fake_curve)
    sets = (*TINY[:-1], "algorithm.name=moon", "local.lr=0.0123", "algorithm.moon.mu=5.0")
    folder = tmp_path / "study"
    tune(folder, TuneRequest(None, sets, trials=3))
    assert seen[0] == (0.0123, 5.0)
    assert all(lr != 0.0123 for lr, _ in seen[1:])  # the others are drawn
    trials = json.loads((folder / "trials.json").read_text())
    assert [t.get("config_default", False) for t in trials] == [True, False, False]
    meta = json.loads((folder / "tune.json").read_text())
    assert meta["default_trial"] == {"local.lr": 0.0123, "algorithm.moon.mu": 5.0}
    seen.clear()
    tune(folder, TuneRequest(None, sets, trials=4))
    assert len(seen) == 1 and seen[0] != (0.0123, 5.0)


def test_a_config_value_outside_the_search_space_is_not_trial_0(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[float] = []
    monkeypatch.setattr(
        tune_mod, "validation_curve", lambda cfg, report=None: seen.append(cfg.local.lr) or 0.5
    )
    folder = tmp_path / "study"
    tune(folder, TuneRequest(None, (*TINY, "local.lr=0.9"), trials=1))
    assert seen != [0.9]
    meta = json.loads((folder / "tune.json").read_text())
    assert meta["default_trial"] == (
        "not run: local.lr = 0.9 is outside its search space 0.001..0.3 (log)"
    )


def test_every_shipped_config_s_own_values_can_be_trial_0() -> None:
    """A config whose value lies outside its method's search space would be tuned without its
    own default among the trials (DFedHP's lr 1.0 once was: its space ended at 0.1)."""
    from hyperfed.config import load_config

    configs = sorted(Path(__file__).parents[1].joinpath("configs").rglob("*.toml"))
    assert len(configs) > 50
    for path in configs:
        cfg = load_config(path, [])
        space = search_space(cfg.algorithm.name, cfg.hparams())
        values, why = tune_mod.config_default_trial(cfg, space)
        assert values is not None, (path.name, why)
        if path.name == "dfedhp_cifar10_dir0.3.toml":  # lr_phi unset: it runs at the [local] lr
            assert values["algorithm.dfedhp.lr_phi"] == values["local.lr"] == cfg.local.lr


def test_pfedkt_end_to_end_tunes_its_hypernetwork_step_not_the_unused_local_lr() -> None:
    """End to end (the default) pFedKT trains only phi with hn_lr (eta_HN, Eq. 1); a study over
    local.lr there would vary nothing. First-order trains theta with the [local] lr as well."""
    from hyperfed.algorithms.pfedkt import PFedKTParams
    from hyperfed.config import load_config

    end_to_end = search_space("pfedkt")
    assert "local.lr" not in end_to_end and "algorithm.pfedkt.hn_lr" in end_to_end
    first_order = search_space("pfedkt", PFedKTParams(hn_training="first_order"))
    assert "local.lr" in first_order
    # trial 0 runs the config's own values: hn_lr None means the mode's default step
    cfg = load_config(Path(__file__).parents[1] / "configs/pfedkt_fmnist.toml", [])
    values, why = tune_mod.config_default_trial(cfg, search_space("pfedkt", cfg.hparams()))
    assert values == {"algorithm.pfedkt.mu": 0.001, "algorithm.pfedkt.hn_lr": 1e-3}, why
    cfg = load_config(
        Path(__file__).parents[1] / "configs/pfedkt_fmnist.toml",
        ["algorithm.pfedkt.hn_training=first_order"],
    )
    values, why = tune_mod.config_default_trial(cfg, search_space("pfedkt", cfg.hparams()))
    assert values is not None and values["algorithm.pfedkt.hn_lr"] == 1e-4, why


def test_parallel_workers_share_one_budget_of_trials(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker claims trials until the study holds the requested number, counting the other
    workers' running ones: a lone worker whose partner's trial is still running runs the rest
    (no fixed quota leaves it idle), and none starts a trial past the budget."""
    from optuna.trial import TrialState

    calls: list[float] = []

    def fake_curve(cfg, report=None) -> float:  # type: ignore[no-untyped-def]
        calls.append(cfg.local.lr)
        return 0.5

    import torch

    monkeypatch.setattr(tune_mod, "validation_curve", fake_curve)
    threads = torch.get_num_threads()  # a worker pins 1 thread; give this process its own back
    folder = tmp_path / "study"
    folder.mkdir()
    request = TuneRequest(None, TINY, trials=5)
    space = search_space("fedavg")
    study = tune_mod.open_study(folder, request)
    partner = tune_mod.claim_trial(study, folder, request.trials)  # another worker's, running
    assert partner is not None
    tune_mod._worker(str(folder), request, space, worker=1)
    states = [t.state for t in study.get_trials(deepcopy=False)]
    assert len(calls) == 4 and states.count(TrialState.COMPLETE) == 4
    assert states.count(TrialState.RUNNING) == 1  # the partner's: 4 + 1 = the budget of 5
    assert tune_mod.claim_trial(study, folder, request.trials) is None
    study.tell(partner, 0.5)
    tune_mod._worker(str(folder), request, space, worker=2)  # nothing left to claim
    torch.set_num_threads(threads)
    assert len(calls) == 4 and len(study.trials) == 5


def test_a_trial_that_crashes_is_one_line_counted_failed_and_the_study_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 56: a bug inside a trial (not a user error) fails that trial only: the study runs
    its other trials, ``trials.json`` and the console give the trial's number and one-line
    cause, and the exit status is 0 while a trial completed, 1 when every one failed."""
    from typer.testing import CliRunner

    from hyperfed.cli import app

    calls: list[float] = []

    def flaky(cfg, report=None) -> float:  # type: ignore[no-untyped-def]
        calls.append(cfg.local.lr)
        if len(calls) == 2:  # the second trial (trial 1) crashes
            raise RuntimeError("shape mismatch [1, 2]\nsecond line")
        return 0.5

    monkeypatch.setattr(tune_mod, "validation_curve", flaky)
    folder = tmp_path / "study"
    args = ["tune", "--out", str(folder), "--trials", "3"]
    for s in TINY:
        args += ["--set", s]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert len(calls) == 3  # the study went on after the crash, and the crash counted
    lines = result.output.splitlines()
    failed = [line for line in lines if line.startswith("failed: trial 1: ")]
    assert len(failed) == 1 and "Traceback" not in result.output, result.output
    assert failed[0].startswith("failed: trial 1: RuntimeError: shape mismatch [1, 2] (at ")
    assert "test_tune.py:" in failed[0]
    assert f"tune {folder}: 3 trials ended, 1 failed" in result.output
    trials = json.loads((folder / "trials.json").read_text())
    assert [t["state"] for t in trials] == ["COMPLETE", "FAIL", "COMPLETE"]
    assert trials[1]["error"].startswith("RuntimeError: shape mismatch [1, 2] (at ")

    def broken(cfg, report=None) -> float:  # type: ignore[no-untyped-def]
        raise ValueError("always")

    monkeypatch.setattr(tune_mod, "validation_curve", broken)
    args[2] = str(tmp_path / "all-failed")
    result = CliRunner().invoke(app, args, env={"COLUMNS": "250"})
    assert result.exit_code == 1, result.output
    lines = result.output.splitlines()
    assert [line.split(" (at ")[0] for line in lines if line.startswith("failed: ")] == [
        f"failed: trial {i}: ValueError: always" for i in range(3)
    ]
    assert "no trial completed (3 failed, the others pruned" in result.output
    assert "Traceback" not in result.output


def test_a_parallel_worker_that_stops_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker stopped by a user error leaves its one line for the parent, which names the
    worker and the cause (not just "a worker failed"); one killed by a signal is named by it.
    The workers run in this process (a spawned one would not see the patched trial)."""
    import torch

    def no_data(cfg, report=None) -> float:  # type: ignore[no-untyped-def]
        raise tune_mod.TuneError("fashion_mnist: train-images not found in [/x]")

    class Worker:  # worker 1 is killed by SIGKILL; worker 2 runs _worker here, which raises
        def __init__(self, target, args) -> None:  # type: ignore[no-untyped-def]
            self.target, self.args, self.exitcode = target, args, 0

        def start(self) -> None:
            if self.args[3] == 1:
                self.exitcode = -9
                return
            try:
                self.target(*self.args)
            except tune_mod.TuneError:
                self.exitcode = 1

        def is_alive(self) -> bool:
            return False

        def join(self) -> None:
            pass

    class Context:
        Process = Worker

    monkeypatch.setattr(tune_mod, "validation_curve", no_data)
    monkeypatch.setattr(tune_mod.mp, "get_context", lambda kind: Context())
    threads = torch.get_num_threads()  # a worker pins 1 thread; give this process its own back
    folder = tmp_path / "study"
    folder.mkdir()
    (folder / ".worker-2.error").write_text("a stale line from an earlier study\n")
    request = TuneRequest(None, TINY, trials=2)
    study = tune_mod.open_study(folder, request)
    with pytest.raises(tune_mod.TuneError) as stopped:
        tune_mod._run_workers(study, folder, request, search_space("fedavg"), 2, None)
    torch.set_num_threads(threads)
    assert str(stopped.value) == (
        "tuning worker 1: killed by SIGKILL (out of memory?); worker 2: fashion_mnist: "
        f"train-images not found in [/x]; the same command resumes the study in {folder}"
    )
    assert not list(folder.glob(".worker-*"))
