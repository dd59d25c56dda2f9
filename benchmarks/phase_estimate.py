"""How close ``hyperfed run``'s pre-run cost estimate comes to the phase it estimates: the
timed probe of a distillation setup (MH-pFedHNDD as ``configs/distill_cpu.toml`` runs it, on
two LeNet clients) against the measured setup, for a few iteration counts. Prints estimate /
measured; the estimate is meant to be within a factor of three (it is shown to a person deciding whether to
start a run, not used to schedule anything).

    python benchmarks/phase_estimate.py [--iters 200,400,800] [--repeats 3]
"""

import argparse
import statistics
import time

from hyperfed.config import load_config
from hyperfed.runtime.simulate import Simulation

CONFIG = "configs/distill_cpu.toml"  # the two-minute distillation demo, on two LeNet clients
SMALLER = ["clients.count=2", "clients.models=lenet", "rounds=1"]


def estimate_and_measure(iters: int) -> tuple[float, float]:
    sets = [*SMALLER, f"algorithm.mh_pfedhndd.distill_iters={iters}"]
    sim = Simulation(load_config(CONFIG, sets))
    sim.heavy_phases()  # warm-up: a cold first probe pays one-off costs
    (cost,) = sim.heavy_phases()
    t0 = time.perf_counter()
    sim.run_setup()
    return cost.seconds, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", default="200,400,800")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"{'iters':>6} {'estimate s':>11} {'measured s':>11} {'ratio':>7}")
    ratios = []
    for iters in (int(v) for v in args.iters.split(",")):
        for _ in range(args.repeats):
            est, measured = estimate_and_measure(iters)
            ratios.append(est / measured)
            print(f"{iters:>6} {est:>11.2f} {measured:>11.2f} {est / measured:>7.2f}")
    print(
        f"estimate / measured: median {statistics.median(ratios):.2f}, "
        f"range {min(ratios):.2f}-{max(ratios):.2f} over {len(ratios)} runs"
    )


if __name__ == "__main__":
    main()
