"""Memory of simulated Flower clients: each node's own samples vs the whole pool per node.

One process builds the ClientApp runtime of every client (as one Ray actor serving many
simulated SuperNodes does) and reports its resident memory. ``per-node`` is hyperfed's way
(``load_federation(..., clients=[cid])``: a node keeps its client's samples); ``pooled`` gives
every runtime the whole federation (what a node held before). Each measurement runs in a fresh
subprocess; peak RSS is ``ru_maxrss``. Prints MB and the ratio; never a unit test.

    python benchmarks/node_memory.py --dataset fashion_mnist --clients 3 30
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys


def measure(dataset: str, clients: int, pooled: bool) -> dict[str, float]:
    import torch

    from hyperfed.config import load_config
    from hyperfed.deploy.node import ClientRuntime
    from hyperfed.runtime import federation

    torch.set_num_threads(1)
    cfg = load_config(
        None,
        [f"dataset.name={dataset}", f"clients.count={clients}", "clients.models=mlp", "device=cpu"],
    )
    if pooled:  # every node materializes the whole federation
        whole = federation.load_federation
        federation.load_federation = lambda cfg, device, clients=None: whole(cfg, device)  # type: ignore[assignment,misc]
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    runtimes = [ClientRuntime.build(cfg, [cid], clients) for cid in range(clients)]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    held = sum(rt.data.x.nbytes + rt.data.y.nbytes for rt in runtimes) / 2**20
    return {"peak_mb": peak, "growth_mb": peak - base, "data_mb": held}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="fashion_mnist")
    ap.add_argument("--clients", type=int, nargs="+", default=[3, 30])
    ap.add_argument("--one", nargs=3, help=argparse.SUPPRESS)  # dataset clients pooled
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.one[0], int(args.one[1]), args.one[2] == "1")))
        return
    print(f"{args.dataset}: one process building every simulated client's runtime")
    print(f"{'clients':>8} {'mode':>9} {'data MB':>9} {'RSS growth MB':>14} {'MB/client':>10}")
    for n in args.clients:
        got = {}
        for pooled in (False, True):
            cmd = [sys.executable, __file__, "--one", args.dataset, str(n), str(int(pooled))]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            got[pooled] = r = json.loads(out.strip().splitlines()[-1])
            mode = "pooled" if pooled else "per-node"
            print(
                f"{n:>8} {mode:>9} {r['data_mb']:>9.1f} {r['growth_mb']:>14.1f} "
                f"{r['growth_mb'] / n:>10.2f}"
            )
        print(
            f"{'':>8} pooled / per-node RSS growth: {got[True]['growth_mb'] / got[False]['growth_mb']:.1f}x"
        )


if __name__ == "__main__":
    main()
