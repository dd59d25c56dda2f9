"""Griffe extension for the API reference: the docstrings' rST roles become cross-reference links.

The package's docstrings are written in one style, Sphinx's: ``:class:`Name```, ``:meth:`...```,
``:func:``, ``:mod:``, ``:data:``, ``:attr:``, with ``~`` to show only the last dotted part.
mkdocstrings would print those roles as raw text; this extension (loaded by mkdocs.yml's
mkdocstrings options, run once the package is loaded) rewrites each role into an autorefs
reference to the object's full path, resolved in the docstring's own scope as Sphinx resolves it
(the object's members, its module's imports, then the enclosing scopes).

- A target shown on an API page becomes a link; one not in the reference (an internal module no
  page renders) stays code, with its full path as a tooltip (an "optional" autoref).
- A target that names nothing in the package fails the strict build (a griffe warning, which
  mkdocs --strict counts), so a typo or a renamed object cannot hide; names outside the package
  (``torch.nn.Module``) stay code.
- rST's literal-block marker (``text::`` before an indented block) loses its extra colon; the
  indented block is a code block in Markdown as it is.

tests/test_docs.py keeps the docstrings to the roles handled here; ``make docs`` checks that no
raw role is left in the built HTML.
"""

from __future__ import annotations

import html
import re
from typing import Any

import griffe

ROLES = ("class", "meth", "func", "mod", "data", "attr")
# a dotted target may break at a line end (``:class:`hyperfed.x.\n    Name```)
ROLE_RE = re.compile(
    r"(?<![\w:]):(?P<role>" + "|".join(ROLES) + r"):`(?P<target>~?[\w.]+(?:\n\s*[\w.]+)*)`"
)
# rST's ``text::`` / a lone ``::`` line before an indented literal block -> ``text:`` / nothing
END_MARKER_RE = re.compile(r"(?<=\S)::[ \t]*$", re.M)
LONE_MARKER_RE = re.compile(r"^[ \t]*::[ \t]*\n", re.M)
PACKAGE = "hyperfed"

logger = griffe.get_logger("hyperfed.docs.rst_roles")


class RstRoles(griffe.Extension):
    """Rewrite ``:role:`target``` in every docstring of the package into an autorefs reference."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.name != PACKAGE:
            return
        self.by_name: dict[str, list[tuple[str, str]]] = {}
        _index(pkg, self.by_name)
        self._walk(pkg, pkg)

    def _walk(self, obj: griffe.Object, pkg: griffe.Module) -> None:
        if obj.docstring is not None and ":" in obj.docstring.value:
            text = ROLE_RE.sub(lambda m: self._link(m, obj, pkg), obj.docstring.value)
            # rST's literal-block marker: the indented block is code in Markdown already
            text = LONE_MARKER_RE.sub("\n", text)
            obj.docstring.value = END_MARKER_RE.sub(":", text)
        for member in obj.members.values():
            if not member.is_alias:
                self._walk(member, pkg)  # type: ignore[arg-type]

    def _link(self, m: re.Match[str], obj: griffe.Object, pkg: griffe.Module) -> str:
        target = re.sub(r"\s+", "", m["target"])
        short = target.startswith("~")
        name = target.lstrip("~")
        title = name.rsplit(".", 1)[-1] if short else name
        path = _resolve(name, obj, pkg) or _search(name, m["role"], obj, self.by_name)
        code = f"<code>{html.escape(title)}</code>"
        if path is None:
            if name.split(".")[0] != PACKAGE and "." in name:
                return code  # outside the package (torch.nn.Module ...): code, no link
            location = f"{obj.relative_filepath}:{obj.lineno or 1}"
            logger.warning(f"{location}: {m[0]} in {obj.path}'s docstring names nothing")
            return code
        return f'<autoref identifier="{path}" optional>{code}</autoref>'


def _resolve(name: str, obj: griffe.Object, pkg: griffe.Module) -> str | None:
    """The full path of ``name`` seen from ``obj``'s docstring, or None when it names nothing."""
    head, _, rest = name.partition(".")
    if head == PACKAGE:
        candidates = [name]
    else:
        candidates = []
        scope: griffe.Object | None = obj
        while scope is not None:  # the object, then its class, module, parent packages
            try:
                resolved = scope.resolve(head)
            except griffe.NameResolutionError:
                scope = scope.parent
                continue
            candidates.append(f"{resolved}.{rest}" if rest else resolved)
            break
        # a module named relative to its package (``fedavg`` in hyperfed.algorithms)
        module = obj if obj.is_module else obj.module
        candidates.append(f"{module.path}.{name}")
    for path in candidates:
        found = _lookup(path, pkg)
        if found is not None:
            return found
    return None


KINDS = {"class": "class", "meth": "function", "func": "function", "mod": "module"}
KINDS.update(data="attribute", attr="attribute")


def _index(obj: griffe.Object, by_name: dict[str, list[tuple[str, str]]]) -> None:
    """Every object the package defines (imports left out): its path and kind, by its name."""
    by_name.setdefault(obj.name, []).append((obj.path, obj.kind.value))
    for member in obj.members.values():
        if not member.is_alias:
            _index(member, by_name)  # type: ignore[arg-type]


def _search(
    name: str, role: str, obj: griffe.Object, by_name: dict[str, list[tuple[str, str]]]
) -> str | None:
    """The one object of the role's kind named ``name`` in ``obj``'s module (then the package)."""
    if "." in name:
        return None
    paths = [path for path, kind in by_name.get(name, []) if kind == KINDS[role]]
    module = obj if obj.is_module else obj.module
    for scope in (module.path, PACKAGE):
        inside = [p for p in paths if p.startswith(scope + ".")]
        if len(inside) == 1:
            return inside[0]
        if inside:
            return None  # ambiguous: name it in full
    return None


def _lookup(path: str, pkg: griffe.Module) -> str | None:
    """The canonical path of the object at ``path`` in the package (following imports)."""
    parts = path.split(".")
    if parts[0] != PACKAGE:
        return None
    try:
        found = pkg.get_member(parts[1:]) if len(parts) > 1 else pkg
    except (KeyError, ValueError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        return None
    if found.is_alias:
        try:
            return found.final_target.path  # type: ignore[union-attr]
        except (griffe.AliasResolutionError, griffe.CyclicAliasError):
            return found.target_path  # type: ignore[union-attr]
    return found.path
