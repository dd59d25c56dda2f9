"""The per-step kernel floor of issue 57's workload: a bare PyTorch loop (the zoo's LeNet as an
``nn.Module``, cross-entropy, backward, ``torch.optim.SGD``), no federated code around it.

    python benchmarks/kernel_floor.py --steps 400 --threads 1 2

Prints the median seconds per step at each thread count and what a round of the workload
(20 clients x ~23 steps at batch 10 on 1 x 28 x 28) costs at that floor on one core, and
spread over the machine's cores (one process per core, one thread each): the least any
library can spend on the round's training on this machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from hyperfed.models.zoo import build_model
from hyperfed.runtime.cores import available_cores


def seconds_per_step(threads: int, steps: int, batch: int) -> float:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = build_model("lenet", (1, 28, 28), 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))
    times = []
    for i in range(steps + 20):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if i >= 20:  # warm-up steps not counted
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=10)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--round-steps", type=int, default=460, help="steps of one round, all clients")
    args = ap.parse_args()
    cores = available_cores()
    for t in args.threads:
        s = seconds_per_step(t, args.steps, args.batch)
        print(
            f"{t} thread(s): {1000 * s:.2f} ms/step; a round of {args.round_steps} steps: "
            f"{s * args.round_steps:.2f} s in one process, {s * args.round_steps / cores:.2f} s "
            f"over {cores} cores"
        )


if __name__ == "__main__":
    main()
