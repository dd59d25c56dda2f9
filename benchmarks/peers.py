"""Seconds per round: hyperfed against PFLlib and FL-bench on identical data (issue 57 item 4).

One federation (Fashion-MNIST, 6000 images, 20 clients x 2 classes, seed 0) is written once
per format with ``hyperfed export``; hyperfed reads the npz export, PFLlib its own layout and
FL-bench its ``synthetic`` slot, so all three train on the same per-client tensors. Every
library trains the same LeNet (hyperfed's zoo ``lenet``) with the same local SGD (lr 0.01, no
momentum, no weight decay, batch 10, 1 epoch), every client every round, and evaluates once,
after the last round. Everything else is each library's default; hyperfed runs at its default
``local.workers`` and, as an extra row, at ``local.workers=1``.

Rows: fedavg (hyperfed, PFLlib), fedrep (1 head + 1 body epoch; hyperfed, PFLlib), pfedhn
(the same hypernetwork size: embedding 64, 3 Linear layers of 100; hyperfed, FL-bench).
Repetitions are interleaved: repetition 1 of every row, then repetition 2, ... Per run:
process wall seconds per round, the library's own per-round clock, CPU seconds per round
(children's rusage), peak RSS, final accuracy as the library reports it, the 1-minute load
average before the run. The peers' work trees need the scratch changes benchmarks/peers.md
describes.

    .venv/bin/python benchmarks/peers.py --pfllib /tmp/peers/PFLlib \\
        --flbench /tmp/peers/FL-bench --peer-python /tmp/peers/venv/bin/python \\
        --reps 5 --rounds 30 --out runs/peers
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import re
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

# the federation every library trains on
FEDERATION = [
    "dataset.name=fashion_mnist",
    "dataset.subsample=6000",
    "partition.name=quantity",
    "partition.classes_per_client=2",
    "clients.count=20",
    "clients.models=lenet",
    "seed=0",
]
CLIENTS, CLASSES = 20, 10
# the same local SGD on every side
LR, BATCH, EPOCHS = 0.01, 10, 1
PFLLIB_DATA = "hyperfed-fmnist20"  # PFLlib/dataset/<this>
WORKLOADS = ("fedavg", "fedrep", "pfedhn")


@dataclass
class Row:
    """One (workload, library) pair: how to build its command and read its log."""

    workload: str
    library: str  # hyperfed | hyperfed-w1 | pfllib | flbench
    cwd: Path
    cmd: list[str]
    log: str = ""
    extra_rounds: int = 0  # rounds the library trains beyond --rounds (PFLlib: one)
    runs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def key(self) -> str:
        return f"{self.workload}/{self.library}"


def hyperfed_cmd(
    hyperfed: list[str], workload: str, npz: Path, rounds: int, out: Path, workers: int | None
) -> list[str]:
    sets = [
        "dataset.name=npz",
        f"dataset.path={npz}",
        "partition.name=natural",  # the export's own train / test split
        f"clients.count={CLIENTS}",
        "clients.models=lenet",
        "seed=0",
        f"rounds={rounds}",
        f"eval_every={rounds}",
        f"local.epochs={EPOCHS}",
        f"local.batch_size={BATCH}",
        f"local.lr={LR}",
        "local.momentum=0",
        "local.weight_decay=0",
        f"algorithm.name={workload}",
    ]
    if workload == "fedrep":
        sets += ["algorithm.head_epochs=1", "algorithm.body_epochs=1"]
    if workers is not None:
        sets.append(f"local.workers={workers}")
    cmd = [*hyperfed, "run"]
    for s in sets:
        cmd += ["--set", s]
    return [*cmd, "--quiet", "--force", "--out", str(out)]


def pfllib_cmd(python: str, workload: str, rounds: int) -> list[str]:
    algo = {"fedavg": "FedAvg", "fedrep": "FedRep"}[workload]
    # -gr R trains rounds 0..R (R + 1) and evaluates before round 0 and before round R, i.e.
    # after R aggregations
    cmd = [python, "main.py", "-data", PFLLIB_DATA, "-m", "HFLeNet", "-algo", algo]
    cmd += ["-nc", str(CLIENTS), "-ncl", str(CLASSES), "-gr", str(rounds), "-eg", str(rounds)]
    cmd += ["-ls", str(EPOCHS), "-lbs", str(BATCH), "-lr", str(LR), "-jr", "1", "-dev", "cpu"]
    if workload == "fedrep":
        cmd += ["-pls", "1"]  # head epochs; -ls is the body's
    return cmd


def flbench_cmd(python: str, workload: str, rounds: int) -> list[str]:
    assert workload == "pfedhn"
    return [
        python,
        "main.py",
        "method=pfedhn",
        "dataset.name=synthetic",
        "model.name=custom",
        "common.join_ratio=1",
        f"common.global_epoch={rounds}",
        f"common.local_epoch={EPOCHS}",
        f"common.batch_size={BATCH}",
        f"optimizer.lr={LR}",
        f"common.test.client.interval={rounds}",
        "common.buffers=local",  # its pFedHN refuses the default (global)
        "common.use_cuda=false",
        # hyperfed's pFedHN: embedding 64, Linear 64->100 then 2 x Linear 100->100
        "+pfedhn.embed_dim=64",
        "+pfedhn.hidden_dim=100",
        "+pfedhn.hidden_num=2",
    ]


def build_rows(args: argparse.Namespace, out: Path) -> list[Row]:
    hyperfed = [sys.executable, "-m", "hyperfed"]
    npz = out / "export" / "npz" / "data.npz"
    rows: list[Row] = []
    for w in WORKLOADS:
        for lib, workers in (("hyperfed", None), ("hyperfed-w1", 1)):
            run_dir = out / "runs" / w / lib
            cmd = hyperfed_cmd(hyperfed, w, npz, args.rounds, run_dir, workers)
            rows.append(Row(w, lib, REPO, cmd))
        if w in ("fedavg", "fedrep") and args.pfllib:
            cwd = Path(args.pfllib) / "system"
            rows.append(
                Row(w, "pfllib", cwd, pfllib_cmd(args.peer_python, w, args.rounds), extra_rounds=1)
            )
        if w == "pfedhn" and args.flbench:
            rows.append(
                Row(w, "flbench", Path(args.flbench), flbench_cmd(args.peer_python, w, args.rounds))
            )
    if args.only:
        keep = [s.strip() for s in args.only.split(",") if s.strip()]
        rows = [r for r in rows if any(k in (r.key, r.workload, r.library) for k in keep)]
    return rows


def export(out: Path, reuse: bool, dry_run: bool) -> list[list[str]]:
    """The three exports of one federation; returns the commands."""
    cmds = []
    for fmt in ("npz", "pfllib", "flbench"):
        dest = out / "export" / fmt
        cmd = [sys.executable, "-m", "hyperfed", "export", "--format", fmt, "--out", str(dest)]
        for s in FEDERATION:
            cmd += ["--set", s]
        cmds.append([*cmd, "--force"])
        if dry_run or (reuse and (dest / "README.txt").is_file()):
            continue
        subprocess.run(cmds[-1], check=True, stdout=subprocess.DEVNULL)
    return cmds


def place_data(out: Path, args: argparse.Namespace) -> None:
    """Copy the exports where the peers read them (docs/export.md)."""
    if args.pfllib:
        dest = Path(args.pfllib) / "dataset" / PFLLIB_DATA
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(out / "export" / "pfllib", dest)
    if args.flbench:
        dest = Path(args.flbench) / "data" / "synthetic"
        dest.mkdir(parents=True, exist_ok=True)
        for f in (out / "export" / "flbench").iterdir():
            shutil.copy2(f, dest / f.name)


# -- reading each library's log -----------------------------------------------------------


def parse_hyperfed(run_dir: Path, rounds: int) -> dict[str, Any]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    rec = json.loads(lines[-1])
    return {
        "accuracy": rec["mean_acc"],
        "accuracy_weighted": rec["weighted_acc"],
        "accuracy_kind": "mean over clients (mean_acc) at the last round",
        # the driver's clock: setup + every round + the one evaluation; no per-round log
        "tool_s_per_round": rec["seconds"] / rounds,
        "tool_clock": "metrics seconds / rounds (setup, all rounds, 1 evaluation)",
        "rounds_logged": rec["round"],
    }


def parse_pfllib(log: str) -> dict[str, Any]:
    costs = [float(x) for x in re.findall(r"-+ time cost -+ ([0-9.eE+-]+)", log)]
    accs = re.findall(r"Averaged Test Accuracy: ([0-9.]+)", log)
    return {
        "accuracy": float(accs[-1]) if accs else None,
        "accuracy_kind": "sample-weighted over clients, evaluated before round R (R aggregations)",
        # round 0 (warm-up, and the evaluation of the initial model) left out, as PFLlib's own
        # 'Average time cost per round'
        "tool_s_per_round": statistics.mean(costs[1:]) if len(costs) > 1 else None,
        "tool_clock": "mean of its per-round 'time cost' over rounds 1..R (round 0 left out)",
        "rounds_logged": len(costs),
    }


def parse_flbench(log: str) -> dict[str, Any]:
    accs = re.findall(r'"accuracy":\s*"([0-9.]+)% ->', log)
    t = re.findall(r"average time taken by each global epoch: (\d+) min ([0-9.]+) sec", log)
    return {
        "accuracy": float(accs[-1]) / 100 if accs else None,
        "accuracy_kind": "sample-weighted over clients at the last epoch (before fine-tuning)",
        "tool_s_per_round": 60 * int(t[-1][0]) + float(t[-1][1]) if t else None,
        "tool_clock": "its average train_one_round time over all rounds (first included; "
        "the last evaluation not)",
    }


# -- one run ------------------------------------------------------------------------------


def become_subreaper() -> bool:
    """Adopt orphaned descendants (Linux ``PR_SET_CHILD_SUBREAPER``). hyperfed's workers are
    children of multiprocessing's forkserver, which the run does not wait for: adopted and
    reaped here, their CPU time reaches ``RUSAGE_CHILDREN``."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(36, 1, 0, 0, 0) == 0)  # 36: PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def reap_descendants(timeout: float = 60.0) -> tuple[float, int]:
    """Wait for every adopted descendant still running; returns (largest ru_maxrss in KiB,
    how many were still running at ``timeout``: 0 when all were reaped)."""
    peak, deadline = 0.0, time.monotonic() + timeout
    while True:
        try:
            pid, _, ru = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return peak, 0
        if pid:
            peak = max(peak, ru.ru_maxrss)
        elif time.monotonic() > deadline:
            return peak, 1
        else:
            time.sleep(0.05)


