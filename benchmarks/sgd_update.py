"""The engine's SGD and Adam steps on flat parameters: out of place (``step``, what CUDA
graphs and partly-active groups use) vs in place (``step_``, the eager loop when every client
of the group is active). Prints milliseconds per step and the ratio. Adam is the rule of
pFedKT's hypernetwork: 13 k parameters a client for HN(small), 18 M for HN(large).

    python benchmarks/sgd_update.py [--device cpu|cuda]
"""

import argparse
import statistics
import time

import torch

from hyperfed.engine.optim import SGD, Adam, UpdateRule


def per_step_ms(
    rule: UpdateRule, in_place: bool, clients: int, size: int, device: torch.device
) -> float:
    theta = torch.randn(clients, size, device=device)
    state = rule.init_state(theta)
    times = []
    for _ in range(40):
        grads = 1e-3 * torch.randn(clients, size, device=device)  # fresh, as autograd gives
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        if in_place:
            rule.step_(theta, grads, state, None)
        else:
            theta, state = rule.step(theta, grads, state, None)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times[5:]) * 1e3


# CNN-1 (pFedES, 1x28x28): 2.0 M; LeNet-style (CIFAR-100 shape): 0.24 M
SIZES = ((1, 2_000_000), (1, 240_000), (20, 240_000), (50, 240_000))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    device = torch.device(parser.parse_args().device)
    print(f"device {device}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    rules: list[tuple[UpdateRule, tuple[tuple[int, int], ...]]] = [
        (SGD(lr=0.01, momentum=0.9, weight_decay=1e-4), SIZES),
        (Adam(lr=1e-3), ((1, 2_000_000), (10, 240_000), (1, 18_200_000))),
    ]
    for rule, sizes in rules:
        for clients, size in sizes:
            out = min(per_step_ms(rule, False, clients, size, device) for _ in range(2))
            inp = min(per_step_ms(rule, True, clients, size, device) for _ in range(2))
            print(
                f"{type(rule).__name__:>4} {clients:>3} x {size:>10,} parameters: out of place "
                f"{out:8.2f} ms, in place {inp:8.2f} ms per step ({out / inp:.1f}x)"
            )


if __name__ == "__main__":
    main()
