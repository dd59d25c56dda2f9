"""The engine's SGD step on flat parameters: out of place (``SGD.step``, what CUDA graphs
and partly-active groups use) vs in place (``SGD.step_``, the eager loop when every client
of the group is active). Prints milliseconds per step and the ratio.

    python benchmarks/sgd_update.py [--device cpu|cuda]
"""

import argparse
import statistics
import time

import torch

from hyperfed.engine.optim import SGD


def per_step_ms(in_place: bool, clients: int, size: int, device: torch.device) -> float:
    sgd = SGD(lr=0.01, momentum=0.9, weight_decay=1e-4)
    theta = torch.randn(clients, size, device=device)
    state = sgd.init_state(theta)
    times = []
    for _ in range(40):
        grads = 1e-3 * torch.randn(clients, size, device=device)  # fresh, as autograd gives
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        if in_place:
            sgd.step_(theta, grads, state, None)
        else:
            theta, state = sgd.step(theta, grads, state, None)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times[5:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    device = torch.device(parser.parse_args().device)
    print(f"device {device}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    # CNN-1 (pFedES, 1x28x28): 2.0 M; LeNet-style (CIFAR-100 shape): 0.24 M
    for clients, size in ((1, 2_000_000), (1, 240_000), (20, 240_000), (50, 240_000)):
        out = min(per_step_ms(False, clients, size, device) for _ in range(2))
        inp = min(per_step_ms(True, clients, size, device) for _ in range(2))
        print(
            f"{clients:>3} x {size:>9,} parameters: out of place {out:7.2f} ms, "
            f"in place {inp:7.2f} ms per step ({out / inp:.1f}x)"
        )


if __name__ == "__main__":
    main()
