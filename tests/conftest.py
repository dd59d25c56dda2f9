import os
import time
from pathlib import Path

import pytest
import torch

from hyperfed.data.federated import FederatedData, federate
from hyperfed.data.sources import load_dataset

# local.workers = auto (the default) trains in one process under the test runner: a worker
# pool per tiny simulation would cost more than it saves (tests/test_parallel.py sets its own)
os.environ.setdefault("HYPERFED_CORES", "1")


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)  # tiny models: one thread is faster and steadier


@pytest.fixture(scope="session")
def digits_data() -> FederatedData:
    """scikit-learn digits over 4 clients of different sizes (Dirichlet 1.0)."""
    return federate(load_dataset("digits"), 4, "dirichlet", alpha=1.0, seed=0)


# -- a small simulation, built like `hyperfed run` builds one ------------------------------
# Sizes only: what makes a run short (rounds, clients, samples, local epochs, distillation
# iterations) is shrunk; every other setting is default.toml's and the method's own default.
SMALL_RUN = [
    "device=cpu",
    "rounds=2",
    "eval_every=1",
    "clients.count=4",
    "dataset.subsample=300",
    "local.epochs=1",
]
# hyperparameters that only set how long a one-off phase runs; applied where a method has them
SMALL_HPARAMS = {
    "distill_iters": 2,  # MH-pFedHNDD family: dataset-distillation iterations
    "ipc": 1,  # synthetic images per class
    "syn_batch": 10,
    "distill_batch_real": 16,
    "one_shot_epochs": 1,
    "extractor_epochs": 1,  # pFedES: local epochs of the shared extractor
}


class SmallSim:
    """Builds tiny digits simulations from default.toml plus ``--set``-style overrides."""

    def sets(self, algorithm: str, models: str | list[str] = "lenet", *extra: str) -> list[str]:
        import dataclasses
        import json

        from hyperfed.algorithms import get_algorithm

        fields = {f.name for f in dataclasses.fields(get_algorithm(algorithm).hparams)}
        small = [f"algorithm.{k}={v}" for k, v in SMALL_HPARAMS.items() if k in fields]
        return [
            *SMALL_RUN,
            f"algorithm.name={algorithm}",
            f"clients.models={json.dumps(models)}",
            *small,
            *extra,
        ]

    def config(self, algorithm: str, models: str | list[str] = "lenet", *extra: str):
        from hyperfed.config import load_config

        return load_config(None, self.sets(algorithm, models, *extra))

    def __call__(self, algorithm: str, models: str | list[str] = "lenet", *extra: str):
        from hyperfed.runtime.simulate import Simulation

        return Simulation(self.config(algorithm, models, *extra))


@pytest.fixture(scope="session")
def small_sim() -> SmallSim:
    """``small_sim("fedavg", ["lenet", "mlp"], "rounds=1")``: a Simulation of 4 digits clients
    (300 samples), 2 rounds of 1 local epoch, evaluated every round; ``small_sim.config(...)``
    gives its ExperimentConfig, ``small_sim.sets(...)`` the override strings."""
    return SmallSim()


# -- real loopback Flower deployments (test_flower*.py) ------------------------------------
def _working_in(folder: Path) -> list[str]:
    """Processes (not zombies) whose working directory is inside ``folder``: what a
    deployment started there, the ServerApp its SuperLink's detached SuperExec runs included."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            cwd = Path(os.readlink(entry / "cwd"))
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and cwd.is_relative_to(folder):
            found.append(f"{entry.name}: {(entry / 'cmdline').read_bytes()[:80]!r}")
    return found


@pytest.fixture
def deployments(request, tmp_path):
    """Deployments (``LocalDeployment``) a test started and appended here; every process group
    they started is stopped at the end, also when the test fails. In a module that sets
    ``CHECK_FOLDER = True``, also nothing they started keeps running in the test's folder
    (waited for up to 10 s)."""
    from hyperfed.deploy.launch import _group_alive  # needs Flower: only where it is used

    started: list = []
    try:
        yield started
    finally:
        for d in started:
            d.stop()
        pids = [p.pid for d in started for p in d.processes]
        assert not [pid for pid in pids if _group_alive(pid)], "processes left running"
        if getattr(request.module, "CHECK_FOLDER", False):
            deadline = time.monotonic() + 10
            while _working_in(tmp_path) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not _working_in(tmp_path), _working_in(tmp_path)
