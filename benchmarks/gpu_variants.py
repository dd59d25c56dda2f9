"""Which local-training path is fastest per architecture on this device? (issue 9 profiling)

Times one round of plain local SGD (E=2, batch 64, 900 synthetic CIFAR-100-shaped samples per
client) for each zoo architecture of the heterogeneous benchmark, client group by client
group, three ways: vmap, vmap with each step replayed as a CUDA graph, client loop. Prints
ms per round per path. Run: python benchmarks/gpu_variants.py [--clients 10]
"""

from __future__ import annotations

import argparse
import time

import torch

from hyperfed.bench import HETERO, synthetic_federation
from hyperfed.engine.local import SGDConfig, client_seed, plan_batches, train_clients
from hyperfed.models.layout import FunctionalModel
from hyperfed.models.zoo import build_model


def time_round(fm, data, clients, sgd, vectorize, repeats=1) -> float:
    theta = fm.initial_params().expand(clients, -1).clone()
    buffers = fm.initial_buffers().expand(clients, -1).clone()
    ids = list(range(clients))
    times = []
    for r in range(repeats + 1):
        seeds = [client_seed(0, r, c) for c in ids]
        plan = plan_batches([data.train_idx[c] for c in ids], sgd.epochs, sgd.batch_size, seeds)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        train_clients(fm, theta, buffers, data, plan, sgd, vectorize=vectorize)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 1000 * min(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--models", default=",".join(HETERO))
    args = ap.parse_args()
    dev = torch.device("cuda")
    data = synthetic_federation(args.clients, 900, (3, 32, 32), 100).to(dev)
    print(f"{args.clients} clients, ms per round (E=2, B=64, 900 samples each)")
    print("| model | K | vmap | vmap + CUDA graphs | client loop |")
    print("|---|---|---|---|---|")
    for name in args.models.split(","):
        torch.manual_seed(0)
        fm = FunctionalModel(build_model(name, (3, 32, 32), 100).to(dev), name)
        row = []
        for vectorize, graphs in ((True, "off"), (True, "on"), (False, "off")):
            sgd = SGDConfig(lr=0.01, epochs=2, batch_size=64, cuda_graphs=graphs)
            row.append(f"{time_round(fm, data, args.clients, sgd, vectorize):.0f}")
        print(f"| {name} | {fm.num_params} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