def run_once(row: Row, rep: int, rounds: int, out: Path) -> dict[str, Any]:
    log_path = out / "logs" / f"{row.workload}-{row.library}-rep{rep}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    load1 = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with open(log_path, "w") as fh:
        proc = subprocess.Popen(row.cmd, cwd=row.cwd, stdout=fh, stderr=subprocess.STDOUT)
        # wait4: this run's own rusage; its ru_maxrss is the largest of the process and the
        # children it reaped; reap_descendants adds the ones it left (hyperfed's workers)
        _, status, own = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    adopted_peak, left = reap_descendants()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    trained = rounds + row.extra_rounds
    rec: dict[str, Any] = {
        "rep": rep,
        "returncode": proc.returncode,
        "load1_before": round(load1, 2),
        "wall_s": round(wall, 3),
        "rounds_trained": trained,
        "wall_s_per_round": wall / trained,
        "cpu_s_per_round": cpu / trained,
        "peak_rss_mib": max(own.ru_maxrss, adopted_peak) / 1024,  # Linux: KiB
        "descendants_left": left,
        "log": str(log_path),
    }
    text = log_path.read_text(errors="replace")
    try:
        if row.library.startswith("hyperfed"):
            rec.update(parse_hyperfed(out / "runs" / row.workload / row.library, rounds))
        elif row.library == "pfllib":
            rec.update(parse_pfllib(text))
        else:
            rec.update(parse_flbench(text))
    except (OSError, ValueError, KeyError, IndexError) as exc:
        rec["parse_error"] = repr(exc)
    if proc.returncode != 0:
        rec["tail"] = text[-2000:]
    return rec


