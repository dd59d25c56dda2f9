"""Behaviour fingerprint of a few methods: per-client accuracies and byte counts, bit for bit.

A refactor that must not change behaviour (issue 38) runs this before and after:

    python benchmarks/behaviour_fingerprint.py --out before.json          # on the old commit
    python benchmarks/behaviour_fingerprint.py --compare before.json      # on the new one

Each method runs 3 rounds of the default digits federation (4 clients, the default mix of
LeNet / VGG8 / MLP where the method accepts it, evaluated every round), one torch thread.
The fingerprint holds every record's per-client accuracies and test loss and the byte and
FLOP totals; ``--compare`` prints the first difference per method and exits 1 on any.
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


def fingerprint(method: str) -> list[dict[str, Any]]:
    from hyperfed.config import load_config
    from hyperfed.runtime.simulate import Simulation

    torch.set_num_threads(1)
    cfg = load_config(None, [*SMALL, f"algorithm.name={method}", *METHODS[method]])
    records = Simulation(cfg).run()
    return [{k: r.get(k) for k in ("round", *KEYS)} for r in records]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the fingerprint here")
    parser.add_argument("--compare", type=Path, help="compare with a fingerprint written before")
    parser.add_argument("--methods", default=",".join(METHODS))
    args = parser.parse_args()
    got = {m: fingerprint(m) for m in args.methods.split(",")}
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
