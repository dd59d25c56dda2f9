"""Behaviour fingerprint of a few methods: per-client accuracies and byte counts, bit for bit.

A refactor that must not change behaviour (issue 38) runs this before and after:

    python benchmarks/behaviour_fingerprint.py --out before.json          # on the old commit
    python benchmarks/behaviour_fingerprint.py --compare before.json      # on the new one

Each method runs 3 rounds of the default digits federation (4 clients, the default mix of
LeNet / VGG8 / MLP where the method accepts it, evaluated every round), one torch thread.
The fingerprint holds every record's per-client accuracies and test loss and the byte and
FLOP totals; ``--compare`` prints the first difference per method and exits 1 on any.

``--methods all`` runs every registered method on LeNet-style clients (``lenet``) and on the
default model mix (``mix``; a method that refuses the mix is skipped there), with the
one-off phases shrunk as the test suite shrinks them; ``--set K=V`` adds settings, e.g.
``--set local.workers=1`` against ``--set local.workers=2`` (issue 57: one result at any
worker count).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

METHODS: dict[str, list[str]] = {
    "fedavg": [],
    "mh_pfedhn": [],
    "pfedkt": ["clients.models=lenet", "algorithm.hn_training=end_to_end"],
    "dfedhp": ["clients.models=lenet"],
    "mh_pfedhndd": ["algorithm.distill_iters=2", "algorithm.ipc=1", "algorithm.syn_batch=10"],
}
SMALL = [
    "device=cpu",
    "rounds=3",
    "eval_every=1",
    "clients.count=4",
    "dataset.subsample=300",
    "local.epochs=1",
]
KEYS = ("client_acc", "test_loss", "bytes_up_total", "bytes_down_total", "flops_total")


# hyperparameters that only set how long a one-off phase runs (as tests/conftest.py shrinks them)
SHORT = {
    "distill_iters": 2,
    "ipc": 1,
    "syn_batch": 10,
    "distill_batch_real": 16,
    "one_shot_epochs": 1,
    "extractor_epochs": 1,
}


def every_method() -> dict[str, list[str]]:
    """Every registered method on ``lenet`` clients and on the default mix."""
    import dataclasses

    from hyperfed.algorithms import ALGORITHMS

    runs = {}
    for name, alg in ALGORITHMS.entries().items():
        fields = {f.name for f in dataclasses.fields(alg.hparams)}
        short = [f"algorithm.{k}={v}" for k, v in SHORT.items() if k in fields]
        runs[f"{name}/lenet"] = [f"algorithm.name={name}", "clients.models=lenet", *short]
        runs[f"{name}/mix"] = [f"algorithm.name={name}", *short]
    return runs


def fingerprint(sets: list[str]) -> list[dict[str, Any]] | str:
    from hyperfed.config import load_config
    from hyperfed.errors import HyperfedError
    from hyperfed.runtime.simulate import Simulation

    torch.set_num_threads(1)
    try:
        records = Simulation(load_config(None, [*SMALL, *sets])).run()
    except HyperfedError as e:  # e.g. a method that refuses a model mix
        return f"refused: {str(e).splitlines()[0]}"
    return [{k: r.get(k) for k in ("round", *KEYS)} for r in records]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the fingerprint here")
    parser.add_argument("--compare", type=Path, help="compare with a fingerprint written before")
    parser.add_argument("--methods", default=",".join(METHODS), help="names, or all")
    parser.add_argument("--set", action="append", default=[], dest="sets", metavar="K=V")
    args = parser.parse_args()
    if args.methods == "all":
        runs = every_method()
    else:
        runs = {m: [f"algorithm.name={m}", *METHODS.get(m, [])] for m in args.methods.split(",")}
    got = {}
    for name, sets in runs.items():
        got[name] = fingerprint([*sets, *args.sets])
        print(f"{name}: {'done' if isinstance(got[name], list) else got[name]}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(got, indent=1))
    if args.compare:
        want = json.loads(args.compare.read_text())
        bad = 0
        for method, records in got.items():
            if records == want.get(method):
                print(f"{method}: identical ({len(records)} records)")
                continue
            bad += 1
            if isinstance(records, str) or isinstance(want.get(method), str):
                print(f"{method}: {records!r:.80} vs {want.get(method)!r:.80}")
                continue
            for a, b in zip(records, want.get(method, []), strict=False):
                diff = [k for k in a if a[k] != b.get(k)]
                if diff:
                    print(f"{method}: round {a['round']} differs in {', '.join(diff)}")
                    break
            else:
                print(f"{method}: a different number of records")
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
