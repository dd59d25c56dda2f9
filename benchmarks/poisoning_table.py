"""The poisoning table of docs/robustness.md: method x defense x attack -> honest clients' mean
accuracy (``mean_acc_honest`` of the last round), from real simulated runs.

    python benchmarks/poisoning_table.py --seeds 0 --workers 2 --out results_poisoning.json

Every cell is one run on scikit-learn's digits (no download): 10 clients of the ``mlp``, 3
classes each, 10 rounds of 1 local epoch (lr 0.05, batch 32). Attack: ``scale`` (each attacker's
update times ``--scale``, default -10) by 10% and 30% of the clients, drawn with the seed; the
clean run beside it. Defenses, each alone (the default norm bounds ``max_update_norm`` /
``max_norm_ratio`` off in every cell, so "none" is undefended): ``clip_update_norm = median``,
``aggregation = median``, ``trimmed_mean`` (beta 0.3), ``multi_krum`` (f 3, m = n - f), where they
apply: the robust rules to methods that aggregate with FedAvg's rule (Server.average_reply),
clipping to methods whose server aggregates declared model updates (not to gossip). A run that
raises is a cell "crash" (none did); the JSON keeps every cell's record. Prints the markdown.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

METHODS = {  # name in the table -> (algorithm, defenses that apply)
    "FedAvg": ("fedavg", ("none", "clip", "median", "trimmed_mean", "multi_krum")),
    "FedPer": ("fedper", ("none", "clip", "median", "trimmed_mean", "multi_krum")),
    "Ditto": ("ditto", ("none", "clip", "median", "trimmed_mean", "multi_krum")),
    "pFedHN": ("pfedhn", ("none", "clip", "median", "trimmed_mean", "multi_krum")),
    "MH-pFedHN": ("mh_pfedhn", ("none", "clip", "median", "trimmed_mean", "multi_krum")),
    "DFedHP": ("dfedhp", ("none",)),
}
DEFENSES = {
    "none": [],
    "clip": ["defense.clip_update_norm=median"],
    "median": ["defense.aggregation=median"],
    "trimmed_mean": ["defense.aggregation=trimmed_mean", "defense.trim_fraction=0.3"],
    "multi_krum": ["defense.aggregation=multi_krum", "defense.byzantine=3"],
}
ATTACKS = {"clean": None, "10%": 0.1, "30%": 0.3}
BASE = [
    "clients.count=10",
    "clients.models=mlp",
    "rounds=10",
    "eval_every=10",
    "local.epochs=1",
    "local.lr=0.05",
    "local.batch_size=32",
    "defense.max_update_norm=off",
    "defense.max_norm_ratio=off",
]


def overrides(alg: str, defense: str, attack: float | None, scale: float, seed: int) -> list[str]:
    out = [*BASE, f"algorithm.name={alg}", f"seed={seed}", *DEFENSES[defense]]
    if attack is not None:
        out += ["attack.kind=scale", f"attack.scale={scale}", f"attack.clients={attack}"]
    return out


def run_cell(args: tuple[str, str, str, float, int]) -> dict[str, Any]:
    alg, defense, attack, scale, seed = args
    import torch

    torch.set_num_threads(1)
    from hyperfed.config import load_config
    from hyperfed.runtime.simulate import Simulation

    t0 = time.time()
    cell: dict[str, Any] = {"alg": alg, "defense": defense, "attack": attack, "seed": seed}
    try:
        cfg = load_config(None, overrides(alg, defense, ATTACKS[attack], scale, seed))
        last = Simulation(cfg).run()[-1]
        cell["acc"] = last.get("mean_acc_honest", last["mean_acc"])
        cell["rejected"] = last["rejected"]
    except Exception as e:  # a crash is a result of the table, not the end of it
        cell["crash"] = f"{type(e).__name__}: {e}"
    cell["seconds"] = round(time.time() - t0, 1)
    print(json.dumps(cell), flush=True)
    return cell


def table(cells: list[dict[str, Any]]) -> str:
    by: dict[tuple[str, str, str], list[float]] = {}
    crashed: set[tuple[str, str, str]] = set()
    for c in cells:
        key = (c["alg"], c["defense"], c["attack"])
        if "crash" in c:
            crashed.add(key)
        else:
            by.setdefault(key, []).append(c["acc"])

    def fmt(key: tuple[str, str, str]) -> str:
        if key in crashed:
            return "crash"
        vals = by.get(key)
        if not vals:
            return "n/a"
        mean = sum(vals) / len(vals)
        if len(vals) == 1:
            return f"{100 * mean:.1f}"
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
        return f"{100 * mean:.1f} ± {100 * std:.1f}"

    lines = [
        "| method | defense | clean | 10% attackers | 30% attackers |",
        "|---|---|---|---|---|",
    ]
    for name, (alg, defenses) in METHODS.items():
        for d in defenses:
            row = [fmt((alg, d, a)) for a in ATTACKS]
            lines.append(
                f"| {name} | {d.replace('clip', 'clip_update_norm = median')} | "
                + " | ".join(row)
                + " |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--scale", type=float, default=-10.0)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--out", default=None, help="JSON file of the cells (read back if present)")
    ap.add_argument("--methods", default=",".join(METHODS))
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    done: list[dict[str, Any]] = []
    if a.out and Path(a.out).is_file():
        done = json.loads(Path(a.out).read_text())
    have = {(c["alg"], c["defense"], c["attack"], c["seed"]) for c in done}
    todo = [
        (alg, d, att, a.scale, int(s))
        for name in a.methods.split(",")
        for alg, defenses in [METHODS[name]]
        for d in defenses
        for att in ATTACKS
        for s in a.seeds.split(",")
        if (alg, d, att, int(s)) not in have
    ]
    with ProcessPoolExecutor(a.workers) as pool:
        for cell in pool.map(run_cell, todo):
            done.append(cell)
            if a.out:
                Path(a.out).write_text(json.dumps(done, indent=1))
    print(table(done))


if __name__ == "__main__":
    main()
