"""Tables and plots from run directories (``hyperfed report``, and each run's summary.md).

The headline is the mean per-client test accuracy at the *final* evaluated round; the best
round is reported beside it, labelled as such, never instead (DESIGN).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hyperfed.config import flat_keys
from hyperfed.errors import HyperfedError
from hyperfed.runtime.rundir import MACHINE, SUMMARY, machine_label, read_machines, read_metrics

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ReportError(HyperfedError, ValueError):
    pass


def _mb(n: float) -> str:
    return f"{n / 1e6:.3f}"


def run_algorithm(path: str | Path) -> str:
    """The method a run directory's config.toml names ("" without one)."""
    config = Path(path) / "config.toml"
    if not config.exists():
        return ""
    return str(tomllib.loads(config.read_text()).get("algorithm", {}).get("name", ""))


# A run has plateaued when the mean accuracy over its last window of rounds (10% of its rounds,
# at least one evaluation interval) is less than PLATEAU_POINTS above the window before.
PLATEAU_WINDOW = 0.1
PLATEAU_POINTS = 0.5


# The metric and the two per-row labels, defined once (report.md, reproduce.md, docs/runs.md).
METRIC_NOTE = (
    "Mean acc (final) is the mean over all clients of each client's test accuracy on its own "
    "test split at the last evaluated round (weighted: the same, weighted by test samples); "
    "best is the best evaluated round, chosen on the validation split where the clients hold "
    "one (`by val`). *scores* is the model each method's evaluation scores: global (one "
    "global model), personalized (each client's own model) or local (each client's model "
    "after its latest local training). *plateau*: the mean accuracy over the last 10% of "
    f"rounds rose by less than {PLATEAU_POINTS} points over the 10% before (for a row of "
    "several seeds: its mean over seeds did; for a held-out-client run, both its training "
    "phase and its adaptation rounds did); a row marked not converged (with that rise) is "
    "not ranked."
)
# the report's over-seeds table also carries the plateau window's mean (reproduce's does not)
WINDOW_NOTE = (
    " Mean acc (last 10%) averages the mean accuracy over the evaluations in the plateau "
    "rule's last window: a steadier score for rows that swing between evaluations."
)


def last_windows(
    records: list[dict[str, Any]], window: float = PLATEAU_WINDOW
) -> tuple[list[float], list[float]]:
    """Mean accuracies (points) of the evaluations in the last window of rounds and in the
    window before it, each ``window`` of the run's rounds but at least one evaluation interval."""
    rounds = [int(r["round"]) for r in records]
    if len(rounds) < 2:
        return [100 * r["mean_acc"] for r in records], []
    last = rounds[-1]
    width = max(math.ceil(window * last), rounds[-1] - rounds[-2])
    now = [100 * r["mean_acc"] for r, x in zip(records, rounds) if x > last - width]
    before = [
        100 * r["mean_acc"] for r, x in zip(records, rounds) if last - 2 * width < x <= last - width
    ]
    return now, before


def plateau_gain(records: list[dict[str, Any]], window: float = PLATEAU_WINDOW) -> float | None:
    """Mean accuracy (points) of the last window of rounds minus that of the window before;
    None when the run has too few evaluated rounds to tell (fewer than two windows)."""
    now, before = last_windows(records, window)
    if not now or not before:
        return None
    return sum(now) / len(now) - sum(before) / len(before)


def adaptation_rounds(cfg: dict[str, Any]) -> int:
    """The final rounds of a held-out-client run (``algorithm.<name>.adapt_rounds``, MH-pFedHN's
    and PeFLL's ``new_clients`` mode) in which nothing shared trains; 0 for any other run."""
    algorithm = cfg.get("algorithm", {})
    own = algorithm.get(algorithm.get("name", ""), {})
    return int(own.get("adapt_rounds", 0) or 0) if isinstance(own, dict) else 0


