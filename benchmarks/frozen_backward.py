"""FedRep's head-only epoch: the whole backward pass masked after (how hyperfed trained a frozen
part before issue 35) vs the backward pass stopped at the head (the engine now: the frozen
body enters the loss as constants). Prints seconds per head-only epoch of all clients, and
the ratio masked / stopped.

Setting: the CPU seed-001 target's shape -- Fashion-MNIST-shaped inputs (1x28x28, 10
classes, random pixels: only the shapes matter for time), 20 clients of 240 training samples,
the LeNet-style model, batch 64, SGD with momentum and weight decay, FedRep's head (the last
Linear, ``classifier``). Both paths run the engine's client loop (``vectorize=False``, the CPU
default) or, with ``--vectorize``, its vmapped step; they alternate, and the medians are shown.

    python benchmarks/frozen_backward.py [--clients 20] [--samples 240] [--repeat 5]
        [--threads 1] [--vectorize] [--device cpu|cuda]
"""

import argparse
import statistics
import time

import torch

from hyperfed.algorithms.fedrep import rep_split
from hyperfed.data.federated import FederatedData
from hyperfed.engine.local import (
    SGDConfig,
    client_seed,
    cross_entropy_loss,
    plan_batches,
    train_clients,
)
from hyperfed.models.layout import FunctionalModel
from hyperfed.models.zoo import build_model


def masked_after(*args):  # the plain loss, unmarked: the engine masks the update after a
    return cross_entropy_loss(*args)  # full backward (the pre-issue-35 path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--samples", type=int, default=240, help="training samples per client")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--vectorize", action="store_true", help="the vmapped step")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    g = torch.Generator().manual_seed(0)
    n = args.clients * args.samples
    x = torch.randint(0, 256, (n, 1, 28, 28), generator=g, dtype=torch.uint8).to(device)
    y = torch.randint(0, 10, (n,), generator=g).to(device)
    train = list(torch.arange(n, device=device).split(args.samples))
    empty = [torch.zeros(0, dtype=torch.long, device=device) for _ in train]
    none = torch.zeros(0, device=device)
    data = FederatedData(x, y, train, empty, empty, 10, (1, 28, 28), none, none, "fmnist-shaped")

    torch.manual_seed(0)
    fm = FunctionalModel(build_model("lenet", (1, 28, 28), 10).to(device))
    head = rep_split(fm, "classifier").head_mask().to(device)
    theta = fm.initial_params().expand(args.clients, -1).clone()
    buffers = fm.initial_buffers().expand(args.clients, -1).clone()
    sgd = SGDConfig(lr=0.01, momentum=0.9, weight_decay=5e-5, epochs=1, batch_size=64)
    seeds = [client_seed(0, 1, c) for c in range(args.clients)]
    plan = plan_batches(train, sgd.epochs, sgd.batch_size, seeds)

    def epoch(loss_fn) -> tuple[float, torch.Tensor]:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        out, _, _ = train_clients(
            fm, theta, buffers, data, plan, sgd, loss_fn=loss_fn, trainable=head,
            vectorize=args.vectorize,
        )  # fmt: skip
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t, out

    epoch(cross_entropy_loss)  # warm-up (allocator, lazy init)
    epoch(masked_after)
    masked, stopped = [], []
    for _ in range(args.repeat):
        t, out_m = epoch(masked_after)
        masked.append(t)
        t, out_s = epoch(cross_entropy_loss)
        stopped.append(t)
    body = ~head
    assert torch.equal(out_s[:, body], theta[:, body]), "the body moved"
    diff = float((out_s - out_m).abs().max())
    m, s = statistics.median(masked), statistics.median(stopped)
    path = "vmapped step" if args.vectorize else "client loop"
    print(
        f"device {device}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
        f"{args.clients} clients x {args.samples} samples (1x28x28), LeNet, batch 64, "
        f"{plan.steps} steps per client, {path}"
    )
    print(f"  masked after a full backward: {m:.3f} s per head-only epoch  {masked}")
    print(f"  backward stopped at the head: {s:.3f} s per head-only epoch  {stopped}")
    print(f"  ratio masked / stopped: {m / s:.2f}x  (max |head difference| {diff:.1e})")


if __name__ == "__main__":
    main()
