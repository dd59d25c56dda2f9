"""The package's imports point one way (DESIGN "Where the layout goes next", issue 18).

Every module of ``hyperfed`` is parsed (not imported); each ``import hyperfed...`` it makes,
at top level or inside a function, is an edge, except imports under ``if TYPE_CHECKING:``
(annotations only). A module may import its own layer or a lower one, and the graph of modules
has no cycle.

Package = layer (issue 38, item 4): every sub-package (``hyperfed.<name>``, with everything
below it) holds modules of one layer, and the graph of packages -- a module of package P
importing one of package Q is an edge P -> Q; each top-level module is a package of its own --
has no cycle, lazy imports included. The top-level ``hyperfed`` namespace itself holds modules of
every layer and is not a package in this sense.
"""

from __future__ import annotations

import ast
from pathlib import Path

import hyperfed

# bottom -> top; a module belongs to the layer of the longest prefix that names it
LAYERS: list[tuple[str, list[str]]] = [
    (
        "errors",
        [
            "hyperfed.errors",
            "hyperfed.hparams",
            "hyperfed.plugins",
            "hyperfed.progress",
            "hyperfed.registry",
        ],
    ),
    ("data", ["hyperfed.data"]),
    ("models", ["hyperfed.models"]),
    ("hypernet", ["hyperfed.hypernet"]),
    (
        "train",  # mechanics the algorithms call
        [
            "hyperfed.engine",  # local SGD, losses, optimizers, topologies, codecs
            "hyperfed.distill",  # dataset distillation
            "hyperfed.privacy.accounting",
            "hyperfed.privacy.dp_sgd",
            "hyperfed.privacy.inversion",
        ],
    ),
    ("algorithms", ["hyperfed.algorithms"]),
    (
        "runtime",  # what calls the algorithms: config, the round driver, simulator, gossip, run dir
        ["hyperfed.config", "hyperfed.runtime"],
    ),
    (
        "apps",
        [
            "hyperfed.cli",
            "hyperfed.api",
            "hyperfed.__main__",
            "hyperfed.terminal",
            "hyperfed.report",
            "hyperfed.sweep",
            "hyperfed.reproduce",
            "hyperfed.tune",
            "hyperfed.export",
            "hyperfed.bench",
            "hyperfed.deploy",
            "hyperfed.attack",
        ],
    ),
]
PACKAGES_WITHOUT_CODE = {"hyperfed", "hyperfed.privacy", "hyperfed.runtime"}


def _modules() -> dict[str, Path]:
    root = Path(hyperfed.__file__).parent
    out = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _layer(module: str) -> int:
    best, best_len = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = i, len(p)
    return best


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, known: set[str]) -> set[str]:
    """hyperfed modules imported by ``path`` (a ``from pkg import mod`` counts as ``pkg.mod``)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("hyperfed"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hyperfed"):
            assert node.module is not None
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in known else node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(p, set(mods)) - {m} for m, p in mods.items()}


def test_every_module_has_a_layer() -> None:
    missing = [m for m in _modules() if _layer(m) < 0 and m not in PACKAGES_WITHOUT_CODE]
    assert not missing, f"add these modules to LAYERS: {missing}"


def test_no_module_imports_from_a_higher_layer() -> None:
    upward = []
    for mod, deps in _graph().items():
        for dep in deps:
            if dep in PACKAGES_WITHOUT_CODE or mod in PACKAGES_WITHOUT_CODE:
                continue
            if _layer(dep) > _layer(mod):
                upward.append(
                    f"{mod} ({LAYERS[_layer(mod)][0]}) -> {dep} ({LAYERS[_layer(dep)][0]})"
                )
    assert not upward, "imports that point up:\n" + "\n".join(sorted(upward))


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (its nodes, the first repeated at the end), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if d not in graph:
                continue
            if state.get(d) == 1:
                return stack[stack.index(d) :] + [d]
            if d not in state and (found := visit(d)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def _package(module: str) -> str:
    """``hyperfed.runtime.driver`` -> ``hyperfed.runtime``; a top-level module is its own."""
    return ".".join(module.split(".")[:2])


def _package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    packages: dict[str, set[str]] = {}
    for mod, deps in graph.items():
        if mod == "hyperfed":
            continue
        here = _package(mod)
        packages.setdefault(here, set()).update(
            _package(d) for d in deps if d != "hyperfed" and _package(d) != here
        )
    return packages


def _layers_per_package(layer_of: dict[str, str]) -> dict[str, set[str]]:
    """The layers of each package's modules, from ``{module: its layer}``."""
    out: dict[str, set[str]] = {}
    for m, layer in layer_of.items():
        out.setdefault(_package(m), set()).add(layer)
    return out


