"""The ``hyperfed`` command: run / list / report (and bench, attack)."""

from __future__ import annotations

import contextlib
import errno
import logging
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import click
import typer
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from typer.core import TyperGroup

from hyperfed.deploy.cli import ConfigOpt, ForceOpt, SetOpt, flower_cli
from hyperfed.errors import HyperfedError
from hyperfed.progress import LineReporter, duration
from hyperfed.terminal import (
    RichPhases,
    console,
    err_console,
    fail,
    print_failed,
    print_final,
    run_counts,
    say,
)


class _ErrorBoundary(TyperGroup):
    """The one place where a :class:`HyperfedError` raised by any command (``hyperfed flower``'s
    too, and their option callbacks) becomes ``error: <message>`` on stderr and exit code 2.

    Commands let it propagate: their ``with`` blocks (progress bars, a run directory's lock)
    close before the line is printed. What a command knows and the error does not (a resume
    hint that needs the run directory) it still adds in its own ``except``."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except HyperfedError as e:
            fail(str(e))


app = typer.Typer(
    cls=_ErrorBoundary,
    help="Personalized federated learning with hypernetworks across heterogeneous clients.",
    no_args_is_help=True,
    add_completion=True,  # hyperfed --install-completion / --show-completion (bash, zsh, fish)
    pretty_exceptions_enable=False,
)
app.add_typer(flower_cli, name="flower")


def progress_with_last(eta: bool = True) -> Progress:
    """The bar of a long batch of jobs (sweep runs, tuning trials, reproduce): its task's
    description (the batch's label; a running run's name under it, :func:`live_runs`), done of
    total, the last finished job (the task's ``last`` field), elapsed time and an ETA."""
    columns = [
        TextColumn("[bold blue]{task.description}"),
        MofNCompleteColumn(),
        BarColumn(),
        TextColumn("{task.fields[last]}", markup=False),
        TimeElapsedColumn(),
    ]
    if eta:
        columns += [TextColumn("eta"), TimeRemainingColumn()]
    return Progress(*columns, console=console)


@contextlib.contextmanager
def batch_bar(
    label: str, total: int | None = None, eta: bool = True, echo: str = ""
) -> Iterator[tuple[Callable[[int, int, str], None], Callable[[dict[str, Any]], None]]]:
    """A batch's bar (:func:`progress_with_last`) held while the batch runs: gives its
    ``on_progress(ended, total, last line)`` and the sweep's ``on_running`` (:func:`live_runs`).
    With ``echo`` (``runs ended``), off a terminal each new last line is also printed,
    ``<label>: 3/8 runs ended (<line>)``."""
    with progress_with_last(eta) as progress:
        task = progress.add_task(label, total=total, last="")

        def on_progress(ended: int, total: int, line: str) -> None:
            progress.update(task, completed=ended, total=total, last=line)
            if echo and line and not console.is_terminal:
                say(f"{label}: {ended}/{total} {echo} ({line})")

        yield on_progress, live_runs(progress, label)


def parse_seeds(seeds: str) -> list[int]:
    """``--seeds 0,1,2`` as integers; anything else is a one-line error."""
    try:
        return [int(s) for s in seeds.split(",")]
    except ValueError:
        fail(f"--seeds {seeds!r}: expected integers separated by commas, e.g. 0,1,2")


def live_runs(progress: Progress, label: str) -> Callable[[dict[str, Any]], None]:
    """A sweep's ``on_running``: one line per running run under the batch's bar (its round of
    rounds, mean accuracy and ETA from its own clock: ``sweep.live_run``), gone when the run
    ends; off a terminal a plain ``<label>: <run>: round ...`` line whenever a run's round
    moves."""
    tasks: dict[str, Any] = {}
    shown: dict[str, int] = {}

    def update(live: dict[str, Any]) -> None:
        for name in [n for n in tasks if n not in live]:
            progress.remove_task(tasks.pop(name))
            shown.pop(name, None)
        for name, run in live.items():
            if name not in tasks:
                tasks[name] = progress.add_task(f"  └ {escape(name)}", total=run.rounds, last="")
            rest = run.line().split(", ", 1)[1]  # the bar shows the round
            progress.update(tasks[name], completed=run.round, last=rest)
            if not console.is_terminal and shown.get(name) != run.round:
                shown[name] = run.round
                say(f"{label}: {name}: {run.line()}")

    return update


@app.command()
def run(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    out: Annotated[
        Path | None, typer.Option(help="Run directory (default runs/<time>-<algo>).")
    ] = None,
    resume: Annotated[
        Path | None, typer.Option(help="Continue a run directory from its last checkpoint.")
    ] = None,
    quiet: Annotated[bool, typer.Option(help="No progress bar or tables.")] = False,
    force: ForceOpt = False,
) -> None:
    """Run an experiment (no arguments: the built-in default on scikit-learn's digits)."""
    from hyperfed.api import build_simulation
    from hyperfed.config import load_config
    from hyperfed.runtime.rundir import RunDir, check_new_run
    from hyperfed.runtime.simulate import resume as resume_run

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    with contextlib.ExitStack() as held:
        if resume is not None:
            if config is not None:  # --set rounds=N alone may change it (resume_run)
                fail(
                    "--resume takes its config from the run directory; drop --config "
                    "(--set rounds=N alone extends the run)"
                )
            if not (resume / "config.toml").exists():
                fail(f"--resume {resume}: not a run directory (no config.toml)")
            held.enter_context(RunDir(resume).locked())
            sim, run_dir, start = resume_run(resume, set_ or [])
        else:
            cfg = load_config(config, set_ or [])
            stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
            run_dir = RunDir(out or Path("runs") / f"{stamp}-{cfg.algorithm.name}")
            if out is not None and out.exists() and not out.is_dir():
                fail(f"--out {out} is a file; choose a folder")
            held.enter_context(run_dir.locked())  # before any work: a second run is refused
            check_new_run(run_dir.path, force, resume=f"--resume {run_dir.path}")
            sim = build_simulation(cfg)
            start = 0
        try:
            _run_with_progress(sim, run_dir, start, quiet)
        except KeyboardInterrupt:  # Ctrl-C: say how to go on, as sweep and reproduce do
            say(interrupted(run_dir.path), err=True)
            raise typer.Exit(130) from None


def interrupted(path: Path) -> str:
    """The line a run stopped by Ctrl-C ends with: how to resume it (or, before its first
    checkpoint, how to start it again)."""
    from hyperfed.runtime.rundir import CHECKPOINT

    if (path / CHECKPOINT).exists():
        return f"interrupted; resume with: hyperfed run --resume {path}"
    return f"interrupted before the first checkpoint; start it again with --out {path} --force"


def _run_with_progress(sim: Any, run_dir: Any, start: int, quiet: bool) -> None:
    from hyperfed.api import execute
    from hyperfed.runtime.rundir import CHECKPOINT, CheckpointWriteError

    cfg = sim.cfg
    if not quiet:
        groups = ", ".join(f"{len(c)}x {n}" for n, c in sim.groups.items())
        console.print(
            f"[bold]{cfg.algorithm.name}[/] on {cfg.dataset.name}: {cfg.clients.count} clients "
            f"({groups}), {cfg.partition.name} partition, {cfg.rounds} rounds, "
            f"{sim.compute_line()}, run dir {run_dir.path}"
        )
    if not quiet:
        print_estimates(sim, start)
    t0 = time.perf_counter()
    nonfinite: list[int] = []
    with Progress(
        TextColumn("[bold blue]{task.description}"),
        MofNCompleteColumn(),
        BarColumn(),
        TextColumn("{task.fields[acc]}"),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=console,
        disable=quiet,
    ) as progress:
        task = progress.add_task("round", total=cfg.rounds, completed=start, acc="")
        lines = not quiet and not console.is_terminal  # CI logs: one plain line per evaluation
        # long phases (distillation, server training): nested bars, or plain lines in logs
        phases: RichPhases | LineReporter | None = None
        if not quiet:
            phases = RichPhases(progress, acc="") if console.is_terminal else LineReporter(say)

        def on_round(rnd: int, result: Any, record: dict[str, Any] | None) -> None:
            if result.nonfinite_loss:
                nonfinite.append(rnd)
            warn = " [bold red]train loss not finite![/]" if nonfinite else ""
            if record is not None:
                progress.update(task, acc=f"mean acc {record['mean_acc']:.4f}{warn}")
                if lines:
                    console.print(
                        f"round {rnd}/{cfg.rounds}: mean acc {record['mean_acc']:.4f} "
                        f"({time.perf_counter() - t0:.1f} s){warn}",
                        highlight=False,
                    )
            progress.update(task, advance=1)

        try:  # hyperfed.api.execute: what hyperfed.run runs too (plots, rounds, summary.md)
            execute(sim, run_dir, start, on_round=on_round, phases=phases)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            fail(
                f"no space left on device; run directory kept at {run_dir.path}, free some "
                f"space and continue with: hyperfed run --resume {run_dir.path}"
            )
        except CheckpointWriteError as e:  # a HyperfedError; the hint needs the run directory
            again = (
                f"continue with: hyperfed run --resume {run_dir.path}"
                if (run_dir.path / CHECKPOINT).exists()
                else f"run again with --out {run_dir.path} --force"
            )
            fail(f"{e}; free some space and {again}")
        finally:
            if isinstance(phases, LineReporter):
                phases.close()
    if not quiet:
        print_final(run_dir.path, time.perf_counter() - t0)
    if nonfinite:
        err_console.print(
            f"[bold red]warning:[/] training loss was NaN or Inf in {len(nonfinite)} round(s) "
            f"(first: round {nonfinite[0]}); the run diverged: lower local.lr or check the data",
            highlight=False,
        )


def print_estimates(sim: Any, start: int) -> None:
    """Before the run: what the method's known heavy phases (the distillation methods') will
    cost on this machine, from a short timed probe (``Simulation.heavy_phases``)."""
    rounds = sim.cfg.rounds - start
    costs = [c for c in sim.heavy_phases() if c.per_round or start == 0]
    total = 0.0
    for c in costs:
        seconds = c.seconds * (rounds if c.per_round else 1)
        total += seconds
        each = f"{duration(c.seconds)} a round x {rounds} rounds = " if c.per_round else ""
        say(f"estimate: {c.what}: about {each}{duration(seconds)} on this machine")
    if len(costs) > 1:
        say(f"estimate: heavy phases about {duration(total)} in all")
    if total > 120:
        say(
            "  (a faster first look: --config configs/distill_cpu.toml, fewer distillation "
            "iterations and images; hyperfed list algorithms says what drives the cost)"
        )


class ListWhat(str, Enum):
    algorithms = "algorithms"
    models = "models"
    datasets = "datasets"
    partitions = "partitions"


@app.command("list")
def list_(
    what: Annotated[ListWhat, typer.Argument(help="What to list.")],
    input_shape: Annotated[
        str, typer.Option(help="Input shape C,H,W for model parameter counts.")
    ] = "3,32,32",
    classes: Annotated[int, typer.Option(help="Number of classes for parameter counts.")] = 100,
) -> None:
    """List algorithms, models (with parameter counts), datasets or partitions."""
    _list_table(what, input_shape, classes)


def _skip_faulty(kind: str, name: str, e: Exception) -> None:
    why = " ".join(str(e).split()) or type(e).__name__
    logging.getLogger("hyperfed.plugins").warning(
        "skipping %s %s: %s: %s", kind, name, type(e).__name__, why
    )


def _list_table(what: ListWhat, input_shape: str, classes: int) -> None:
    table = Table()
    if what is ListWhat.algorithms:
        from hyperfed.algorithms import registry
        from hyperfed.algorithms.base import hparam_fields, hparam_sources

        mark = {"paper": "P", "chosen": "C", "unmarked": "?"}
        table.caption = (
            "default from: P = the method's paper, C = chosen here (reasons in the method's "
            "docstring)"
        )
        table.add_column("name")
        table.add_column("description")
        table.add_column("hyperparameters (defaults)")
        table.add_column("follows")
        for name, alg in sorted(registry().items()):
            try:
                sources = hparam_sources(alg.hparams)
                hp = ", ".join(
                    f"{k}={v} [{mark[sources[k].split()[0]]}]"
                    for k, v in hparam_fields(alg.hparams).items()
                )
                row = [escape(alg.summary), escape(hp) or "-", escape(alg.reference or "the paper")]
            except Exception as e:  # a plugin's broken entry: skipped, named; never the listing
                _skip_faulty("algorithm", name, e)
                continue
            table.add_row(name, *row)
    elif what is ListWhat.models:
        from hyperfed.models.zoo import (
            ModelInputError,
            build_model,
            check_input,
            describe_model,
            model_names,
            param_count,
        )

        try:
            shape = tuple(int(s) for s in input_shape.split(","))
        except ValueError:
            fail(f"--input-shape {input_shape!r}: expected integers C,H,W, e.g. 3,32,32")
        table.title = f"parameter counts for input {shape}, {classes} classes"
        table.add_column("name")
        table.add_column("parameters", justify="right")
        table.add_column("description")
        for name in model_names():
            try:
                check_input(name, shape)
                count = f"{param_count(build_model(name, shape, classes)):,}"
            except ModelInputError as e:
                count = f"n/a ({e})"
            except Exception as e:  # a plugin's model that fails to build: skipped, named
                _skip_faulty("model", name, e)
                continue
            table.add_row(name, count, escape(describe_model(name)))
    elif what is ListWhat.datasets:
        from hyperfed.data.sources import dataset_entries

        table.add_column("name")
        table.add_column("description")
        for name, entry in dataset_entries().items():
            table.add_row(name, getattr(entry, "description", ""))
    else:
        from hyperfed.data.partition import PARTITIONS

        table.add_column("name")
        for p in PARTITIONS:
            table.add_row(p)
        table.add_row("natural (the dataset's own writers: synthetic, npz client, hf_disk)")
        table.add_row("flwr:<Partitioner> (flwr-datasets; arguments in partition.flwr)")
    console.print(table)


@app.command()
def export(
    format_: Annotated[
        str, typer.Option("--format", help="pfllib, flbench or npz (docs/export.md).")
    ],
    out: Annotated[Path, typer.Option(help="Folder to write (must be empty unless --force).")],
    config: ConfigOpt = None,
    set_: SetOpt = None,
    force: Annotated[
        bool, typer.Option(help="Write into a non-empty --out, replacing the export's files.")
    ] = False,
) -> None:
    """Write the federation `hyperfed run` would train on (each client's exact train / val /
    test samples) for PFLlib, FL-bench or hyperfed's npz reader."""
    import torch

    from hyperfed.config import load_config
    from hyperfed.export import check_target, export_federation
    from hyperfed.runtime.simulate import load_federation

    check_target(out, format_, force)  # before any work
    cfg = load_config(config, set_ or [])
    data = load_federation(cfg, torch.device("cpu"))
    with Progress(
        TextColumn("[bold blue]export"), MofNCompleteColumn(), BarColumn(), console=console
    ) as progress:
        task = progress.add_task("clients", total=data.num_clients)
        tick = lambda done, total: progress.update(task, completed=done)  # noqa: E731
        names = export_federation(data, out, format_, config=cfg, force=force, progress=tick)
    console.print(f"wrote {', '.join(names)} in {out}/ (README.txt says what is where)")


@app.command()
def schema() -> None:
    """Print the config's JSON schema (for editor completion of TOML / YAML config files)."""
    import json

    from hyperfed.config import ExperimentConfig

    schema = ExperimentConfig.model_json_schema()
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}
    print(json.dumps(schema, indent=2))


