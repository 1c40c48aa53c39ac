"""Rewrites the imports of one of Monarch's test files to ours, and nothing else.

Monarch's tests import public names from internal paths (``monarch._src.actor.host_mesh.this_host``)
as well as from ``monarch.actor``; a name that ours exports publicly is taken from ours whichever
path it came by. A name only Monarch's runtime has (Rust bindings, config knobs, internal helpers)
is bound to an :class:`stand_ins.monarch_internal.Internal` that skips the test using it, so such a
test is counted as "Monarch-internal, left out" rather than as a failure of ours. A name Monarch
exports publicly that ours lacks is bound to a ``Missing`` instead: the test fails on using it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Sequence

# where each of Monarch's public surfaces lives in ours
OURS: dict[str, str] = {
    "monarch.actor": "monarch_torchx.actor",
    "monarch._src.actor": "monarch_torchx.actor",
    "monarch.job": "monarch_torchx.job",
    "monarch._src.job": "monarch_torchx.job",
    "monarch.rdma": "monarch_torchx.rdma",
    "monarch._src.rdma": "monarch_torchx.rdma",
    "monarch.config": "monarch_torchx.actor.config",
}
# Monarch's public names per surface (its ``__all__``), read from the checkout by ``load_public``:
# a test that imports one that ours lacks fails on using it (``stand_ins.monarch_internal.Missing``),
# it is not left out as internal
MONARCH_PUBLIC: dict[str, set] = {}
_SURFACE = {"monarch_torchx.actor": "actor", "monarch_torchx.job": "job", "monarch_torchx.rdma": "rdma"}


def load_public(checkout: Path) -> None:
    """Reads each public surface's ``__all__`` (``monarch/{actor,job,rdma,config}/__init__.py``)."""
    for surface in ("actor", "job", "rdma", "config"):
        init = checkout / "python" / "monarch" / surface / "__init__.py"
        if not init.exists():
            continue
        for node in ast.walk(ast.parse(init.read_text())):
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
                MONARCH_PUBLIC[surface] = set(ast.literal_eval(node.value))


def private_names(checkout: Path) -> dict[str, list[str]]:
    """For each class Monarch exports publicly: the private names (``_x``, not dunders) its
    definition and its bases' give it (methods, class attributes, ``self._x = ...``), read from
    the checkout's source. A test that asks one of ours for such a name reaches Monarch's
    internals (``stand_ins.monarch_internal`` guards our classes with this list)."""
    defined: dict[str, tuple[set, list[str]]] = {}
    for path in sorted((checkout / "python" / "monarch").rglob("*.py")):
        try:
            tree = ast.parse(path.read_text())
        except (SyntaxError, UnicodeDecodeError):
            continue
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            names = defined.setdefault(cls.name, (set(), []))
            names[1].extend(b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in cls.bases)
            for node in ast.walk(cls):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names[0].add(node.name)
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                    if isinstance(node.value, ast.Name) and node.value.id == "self":
                        names[0].add(node.attr)
                elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                    for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                        if isinstance(t, ast.Name):
                            names[0].add(t.id)

    def all_names(name: str, seen: set) -> set:
        if name in seen or name not in defined:
            return set()
        seen.add(name)
        own, bases = defined[name]
        return own.union(*(all_names(b, seen) for b in bases))

    public = set().union(*(MONARCH_PUBLIC.get(k, set()) for k in ("actor", "job", "rdma")))
    out = {}
    for name in sorted(public & set(defined)):
        private = sorted(n for n in all_names(name, set()) if n.startswith("_") and not n.startswith("__"))
        if private:
            out[name] = private
    return out


def _monarch_public(module: str, ours: str, name: str) -> bool:
    """Whether Monarch exports ``name`` publicly on the surface ``module`` belongs to."""
    if module == "monarch.config" or module.startswith("monarch.config."):
        return name in MONARCH_PUBLIC.get("config", set())
    surface = _SURFACE.get(ours)
    return surface is not None and name in MONARCH_PUBLIC.get(surface, set())


# Names Monarch's tests import from its Rust bindings that are its public types (re-exported by
# ``monarch.actor``, the type its public calls raise, or the one they return, as
# ``default_bootstrap_cmd()``'s): the same concept as ours of that name
PUBLIC_FROM_BINDINGS = {"MeshFailure", "SupervisionError", "Extent", "BootstrapCommand"}
# Monarch's own test helpers, replaced by ours (stand_ins/): their names, not their code
HELPERS = {"isolate_in_subprocess", "scoped_state", "proc_mesh_test_utils", "rdma_test_utils"}


