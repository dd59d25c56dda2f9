"""A method imports another method only to reuse a role (issue 38, item 3).

A *method file* is a module of ``hyperfed/algorithms/`` that defines ``ALGORITHM`` or
``ALGORITHMS``. Helpers several methods share (layer selectors, the sparse-upload codec,
distillation, representation sharing) live in libraries below the methods; what a method may
take from another method file is listed in :data:`ROLE_IMPORTS`: a server or client role, the
hyperparameters of that role, or a whole registered method (``"*"``: the module itself, as the
Table 5 plug-ins compose FedBN, pFedLHN and FedGH).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
from pathlib import Path

import pytest

import hyperfed.algorithms
from hyperfed.algorithms.base import Client, Server

ROOT = Path(hyperfed.algorithms.__file__).parent

# importer -> {imported method module -> names it may import}
ROLE_IMPORTS: dict[str, dict[str, set[str]]] = {
    "dfedhp": {"dfedalt": {"DFedAltClient"}},
    "distilled_set": {"fedbn": {"*"}, "fedgh": {"*"}, "pfedlhn": {"*"}},
    "ditto": {"fedavg": {"FedAvgServer"}},
    "fd": {"fedproto": {"ClassStatsClient"}},
    "fedkd": {"fml": {"FMLClient", "FMLServer"}},
    "fedphp": {"fedavg": {"FedAvgServer"}},
    "fedrod": {"fedavg": {"FedAvgServer"}},
    "fedtgp": {"fedproto": {"FedProtoClient"}},
    "mapper": {"fedavg": {"FedAvgServer"}},
    "mh_pfedhndd": {
        "fedavg": {"FedAvgClient", "FedAvgParams", "FedAvgServer"},
        "mh_pfedhn": {"MHPFedHNClient", "MHPFedHNParams", "MHPFedHNServer", "GLOBAL"},
    },
    "moon": {"fedavg": {"FedAvgServer"}},
    "pfedhn": {"mh_pfedhn": {"MHPFedHNClient", "MHPFedHNParams", "MHPFedHNServer"}},
    "pfedkt": {"fedavg": {"FedAvgServer"}},
    "pfedlhn": {"pfedla": {"UpdateClient"}},
}
# not a class, but part of the role's interface: the MH-pFedHN server's extra-model slot id,
# which MH-pFedHNDD's theta_d takes (the hypernetwork treats that slot apart)
ROLE_CONSTANTS = {("mh_pfedhn", "GLOBAL")}


def _defines_algorithm(tree: ast.Module) -> bool:
    return any(
        isinstance(node, ast.Assign)
        and any(
            isinstance(t, ast.Name) and t.id in ("ALGORITHM", "ALGORITHMS") for t in node.targets
        )
        for node in tree.body
    )


def method_files(root: Path = ROOT) -> dict[str, ast.Module]:
    trees = {p.stem: ast.parse(p.read_text()) for p in root.glob("*.py")}
    return {name: tree for name, tree in trees.items() if _defines_algorithm(tree)}


def method_imports(tree: ast.Module, methods: set[str], own: str) -> set[tuple[str, str]]:
    """``(method module, name)`` for every import of another method file (``"*"``: the module
    itself), at top level or inside a function."""
    found: set[tuple[str, str]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            "hyperfed.algorithms"
        ):
            parts = (node.module or "").split(".")
            if len(parts) == 3:
                found |= {(parts[2], a.name) for a in node.names}
            elif len(parts) == 2:
                found |= {(a.name, "*") for a in node.names}
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if len(parts) >= 3 and parts[:2] == ["hyperfed", "algorithms"]:
                    found.add((parts[2], "*"))
    return {(mod, name) for mod, name in found if mod in methods and mod != own}


def helper_imports(root: Path = ROOT) -> list[str]:
    """Imports of another method file that :data:`ROLE_IMPORTS` does not allow."""
    methods = method_files(root)
    bad = []
    for own, tree in sorted(methods.items()):
        allowed = ROLE_IMPORTS.get(own, {})
        for mod, name in sorted(method_imports(tree, set(methods), own)):
            if name not in allowed.get(mod, set()):
                bad.append(f"{own} imports {mod}.{name}")
    return bad


def test_method_files_import_other_methods_only_for_roles() -> None:
    bad = helper_imports()
    assert not bad, (
        "a method file imports another method's helper; move it to a library below the "
        "methods (hyperfed/models/select.py, engine/, distill/) or, if it is a role, list it "
        "in ROLE_IMPORTS:\n" + "\n".join(bad)
    )


@pytest.mark.parametrize("importer", sorted(ROLE_IMPORTS))
def test_the_allowed_imports_are_roles(importer: str) -> None:
    """The allowlist cannot smuggle a helper in: each entry is a Server or Client role, a
    hyperparameter dataclass, a whole method module or a listed role constant."""
    for mod, names in ROLE_IMPORTS[importer].items():
        module = importlib.import_module(f"hyperfed.algorithms.{mod}")
        for name in names:
            if name == "*":
                assert hasattr(module, "ALGORITHM") or hasattr(module, "ALGORITHMS")
                continue
            obj = getattr(module, name)
            role = isinstance(obj, type) and (
                issubclass(obj, Server | Client) or dataclasses.is_dataclass(obj)
            )
            assert role or (mod, name) in ROLE_CONSTANTS, f"{mod}.{name} is no role"


def test_the_check_sees_a_helper_import(tmp_path: Path) -> None:
    """The parser flags a method file that imports another method's helper (here FedBN's old
    ``split_by_mask``, inside a function) and accepts a role import."""
    alg = "ALGORITHM = None\n"
    (tmp_path / "fedbn.py").write_text(alg)
    (tmp_path / "fedavg.py").write_text(alg)
    (tmp_path / "fedrep.py").write_text(
        alg + "def f():\n    from hyperfed.algorithms.fedbn import split_by_mask\n"
    )
    (tmp_path / "ditto.py").write_text(
        alg + "from hyperfed.algorithms.fedavg import FedAvgServer\n"
    )
    (tmp_path / "helpers.py").write_text("from hyperfed.algorithms.fedbn import anything\n")
    assert helper_imports(tmp_path) == ["fedrep imports fedbn.split_by_mask"]
