"""Progress and cost estimates of long phases (issue 40): hyperfed.progress, the distillation
phase's reports, the timed-probe estimate, the CLI's nested bars and plain lines."""

from __future__ import annotations

import io
import time

import pytest
import torch
from cli_helpers import invoke, sets
from rich.console import Console
from rich.progress import Progress

from hyperfed import progress
from hyperfed.config import load_config
from hyperfed.progress import LineReporter, phase, reporting

# a distillation method on a hand-sized federation: one LeNet group of two clients
TINY = [
    "device=cpu",
    "dataset.name=digits",
    "dataset.subsample=200",
    "clients.count=2",
    "clients.models=lenet",
    "algorithm.name=mh_pfedhndd",
    "algorithm.mh_pfedhndd.distill_model=lenet",
    "algorithm.mh_pfedhndd.distill_batch_real=8",
    "algorithm.mh_pfedhndd.ipc=2",
    "local.epochs=1",
    "rounds=1",
]


def simulation(iters: int, extra: list[str] | None = None):
    from hyperfed.runtime.simulate import Simulation

    sets_ = [*TINY, f"algorithm.mh_pfedhndd.distill_iters={iters}", *(extra or [])]
    return Simulation(load_config(None, sets_))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_line_reporter_prints_every_tenth_with_an_eta() -> None:
    lines: list[str] = []
    clock = Clock()
    rep = LineReporter(lines.append, every_s=1000, quiet_s=0, clock=clock)
    with reporting(rep), phase("work", 20) as p:
        for _ in range(20):
            clock.now += 1.0
            p.advance()
    rep.close()
    # 20 units, a line per 10%: at 2, 4, ..., 20 done, then "done"
    assert len(lines) == 11
    assert lines[0] == "work: 2/20 (10%), 2 s, eta 18 s"  # 1 s per unit, 18 units left
    assert lines[4] == "work: 10/20 (50%), 10 s, eta 10 s"
    assert lines[-1] == "work: done in 20 s"


def test_line_reporter_keeps_short_phases_quiet_and_throttles_by_time() -> None:
    lines: list[str] = []
    clock = Clock()
    rep = LineReporter(lines.append, every_s=30, quiet_s=2, clock=clock)
    with reporting(rep):
        with phase("short", 10) as p:  # 1 s in all: below quiet_s, nothing printed
            for _ in range(10):
                clock.now += 0.1
                p.advance()
        assert lines == []
        with phase("later", 20) as p:  # quiet for 2 s (17 units), then from the next 10%
            for _ in range(20):
                clock.now += 0.12
                p.advance()
        assert [ln.split(",")[0] for ln in lines[:-1]] == [
            "later: 18/20 (90%)",
            "later: 20/20 (100%)",
        ]
        assert lines[-1] == "later: done in 2 s"
        lines.clear()
        with phase("long", 1000) as p:  # 1% per 40 s: a line per 30 s, not per 10%
            for _ in range(3):
                clock.now += 40
                p.advance()
    rep.close()
    assert [ln.split(":")[0] for ln in lines] == ["long"] * 4
    assert lines[0].startswith("long: 1/1000 (0%), 40 s, eta 11 h")


def test_heartbeat_reports_a_phase_without_ticks() -> None:
    lines: list[str] = []
    with (
        LineReporter(lines.append, every_s=0.05, quiet_s=0) as rep,
        reporting(rep),
        phase("server: training"),
    ):
        time.sleep(0.3)
    assert any(ln.startswith("server: training: running") for ln in lines)
    assert lines[-1].startswith("server: training: done in")


def test_no_reporter_no_output_and_nesting_depth() -> None:
    with phase("anything", 3) as p:  # Flower, sweep workers: no reporter installed
        p.advance()
    seen: list[tuple[str, int]] = []

    class Rec:
        def open(self, label: str, total: int | None, depth: int) -> progress.Phase:
            seen.append((label, depth))
            return progress._SILENT

    with reporting(Rec()), phase("outer"), phase("inner"):
        pass
    with reporting(Rec()), phase("again"):
        pass
    assert seen == [("outer", 0), ("inner", 1), ("again", 0)]