def _ours_for(module: str) -> str:
    for prefix in sorted(OURS, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return OURS[prefix]
    return ""


def _exports(module: str) -> set:
    import importlib

    m = importlib.import_module(module)
    return set(getattr(m, "__all__", ()))


def rewrite(source: str, guard: bool = True) -> str:
    """The test file with only its import statements changed (and, with ``guard``, one line added
    at its end: see below)."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    edits: list[tuple] = []  # (first line, last line, replacement lines, or a string literal's (start, end, text))
    in_fstrings = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            # a program built with an f-string (python -c f"from monarch.actor import X; X({addr!r})"):
            # its imports of public names, rewritten in the literal's source text
            first_b, last_b = lines[node.lineno - 1].encode(), lines[node.end_lineno - 1].encode()
            if node.lineno == node.end_lineno:
                text = first_b[node.col_offset : node.end_col_offset].decode()
            else:
                text = (
                    first_b[node.col_offset :].decode()
                    + "".join(lines[node.lineno : node.end_lineno - 1])
                    + last_b[: node.end_col_offset].decode()
                )
            new = _FSTRING_IMPORT.sub(_fstring_import, text)
            if new != text:
                edits.append((node.lineno, node.end_lineno, None, (node.col_offset, node.end_col_offset, new)))
            continue
        if id(node) in in_fstrings:
            continue
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "monarch" in node.value:
            inner = _rewrite_script(node.value)  # a program the test runs (python -c "..."): its imports too
            if inner is not None:
                edits.append((node.lineno, node.end_lineno, None, (node.col_offset, node.end_col_offset, repr(inner))))
            continue
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.level == 0
            and (node.module == "monarch" or node.module.startswith("monarch."))
        ):
            edits.append((node.lineno, node.end_lineno, _from_import(node), None))
        elif isinstance(node, ast.Import) and any(a.name.split(".")[0] == "monarch" for a in node.names):
            edits.append((node.lineno, node.end_lineno, _plain_import(node), None))
    for first, last, text, literal in sorted(edits, key=lambda e: (e[0], e[1]), reverse=True):
        if literal is not None:  # a string constant, replaced by the rewritten one's repr (source text as is)
            start, end, new = literal[:3]
            first_b, last_b = lines[first - 1].encode(), lines[last - 1].encode()  # AST offsets are in bytes
            head, tail = first_b[:start].decode(), last_b[end:].decode()
            lines[first - 1 : last] = [head + new + tail]
            continue
        indent = lines[first - 1][: len(lines[first - 1]) - len(lines[first - 1].lstrip())]
        lines[first - 1 : last] = [indent + t + "\n" for t in text]
    if not guard:
        return "".join(lines)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    # the harness's one added line: our classes answer a private name of Monarch's as internal
    # (in this process and in the procs that import this file for its actors)
    lines.append("import monarch_internal as _monarch_internal  # noqa: E402 (added by the harness)\n")
    return "".join(lines)


def _rewrite_script(text: str):
    """``text`` with its imports rewritten, if it is a Python program that imports monarch."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    if not any(
        isinstance(n, (ast.Import, ast.ImportFrom))
        and (
            (isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "monarch")
            or (isinstance(n, ast.Import) and any(a.name.split(".")[0] == "monarch" for a in n.names))
        )
        for n in ast.walk(tree)
    ):
        return None
    return rewrite(text, guard=False)


_FSTRING_IMPORT = re.compile(r"from (monarch(?:\.\w+)*) import (\w+(?:, *\w+)*)")


def _fstring_import(m: re.Match[str]) -> str:
    ours = _ours_for(m.group(1))
    names = [n.strip() for n in m.group(2).split(",")]
    if ours and all(n in _exports(ours) for n in names):
        return f"from {ours} import {m.group(2)}"
    return m.group(0)  # a name only Monarch has: left alone (the program fails as it would)


def _from_import(node: ast.ImportFrom) -> Sequence[str]:
    ours = _ours_for(node.module)
    public = _exports(ours) if ours else set()
    if not ours and node.module.startswith("monarch._rust_bindings."):
        ours, public = "monarch_torchx.actor", PUBLIC_FROM_BINDINGS & _exports("monarch_torchx.actor")
    out = []
    for a in node.names:
        local = a.asname or a.name
        if a.name in public:
            out.append(f"from {ours} import {a.name} as {local}")
        elif ours and _monarch_public(node.module, ours, a.name):  # public in Monarch, missing here: a failure
            out.append(f"from monarch_internal import Missing as _M; {local} = _M({node.module + '.' + a.name!r})")
        else:
            out.append(f"from monarch_internal import Internal as _I; {local} = _I({node.module + '.' + a.name!r})")
    return out


def _plain_import(node: ast.Import) -> Sequence[str]:
    out = []
    for a in node.names:
        ours = _ours_for(a.name)
        if a.asname:
            out.append(
                f"import {ours} as {a.asname}"
                if ours
                else f"from monarch_internal import Internal as _I; {a.asname} = _I({a.name!r})"
            )
        elif ours:  # `import monarch.actor` then `monarch.actor.Actor`
            out.append(f"import {ours}; import monarch_internal; monarch = monarch_internal.package()")
        else:
            out.append("import monarch_internal; monarch = monarch_internal.package()")
    return out