@app.command()
def tune(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    trials: Annotated[int, typer.Option(help="Finished trials the study holds at the end.")] = 20,
    out: Annotated[
        Path, typer.Option(help="Study folder (study.db, best.toml, trials.json, plots).")
    ] = Path("tune/study"),
    parallel: Annotated[int, typer.Option(help="Worker processes on the same study.")] = 1,
    seed: Annotated[int, typer.Option(help="The TPE sampler's seed.")] = 0,
) -> None:
    """Tune a method's local lr and its paper's hyperparameters on the validation split.

    hyperfed tune --set algorithm.name=moon --trials 20 --out tune/moon; the same command
    resumes a killed study. The test split is never evaluated while tuning."""
    from hyperfed.tune import NoTrialCompleted, TuneRequest, search_space
    from hyperfed.tune import tune as run_tune

    request = TuneRequest(config, tuple(set_ or []), trials, seed)
    cfg = request.base_config()
    space = search_space(cfg.algorithm.name, cfg.hparams())
    say(f"tuning on the validation split: {', '.join(space)}")
    try:
        with batch_bar("tune", total=trials, echo="trials") as (on_progress, _):
            best = run_tune(out, request, parallel=parallel, on_progress=on_progress)
    except NoTrialCompleted as e:  # a HyperfedError that exits 1, after each failure's line
        for name, why in e.failed:
            print_failed(name, why)
        fail(str(e), code=1)
    except KeyboardInterrupt:
        say(f"interrupted; the same command resumes the study in {out}", err=True)
        raise typer.Exit(130) from None
    for name, why in best["failed"]:
        print_failed(name, why)
    if best["failed"]:
        say(
            f"tune {out}: {best['ended']} trials ended, {len(best['failed'])} failed (a failed "
            "trial counts in --trials; a larger --trials runs more)"
        )
    values = ", ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in best["best"].items()
    )
    say(f"best of {best['completed']} completed trials: val acc {best['value']:.4f} with {values}")
    say(f"wrote {out / 'best.toml'} (a config fragment) and the study's plots")


