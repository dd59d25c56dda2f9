"""README.md is the short version of the documentation site (docs/, built by ``make docs``).

It stays short, its relative links resolve on GitHub, and the two parts it shares with the
site (the quick start, the methods table) are the same text in both places, so neither can
drift. The methods table names every built-in algorithm and nothing else. CONTRIBUTING.md's
layer table covers tests/test_layers.py's layers, and the files and line count it names exist.
The docstrings use only the rST roles the site's griffe extension turns into links.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
from pathlib import Path

import hyperfed.algorithms as algorithms_pkg
from hyperfed.algorithms.base import Algorithm

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
CONTRIBUTING = ROOT / "CONTRIBUTING.md"
MAX_README_LINES = 250  # issue 38: what it is, install, commands, results teaser, methods, links


def _section(text: str, heading: str) -> str:
    """The lines from ``heading`` up to the next heading of the same or a higher level."""
    lines = text.splitlines()
    start = lines.index(heading)
    level = len(heading) - len(heading.lstrip("#"))
    end = len(lines)
    for i in range(start + 1, len(lines)):
        m = re.match(r"(#+) ", lines[i])
        if m and len(m.group(1)) <= level and not _in_code(lines, i):
            end = i
            break
    return "\n".join(lines[start:end]).strip() + "\n"


def _in_code(lines: list[str], i: int) -> bool:
    return sum(1 for line in lines[:i] if line.startswith("```")) % 2 == 1


def _first_table(text: str) -> list[str]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return lines[start:end]


def _relative_links(text: str) -> list[str]:
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    return [t for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def _builtin_algorithms() -> set[str]:
    names = set()
    for info in pkgutil.iter_modules(algorithms_pkg.__path__):
        module = importlib.import_module(f"{algorithms_pkg.__name__}.{info.name}")
        entries = [getattr(module, "ALGORITHM", None), *getattr(module, "ALGORITHMS", [])]
        names.update(alg.name for alg in entries if isinstance(alg, Algorithm))
    return names


def test_readme_is_short() -> None:
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines; move sections to docs/*.md"


def test_readme_links_resolve() -> None:
    missing = [
        t for t in _relative_links(README.read_text()) if not (ROOT / t.split("#")[0]).exists()
    ]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_readme_quick_start_is_the_site_home_page_s() -> None:
    readme = _section(README.read_text(), "## Quick start")
    home = _section((ROOT / "docs" / "index.md").read_text(), "## Quick start")
    assert readme == home, "README.md's and docs/index.md's quick start differ"


def test_readme_methods_table_is_the_methods_page_s() -> None:
    readme = _first_table(_section(README.read_text(), "## Methods"))
    page = _first_table((ROOT / "docs" / "methods.md").read_text())
    assert readme == page, "README.md's and docs/methods.md's methods tables differ"


def test_readme_lists_the_site_s_pages() -> None:
    readme = _first_table(_section(README.read_text(), "## Documentation"))
    home = _first_table(_section((ROOT / "docs" / "index.md").read_text(), "## The pages"))
    home = [row for row in home if "](api/" not in row]  # the API reference: on the site only
    assert [row.replace("](docs/", "](") for row in readme] == home, (
        "README.md's Documentation table and docs/index.md's page list differ"
    )


def test_the_methods_table_names_every_builtin_algorithm() -> None:
    rows = _first_table(_section(README.read_text(), "## Methods"))[2:]
    listed = {name for row in rows for name in re.findall(r"`([a-z0-9_]+)`", row.split("|")[1])}
    builtin = _builtin_algorithms()
    assert builtin - listed == set(), f"missing from the methods table: {sorted(builtin - listed)}"
    assert listed - builtin == set(), f"not an algorithm: {sorted(listed - builtin)}"


def _layer_table() -> str:
    return "\n".join(_first_table(_section(CONTRIBUTING.read_text(), "## The layers")))


def test_contributing_s_layer_table_names_every_layer_of_test_layers() -> None:
    from test_layers import LAYERS

    table = _layer_table()
    missing = []
    for _, prefixes in LAYERS:
        for prefix in prefixes:
            rel = prefix.removeprefix("hyperfed.").replace(".", "/")
            inside = rel.split("/", 1)[-1]  # `engine/` (`codec.py`) names hyperfed/engine/codec.py
            if not any(f"`{n}`" in table for n in (f"{rel}.py", f"{rel}/", f"{inside}.py")):
                missing.append(prefix)
    assert not missing, f"CONTRIBUTING.md's layer table lacks {missing}"


def test_contributing_names_files_that_exist() -> None:
    text = CONTRIBUTING.read_text()
    files = {
        str(f.relative_to(ROOT))
        for top in ("hyperfed", "tests", "benchmarks")
        for f in (ROOT / top).glob("**/*.py")
    }
    dirs = {str(d.relative_to(ROOT / "hyperfed")) + "/" for d in (ROOT / "hyperfed").glob("**/")}
    dirs |= {d.name + "/" for d in ROOT.iterdir() if d.is_dir()}
    gone = []
    for name in set(re.findall(r"`([\w/.]+(?:\.py|/))`", text)):
        if "my_method" in name or name.startswith("."):
            continue
        if not any(f == name or f.endswith("/" + name) for f in files) and name not in dirs:
            gone.append(name)
    assert not gone, f"CONTRIBUTING.md names files that do not exist: {sorted(gone)}"
    m = re.search(r"`fedper\.py` is the model\s+\((\d+) lines\)", text)
    assert m, "CONTRIBUTING.md no longer gives fedper.py's length"
    lines = len((ROOT / "hyperfed" / "algorithms" / "fedper.py").read_text().splitlines())
    assert int(m.group(1)) == lines, (
        f"fedper.py has {lines} lines, CONTRIBUTING.md says {m.group(1)}"
    )


RST_ROLES = ROOT / "docs" / "_ext" / "rst_roles.py"
ANY_ROLE = re.compile(r"(?<![\w:]):((?:py:)?[a-z]+):`([^`]*)`")
TARGET = re.compile(r"~?[\w.]+(?:\n\s*[\w.]+)*")  # a dotted name, which may break at a line end


def _handled_roles() -> tuple[str, ...]:
    """docs/_ext/rst_roles.py's ROLES, read without importing it (griffe is the docs extra's)."""
    for node in ast.parse(RST_ROLES.read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "ROLES":
            return tuple(ast.literal_eval(node.value))
    raise AssertionError("docs/_ext/rst_roles.py defines no ROLES")


def _unhandled_roles(text: str, roles: tuple[str, ...]) -> list[str]:
    return [
        m.group(0)
        for m in ANY_ROLE.finditer(text)
        if m.group(1) not in roles or not TARGET.fullmatch(m.group(2))
    ]


def test_docstring_roles_are_the_ones_the_site_links() -> None:
    """Every ``:role:`target``` in the package is one docs/_ext/rst_roles.py rewrites into a link
    (``make docs`` then fails on a target that names nothing and on any role left in the HTML):
    no ``:exc:``, ``:py:class:``, ``:ref:`` or ``Title <target>`` form that would print raw."""
    roles = _handled_roles()
    assert {"class", "meth", "func", "mod"} <= set(roles)
    bad = [
        f"{f.relative_to(ROOT)}: {role}"
        for f in sorted((ROOT / "hyperfed").glob("**/*.py"))
        for role in _unhandled_roles(f.read_text(), roles)
    ]
    assert not bad, f"rST roles the docs site cannot link (use {', '.join(roles)}): {bad}"


def test_the_helpers_see_a_difference() -> None:
    """The checks above can fail: a changed row, a dead link and an extra heading are seen."""
    text = "# t\n\n## A\n\n```\n## not a heading\n```\n| x |\n|---|\n| `a` |\n\n## B\n\nrest\n"
    assert "## B" not in _section(text, "## A") and "## not a heading" in _section(text, "## A")
    assert _first_table(_section(text, "## A")) == ["| x |", "|---|", "| `a` |"]
    assert _relative_links("[a](docs/x.md) [b](https://e.org) [c](#d) ![i](img/p.png)") == [
        "docs/x.md",
        "img/p.png",
    ]
    text = ":class:`A` :func:`~m.f` :exc:`E` :py:class:`B` :class:`T <m.T>` :meth:`a.b`"
    assert _unhandled_roles(text, _handled_roles()) == [
        ":exc:`E`",
        ":py:class:`B`",
        ":class:`T <m.T>`",
    ]
