"""``hyperfed reproduce`` (issue 26 item 3): the orderings checked are the ones the paper's
own numbers claim, and each is judged on our means over seeds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from hyperfed.algorithms import registry
from hyperfed.cli import app
from hyperfed.reproduce import TARGETS, Target, compare, markdown, sweep_args

TOY = Target(
    "9:t",
    "toy",
    "x.toml",
    ("a", "b", "c"),
    ("c",),
    paper={"a": 50.0, "b": 70.0, "c": 60.0},
)


def _summary(
    method: str, acc: float, converged: bool = True, gain: float | None = 0.1
) -> dict[str, object]:
    return {
        "algorithm": method,
        "final_mean_acc": acc,
        "scores": "global" if method == "a" else "personalized",
        "converged": converged,
        "last_window_gain": gain,
    }


def test_claims_are_the_orderings_the_papers_numbers_show() -> None:
    # the paper has its method c above a but below b: only "c > a" is claimed
    assert TOY.claims() == [("c", "a")]
    # without figures the paper's claim is "ours first": above every baseline
    bare = Target("9:u", "toy", "x.toml", ("a", "b", "c"), ("c",))
    assert bare.claims() == [("c", "a"), ("c", "b")]


def test_each_claim_is_judged_on_our_mean_over_seeds() -> None:
    runs = [_summary("a", 0.66), _summary("a", 0.68), _summary("c", 0.64), _summary("c", 0.64)]
    result = compare(TOY, runs)
    a = next(r for r in result["rows"] if r["method"] == "a")
    assert a["n"] == 2 and a["mean"] == pytest.approx(67.0) and a["std"] == pytest.approx(1.0)
    assert result["checks"] == [{"claim": "c > a", "verdict": "does not hold"}]  # 64 < 67 - 1
    runs[0], runs[1] = _summary("a", 0.60), _summary("a", 0.62)  # a's mean 61 < 64 - 1
    assert compare(TOY, runs)["checks"][0]["verdict"] == "holds"
    text = markdown(TOY, compare(TOY, runs), [0, 1])
    assert "| a | global | 61.00 ± 1.00 | yes | 2 | 50.00 |" in text
    assert "| b | — | not run | — | 0 | 70.00 |" in text


def test_a_row_that_has_not_plateaued_is_not_ranked() -> None:
    """One seed of c still rising by 2 points per window: c's seed-mean curve rises 1.05
    points, so c's row is "not converged" and no ordering with c is judged, whatever the
    means say."""
    runs = [_summary("a", 0.60), _summary("c", 0.70), _summary("c", 0.72, False, 2.0)]
    result = compare(TOY, runs)
    c = next(r for r in result["rows"] if r["method"] == "c")
    assert not c["converged"] and c["gain"] == pytest.approx(1.05)
    assert result["checks"] == [{"claim": "c > a", "verdict": "not converged: c"}]
    text = markdown(TOY, result, [0, 1])
    assert (
        "| c | personalized | 71.00 ± 1.00 | not converged (1 of 2 seeds rising; mean +1.05 pts "
        "in the last window)" in text
    )
    assert "0 of 1 hold here (0 judged: between converged rows on one protocol" in text


def test_a_row_whose_training_went_non_finite_is_not_ranked() -> None:
    """One seed of a lost a client to NaN (its accuracy pulled down to 0.60): c at 0.70 would
    "hold" over a on the means, but a diverged run measures the failure, so nothing is
    ranked against a and its row says why; the same for a rejected client update."""
    bad = {**_summary("a", 0.58), "nonfinite_rounds": 3, "rejected_updates": 0}
    runs = [_summary("a", 0.60), bad, _summary("c", 0.70), _summary("c", 0.70)]
    result = compare(TOY, runs)
    assert result["checks"] == [{"claim": "c > a", "verdict": "non-finite training: a"}]
    text = markdown(TOY, result, [0, 1])
    assert (
        "| a | global | 59.00 ± 1.00 (non-finite training or rejected updates in 1 of 2 seeds) |"
        in text
    )
    runs[1] = {**_summary("a", 0.58), "nonfinite_rounds": 0, "rejected_updates": 2}
    assert compare(TOY, runs)["checks"][0]["verdict"] == "non-finite training: a"
    runs[1] = {**_summary("a", 0.58), "nonfinite_rounds": 0, "rejected_updates": 0}
    assert compare(TOY, runs)["checks"][0]["verdict"] == "holds"


def test_a_run_summary_counts_non_finite_rounds_and_rejected_updates(tmp_path: Path) -> None:
    import json

    from hyperfed.report import plateau_cell, run_summary

    base = {"mean_acc": 0.5, "weighted_acc": 0.5, "min_acc": 0, "max_acc": 1, "std_acc": 0}
    rows = [
        {**base, "round": 1, "nonfinite_loss": False, "rejected": []},
        {**base, "round": 2, "nonfinite_loss": True, "rejected": [3, 4]},
        {**base, "round": 3, "nonfinite_loss": True, "rejected": [3]},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = run_summary(tmp_path)
    assert (s["nonfinite_rounds"], s["rejected_updates"]) == (2, 3)
    assert "non-finite loss in 2 evaluated rounds, 3 updates rejected" in plateau_cell(s)


def test_a_row_converges_on_its_seed_mean_curve() -> None:
    """One seed's last window up 0.6 points, the other's down 0.4: the seed-mean curve rose
    0.1 < 0.5, so the row has plateaued (a noisy seed alone does not stop the ranking); a row
    with a seed too short to tell has not."""
    runs = [_summary("a", 0.60), _summary("c", 0.70, False, 0.6), _summary("c", 0.72, True, -0.4)]
    c = next(r for r in compare(TOY, runs)["rows"] if r["method"] == "c")
    assert c["converged"] and c["gain"] == pytest.approx(0.1) and c["stalled"] == 1
    assert compare(TOY, runs)["checks"] == [{"claim": "c > a", "verdict": "holds"}]
    runs[2] = _summary("c", 0.72, False, None)
    result = compare(TOY, runs)
    assert not next(r for r in result["rows"] if r["method"] == "c")["converged"]
    assert "| c | personalized | 71.00 ± 1.00 | not converged (too few evaluations to tell) |" in (
        markdown(TOY, result, [0, 1])
    )


def test_plateau_is_the_last_tenth_of_rounds_against_the_tenth_before() -> None:
    from hyperfed.report import plateau_gain, plateaued

    # 100 rounds evaluated every 5: windows of 10 rounds = rounds 95, 100 vs 85, 90
    accs = {85: 0.50, 90: 0.52, 95: 0.53, 100: 0.55}
    records = [{"round": r, "mean_acc": accs.get(r, 0.1)} for r in range(5, 101, 5)]
    gain = plateau_gain(records)
    assert gain == pytest.approx(100 * ((0.53 + 0.55) / 2 - (0.50 + 0.52) / 2))  # 3 points
    assert not plateaued(gain)
    accs.update({95: 0.512, 100: 0.512})  # +0.2 points: a plateau
    records = [{"round": r, "mean_acc": accs.get(r, 0.1)} for r in range(5, 101, 5)]
    assert plateaued(plateau_gain(records))
    # 30 rounds evaluated every 5: a window is one evaluation interval (round 30 vs 25)
    short = [{"round": r, "mean_acc": 0.01 * r} for r in range(5, 31, 5)]
    assert plateau_gain(short) == pytest.approx(5.0)
    assert plateau_gain(short[:1]) is None and not plateaued(None)


def test_the_last_window_mean_is_the_plateau_windows_average_and_a_seed_table_column() -> None:
    """400 rounds evaluated every 8: the last 10% is rounds 368-400, five evaluations (the
    smoothed score session 34 read by hand for Table 6's swinging mu 0.1 row)."""
    from hyperfed.report import last_windows, seed_table

    accs = {368: 0.80, 376: 0.95, 384: 0.85, 392: 0.97, 400: 0.90, 360: 0.70}
    records = [{"round": r, "mean_acc": accs.get(r, 0.5)} for r in range(8, 401, 8)]
    now, before = last_windows(records)
    assert now == pytest.approx([80.0, 95.0, 85.0, 97.0, 90.0])
    assert before == pytest.approx([50.0, 50.0, 50.0, 50.0, 70.0])  # rounds 328-360

    def summary(seed: int, final: float, window: float) -> dict[str, object]:
        return {
            "config": {"seed": seed, "algorithm": {"name": "a"}},
            "scores": "personalized",
            "final_mean_acc": final,
            "window_mean_acc": window,
            "final_weighted_acc": final,
            "best_mean_acc": final,
            "best_by": "test",
            "up_mb_total": 0.0,
            "gflops_per_round": 0.0,
            "last_window_gain": 0.1,
            "converged": True,
        }

    table = seed_table([{"label": "a", "runs": [summary(0, 0.90, 0.874), summary(1, 0.80, 0.858)]}])
    header, _, row = table.splitlines()
    cells = dict(zip(header.split("|")[1:-1], row.split("|")[1:-1]))
    assert cells[" mean acc (final) "].strip() == "0.8500 ± 0.0500"
    assert cells[" mean acc (last 10%) "].strip() == "0.8660 ± 0.0080"


def test_every_target_names_registered_methods_and_an_existing_config() -> None:
    for target in TARGETS.values():
        assert set(target.methods) <= set(registry()), target.key
        assert set(target.ours) <= set(target.methods)
        assert set(target.paper) <= set(target.methods)
        config, sets = sweep_args(target, "cpu", Path("configs"))
        assert config.exists() and sets[0].startswith("algorithm.name=")


def test_cli_lists_targets_and_refuses_an_unknown_one() -> None:
    runner = CliRunner()
    listing = runner.invoke(app, ["reproduce", "--list"])
    assert listing.exit_code == 0 and "000:table1" in listing.output
    bad = runner.invoke(app, ["reproduce", "000:table99"])
    assert bad.exit_code == 2 and "unknown target '000:table99'" in bad.output


def test_methods_picks_a_subset_and_the_rest_show_as_not_run(tmp_path: Path) -> None:
    from hyperfed.reproduce import ReproduceError, chosen_methods

    assert chosen_methods(TOY, None) == ("a", "b", "c")
    assert chosen_methods(TOY, "c, a") == ("a", "c")  # the target's order
    with pytest.raises(ReproduceError, match="--methods 'a,z': z not in 9:t's methods"):
        chosen_methods(TOY, "a,z")
    # the sweep keeps the target's whole grid; --methods only filters which points run
    from hyperfed.reproduce import runs_method
    from hyperfed.sweep import expand, parse_axes

    target = TARGETS["003:table1"]
    _, sets = sweep_args(target, "cpu", Path("configs"))
    points = expand(parse_axes(sets), [0, 1])
    picked = [p for p in points if runs_method(chosen_methods(target, "mh_pfedhn,fedavg"))(p)]
    assert [p.name for p in picked] == [
        "algorithm.name=fedavg,seed=0",
        "algorithm.name=fedavg,seed=1",
        "algorithm.name=mh_pfedhn,seed=0",
        "algorithm.name=mh_pfedhn,seed=1",
    ]
    # runs of a left-out method already in the folder do not count
    runs = [_summary("a", 0.5), _summary("b", 0.9), _summary("c", 0.6)]
    result = compare(TOY, runs, ("a", "c"))
    b = next(r for r in result["rows"] if r["method"] == "b")
    assert b["n"] == 0 and b["mean"] is None
    assert result["checks"] == [{"claim": "c > a", "verdict": "holds"}]
    # the CLI tells a run's method from its config.toml, even a run that wrote no metrics
    from hyperfed.report import run_algorithm

    (tmp_path / "config.toml").write_text('[algorithm]\nname = "feddm"\n')
    assert run_algorithm(tmp_path) == "feddm" and run_algorithm(tmp_path / "none") == ""


def test_cli_refuses_a_method_the_target_lacks() -> None:
    bad = CliRunner().invoke(app, ["reproduce", "003:table1", "--methods", "fedavg,moon"])
    assert bad.exit_code != 0 and "moon not in 003:table1's methods" in bad.output


def test_kept_summaries_redraw_the_same_table(tmp_path: Path) -> None:
    """``hyperfed report DIR --keep results/X`` keeps config + metrics (+ studies) only, and
    the kept copy gives the same summaries; runs below tuned/<method>/ are found too."""
    import json

    from hyperfed.report import keep_summaries, run_summary
    from hyperfed.sweep import sweep_runs

    src = tmp_path / "reproduce"
    for rel in ("algorithm.name=a,seed=0", "tuned/a/algorithm.name=a,seed=0"):
        run = src / rel
        run.mkdir(parents=True)
        (run / "config.toml").write_text('[algorithm]\nname = "a"\n')
        records = [{"round": r, "mean_acc": 0.1 * r, "weighted_acc": 0.1 * r} for r in (1, 2)]
        for rec in records:
            rec.update(min_acc=0.0, max_acc=1.0, std_acc=0.1)
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        (run / "checkpoint.pt").write_bytes(b"x" * 100)
    kept = keep_summaries(src, tmp_path / "results")
    assert sorted(p.name for p in kept) == ["config.toml"] * 2 + ["metrics.jsonl"] * 2
    again = sweep_runs([tmp_path / "results"])
    assert len(again) == 2 and not (again[0] / "checkpoint.pt").exists()
    for a, b in zip(sweep_runs([src]), again):
        assert run_summary(a)["final_mean_acc"] == run_summary(b)["final_mean_acc"] == 0.2


def test_a_row_scored_under_another_protocol_is_not_ranked() -> None:
    """Seed 001 scores every row as PM@Acc (each client's trained private model): a row that
    scored the global model (a in the toy, which scores "global") is marked, not ranked, and
    the header states the setting and the protocol."""
    on_pm = Target(
        "9:p",
        "toy",
        "x.toml",
        ("a", "b", "c"),
        ("c",),
        cpu=("rounds=60", "algorithm.a.evaluate=local"),
        protocol=("personalized", "local"),
        protocol_name="PM@Acc",
    )
    runs = [_summary("a", 0.50), _summary("b", 0.60), _summary("c", 0.70)]
    result = compare(on_pm, runs)
    assert result["checks"] == [
        {"claim": "c > a", "verdict": "other protocol: a"},
        {"claim": "c > b", "verdict": "holds"},
    ]
    runs[0] = {**runs[0], "scores": "local"}  # a brought onto the protocol
    assert compare(on_pm, runs)["checks"][0]["verdict"] == "holds"
    text = markdown(on_pm, result, [0])
    assert "with overrides `rounds=60`, `algorithm.a.evaluate=local`" in text
    assert (
        "Protocol: one protocol for every row, PM@Acc: each client's personalized or local" in text
    )
    # without a declared protocol every row keeps its own, labelled
    assert compare(TOY, runs)["checks"] == [{"claim": "c > a", "verdict": "holds"}]
    assert "Protocol: each method's own evaluation" in markdown(TOY, result, [0])


def test_seed001_scores_every_row_as_pm_at_acc() -> None:
    """Seed 001 §6.1: "the trained private models' mean accuracy" (PM@Acc) for every row: its
    CPU overrides bring the global-model rows (FedAvg, MOON) onto each client's model after
    local training, and every other row already scores a private model."""
    from hyperfed.algorithms import get_algorithm
    from hyperfed.config import load_config

    target = TARGETS["001:table1"]
    assert target.protocol == ("personalized", "local")
    config, sets = sweep_args(target, "cpu", Path("configs"))
    for m in target.methods:
        cfg = load_config(config, [f"algorithm.name={m}", *sets[1:]])
        alg = get_algorithm(m)
        hp = alg.hparams(**cfg.algorithm.params)
        assert alg.scored_model(hp) in target.protocol, m


def test_a_gap_within_the_seeds_spread_is_inconclusive() -> None:
    """c 64 ± 0 against a 63 ± 2 (seeds 61, 65): c's mean is higher, but by less than a's own
    spread over seeds, so the ordering is inconclusive, neither holds nor does not hold."""
    runs = [_summary("a", 0.61), _summary("a", 0.65), _summary("c", 0.64), _summary("c", 0.64)]
    result = compare(TOY, runs)
    assert result["checks"] == [
        {"claim": "c > a", "verdict": "inconclusive (within the seeds' spread)"}
    ]
    assert "0 of 1 hold here (0 judged" in markdown(TOY, result, [0, 1])
    runs[1] = _summary("a", 0.59)  # a: 60 ± 1, 4 points below c: judged
    assert compare(TOY, runs)["checks"][0]["verdict"] == "holds"


def test_cpu_hard_gives_each_client_less_data_and_is_refused_where_unmeasured() -> None:
    """``--scale cpu-hard`` (issue 37's harder settings): the same target, federation and round
    budget as ``cpu`` but fewer pooled images (so fewer a client), in the header; a target
    without one, or an unknown scale, is a one-line error naming the choices."""
    from hyperfed.config import load_config
    from hyperfed.reproduce import ReproduceError

    hard = [t for t in TARGETS.values() if t.cpu_hard]
    assert {t.key for t in hard} >= {"000:table1", "002:table3", "004:table1"}
    for target in hard:
        config, cpu_sets = sweep_args(target, "cpu", Path("configs"))
        _, hard_sets = sweep_args(target, "cpu-hard", Path("configs"))
        method = f"algorithm.name={target.ours[0]}"
        easy = load_config(config, [method, *cpu_sets[1:]])
        harder = load_config(config, [method, *hard_sets[1:]])
        assert (easy.clients.count, easy.rounds) == (harder.clients.count, harder.rounds)
        easy_images = easy.dataset.subsample or 10**9
        assert harder.dataset.subsample is not None and harder.dataset.subsample < easy_images
    text = markdown(
        TARGETS["000:table1"], compare(TARGETS["000:table1"], []), [0], scale="cpu-hard"
    )
    assert "Setting (cpu-hard scale)" in text and "`partition.classes_per_client=4`" in text
    with pytest.raises(ReproduceError, match="003:table1 has no cpu-hard setting.*000:table1"):
        sweep_args(TARGETS["003:table1"], "cpu-hard", Path("configs"))
    with pytest.raises(ReproduceError, match="--scale 'gpu': choose one of cpu, cpu-hard, paper"):
        sweep_args(TARGETS["000:table1"], "gpu", Path("configs"))
    bad = CliRunner().invoke(app, ["reproduce", "001:table1", "--scale", "cpu-hard"])
    assert bad.exit_code != 0 and "001:table1 has no cpu-hard setting" in bad.output


def test_a_held_out_client_run_plateaus_only_if_its_training_phase_did(tmp_path: Path) -> None:
    """A PeFLL held-out-client run (new_clients, adapt_rounds 10 of 60) whose training curve
    still rises 4 points at its end and whose adaptation rounds are frozen: its last 10% is flat
    (+0), but the training phase is not converged, so the run is not; with the training curve
    flat it is."""
    import json

    from hyperfed.report import run_summary

    def write(train_acc: dict[int, float]) -> dict:
        base = {"weighted_acc": 0.5, "min_acc": 0, "max_acc": 1, "std_acc": 0}
        rows = [{**base, "round": r, "mean_acc": train_acc.get(r, 0.5)} for r in range(3, 61, 3)]
        for row in rows:
            if row["round"] > 50:
                row["mean_acc"] = train_acc.get(48, 0.5)  # frozen: nothing trains
        (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return run_summary(tmp_path)

    (tmp_path / "config.toml").write_text(
        '[algorithm]\nname = "pefll"\n[algorithm.pefll]\nnew_clients = 0.2\nadapt_rounds = 10\n'
    )
    rising = write({39: 0.80, 42: 0.80, 45: 0.84, 48: 0.84})  # windows of 5 rounds: 45, 48 vs 42
    assert rising["last_window_gain"] == pytest.approx(100 * (0.84 - 0.80))
    assert not rising["converged"]
    flat = write({39: 0.84, 42: 0.84, 45: 0.842, 48: 0.842})
    assert flat["converged"] and flat["last_window_gain"] == pytest.approx(0.2)
    # MH-pFedHN's adaptation rounds train the new clients' embeddings: a rise there counts too
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        row["mean_acc"] += {57: 0.02, 60: 0.02}.get(row["round"], 0.0)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    adapting = run_summary(tmp_path)
    assert not adapting["converged"] and adapting["last_window_gain"] == pytest.approx(2.0)
    # without adapt_rounds the same records are judged on their own last window (frozen: flat)
    (tmp_path / "config.toml").write_text('[algorithm]\nname = "pefll"\n')
    assert write({39: 0.80, 42: 0.80, 45: 0.84, 48: 0.84})["converged"]


TINY_CONFIG = """device = "cpu"
rounds = 2
eval_every = 1
[dataset]
name = "digits"
subsample = 200
[clients]
count = 3
models = "mlp"
[local]
epochs = 1
"""


def test_dry_run_lists_the_runs_and_estimates_them_from_a_probe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 56 item 4: ``--dry-run`` names every run (methods x seeds) with what the folder
    holds, then each method's probed seconds a run times its runs left, and the total; it runs
    nothing. The probe stands in: FedAvg 20 + 1 s a run, Local 40 + 2 s. ``--list`` then shows
    the full table's estimate (3 seeds: (21 + 42) x 3 = 189 s) without probing."""
    from hyperfed import reproduce
    from hyperfed.progress import PhaseCost
    from hyperfed.reproduce import list_estimate
    from hyperfed.runtime.simulate import Simulation

    def estimate(self: Simulation) -> list[PhaseCost]:
        slow = 2.0 if self.cfg.algorithm.name == "local" else 1.0
        return [PhaseCost("2 rounds of training", 20 * slow), PhaseCost("2 evaluations", slow)]

    monkeypatch.setattr(Simulation, "estimate", estimate)
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "tiny.toml").write_text(TINY_CONFIG)
    target = Target("9:d", "toy", "tiny.toml", ("fedavg", "local"), ("local",))
    monkeypatch.setitem(reproduce.TARGETS, target.key, target)
    folder = tmp_path / "r" / "9-d-cpu"
    done = folder / "algorithm.name=fedavg,seed=0"  # finished by an earlier call
    done.mkdir(parents=True)
    accs = {k: 0.5 for k in ("mean_acc", "weighted_acc", "min_acc", "max_acc", "std_acc")}
    (done / "metrics.jsonl").write_text(json.dumps({"round": 2, **accs}) + "\n")
    args = ["reproduce", "9:d", "--seeds", "0,1", "--dry-run", "--out", str(tmp_path / "r")]
    result = CliRunner().invoke(app, [*args, "--configs", str(configs)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == f"9:d (cpu scale) in {folder}: 2 methods x 2 seeds = 4 runs"
    assert lines[1:5] == [
        "  algorithm.name=fedavg,seed=0: done",
        "  algorithm.name=fedavg,seed=1: new",
        "  algorithm.name=local,seed=0: new",
        "  algorithm.name=local,seed=1: new",
    ]
    assert lines[6:] == [
        "  fedavg: 21 s a run (2 rounds of training 20 s, 2 evaluations 1 s) x 1 to run = 21 s",
        "  local: 42 s a run (2 rounds of training 40 s, 2 evaluations 2 s) x 2 to run = "
        "1 min 24 s",
        "total: about 1 min 45 s for the 3 runs left, one at a time on this machine",
        "nothing was run (--dry-run); the same command without --dry-run runs them",
    ]
    assert sorted(p.name for p in folder.iterdir()) == [done.name, "estimate.json"]
    assert list_estimate(target, tmp_path / "r") == "cpu: 3 min 09 s"
    assert list_estimate(TOY, tmp_path / "r") == "--dry-run probes it"
    listing = CliRunner().invoke(app, ["reproduce", "--list"])
    assert listing.exit_code == 0 and "estimate" in listing.output


def test_the_run_estimate_probes_rounds_and_counts_evaluations(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Simulation.estimate``: the rounds through the distillation probe's ``timed_probe``
    (asked for all 5 rounds), one evaluation timed x 3 (rounds 2, 4 and the last); a method with
    a heavy phase every round (FedDM's distillation) is estimated by that phase instead."""
    import hyperfed.distill.synthesis as synthesis
    from hyperfed.config import load_config
    from hyperfed.progress import PhaseCost
    from hyperfed.runtime.simulate import Simulation

    asked: list[int] = []

    def probe(run, iters: int, budget_s: float = 0.5) -> float:  # type: ignore[no-untyped-def]
        run(1)  # one round really runs
        asked.append(iters)
        return 7.0

    monkeypatch.setattr(synthesis, "timed_probe", probe)
    (tmp_path / "tiny.toml").write_text(TINY_CONFIG)
    cfg = load_config(tmp_path / "tiny.toml", ["rounds=5", "eval_every=2"])
    costs = Simulation(cfg).estimate()
    assert asked == [5] and costs[0] == PhaseCost("5 rounds of training", 7.0)
    assert costs[1].what == "3 evaluations" and len(costs) == 2
    heavy = PhaseCost("distillation every round", 3.0, per_round=True)
    monkeypatch.setattr(Simulation, "heavy_phases", lambda self: [heavy])
    costs = Simulation(cfg).estimate()
    assert asked == [5] and costs[0] == heavy and costs[1].what == "3 evaluations"


def test_a_mistyped_method_or_target_gets_a_did_you_mean() -> None:
    bad = CliRunner().invoke(app, ["reproduce", "003:table1", "--methods", "fedavgg,feddm"])
    assert bad.exit_code == 2
    assert "fedavgg not in 003:table1's methods; did you mean fedavg? choose from: " in bad.stderr
    bad = CliRunner().invoke(app, ["reproduce", "000:tabel1"])
    assert bad.exit_code == 2
    assert "unknown target '000:tabel1'; did you mean 000:table1 or " in bad.stderr


def test_tuned_prints_a_failed_line_for_each_crashed_trial(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trial that crashed counts in its study (as in ``hyperfed tune``) and fails no run,
    but the console names it: ``failed: tune/<method>/trial <n>: <cause>``."""
    import hyperfed.report
    import hyperfed.sweep
    import hyperfed.tune
    from hyperfed import reproduce
    from hyperfed.sweep import SweepResult

    def tune(folder: Path, request: Any, parallel: int = 1, on_progress: Any = None) -> dict:
        crashed = folder.name == "local"
        return {"failed": [("trial 1", "RuntimeError: out of memory")] if crashed else []}

    monkeypatch.setattr(hyperfed.sweep, "run_sweep", lambda out, **kw: SweepResult([], [], []))
    monkeypatch.setattr(hyperfed.tune, "tune", tune)
    monkeypatch.setattr(hyperfed.tune, "best_sets", lambda study: [])
    monkeypatch.setattr(hyperfed.tune, "require_optuna", lambda: None)
    # no plots (write_report makes its folder, as the real one does)
    monkeypatch.setattr(hyperfed.report, "write_report", lambda runs, out: out.mkdir(parents=True))
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "tiny.toml").write_text(TINY_CONFIG)
    target = Target("9:d", "toy", "tiny.toml", ("fedavg", "local"), ("local",))
    monkeypatch.setitem(reproduce.TARGETS, target.key, target)
    args = ["reproduce", "9:d", "--tuned", "--trials", "2", "--seeds", "0"]
    result = CliRunner().invoke(
        app, [*args, "--out", str(tmp_path / "r"), "--configs", str(configs)]
    )
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == ["failed: tune/local/trial 1: RuntimeError: out of memory"]


def test_report_target_columns_are_what_was_spent_until_the_first_round_reaching_it(
    tmp_path: Path,
) -> None:
    """Seed 002 §6.1 / Fig. 5: parameters transmitted (up and down) and FLOPs consumed (the
    clients' and the server's) until the mean accuracy first reaches the target."""
    from hyperfed.report import markdown_table, run_summary

    run = tmp_path / "run"
    run.mkdir()
    spent = [  # round, acc, bytes up, bytes down, client FLOPs, server FLOPs
        (2, 0.60, 1e6, 4e6, 1e12, 2e11),
        (4, 0.85, 3e6, 9e6, 5e12, 7e11),
        (6, 0.80, 5e6, 15e6, 8e12, 9e11),
    ]
    lines = [
        {
            "round": r,
            "mean_acc": acc,
            "weighted_acc": acc,
            "min_acc": acc,
            "max_acc": acc,
            "std_acc": 0.0,
            "bytes_up_total": up,
            "bytes_down_total": down,
            "flops_total": cf,
            "flops_server_total": sf,
        }
        for r, acc, up, down, cf, sf in spent
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    header, _, row = markdown_table([run_summary(run)], target=0.8).splitlines()
    assert header.endswith(
        "| rounds to 80% | upload MB to 80% | MB up + down to 80% "
        "| TFLOPs (clients) to 80% | TFLOPs (server) to 80% |"
    )
    # round 4 is the first at or above 80% (round 6 reaches it too; the first one counts)
    assert [c.strip() for c in row.split("|")[-6:-1]] == ["4", "3.00", "12.00", "5.000", "0.700"]
    header, _, row = markdown_table([run_summary(run)], target=0.9).splitlines()
    assert row.count("|") == header.count("|")
    assert row.endswith(" not reached | — | — | — | — |")