@app.command()
def sweep(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    seeds: Annotated[
        str | None, typer.Option(help="Seeds to run every setting with, e.g. 0,1,2.")
    ] = None,
    out: Annotated[
        Path, typer.Option(help="Sweep folder (one run directory per point of the grid).")
    ] = Path("sweeps/sweep"),
    parallel: Annotated[int, typer.Option(help="Runs at a time (processes).")] = 1,
    threads: Annotated[
        int | None, typer.Option(help="torch threads per run (default: cores // parallel).")
    ] = None,
    drop_checkpoints: Annotated[
        bool,
        typer.Option(
            "--drop-checkpoints",
            help="Delete each finished run's checkpoint.pt (only --resume needs it), also of "
            "runs finished before; the metrics and config stay.",
        ),
    ] = False,
) -> None:
    """Run a grid of settings x seeds, resumable: --set key=v1,v2 makes an axis.

    hyperfed sweep --set algorithm.name=fedavg,local --seeds 0,1,2 --parallel 2 --out S;
    call it again with only --out S to resume; hyperfed report S gives mean ± std over seeds."""
    from hyperfed.sweep import checkpoint_bytes, run_sweep

    seed_list = parse_seeds(seeds) if seeds else []
    if out.exists() and not out.is_dir():
        fail(f"--out {out} is a file; choose a folder for the sweep")
    try:
        with batch_bar("sweep", echo="runs ended") as (on_progress, on_running):
            result = run_sweep(
                out,
                config=config,
                sets=set_ or [],
                seeds=seed_list,
                parallel=parallel,
                threads=threads,
                on_progress=on_progress,
                drop_checkpoints=drop_checkpoints,
                on_running=on_running,
            )
    except KeyboardInterrupt:
        say(f"interrupted; resume with: hyperfed sweep --out {out}", err=True)
        raise typer.Exit(130) from None
    for name, why in result.failed:
        print_failed(name, why)
    say(f"sweep {out}: {run_counts(len(result.done), len(result.failed), len(result.skipped))}")
    kept = checkpoint_bytes(out)
    if kept:
        say(
            f"checkpoints below {out}: {kept / 1e6:.0f} MB (--drop-checkpoints deletes the "
            "finished runs' ones)"
        )
    if result.failed:
        raise typer.Exit(1)
    say(f"compare with: hyperfed report {out}")


