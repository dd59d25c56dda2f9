"""The package's imports point one way (DESIGN "Where the layout goes next", issue 18).

Every module of ``hyperfed`` is parsed (not imported); each ``import hyperfed...`` it makes,
at top level or inside a function, is an edge, except imports under ``if TYPE_CHECKING:``
(annotations only). A module may import its own layer or a lower one, and the graph of modules
has no cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import hyperfed

# bottom -> top; a module belongs to the layer of the longest prefix that names it
LAYERS: list[tuple[str, list[str]]] = [
    ("errors", ["hyperfed.errors", "hyperfed.hparams", "hyperfed.plugins", "hyperfed.progress"]),
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
            "hyperfed.__main__",
            "hyperfed.terminal",
            "hyperfed.report",
            "hyperfed.sweep",
            "hyperfed.reproduce",
            "hyperfed.tune",
            "hyperfed.export",
            "hyperfed.bench",
            "hyperfed.deploy",
            "hyperfed.privacy.attack",
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


def test_the_import_graph_has_no_cycle() -> None:
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if d not in graph:
                continue
            if state.get(d) == 1:
                cycle = stack[stack.index(d) :] + [d]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_the_checker_sees_an_upward_edge(tmp_path: Path) -> None:
    """The parser finds edges, including imports inside functions."""
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from hyperfed.runtime.simulate import Simulation\n")
    assert _imports(src, set(_modules())) == {"hyperfed.runtime.simulate"}
    assert _layer("hyperfed.runtime.simulate") > _layer("hyperfed.algorithms.fedavg")
