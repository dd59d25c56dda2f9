"""One federation builder (issue 38, items 1, 2 and 4): ``hyperfed.runtime.federation``.

* Conformance, parametrized over the registry: a Flower node's client (built, joined and given
  its initial state as ``deploy/node.py`` does, one node after another) and the Flower
  server's role hold exactly the state the simulator builds for them -- join payloads, initial
  client state and server state, tensor for tensor.
* The builder's seeding leaves the random state outside it as it was.
* ``RoundDriver.train_exchange`` validates the replies and aggregates nothing.
* Static checks: every method module is in the registry's import list, Flower does not import
  the simulator, and no module outside the driver and the methods calls a server's configure or
  aggregate hooks.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

import hyperfed
from hyperfed.algorithms import METHOD_MODULES, get_algorithm, registry
from hyperfed.runtime.federation import Federation
from hyperfed.runtime.simulate import Simulation

ALGORITHMS = registry()
MIXES: dict[str, str | list[str]] = {
    "homogeneous": "lenet",
    "heterogeneous": ["lenet", "vgg8", "mlp"],
}
# as in test_conformance.py: settings 8x8 digits or a mix needs (the error says which)
ADJUST: dict[tuple[str, str | None], list[str]] = {
    ("fedkd", None): ["algorithm.shared_model=lenet"],
    ("fml", None): ["algorithm.shared_model=lenet"],
    ("lg_fedavg", "heterogeneous"): ["algorithm.global_layers=classifier"],
}
ROOT = Path(hyperfed.__file__).parent


def _same(a: Any, b: Any, where: str = "") -> str | None:
    """Where ``a`` and ``b`` differ (tensors bit for bit, NaN equal to NaN), or None."""
    if isinstance(a, Tensor):
        if not isinstance(b, Tensor) or a.shape != b.shape or a.dtype != b.dtype:
            return f"{where}: {getattr(b, 'shape', b)} / {getattr(b, 'dtype', '')}"
        a, b = a.detach().cpu(), b.detach().cpu()
        if a.is_floating_point() or a.is_complex():
            same = (a == b) | (torch.isnan(a) & torch.isnan(b))
        else:
            same = a == b
        return None if bool(same.all()) else f"{where}: values differ"
    if isinstance(a, dict):
        if not isinstance(b, dict) or set(a) != set(b):
            return f"{where}: keys {sorted(map(str, a))} / {sorted(map(str, b or {}))}"
        return next((d for k in a if (d := _same(a[k], b[k], f"{where}.{k}"))), None)
    if isinstance(a, list | tuple):
        if not isinstance(b, list | tuple) or len(a) != len(b):
            return f"{where}: lengths differ"
        return next(
            (d for i, (x, y) in enumerate(zip(a, b)) if (d := _same(x, y, f"{where}[{i}]"))), None
        )
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return None
    return None if a == b else f"{where}: {a!r} / {b!r}"


def _cases() -> list[Any]:
    out = []
    for name, alg in ALGORITHMS.items():
        for mix in MIXES:
            if mix == "heterogeneous" and alg.homogeneous_only:
                continue
            marks = [pytest.mark.slow] if mix == "heterogeneous" else []
            out.append(pytest.param(name, mix, id=f"{name}-{mix}", marks=marks))
    return out


@pytest.mark.parametrize(("name", "mix"), _cases())
def test_flower_builds_the_simulators_initial_state(
    name: str, mix: str, small_sim: Any, tmp_path: Path
) -> None:
    pytest.importorskip("flwr")
    from flwr.app import Context, RecordDict

    from hyperfed.deploy.appconfig import RunSettings, experiment_run_config
    from hyperfed.deploy.node import ClientRuntime
    from hyperfed.deploy.server import Deployment

    extra = ADJUST.get((name, None), []) + ADJUST.get((name, mix), [])
    cfg = small_sim.config(name, MIXES[mix], *extra)
    sim = Simulation(cfg)
    n = cfg.clients.count
    joins = {}
    for cid in range(n):  # one node after another, as separate processes would run them
        torch.manual_seed(1000 + cid)  # its own process
        node = ClientRuntime.build(cfg, [cid], n)
        joins[cid] = node.joins()[cid]
        assert (d := _same(sim.joins[cid], joins[cid], f"join {cid}")) is None, d
        context = Context(1, cid, {}, RecordDict(), {})  # a fresh node's
        stored = node.load_states(context, [cid])[cid]  # its state on the first message
        assert (d := _same(sim.store[cid], stored, f"client {cid}")) is None, d
    settings = RunSettings(run_dir=str(tmp_path)).to_run_config()
    deployment = Deployment(None, {**experiment_run_config(cfg), **settings})
    torch.manual_seed(12345)  # the server's process ran other things before
    server = deployment.build_server(joins)
    assert (d := _same(sim.server.state_dict(), server.state_dict(), "server")) is None, d


def test_the_builders_seeding_leaves_the_random_state_as_it_was(small_sim: Any) -> None:
    # pFedKT draws each client's hypernetwork from the global generator at init
    cfg = small_sim.config("pfedkt", "lenet")
    fed = Federation(cfg)
    data = fed.load_data()
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    models = fed.models(data.input_shape, data.num_classes)
    client = fed.client_role(data.input_shape, data.num_classes)
    after_role = torch.random.get_rng_state()
    first = fed.initial_states(client, models)
    assert torch.equal(torch.random.get_rng_state(), after_role)  # the draw is the builder's own
    torch.manual_seed(7)  # whatever ran before
    again = fed.initial_states(client, models, [2, 3])
    assert _same({c: first[c] for c in (2, 3)}, again) is None  # the same draw: from the seed
    assert not torch.equal(first[0]["hn"], first[1]["hn"])  # Alg. 1: one draw per client
    assert not torch.equal(before, after_role)  # (the role itself is seeded, by design)


def test_each_role_starts_from_the_seed_whatever_ran_before(small_sim: Any) -> None:
    """A role that draws at construction draws the same in every process (today's methods
    also seed themselves, so this is checked with roles that do not)."""
    fed = Federation(small_sim.config("fedavg", "lenet"))
    fed.algorithm = dataclasses.replace(
        fed.algorithm,
        server=lambda hp, joins, ctx: torch.rand(3),  # type: ignore[arg-type,return-value]
        client=lambda hp, ctx: torch.rand(3),  # type: ignore[arg-type,return-value]
    )
    clients, servers = [], []
    for before in (1, 2):
        torch.manual_seed(before)
        clients.append(fed.client_role((1, 8, 8), 10))
        torch.manual_seed(before)
        servers.append(fed.server_role({}, {}, (1, 8, 8), 10))
    assert torch.equal(*clients) and torch.equal(*servers)


def test_train_exchange_validates_and_aggregates_nothing(small_sim: Any, monkeypatch: Any) -> None:
    sim = small_sim("fedavg", "lenet")
    before = {k: v.clone() for k, v in sim.server.state_dict().items() if isinstance(v, Tensor)}
    fit = sim.transport.fit

    def forged(rnd: int, msgs: dict[int, Any]) -> Any:  # client 1 sends a NaN
        got = fit(rnd, msgs)
        got.replies[1] = {k: torch.full_like(v, math.nan) for k, v in got.replies[1].items()}
        return got

    monkeypatch.setattr(sim.transport, "fit", forged)
    ex = sim.driver.train_exchange(1, [0, 1, 2])
    assert sorted(ex.msgs) == [0, 1, 2] and sorted(ex.got.replies) == [0, 1, 2]
    assert list(ex.accepted) == [0, 2] and ex.rejected == [1]
    after = sim.server.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in before.items())  # not aggregated
    assert sim.driver.totals["bytes_down"] == 0  # nor counted


def _method_modules_on_disk() -> set[str]:
    found = set()
    for path in (ROOT / "algorithms").glob("[!_]*.py"):
        if re.search(r"^ALGORITHMS?\s*[:=]", path.read_text(), re.M):
            found.add(path.stem)
    return found


def test_every_method_module_is_imported_by_the_registry() -> None:
    listed = {m.__name__.rsplit(".", 1)[1] for m in METHOD_MODULES}
    assert listed == _method_modules_on_disk(), "add the module to algorithms/__init__.py"
    for module in METHOD_MODULES:
        for alg in [getattr(module, "ALGORITHM", None), *getattr(module, "ALGORITHMS", [])]:
            if alg is not None:
                assert get_algorithm(alg.name) is alg


def _imported(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.update({node.module, *(f"{node.module}.{a.name}" for a in node.names)})
    return out


def test_flower_builds_with_the_federation_not_the_simulator() -> None:
    for path in (ROOT / "deploy").glob("*.py"):
        assert "hyperfed.runtime.simulate" not in _imported(path), path.name
    for side in ("node.py", "server.py"):  # both build with the simulator's builder
        assert "hyperfed.runtime.federation" in _imported(ROOT / "deploy" / side)


SERVER_HOOKS = {
    "configure_train",
    "configure_eval",
    "configure_setup",
    "configure_eval_request",
    "aggregate",
    "aggregate_setup",
}


def _hook_calls(source: str) -> list[str]:
    return [
        node.func.attr
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in SERVER_HOOKS
    ]


def test_only_the_driver_and_the_methods_call_server_hooks() -> None:
    assert _hook_calls("msg = sim.server.configure_train(1, [0])[0]") == ["configure_train"]
    assert _hook_calls("x = driver.train_exchange(1, [0])") == []
    callers = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "runtime/driver.py" or rel.startswith("algorithms/"):
            continue
        if calls := _hook_calls(path.read_text()):
            callers.append(f"{rel}: {calls}")
    assert not callers, callers