def test_the_import_graph_has_no_cycle() -> None:
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_package_graph_has_no_cycle() -> None:
    cycle = _cycle(_package_graph(_graph()))
    assert cycle is None, "import cycle between packages: " + " -> ".join(cycle or [])


def test_every_package_holds_one_layer() -> None:
    layer_of = {
        m: LAYERS[_layer(m)][0]
        for m in _modules()
        if m not in PACKAGES_WITHOUT_CODE and _layer(m) >= 0  # (a missing layer fails above)
    }
    mixed = {p: sorted(ls) for p, ls in _layers_per_package(layer_of).items() if len(ls) > 1}
    assert not mixed, f"packages spanning layers (move the modules or split the package): {mixed}"


def test_the_package_checks_fail_on_a_bad_graph() -> None:
    """The checkers on hand-made graphs: a cycle through lazy imports of two packages (no cycle
    between their modules), and a package holding an app beside a layer below it."""
    modules = {
        "hyperfed.config": {"hyperfed.algorithms"},  # e.g. a deferred registry import
        "hyperfed.algorithms": {"hyperfed.algorithms.x"},
        "hyperfed.algorithms.x": {"hyperfed.algorithms.base"},
        "hyperfed.algorithms.base": {"hyperfed.config"},
    }
    assert _cycle({"a": {"b"}, "b": set()}) is None
    assert _cycle(modules) is not None
    no_module_cycle = {**modules, "hyperfed.algorithms.base": {"hyperfed.config_errors"}}
    no_module_cycle["hyperfed.config_errors"] = set()
    no_module_cycle["hyperfed.config"] = {"hyperfed.algorithms.x"}
    no_module_cycle["hyperfed.algorithms.y"] = {"hyperfed.config"}
    assert _cycle(no_module_cycle) is None
    assert _cycle(_package_graph(no_module_cycle)) == [
        "hyperfed.algorithms",
        "hyperfed.config",
        "hyperfed.algorithms",
    ]
    one_each = {"hyperfed.privacy.accounting": "train", "hyperfed.deploy.flower": "apps"}
    assert _layers_per_package(one_each) == {
        "hyperfed.privacy": {"train"},
        "hyperfed.deploy": {"apps"},
    }
    # privacy/ as it was: DP accounting (train) beside the attack app
    spanning = {"hyperfed.privacy.accounting": "train", "hyperfed.privacy.attack": "apps"}
    assert _layers_per_package(spanning) == {"hyperfed.privacy": {"train", "apps"}}


def test_the_checker_sees_an_upward_edge(tmp_path: Path) -> None:
    """The parser finds edges, including imports inside functions."""
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from hyperfed.runtime.simulate import Simulation\n")
    assert _imports(src, set(_modules())) == {"hyperfed.runtime.simulate"}
    assert _layer("hyperfed.runtime.simulate") > _layer("hyperfed.algorithms.fedavg")


# -- who plays a round ----------------------------------------------------------------------------
# Issue 38: the round driver is the one caller of a server's exchange hooks (the methods and
# the components they compose call them on the roles they wrap); an app that plays part of a
# round by hand would skip the driver's reply validation.
SERVER_EXCHANGE_HOOKS = {
    "configure_train",
    "configure_eval",
    "configure_setup",
    "configure_eval_request",
    "aggregate",
    "aggregate_setup",
}
MAY_CALL_EXCHANGE_HOOKS = ("hyperfed.runtime.driver", "hyperfed.algorithms", "hyperfed.distill")


def _exchange_hook_calls(source: str) -> set[str]:
    """The server exchange hooks ``source`` calls as ``<anything>.<hook>(...)``."""
    return {
        node.func.attr
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in SERVER_EXCHANGE_HOOKS
    }


def test_only_the_driver_and_the_methods_call_a_servers_exchange_hooks() -> None:
    offenders = {
        module: sorted(calls)
        for module, path in _modules().items()
        if not any(module == p or module.startswith(p + ".") for p in MAY_CALL_EXCHANGE_HOOKS)
        and (calls := _exchange_hook_calls(path.read_text()))
    }
    assert not offenders, f"exchange hooks called outside the round driver: {offenders}"
    # the check sees a half round played by hand (what the attack app did before issue 38)
    hand = "msgs = sim.server.configure_train(1, [c])\nsim.server.aggregate(1, replies)\n"
    assert _exchange_hook_calls(hand) == {"configure_train", "aggregate"}