def held_out_gain(records: list[dict[str, Any]], adapt_rounds: int) -> float | None:
    """The last-window gain of a held-out-client run: the larger of its training phase's (the
    rounds before the final ``adapt_rounds``, where the shared model learns) and its
    adaptation phase's (where only new clients' parts may move). The last 10% of such a run can
    be frozen adaptation rounds (PeFLL generates new clients' models with no training), so its
    own window would call a still-rising training curve a plateau. None when the training
    phase has too few evaluations to tell."""
    last = int(records[-1]["round"]) if records else 0
    training = [r for r in records if int(r["round"]) <= last - adapt_rounds]
    adapting = [r for r in records if int(r["round"]) > last - adapt_rounds]
    train_gain = plateau_gain(training)
    if train_gain is None:
        return None
    adapt_gain = plateau_gain(adapting)
    return train_gain if adapt_gain is None else max(train_gain, adapt_gain)


def plateaued(gain: float | None, points: float = PLATEAU_POINTS) -> bool:
    """Whether a run whose last-window gain is ``gain`` counts as converged."""
    return gain is not None and gain < points


def row_gain(gains: list[float | None]) -> float | None:
    """The last-window gain of a row's seed-mean curve (the mean of its seeds' gains; None when
    a seed has too few evaluations to tell)."""
    if not gains or any(g is None for g in gains):
        return None
    return sum(g for g in gains if g is not None) / len(gains)


