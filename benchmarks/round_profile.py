"""Where a round's wall time goes (issue 57): cProfile over a few rounds of one method,
attributed to phases by the functions each phase runs.

    python benchmarks/round_profile.py --algorithm fedavg --workers 1 --rounds 3

The workload is issue 57's (``benchmarks/peers.py``'s federation and local SGD): Fashion-MNIST
(6,000 images), 20 LeNet-style clients with 2 classes each, batch 10, 1 local epoch, lr 0.01,
every client every round, evaluated every round.
Phases: the clients' training (split into data batching, forward, backward, optimizer step and
the rest of the loop), evaluation, the server's work (configure + aggregate + reply checks),
the metrics record, and -- with workers -- the time the main process waits on them. Times are
cumulative seconds of the main process per round; with workers, the training itself runs in
the worker processes and shows as the wait.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
from peers import FEDERATION  # this folder's peers.py

WORKLOAD = [
    "device=cpu",
    *FEDERATION,  # benchmarks/peers.py's: the peer benchmark's federation
    "local.epochs=1",
    "local.batch_size=10",
    "local.lr=0.01",
    "local.momentum=0",
    "local.weight_decay=0",
    "participation=1.0",
    "eval_every=1",
]

# phase -> (file suffix, function name) pairs whose cumulative time is the phase's
PHASES: dict[str, list[tuple[str, str]]] = {
    "clients' training (all)": [("runtime/simulate.py", "_fit")],
    "  data batching": [("data/federated.py", "batch")],
    "  forward": [("engine/local.py", "cross_entropy_loss")],
    "  backward": [("torch/autograd/__init__.py", "grad")],
    "  optimizer step": [("", "<built-in method torch._fused_sgd_>")],
    "  waiting on workers": [
        ("", "<built-in method select.poll>"),
        ("", "<method 'poll' of 'select.poll' objects>"),
    ],
    "evaluation": [("runtime/driver.py", "evaluate")],
    "server: configure": [
        ("algorithms/fedavg.py", "configure_train"),
        ("algorithms/base.py", "configure_train"),
    ],
    "server: aggregate": [
        ("runtime/driver.py", "_aggregate"),
        ("algorithms/base.py", "aggregate"),
        ("algorithms/fedavg.py", "aggregate"),
    ],
    "reply checks (defense)": [
        ("runtime/driver.py", "bound_updates"),
        ("runtime/driver.py", "_validate"),
    ],
    "metrics record (with its evaluation)": [("runtime/driver.py", "record")],
}


def phase_seconds(stats: pstats.Stats) -> dict[str, float]:
    out = {}
    table = stats.stats  # type: ignore[attr-defined]
    for phase, keys in PHASES.items():
        total = 0.0
        for (file, _line, name), (_cc, _nc, _tt, ct, _callers) in table.items():
            if any(file.endswith(f) and name == n for f, n in keys if f) or any(
                not f and name == n for f, n in keys
            ):
                total += ct
        out[phase] = total
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--algorithm", default="fedavg")
    ap.add_argument("--workers", default="1")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], dest="sets")
    args = ap.parse_args()

    from hyperfed.config import load_config
    from hyperfed.runtime.simulate import Simulation

    sets = [*WORKLOAD, f"algorithm.name={args.algorithm}", f"local.workers={args.workers}"]
    cfg = load_config(None, [*sets, f"rounds={args.rounds + 1}", *args.sets])
    sim = Simulation(cfg)
    with sim.computing():
        sim.driver.run_setup()
        sim.driver.run_round(1)  # warm-up (starts a worker pool)
        profile = cProfile.Profile()
        t0 = time.perf_counter()
        profile.enable()
        for rnd in range(2, args.rounds + 2):
            sim.driver.record(rnd, sim.driver.run_round(rnd, score_before_mix=True))
        profile.disable()
        wall = (time.perf_counter() - t0) / args.rounds
    sim.close()
    seconds = phase_seconds(pstats.Stats(profile))
    print(
        f"{args.algorithm}, workers {args.workers}, torch {torch.__version__}: {wall:.3f} s/round"
    )
    for phase, s in seconds.items():
        print(f"| {phase} | {s / args.rounds:.3f} s | {100 * s / args.rounds / wall:.0f}% |")


if __name__ == "__main__":
    main()