@app.command()
def reproduce(
    target: Annotated[
        str | None, typer.Argument(help="SEED:TABLE, e.g. 000:table1 (--list shows them).")
    ] = None,
    list_targets: Annotated[bool, typer.Option("--list", help="List the targets.")] = False,
    seeds: Annotated[str, typer.Option(help="Seeds, e.g. 0,1,2.")] = "0,1,2",
    scale: Annotated[
        str,
        typer.Option(
            help="cpu (Fashion-MNIST, minutes), cpu-hard (less data a client, so Local is off "
            "the ceiling; where --list shows one) or paper (the paper's sizes)."
        ),
    ] = "cpu",
    parallel: Annotated[int, typer.Option(help="Runs at a time (processes).")] = 1,
    methods: Annotated[
        str | None,
        typer.Option(help="Only these of the target's methods, e.g. fedavg,mh_pfedhn."),
    ] = None,
    out: Annotated[Path, typer.Option(help="Folder for the target's sweep.")] = Path("reproduce"),
    configs: Annotated[Path, typer.Option(help="The repository's configs/ folder.")] = Path(
        "configs"
    ),
    tuned: Annotated[
        bool,
        typer.Option(
            help="Also tune every method (same --trials each, validation split) and run its "
            "seeds with the best values; the table shows default and tuned rows."
        ),
    ] = False,
    trials: Annotated[int, typer.Option(help="Tuning trials per method (--tuned).")] = 12,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Print the runs (and what the folder holds) and an estimate of their time on "
            "this machine from a short probe of each method; run nothing.",
        ),
    ] = False,
) -> None:
    """Run a paper table's comparison and print it beside the paper's figures."""
    from hyperfed.reproduce import ReproduceRequest, dry_run_lines, run_reproduce

    if list_targets or target is None:
        _print_targets(out)
        if target is None:
            return
    assert target is not None
    seed_list = parse_seeds(seeds)
    request = ReproduceRequest.make(
        target,
        out=out,
        seeds=seed_list,
        scale=scale,
        methods=methods,
        configs=configs,
        tuned=tuned,
        trials=trials,
    )
    try:
        if dry_run:
            for line in dry_run_lines(request):
                say(line)
            return
        bar = lambda label: batch_bar(label, eta=False)  # noqa: E731
        outcome = run_reproduce(request, parallel, bar)
    except KeyboardInterrupt:
        say(f"interrupted; the same command resumes it ({request.folder})", err=True)
        raise typer.Exit(130) from None
    result = outcome.runs
    say(outcome.text)
    say(f"wrote {request.folder / 'reproduce.md'} and {request.folder / 'report'}/")
    for name, why in [*outcome.failed_trials, *result.failed]:
        print_failed(name, why)
    counts = run_counts(len(result.done), len(result.failed), len(result.skipped))
    say(f"{request.target.key} runs: {counts}")
    if result.failed:
        raise typer.Exit(1)


