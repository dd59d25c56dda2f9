"""Seconds per round: N worker processes x 1 thread vs 1 process x N threads vs 1 x 1.

FedAvg, Fashion-MNIST-shaped synthetic data (``hyperfed.bench.synthetic_federation``), every
client every round. One simulation per mode and model, warmed up by one untimed round (which
starts the worker pool), then rounds timed in turn, mode after mode (interleaved, so load from
other processes hits every mode alike); ratios are per repetition, reported as medians.
Also printed, for docs/scaling.md: the per-client-step time, the server's share of a round,
and the workers' busy time against the wall time of the parallel exchange.

    .venv/bin/python benchmarks/workers.py --models lenet vgg8 resnet10 --reps 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from hyperfed.bench import synthetic_federation
from hyperfed.config import load_config
from hyperfed.runtime.simulate import Simulation


def _sim(model: str, workers: int, clients: int, samples: int, batch: int) -> Simulation:
    cfg = load_config(
        None,
        [
            "device=cpu",
            "algorithm.name=fedavg",
            f"clients.models={model}",
            f"clients.count={clients}",
            "local.epochs=1",
            f"local.batch_size={batch}",
            "local.lr=0.01",
            f"local.workers={workers}",
            "seed=0",
        ],
    )
    data = synthetic_federation(clients, samples, (1, 28, 28), 10)
    sim = Simulation(cfg, data=data)
    fit = sim.transport.fit
    sim.fit_seconds = 0.0  # type: ignore[attr-defined]

    def timed(rnd: int, msgs: Any) -> Any:
        t0 = time.perf_counter()
        out = fit(rnd, msgs)
        sim.fit_seconds = time.perf_counter() - t0  # type: ignore[attr-defined]
        return out

    sim.transport.fit = timed  # type: ignore[method-assign]
    return sim


def bench_workers(
    models: list[str], clients: int, samples: int, batch: int, reps: int, n: int = 2
) -> list[dict[str, Any]]:
    """One row per model: median seconds per round of each mode and the paired ratios."""
    modes = {"1x1": (1, 1), f"1x{n}": (1, n), f"{n}x1": (n, 1)}
    rows = []
    for model in models:
        sims = {}
        for mode, (workers, threads) in modes.items():
            torch.set_num_threads(threads)
            t0 = time.perf_counter()
            sims[mode] = _sim(model, workers, clients, samples, batch)
            sims[mode].run_round(1)  # warm-up (and the pool's start)
            print(f"{model} {mode}: build + warm-up round {time.perf_counter() - t0:.1f} s")
        secs: dict[str, list[float]] = {m: [] for m in modes}
        fits: dict[str, list[float]] = {m: [] for m in modes}
        busy: list[float] = []
        for rep in range(reps):
            for mode, (_, threads) in modes.items():
                torch.set_num_threads(threads)
                sim = sims[mode]
                t0 = time.perf_counter()
                sim.run_round(2 + rep)
                secs[mode].append(time.perf_counter() - t0)
                fits[mode].append(sim.fit_seconds)  # type: ignore[attr-defined]
                if sim.transport.parallel is not None:
                    busy.append(sim.transport.parallel.last["busy"])
            print(f"{model} rep {rep}: " + ", ".join(f"{m} {s[-1]:.2f}s" for m, s in secs.items()))
        steps = sum(-(-samples * 1 // batch) for _ in range(clients))
        for sim in sims.values():
            sim.close()
        med = {m: statistics.median(v) for m, v in secs.items()}

        def ratio(a: str, b: str, secs: dict[str, list[float]] = secs) -> float:
            return statistics.median(x / y for x, y in zip(secs[a], secs[b]))

        rows.append(
            {
                "model": model,
                "params": sims["1x1"].models[model].num_params,
                "clients": clients,
                "client_steps_per_round": steps,
                "seconds_per_round": med,
                f"speedup_{n}x1_vs_1x1": ratio("1x1", f"{n}x1"),
                f"speedup_1x{n}_vs_1x1": ratio("1x1", f"1x{n}"),
                f"speedup_{n}x1_vs_1x{n}": ratio(f"1x{n}", f"{n}x1"),
                "step_ms_1x1": 1000 * statistics.median(fits["1x1"]) / steps,
                "server_seconds_1x1": statistics.median(
                    s - f for s, f in zip(secs["1x1"], fits["1x1"])
                ),
                f"fit_seconds_{n}x1": statistics.median(fits[f"{n}x1"]),
                "worker_busy_seconds": statistics.median(busy),
            }
        )
        print(json.dumps(rows[-1]))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["lenet", "vgg8", "resnet10"])
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--samples", type=int, default=100, help="training samples per client")
    ap.add_argument("--batch", type=int, default=10)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", help="write the rows as JSON here")
    a = ap.parse_args()
    rows = bench_workers(a.models, a.clients, a.samples, a.batch, a.reps, a.workers)
    print(f"\nmodel      1x1 s/round  1xN s/round  Nx1 s/round  Nx1/1x1  Nx1/1xN  (N={a.workers})")
    for r in rows:
        s = list(r["seconds_per_round"].values())
        sp = [v for k, v in r.items() if k.startswith("speedup")]
        print(
            f"{r['model']:10s} {s[0]:11.2f}  {s[1]:11.2f}  {s[2]:11.2f}  {sp[0]:6.2f}x  {sp[2]:6.2f}x"
        )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
