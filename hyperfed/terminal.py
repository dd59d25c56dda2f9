"""What every command prints with: the consoles, the one-line failure, the final table.

Text that comes from the user or from an error (paths, ``--set`` values, a run's last error
line) goes through :func:`say` or :func:`print_failed`, which never read it as rich markup: a
path such as ``[/data]`` would otherwise be taken for a closing tag and crash the command.

Shared by ``hyperfed`` (cli.py) and ``hyperfed flower`` (deploy/cli.py), so neither imports the
other's private helpers.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.progress import Progress, TaskID
from rich.table import Table

console = Console()
err_console = Console(stderr=True)


def fail(message: str, code: int = 2) -> NoReturn:
    """Print ``error: message`` on stderr (one line) and exit with ``code``."""
    from rich.markup import escape

    # escape: messages quote paths and lists in [...], which rich would read as markup
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def say(line: str, *, err: bool = False) -> None:
    """One plain line on stdout (``err``: stderr), printed literally (no markup, no
    highlighting)."""
    (err_console if err else console).print(line, highlight=False, markup=False, soft_wrap=True)


def print_failed(name: str, why: str) -> None:
    """``failed: <run>: <its one-line error>`` on stderr, the run's name and error printed
    literally (``why`` may quote paths in [...])."""
    from rich.text import Text

    why = why.removeprefix("error: ")
    line = Text.assemble(("failed:", "bold red"), f" {name}: {why}")
    err_console.print(line, highlight=False, soft_wrap=True)


def run_counts(finished: int, failed: int, skipped: int) -> str:
    """The summary of a batch of runs: ``2 finished, 1 failed, 3 skipped (finished before)``."""
    return f"{finished} finished, {failed} failed, {skipped} skipped (finished before)"


class RichPhases:
    """A :class:`hyperfed.progress.Reporter` drawing each long phase as a bar nested under the
    run's bars in ``progress`` (its first column shows the task's description; ``fields`` are
    the extra fields the other columns read). A phase appears once it has run ``show_after``
    seconds, so the many short ones (a round's aggregation) never flicker, and goes when it
    ends."""

    def __init__(self, progress: Progress, show_after: float = 0.5, **fields: Any) -> None:
        self.progress = progress
        self.show_after = show_after
        self.fields = fields

    def open(self, label: str, total: int | None, depth: int) -> _RichPhase:
        from rich.markup import escape

        text = f"{'  ' * depth}└ {escape(label)}"
        task = self.progress.add_task(text, total=total, visible=False, **self.fields)
        return _RichPhase(self.progress, task, self.show_after)


class _RichPhase:
    def __init__(self, progress: Progress, task: TaskID, show_after: float) -> None:
        self.progress = progress
        self.task = task
        self.timer = threading.Timer(show_after, self._show)
        self.timer.daemon = True
        self.timer.start()

    def _show(self) -> None:
        self.progress.update(self.task, visible=True)

    def advance(self, n: int = 1) -> None:
        self.progress.update(self.task, advance=n)

    def close(self) -> None:
        self.timer.cancel()
        self.timer.join()
        self.progress.remove_task(self.task)


# what the final table's title says was scored, by the record's ``scores`` (the method's
# declaration, algorithms.base.SCORED_MODELS); a record without it names no model
SCORED_WORDS = {
    "personalized": "each client's own model",
    "global": "the global model, one per architecture",
    "local": "each client's model after its local training",
}


def final_title(record: dict[str, Any]) -> str:
    """``Test accuracy at round 3 (the global model, one per architecture)``: the model named
    is the one the method's evaluation scored."""
    scored = SCORED_WORDS.get(str(record.get("scores")))
    return f"Test accuracy at round {record['round']}" + (f" ({scored})" if scored else "")


def best_label(summary: dict[str, Any]) -> str:
    """``best mean (round 7, picked on val)``, or ``(round 7, picked on test)`` where the
    clients hold no validation split to choose it on (the final table's caption says so)."""
    on = "val" if summary.get("best_by") == "val" else "test"
    return f"best mean (round {summary['best_round']}, picked on {on})"


def print_final(path: Path, seconds: float) -> None:
    """Each client's test accuracy at the final round, the means, spread and best round."""
    from hyperfed.report import run_summary

    s = run_summary(path)
    final = s["records"][-1]
    table = Table(title=final_title(final))
    table.add_column("client", justify="right")
    table.add_column("model")
    table.add_column("accuracy", justify="right")
    archs = final.get("client_arch") or ["?"] * len(final["client_acc"])
    for i, (a, arch) in enumerate(zip(final["client_acc"], archs)):
        table.add_row(str(i), arch, "missing" if a is None else f"{a:.4f}")
    table.add_section()
    table.add_row("mean", "", f"[bold]{s['final_mean_acc']:.4f}[/]")
    table.add_row("weighted", "", f"{s['final_weighted_acc']:.4f}")
    table.add_row("min / max", "", f"{s['min_acc']:.4f} / {s['max_acc']:.4f}")
    table.add_row(best_label(s), "", f"{s['best_mean_acc']:.4f}")
    if s.get("best_by") != "val":
        table.caption = (
            "no validation split: the best round is picked on the test set (headline: the "
            "final round; partition.val_fraction > 0 picks the best on validation)"
        )
    console.print(table)
    console.print(
        f"upload {s['up_mb_per_client_round']:.4f} MB per client per round; "
        f"{seconds:.1f} s; results in {path}/ (summary.md, metrics.jsonl, plots)"
    )