# -- summary ------------------------------------------------------------------------------


def _median(runs: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in runs if r.get("returncode") == 0 and r.get(key) is not None]
    return statistics.median(vals) if vals else None


def summarize(rows: list[Row]) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        s: dict[str, Any] = {"row": r.key, "workload": r.workload, "library": r.library}
        for key in (
            "wall_s_per_round",
            "tool_s_per_round",
            "cpu_s_per_round",
            "peak_rss_mib",
            "accuracy",
            "load1_before",
        ):
            s[key] = _median(r.runs, key)
        s["ok_runs"] = sum(1 for x in r.runs if x.get("returncode") == 0)
        s["runs"] = len(r.runs)
        out.append(s)
    # ratios peer / hyperfed per workload, on the medians
    by = {s["row"]: s for s in out}
    for s in out:
        if s["library"] in ("pfllib", "flbench"):
            for base in ("hyperfed", "hyperfed-w1"):
                b = by.get(f"{s['workload']}/{base}")
                for key in ("wall_s_per_round", "tool_s_per_round", "cpu_s_per_round"):
                    if b and b.get(key) and s.get(key) is not None:
                        s[f"ratio_{key}_vs_{base}"] = s[key] / b[key]
    return out


def _fmt(v: Any, nd: int = 2) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def markdown(summary: list[dict[str, Any]], reps: int, rounds: int) -> str:
    lines = [
        f"Medians over {reps} interleaved repetitions, {rounds} rounds each. "
        "wall: process wall / rounds trained; own clock: the library's timer (see peers.md); "
        "ratio: peer / hyperfed (default, local.workers=1) on wall s/round.",
        "",
        "| workload | library | wall s/round | own clock s/round | CPU s/round | peak RSS MiB "
        "| accuracy | load1 before | ratio vs hyperfed | ratio vs hyperfed w1 | ok runs |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        lines.append(
            f"| {s['workload']} | {s['library']} | {_fmt(s['wall_s_per_round'])} "
            f"| {_fmt(s['tool_s_per_round'])} | {_fmt(s['cpu_s_per_round'])} "
            f"| {_fmt(s['peak_rss_mib'], 0)} | {_fmt(s['accuracy'], 4)} "
            f"| {_fmt(s['load1_before'])} "
            f"| {_fmt(s.get('ratio_wall_s_per_round_vs_hyperfed'))} "
            f"| {_fmt(s.get('ratio_wall_s_per_round_vs_hyperfed-w1'))} "
            f"| {s['ok_runs']}/{s['runs']} |"
        )
    return "\n".join(lines) + "\n"


