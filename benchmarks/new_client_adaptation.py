"""Seed 000 §4.4: held-out clients adapted under several readings from one trained state.

Trains MH-pFedHN (or G / GD) on the old clients once per seed, then, from that same state,
runs the adaptation phase once per reading (``adapt_lr`` values; every other setting equal),
and prints the new clients' mean accuracy on the validation and the test split after each
adaptation round. Every reading starts from the identical hypernetwork, so the readings differ
only in how the new clients adapt. Writes one JSON summary per seed under ``--out``.

    python benchmarks/new_client_adaptation.py --config configs/seed000/fmnist_homo.toml \\
        --set algorithm.name=mh_pfedhn --set clients.count=20 ... --adapt-lr 2e-4,1e-2,5e-2 \\
        --seeds 0,1,2 --out results/claims/000-c5-adapt-readings
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

from hyperfed.config import load_config
from hyperfed.runtime.simulate import Simulation


def _new_acc(sim: Simulation, split: str) -> float | None:
    """The new clients' mean accuracy on ``split`` (None: the clients hold no such split)."""
    if split == "val" and not sim.cfg.partition.val_fraction:
        return None
    return round(float(sim.evaluate(split)["mean_acc_new"]), 5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None)
    ap.add_argument("--set", action="append", default=[], dest="sets")
    ap.add_argument("--adapt-lr", default="2e-4,1e-2,5e-2")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    lrs = [float(x) for x in args.adapt_lr.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    for seed in (int(s) for s in args.seeds.split(",")):
        cfg = load_config(args.config, [*args.sets, f"seed={seed}"])
        sim = Simulation(cfg)
        server = getattr(sim.server, "method", sim.server)  # a composed method's own server
        first_adapt = server.adapt_from
        assert first_adapt is not None, "set algorithm.new_clients and algorithm.adapt_rounds"
        t0 = time.perf_counter()
        sim.run_setup()  # a method's setup phase (MH-pFedHNDD: distil and merge S), as sim.run()
        for rnd in range(1, first_adapt):
            sim.run_round(rnd)
        trained = copy.deepcopy(sim.state_dict(first_adapt - 1))
        summary: dict[str, object] = {
            "seed": seed,
            "train_rounds": first_adapt - 1,
            "train_seconds": round(time.perf_counter() - t0, 1),
            "old_test_acc": round(float(sim.evaluate("test")["mean_acc_old"]), 5),
            "start_new": {"val": _new_acc(sim, "val"), "test": _new_acc(sim, "test")},
            "readings": {},
        }
        for lr in lrs:
            sim.load_state_dict(copy.deepcopy(trained))
            assert server.adapt_opt is not None
            for group in server.adapt_opt.param_groups:  # the checkpoint holds lr of run 1
                group["lr"] = lr
            curve = []
            for rnd in range(first_adapt, cfg.rounds + 1):
                sim.run_round(rnd)
                curve.append(
                    {"round": rnd, "val": _new_acc(sim, "val"), "test": _new_acc(sim, "test")}
                )
            summary["readings"][f"adapt_lr={lr:g}"] = curve  # type: ignore[index]
            print(
                f"seed {seed} adapt_lr {lr:g}: new clients val {curve[-1]['val']} "
                f"test {curve[-1]['test']} (start {summary['start_new']})",
                flush=True,
            )
        (args.out / f"seed{seed}.json").write_text(json.dumps(summary, indent=1))
        sim.close()


if __name__ == "__main__":
    main()