def test_distillation_setup_reports_progress_lines_off_a_terminal() -> None:
    sim = simulation(iters=20)
    lines: list[str] = []
    with LineReporter(lines.append, every_s=1000, quiet_s=0) as rep, reporting(rep):
        sim.run_setup()
    distill = [ln for ln in lines if ln.startswith("distilling synthetic sets (lenet)")]
    # one group of two clients, 20 iterations: 10 lines (each 10%) and "done"
    assert len(distill) == 11, lines
    assert "clients 0-1 of 2" in distill[0] and "2/20 (10%)" in distill[0]
    assert "20/20 (100%)" in distill[-2] and "done in" in distill[-1]
    assert any(ln.startswith("setup stage 0, clients done: 2/2") for ln in lines)


class FakeClock:
    """A clock that only the phase advances: ``run(n)`` costs ``fixed + n * per`` seconds,
    plus ``first_call`` once (the one-off costs a warm-up exists to absorb)."""

    def __init__(self, fixed: float, per: float, first_call: float = 0.0) -> None:
        self.now, self.fixed, self.per, self.first_call = 0.0, fixed, per, first_call
        self.calls: list[int] = []

    def perf_counter(self) -> float:
        return self.now

    def run(self, n: int) -> None:
        self.now += self.fixed + n * self.per + (self.first_call if not self.calls else 0.0)
        self.calls.append(n)


@pytest.mark.parametrize(
    ("fixed", "per", "expect_calls"),
    [
        (0.2, 0.001, "fast"),  # fast iterations: fixed cost and slope from two timed runs
        (0.0, 0.5, "slow"),  # an iteration over budget/4: the two-iteration probe suffices
    ],
)
def test_timed_probe_estimates_fixed_cost_plus_iterations_times_slope(
    monkeypatch: pytest.MonkeyPatch, fixed: float, per: float, expect_calls: str
) -> None:
    """The probe's arithmetic on a deterministic clock (the real-time comparison is
    ``benchmarks/phase_estimate.py``: a timed unit test flakes on a busy machine)."""
    from hyperfed.distill import synthesis

    clock = FakeClock(fixed, per, first_call=5.0)
    monkeypatch.setattr(synthesis.time, "perf_counter", clock.perf_counter)
    estimate = synthesis.timed_probe(clock.run, iters=3000, budget_s=0.5)
    # the phase itself: fixed + 3000 * per; the warm-up's one-off 5 s is not part of it
    assert estimate == pytest.approx(fixed + 3000 * per, rel=1e-9)
    assert clock.calls[:2] == [1, 2]  # untimed warm-up, then the two-iteration probe
    if expect_calls == "fast":
        # run(1) against run(1 + p), p chosen from the two-iteration probe's per-iteration
        # time (fixed cost included): (0.2 + 2 * 0.001) / 2 = 0.101 s, p = int(0.5 / 0.101) = 4
        assert clock.calls[2:] == [1, 5]
    else:
        assert clock.calls[2:] == []
    # the probe never runs as many iterations as the phase it estimates
    assert sum(clock.calls) < 3000


def test_the_probe_leaves_the_run_as_it_was() -> None:
    """Probing before the run changes nothing the run computes (setup and a round)."""
    records = []
    for probe in (True, False):
        sim = simulation(iters=5)
        if probe:
            sim.heavy_phases()
        sim.run_setup()
        sim.run_round(1)
        records.append((sim.evaluate(), sim.store[0]))
    (ra, sa), (rb, sb) = records
    assert ra["client_acc"] == rb["client_acc"]
    assert torch.equal(sa["syn_x"], sb["syn_x"]) and torch.equal(sa["buffers"], sb["buffers"])