def _print_targets(out: Path) -> None:
    """``reproduce --list``: every target, its methods, scales and recorded estimate."""
    from hyperfed.reproduce import TARGETS, list_estimate

    table = Table("target", "what", "methods", "config", "scales", "runs", "estimate")
    table.columns[0].no_wrap = True  # a key is what --list is read for
    table.caption = (
        "runs: methods x 3 seeds; estimate: on this machine, one at a time, as the last "
        "--dry-run of the target probed it (per scale)"
    )
    for t in TARGETS.values():
        table.add_row(
            t.key,
            t.title,
            ", ".join(t.methods),
            t.config,
            ", ".join(t.scales()),
            f"{3 * len(t.methods)}",
            escape(list_estimate(t, out)),
        )
    console.print(table)


@app.command()
def report(
    runs: Annotated[
        list[Path], typer.Argument(help="Run directories, or sweep folders (every run in them).")
    ],
    out: Annotated[
        Path | None,
        typer.Option(help="Folder for report.md and the plots (default: <first input>/report)."),
    ] = None,
    target: Annotated[
        float | None, typer.Option(help="Also report rounds to reach this mean accuracy (0-1).")
    ] = None,
    force: Annotated[
        bool, typer.Option(help="Replace the report an earlier call wrote in the same folder.")
    ] = False,
    keep: Annotated[
        Path | None,
        typer.Option(
            help="Also copy the runs' small files (config, metrics, studies; no checkpoints) "
            "here, e.g. results/004-table1, so a fresh clone can redraw the report."
        ),
    ] = None,
) -> None:
    """Compare runs: mean ± std over seeds, a row per run, and accuracy plots (vs round, bytes,
    FLOPs), written to <first input>/report/ unless --out says where."""
    from hyperfed.report import keep_summaries, report_text, run_summary, write_report
    from hyperfed.sweep import sweep_runs

    missing = [str(r) for r in runs if not r.exists()]
    if missing:
        fail(f"no such run directory or sweep folder: {', '.join(missing)}")
    if keep is not None:
        if len(runs) != 1 or not runs[0].is_dir():
            fail("--keep copies one folder's runs: give exactly one run directory or folder")
        kept = keep_summaries(runs[0], keep)
        console.print(f"kept {len(kept)} files in {keep}/")
    runs_given = list(runs)
    runs = sweep_runs(runs) or runs
    if target is not None and not 0 < target <= 1:
        fail(f"--target {target}: a mean accuracy between 0 and 1 (e.g. 0.8 for 80%)")
    if out is None:  # inside the first input: reports of other folders never collide
        first = runs_given[0]
        out = (first if first.is_dir() else first.parent) / "report"
    if out.exists() and not out.is_dir():
        fail(f"--out {out} is a file; choose a folder for the report")
    if (out / "report.md").exists() and not force:
        fail(f"{out} already holds a report; --force replaces it, or choose another --out")
    path = write_report(runs, out, target)
    say(report_text([run_summary(r) for r in runs], target))
    say(f"wrote {path} and plots in {out}/")