def run_summary(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    records = read_metrics(path)
    metrics = path / "metrics.jsonl"
    if not records and metrics.is_file() and metrics.stat().st_size:
        raise ReportError(
            f"{metrics}: line 1 is not a record hyperfed wrote (corrupt or edited); "
            "nothing to report"
        )
    if not records:
        raise ReportError(f"{path}: no metrics.jsonl records; is this a hyperfed run directory?")
    try:
        cfg = (
            tomllib.loads((path / "config.toml").read_bytes().decode())
            if (path / "config.toml").exists()
            else {}
        )
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ReportError(f"{path / 'config.toml'}: not a readable config ({e})") from None
    final = records[-1]
    # the best round is chosen on the validation split where the clients hold one
    best_by = "val" if all(r.get("val_mean_acc") is not None for r in records) else "test"
    best = max(records, key=lambda r: r["val_mean_acc" if best_by == "val" else "mean_acc"])
    rounds = max(1, final["round"])
    adapt = adaptation_rounds(cfg)
    gain = held_out_gain(records, adapt) if adapt else plateau_gain(records)
    return {
        "run": path.name,
        "path": str(path),
        "algorithm": cfg.get("algorithm", {}).get("name", "?"),
        "dataset": cfg.get("dataset", {}).get("name", "?"),
        "clients": final.get("num_clients"),
        "round": final["round"],
        # which model the evaluation scored (algorithms.base.SCORED_MODELS); "?" for runs
        # recorded before records carried it
        "scores": final.get("scores", "?"),
        "last_window_gain": gain,
        "converged": plateaued(gain),
        # evaluated rounds whose training loss was NaN / Inf, and client updates the server
        # rejected: either one in a default configuration is a bug, and the run ranks nothing
        "nonfinite_rounds": sum(bool(r.get("nonfinite_loss")) for r in records),
        "rejected_updates": sum(_count(r.get("rejected")) for r in records),
        "final_mean_acc": final["mean_acc"],
        # the plateau rule's last window, averaged: a steadier score for a run that swings
        # between evaluations (it is the number that rule compares)
        "window_mean_acc": statistics.fmean(last_windows(records)[0]) / 100,
        "final_weighted_acc": final["weighted_acc"],
        "min_acc": final["min_acc"],
        "max_acc": final["max_acc"],
        "std_acc": final["std_acc"],
        "best_mean_acc": best["mean_acc"],
        "best_round": best["round"],
        "best_by": best_by,
        "config": cfg,
        "up_mb_per_client_round": final.get("bytes_up_per_client", 0) / 1e6,
        "up_mb_total": final.get("bytes_up_total", 0) / 1e6,
        "down_mb_total": final.get("bytes_down_total", 0) / 1e6,
        "gflops_per_round": final.get("flops_total", 0) / rounds / 1e9,
        "server_gflops_per_round": final.get("flops_server_total", 0) / rounds / 1e9,
        "seconds": final.get("seconds"),
        # one label per start or resume (machine.jsonl; empty for runs that predate it)
        "machines": [machine_label(m) for m in read_machines(path)],
        "records": records,
    }


def unsound(summary: dict[str, Any]) -> bool:
    """Whether a run's training went non-finite or had an update rejected (it ranks nothing)."""
    return bool(summary.get("nonfinite_rounds") or summary.get("rejected_updates"))


def _count(value: Any) -> int:
    """A record's ``rejected`` field: a list of client ids (a count in older records)."""
    return len(value) if isinstance(value, list) else int(value or 0)


def first_reaching(records: list[dict[str, Any]], target: float) -> dict[str, Any] | None:
    """The first evaluated round whose mean accuracy reaches ``target``."""
    return next((r for r in records if r["mean_acc"] >= target), None)


def rounds_to_reach(records: list[dict[str, Any]], target: float) -> int | None:
    r = first_reaching(records, target)
    return None if r is None else int(r["round"])


def plateau_cell(s: dict[str, Any]) -> str:
    """ "yes", or "not converged (+g)" with the last window's gain in points; a run whose
    training went non-finite or had updates rejected says so."""
    gain = s.get("last_window_gain")
    cell = (
        "too few evaluations"
        if gain is None
        else "yes"
        if s.get("converged")
        else f"not converged ({gain:+.2f})"
    )
    if unsound(s):
        cell += (
            f"; **non-finite loss in {s.get('nonfinite_rounds', 0)} evaluated rounds, "
            f"{s.get('rejected_updates', 0)} updates rejected**"
        )
    return cell


# what ``--target`` adds to each run's row, in order (the first reached round, then what was
# spent until it)
TARGET_COLUMNS = ("rounds", "upload MB", "MB up + down", "TFLOPs (clients)", "TFLOPs (server)")


def markdown_table(summaries: list[dict[str, Any]], target: float | None = None) -> str:
    head = (
        "| run | algorithm | scores | plateau | dataset | clients | round | mean acc (final) "
        "| weighted | min | max "
        "| std | best mean acc (round) | upload MB/client/round | upload MB total | GFLOPs/round "
        "(clients) | GFLOPs/round (server) |"
    )
    if target is not None:  # seed 002 Fig. 5: the cost to get there (bytes and FLOPs, both sides)
        head += "".join(f" {name} to {target:.0%} |" for name in TARGET_COLUMNS)
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for s in summaries:
        row = (
            f"| {s['run']} | {s['algorithm']} | {s['scores']} | {plateau_cell(s)} "
            f"| {s['dataset']} | {s['clients']} | {s['round']} "
            f"| {s['final_mean_acc']:.4f} | {s['final_weighted_acc']:.4f} | {s['min_acc']:.4f} "
            f"| {s['max_acc']:.4f} | {s['std_acc']:.4f} | {s['best_mean_acc']:.4f} "
            f"({s['best_round']}{', by val' if s.get('best_by') == 'val' else ''}) | {s['up_mb_per_client_round']:.4f} | {s['up_mb_total']:.2f} "
            f"| {s['gflops_per_round']:.3f} | {s['server_gflops_per_round']:.3f} |"
        )
        if target is not None:
            r = first_reaching(s["records"], target)
            if r is None:
                row += " not reached |" + " — |" * (len(TARGET_COLUMNS) - 1)
            else:
                up, down = r.get("bytes_up_total", 0), r.get("bytes_down_total", 0)
                row += (
                    f" {r['round']} | {up / 1e6:.2f} | {(up + down) / 1e6:.2f} "
                    f"| {r.get('flops_total', 0) / 1e12:.3f} "
                    f"| {r.get('flops_server_total', 0) / 1e12:.3f} |"
                )
        lines.append(row)
    return "\n".join(lines) + "\n"


def group_by_seed(summaries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Runs whose resolved configs differ only by ``seed``, grouped (in first-seen order),
    each labelled by the config keys that differ between groups (e.g. ``algorithm.name``)."""
    groups: dict[str, list[dict[str, Any]]] = {}
    flats = []
    for s in summaries:
        flat = {k: v for k, v in flat_keys(s.get("config", {})).items() if k != "seed"}
        flats.append(flat)
        groups.setdefault(json.dumps(flat, sort_keys=True, default=str), []).append(s)
    keys = sorted({k for f in flats for k in f})
    varying = [k for k in keys if len({json.dumps(f.get(k), default=str) for f in flats}) > 1]
    # across methods every hyperparameter differs: name the method, not its settings; within
    # one method the hyperparameters that vary are the point
    one_method = "algorithm.name" not in varying
    out = []
    for members in groups.values():
        flat = flat_keys(members[0].get("config", {}))
        shown = [
            k
            for k in varying
            if one_method or not k.startswith("algorithm.") or k == "algorithm.name"
        ]
        if shown == ["algorithm.name"]:  # methods compared on one setting: just their names
            label = str(flat.get("algorithm.name"))
        else:
            label = ", ".join(f"{k}={flat.get(k)}" for k in shown)
        out.append({"label": label or members[0]["algorithm"], "runs": members})
    return out


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.pstdev(values) if len(values) > 1 else 0.0


def seed_table(groups: list[dict[str, Any]]) -> str:
    """Mean ± std over seeds (population std; n runs) of each group's final figures."""
    head = (
        "| setting | scores | plateau (seed mean) | n (seeds) | mean acc (final) "
        "| mean acc (last 10%) | weighted acc "
        "| best mean acc | "
        "upload MB total | GFLOPs/round (clients) |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for g in groups:
        runs = g["runs"]
        seeds = sorted(r.get("config", {}).get("seed", "?") for r in runs)
        cells = []
        for key, fmt in [
            ("final_mean_acc", ".4f"),
            ("window_mean_acc", ".4f"),
            ("final_weighted_acc", ".4f"),
            ("best_mean_acc", ".4f"),
            ("up_mb_total", ".2f"),
            ("gflops_per_round", ".3f"),
        ]:
            m, sd = _mean_std([float(r[key]) for r in runs])
            cells.append(f"{m:{fmt}} ± {sd:{fmt}}")
        best_by = {r.get("best_by") for r in runs}
        if best_by == {"val"}:
            cells[3] += " (val-chosen)"
        scored = "/".join(sorted({str(r.get("scores", "?")) for r in runs}))
        # the seed-mean curve's rise, as in reproduce's rows
        gain = row_gain([r.get("last_window_gain") for r in runs])
        stalled = sum(not r.get("converged") for r in runs)
        if plateaued(gain):
            plateau = "yes"
        elif gain is None:  # fewer than two windows of evaluations
            plateau = "not converged (too few evaluations to tell)"
        else:
            plateau = f"not converged ({stalled} of {len(runs)} rising, mean {gain:+.2f})"
        lines.append(
            f"| {g['label']} | {scored} | {plateau} | {len(runs)} ({', '.join(map(str, seeds))}) | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines) + "\n"


def _legend(fig: Any, ax: Any, entries: int) -> None:
    """A legend inside the axes for a few lines; beside them, in columns, for many (a sweep)."""
    if entries <= 8:
        ax.legend(fontsize=8)
        return
    cols = 1 + entries // 12
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0), ncol=cols)
    fig.set_size_inches(6.4 + 2.8 * cols, max(4.2, 0.16 * entries / cols + 1.0))


def plot_groups(groups: list[dict[str, Any]], out: Path) -> Path:
    """Mean accuracy vs round, the mean over seeds as a line and min..max over seeds as a band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for g in groups:
        curves: dict[int, list[float]] = {}
        for r in g["runs"]:
            for rec in r["records"]:
                curves.setdefault(int(rec["round"]), []).append(100 * rec["mean_acc"])
        xs = sorted(curves)
        mean = [sum(curves[x]) / len(curves[x]) for x in xs]
        (line,) = ax.plot(
            xs, mean, marker="o", markersize=3, label=f"{g['label']} (n={len(g['runs'])})"
        )
        lo, hi = [min(curves[x]) for x in xs], [max(curves[x]) for x in xs]
        ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.15, linewidth=0)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy (%), mean over seeds\n(band: min..max seed)")
    if len(groups) > 10:  # the default cycle repeats after 10 colours
        colours = [matplotlib.colormaps["tab20"](i / 19) for i in range(20)]
        for line, colour in zip(ax.get_lines(), colours):
            line.set_color(colour)
        for band, colour in zip(ax.collections, colours):
            band.set_color(colour)
    ax.grid(alpha=0.3)
    _legend(fig, ax, len(groups))
    fig.tight_layout()
    path = out / "accuracy_vs_round_over_seeds.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run_labels(summaries: list[dict[str, Any]]) -> list[str]:
    """A legend label per run: its folder name, or ``parent/name`` where names collide
    (``a/run`` and ``b/run``), with the algorithm."""
    names = [s["run"] for s in summaries]
    labels = []
    for s in summaries:
        name = s["run"]
        if names.count(name) > 1 and s.get("path"):
            name = f"{Path(s['path']).parent.name}/{name}"
        labels.append(f"{name} ({s['algorithm']})")
    return labels


def _x_value(record: dict[str, Any], x_key: str) -> float:
    if x_key == "flops":  # the clients' and the server's work together
        return float(record.get("flops_total", 0) + record.get("flops_server_total", 0))
    return float(record.get(x_key, 0))


def plot_runs(summaries: list[dict[str, Any]], out: Path) -> list[Path]:
    """Accuracy vs round, vs uploaded bytes and vs FLOPs (seed 002 Fig. 5 style): the mean
    over clients as a line, the worst and best client as a band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    paths = []
    labels = run_labels(summaries)
    for x_key, x_label, fname, scale in [
        ("round", "round", "accuracy_vs_round.png", 1.0),
        ("bytes_up_total", "uploaded MB (all clients, cumulative)", "accuracy_vs_upload.png", 1e6),
        ("flops", "client + server TFLOPs (cumulative)", "accuracy_vs_flops.png", 1e12),
    ]:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for s, label in zip(summaries, labels):
            records = s["records"]
            xs = [_x_value(r, x_key) / scale for r in records]
            ys = [100 * r["mean_acc"] for r in records]
            (line,) = ax.plot(xs, ys, marker="o", markersize=3, label=label)
            if all(r.get("min_acc") is not None and r.get("max_acc") is not None for r in records):
                lo = [100 * r["min_acc"] for r in records]
                hi = [100 * r["max_acc"] for r in records]
                ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.12, linewidth=0)
        if x_key == "round":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel(x_label)
        ax.set_ylabel("test accuracy (%): mean, band = min..max client")
        ax.grid(alpha=0.3)
        _legend(fig, ax, len(summaries))
        fig.tight_layout()
        p = out / fname
        fig.savefig(p, dpi=120)
        plt.close(fig)
        paths.append(p)
    return paths


LABEL_PLOT = "label_distribution.png"


def plot_label_distribution(
    counts: Any, path: str | Path, *, annotate_up_to: int = 400
) -> np.ndarray:
    """Heat map of how many samples of each class each client holds (clients x classes), with
    the (non-zero) counts written in the cells when there are at most ``annotate_up_to`` cells.
    Returns the matrix it drew (``FederatedData.label_counts()`` for a run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = np.asarray(counts, dtype=np.int64)
    if m.ndim != 2:
        raise ValueError(f"label counts must be a [clients, classes] matrix, got shape {m.shape}")
    k, c = m.shape
    fig, ax = plt.subplots(figsize=(min(2.0 + 0.45 * c, 16.0), min(1.5 + 0.35 * k, 16.0)))
    image = ax.imshow(m, aspect="auto", cmap="viridis", interpolation="nearest")
    fig.colorbar(image, ax=ax, label="samples")
    if 0 < m.size <= annotate_up_to:
        high = m.max() / 2 if m.max() else 1
        for i in range(k):
            for j in range(c):
                if not m[i, j]:
                    continue
                colour = "black" if m[i, j] > high else "white"
                ax.text(j, i, str(m[i, j]), ha="center", va="center", fontsize=7, color=colour)
    ax.set_xlabel("class")
    ax.set_ylabel("client")
    ax.set_title(f"samples per client and class ({k} clients, {int(m.sum())} samples)")
    if c <= 40:
        ax.set_xticks(range(c))
    if k <= 40:
        ax.set_yticks(range(k))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return m


def machine_note(summaries: list[dict[str, Any]]) -> str:
    """A paragraph naming the machines when the runs span more than one (a run resumed on
    another machine counts as both); empty when they share one or none recorded any."""
    runs_on: dict[str, list[str]] = {}
    for s in summaries:
        for label in dict.fromkeys(s.get("machines") or ["not recorded"]):
            runs_on.setdefault(label, []).append(s["run"])
    if len(runs_on) < 2:
        return ""
    lines = "".join(f"- {label}: {', '.join(runs)}\n" for label, runs in runs_on.items())
    return (
        f"Machines ({MACHINE}): these runs ran on {len(runs_on)} different machines or torch "
        "builds. Runs with the same seed on different machines part by float rounding after a "
        "few rounds, so compare their rows only beyond that drift.\n\n" + lines + "\n"
    )


def report_text(summaries: list[dict[str, Any]], target: float | None = None) -> str:
    """The report's tables as markdown: mean ± std over seeds (where a setting has more than
    one seed), then one row per run, then the metric note (``report.md`` without its plots;
    what ``hyperfed report`` prints)."""
    text = ""
    groups = group_by_seed(summaries)
    if any(len(g["runs"]) > 1 for g in groups):
        text += "## Over seeds\n\n" + seed_table(groups) + "\n"
        text += "Mean ± std (population) over the runs that differ only by seed.\n\n## Runs\n\n"
    text += markdown_table(summaries, target) + "\n"
    return text + machine_note(summaries) + METRIC_NOTE + WINDOW_NOTE + "\n"


def write_report(
    run_dirs: Sequence[str | Path], out: str | Path, target: float | None = None
) -> Path:
    """``report.md`` (:func:`report_text` and the plots) in ``out``; returns its path."""
    summaries = [run_summary(p) for p in run_dirs]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plots = plot_runs(summaries, out)
    groups = group_by_seed(summaries)
    if any(len(g["runs"]) > 1 for g in groups):
        plots.insert(0, plot_groups(groups, out))
    text = "# hyperfed report\n\n" + report_text(summaries, target) + "\n"
    text += "".join(f"![{p.stem}]({p.name})\n" for p in plots)
    report = out / "report.md"
    report.write_text(text)
    return report


# what ``hyperfed report --keep`` copies: enough to redraw every table and curve (and for
# ``reproduce`` / ``tune`` to find their runs and studies finished), no checkpoints or plots
KEPT_FILES = (
    "config.toml",
    "metrics.jsonl",
    MACHINE,
    "sweep.json",
    "tune.json",
    "trials.json",
    "best.toml",
    "study.db",
    "reproduce.md",
)


def keep_summaries(source: Path, dest: Path) -> list[Path]:
    """Copy the small files of every run, sweep and study below ``source`` to the same
    relative places below ``dest`` (e.g. ``results/004-table1``). Returns the copies."""
    import shutil

    copied = []
    for path in sorted(source.rglob("*")):
        if path.is_file() and path.name in KEPT_FILES:
            to = dest / path.relative_to(source)
            to.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, to)
            copied.append(to)
    return copied


def write_summary(run_dir: str | Path) -> Path:
    """``summary.md`` for one run: the headline table, per-client accuracies, plots."""
    run_dir = Path(run_dir)
    s = run_summary(run_dir)
    plot_runs([s], run_dir)
    final = s["records"][-1]
    lines = ["# Run summary\n", markdown_table([s])]
    diverged = [r["round"] for r in s["records"] if r.get("nonfinite_loss")]
    if diverged:
        lines.append(
            f"\n**Warning: the training loss was NaN or Inf in {len(diverged)} evaluated "
            f"round(s) (first: round {diverged[0]}); the run diverged.**\n"
        )
    lines.append("\n## Per-client test accuracy (final round)\n")
    lines.append("| client | model | accuracy |\n|---|---|---|")
    archs = final.get("client_arch") or ["?"] * len(final["client_acc"])
    for i, (a, arch) in enumerate(zip(final["client_acc"], archs)):
        lines.append(f"| {i} | {arch} | {'missing' if a is None else f'{a:.4f}'} |")
    if final.get("eval_missing"):
        lines.append(
            f"\nClients {final['eval_missing']} did not answer the final evaluation; the means "
            "are over the others."
        )
    lines.append("\n![accuracy](accuracy_vs_round.png)\n")
    if (run_dir / LABEL_PLOT).exists():
        lines.append(f"Samples per client and class: ![label distribution]({LABEL_PLOT})\n")
    ckpt = run_dir / "checkpoint.pt"
    if ckpt.exists():
        lines.append(f"Checkpoint for `--resume`: {ckpt.stat().st_size / 1e6:.1f} MB.\n")
    path = run_dir / SUMMARY
    path.write_text("\n".join(lines) + "\n")
    return path