def test_feddm_round_reports_its_distillation_and_the_server_training() -> None:
    from hyperfed.runtime.simulate import Simulation

    extra = ["feddm.distill_iters=3", "feddm.ipc=1", "feddm.server_epochs=1"]
    cfg = load_config(None, [*TINY[:5], "algorithm.name=feddm", *[f"algorithm.{e}" for e in extra]])
    sim = Simulation(cfg)
    seen: list[tuple[str, int | None, int]] = []

    class Rec:
        def open(self, label: str, total: int | None, depth: int) -> progress.Phase:
            seen.append((label, total, depth))
            return progress._SILENT

    assert [c.per_round for c in sim.heavy_phases()] == [True]
    with reporting(Rec()):
        sim.run_round(1)
    assert seen[0] == ("round 1: distilling synthetic sets: clients 0-1 of 2", 3, 0)
    assert seen[1] == ("server: aggregating round 1", None, 0)
    assert seen[2][0].startswith("server: training on") and seen[2][2] == 1


def test_rich_phase_is_a_nested_task_shown_after_a_delay() -> None:
    from hyperfed.terminal import RichPhases

    console = Console(file=io.StringIO(), force_terminal=True, width=120)
    with Progress(console=console) as bars:
        bars.add_task("round", total=2)
        rep = RichPhases(bars, show_after=0.05)
        with reporting(rep), phase("distilling", 10) as p:
            (task,) = [t for t in bars.tasks if "distilling" in t.description]
            assert not task.visible and task.description.startswith("└ distilling")
            p.advance(3)
            time.sleep(0.2)
            assert task.visible and task.completed == 3
        assert [t.description for t in bars.tasks] == ["round"]


def test_run_prints_an_estimate_and_progress_lines(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(progress, "QUIET_S", 0.0)
    args = sets([*TINY, "algorithm.mh_pfedhndd.distill_iters=10"])
    result = invoke("run", *args, "--out", str(tmp_path / "run"))
    assert result.exit_code == 0, result.output
    out = result.output
    assert "estimate: setup distillation: clients 0-1 of 2 x 10 iterations of lenet" in out
    assert "on this machine" in out
    lines = [ln for ln in out.splitlines() if ln.startswith("distilling synthetic sets")]
    assert len(lines) == 11, out  # off a terminal: a line per 10% and "done"
    assert out.index("estimate:") < out.index("distilling") < out.index("round 1/1")


@pytest.mark.parametrize("name", ["mh_pfedhndd", "feddm", "desa", "fedbn_dd", "fedavg_dd"])
def test_list_algorithms_names_the_cost_drivers(name: str) -> None:
    from hyperfed.algorithms import get_algorithm

    summary = get_algorithm(name).summary
    assert "cost:" in summary and "distill_iters" in summary


@pytest.mark.parametrize("method", ["fedgh", "fedtgp"])
def test_server_training_of_fedgh_and_fedtgp_reports_its_epochs(method: str) -> None:
    """The server's own training (FedGH's header, FedTGP's prototype generator) is a phase of
    ``server_epochs`` units, advanced once per epoch: its bar has an ETA."""
    from hyperfed.runtime.simulate import Simulation

    cfg = load_config(
        None, [*TINY[:5], f"algorithm.name={method}", f"algorithm.{method}.server_epochs=3"]
    )
    sim = Simulation(cfg)
    seen: list[tuple[str, int | None]] = []
    advanced: list[int] = []

    class Counted:
        def advance(self, n: int = 1) -> None:
            advanced.append(n)

        def close(self) -> None:
            pass

    class Rec:
        def open(self, label: str, total: int | None, depth: int) -> progress.Phase:
            seen.append((label, total))
            return Counted() if label.startswith("server: training the") else progress._SILENT

    with reporting(Rec()):
        sim.run_setup()
        sim.run_round(1)
    training = [s for s in seen if s[0].startswith("server: training the")]
    assert len(training) == 1 and training[0][1] == 3
    assert advanced == [1, 1, 1]  # once per epoch