def _git(path: Path) -> dict[str, Any]:
    def q(*a: str) -> str:
        r = subprocess.run(["git", "-C", str(path), *a], capture_output=True, text=True)
        return r.stdout.rstrip("\n")

    return {"commit": q("rev-parse", "HEAD"), "changed": q("status", "--short").splitlines()}


def machine(args: argparse.Namespace) -> dict[str, Any]:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    env = {k: os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS") if k in os.environ}
    info: dict[str, Any] = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "thread_env": env,
        "hyperfed": _git(REPO),
    }
    for name in ("pfllib", "flbench"):
        if getattr(args, name):
            info[name] = _git(Path(getattr(args, name)))
    return info


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--pfllib", help="PFLlib work tree (with the scratch changes of peers.md)")
    p.add_argument("--flbench", help="FL-bench work tree (with the scratch changes of peers.md)")
    p.add_argument("--peer-python", default=sys.executable, help="python of the peers' environment")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--out", default="runs/peers", help="exports, run folders, logs, results")
    p.add_argument(
        "--only",
        default="",
        help="rows to run, comma-separated: fedavg, pfllib, fedrep/hyperfed-w1, ...",
    )
    p.add_argument("--reuse-export", action="store_true", help="keep an export already in --out")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = p.parse_args()

    out = Path(args.out).resolve()
    rows = build_rows(args, out)
    if not rows:
        sys.exit("no rows selected (--only, --pfllib, --flbench)")
    export_cmds = export(out, args.reuse_export, args.dry_run)
    if args.dry_run:
        for c in export_cmds:
            print(shlex.join(c))
        for r in rows:
            print(f"# {r.key} (cwd {r.cwd})\n{shlex.join(r.cmd)}")
        return
    place_data(out, args)
    info = machine(args)
    info["subreaper"] = become_subreaper()
    for rep in range(1, args.reps + 1):
        for r in rows:
            rec = run_once(r, rep, args.rounds, out)
            r.runs.append(rec)
            print(
                f"rep {rep} {r.key:22s} rc {rec['returncode']} load1 {rec['load1_before']:.2f} "
                f"wall/round {rec['wall_s_per_round']:.3f} own {_fmt(rec.get('tool_s_per_round'), 3)} "
                f"cpu/round {rec['cpu_s_per_round']:.3f} rss {rec['peak_rss_mib']:.0f} MiB "
                f"acc {_fmt(rec.get('accuracy'), 4)}",
                flush=True,
            )
    summary = summarize(rows)
    result = {
        "reps": args.reps,
        "rounds": args.rounds,
        "machine": info,
        "exports": [shlex.join(c) for c in export_cmds],
        "rows": [
            {"row": r.key, "cwd": str(r.cwd), "cmd": shlex.join(r.cmd), "runs": r.runs}
            for r in rows
        ],
        "summary": summary,
    }
    (out / "peers.json").write_text(json.dumps(result, indent=1))
    table = markdown(summary, args.reps, args.rounds)
    (out / "peers_table.md").write_text(table)
    print(table)
    print(f"wrote {out / 'peers.json'} and {out / 'peers_table.md'}")


if __name__ == "__main__":
    main()