@app.command()
def bench(
    clients: Annotated[int, typer.Option(help="Number of clients.")] = 20,
    samples: Annotated[int, typer.Option(help="Training samples per client.")] = 900,
    shape: Annotated[str, typer.Option(help="Input shape C,H,W.")] = "3,32,32",
    classes: Annotated[int, typer.Option(help="Number of classes.")] = 100,
    hetero: Annotated[
        bool, typer.Option(help="LeNet, VGG8, ResNet-10/12/18 spread evenly.")
    ] = False,
    rounds: Annotated[int, typer.Option(help="Timed rounds per path (after one warm-up).")] = 2,
    repeat: Annotated[
        int,
        typer.Option(
            help="Time every path this many times in turn; medians and the ratio's range."
        ),
    ] = 1,
    modes: Annotated[
        str,
        typer.Option(
            help="Paths to time, comma-separated: reference, loop, loop-nchw, vmap, graphs."
        ),
    ] = "reference,loop,vmap",
    algorithm: Annotated[str, typer.Option(help="Algorithm to time.")] = "mh_pfedhn",
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
    batch_size: Annotated[int, typer.Option(help="Local batch size.")] = 64,
    epochs: Annotated[int, typer.Option(help="Local epochs.")] = 2,
    profile: Annotated[
        bool, typer.Option(help="First print a torch.profiler table of one engine round.")
    ] = False,
    models: Annotated[
        str | None,
        typer.Option(
            help="Instead: time one client's local step per model (comma-separated, or all): "
            "FLOP/s against the machine's matmul FLOP/s."
        ),
    ] = None,
) -> None:
    """Time the papers' per-client loop against the engine on the same workload."""
    from hyperfed.bench import parse_models, run_benchmark, step_table

    printer = lambda line: console.print(line, highlight=False, soft_wrap=True)  # noqa: E731
    if models is not None:
        step_table(
            parse_models(models),
            shape=tuple(int(s) for s in shape.split(",")),
            classes=classes,
            batch_size=batch_size,
            device=device,
            printer=printer,
        )
        return
    run_benchmark(
        clients=clients,
        samples=samples,
        shape=tuple(int(s) for s in shape.split(",")),
        classes=classes,
        hetero=hetero,
        rounds=rounds,
        modes=tuple(m.strip() for m in modes.split(",")),
        algorithm=algorithm,
        device=device,
        batch_size=batch_size,
        epochs=epochs,
        profile=profile,
        repeat=repeat,
        printer=printer,
    )


class Distance(str, Enum):
    cosine = "cosine"
    l2 = "l2"


@app.command()
def attack(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    client: Annotated[int, typer.Option(help="The client whose upload is attacked.")] = 0,
    images: Annotated[
        int, typer.Option(help="Also invert this many of its training images' gradients.")
    ] = 4,
    round_: Annotated[
        int, typer.Option("--round", help="Attack this round's upload (earlier rounds run first).")
    ] = 1,
    distance: Annotated[
        Distance,
        typer.Option(help="cosine (Geiping et al., Adam) or l2 (iDLG as published, L-BFGS)."),
    ] = Distance.cosine,
    iters: Annotated[int, typer.Option(help="Optimization steps per reconstruction.")] = 500,
    out: Annotated[
        Path | None, typer.Option(help="Folder for attack.png, attack.json, config.toml.")
    ] = None,
) -> None:
    """Gradient inversion (iDLG, seed 000 Fig. 6): what the server can rebuild from an upload."""
    from hyperfed.attack import run_attack, save_report
    from hyperfed.config import load_config

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    if out is not None and out.exists() and not out.is_dir():  # before the attack's work
        fail(f"--out {out} is a file; choose a folder")
    with Progress(
        TextColumn("[bold blue]{task.description}"),
        MofNCompleteColumn(),
        BarColumn(),
        TimeElapsedColumn(),
        console=console,
    ) as progress:

        def tick(label: str, total: int) -> Callable[[], None]:
            task = progress.add_task(label, total=total)
            return lambda: progress.update(task, advance=1)

        cfg = load_config(config, set_ or [])
        report = run_attack(
            cfg,
            client=client,
            images=images,
            round_=round_,
            distance=distance.value,
            iters=iters,
            progress=tick,
        )
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    try:
        paths = save_report(report, out or Path("runs") / f"{stamp}-attack", cfg)
    except OSError as e:
        fail(f"--out {out}: cannot write the attack's files there ({e.strerror or e})")
    table = Table(
        title=f"Gradient inversion of client {report.client} ({report.model}), "
        f"{report.algorithm}, round {report.round}, {report.local_steps} local steps"
    )
    cols = (
        "target",
        "label (true / inferred)",
        "PSNR dB",
        "chance dB",
        "mean image dB",
        "distance",
    )
    for col in cols:
        table.add_column(col, justify="left" if col == "target" else "right")
    for r in report.rows:
        true = "mixed" if r.true_label is None else str(r.true_label)
        table.add_row(
            r.target,
            f"{true} / {r.label}",
            f"{r.psnr:.1f}",
            f"{r.chance:.1f}",
            f"{r.mean_image:.1f}",
            f"{r.distance:.3g}",
        )
    console.print(table)
    console.print(f"wrote {', '.join(str(p) for p in paths)}")


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    app()
