"""The layers of the package, as the README's architecture section writes them, held by the
import graph: every ``import`` in the source (lazy ones inside functions included) is read with
``ast``, nothing is imported. A new import that crosses a wall fails here, naming the line."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = "monarch_torchx"

# bottom to top: a module may import its own layer and the ones below, never one above
LAYERS: list[tuple[str, set[str]]] = [
    ("base", {"errors", "private", "procfs", "credentials", "specs", "interpreter", "quick_exit", "torchrun", "seam"}),
    ("net", {"net", "wire", "wire_conn"}),
    (
        "records",
        {"registry", "history", "submission", "agent_client", "resources", "scheduling", "app_queue", "task_groups"}
        | {"shell_messages", "debugger"},
    ),
    ("agent", {"agent"}),
    ("pool", {"pool", "apps", "pool_exec", "pool_shell", "pool_debug"}),
    ("actor", {"actor"}),
    ("rdma", {"rdma"}),
    ("services", {"syncfs", "telemetry"}),
    ("schedulers", {"schedulers"}),
    (
        "front ends",
        {
            "cli",
            "torchx_cli",
            "job",
            "submitit_executor",
            "submitit_worker",
            "monarch_backend",
            "monarch_worker",
            "monarch_shared",
            "dashboard",
            "top",
        }
        | {"docs", "components", ""},
    ),
]
FRONT_ENDS = ["job", "submitit_executor", "monarch_backend", "monarch_worker"]


def modules(root: Path, pkg: str) -> dict[str, Path]:
    """Every module of ``pkg`` under ``root`` by dotted name (a package by its own name)."""
    out = {}
    for path in sorted((root / pkg).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> Iterator[tuple[int, str, list[str]]]:
    """(line, the module of ours imported, the names taken from it) for each import in ``path``."""
    tree = ast.parse(path.read_text())
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = ".".join(base[: len(base) - node.level + 1] + [node.module or ""]).strip(".")
            if not node.level:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in known:
                    yield node.lineno, sub, []
                else:
                    yield node.lineno, owner(target, known), [alias.name]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, owner(alias.name, known), []


def owner(dotted: str, known: dict[str, Path]) -> str:
    """The longest prefix of ``dotted`` that is one of our modules ("" if none)."""
    while dotted and dotted not in known:
        dotted = dotted.rpartition(".")[0]
    return dotted


def layer_of(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    for i, (_, tops) in enumerate(LAYERS):
        if top in tops:
            return i
    raise AssertionError(f"{module}: in no layer; add its top-level name to LAYERS (and the README's table)")


def graph(root: Path = ROOT, pkg: str = PKG) -> dict[str, list[tuple[int, str, list[str]]]]:
    known = modules(root, pkg)
    return {
        name: [(line, t, names) for line, t, names in imports(name, path, known) if t and t != name]
        for name, path in known.items()
    }


def upward_imports(g: dict[str, list[tuple[int, str, list[str]]]]) -> list[str]:
    return [
        f"{name}:{line} ({LAYERS[layer_of(name)][0]}) imports {t} ({LAYERS[layer_of(t)][0]})"
        for name, edges in g.items()
        for line, t, _ in edges
        if layer_of(t) > layer_of(name)
    ]


def package(module: str) -> str:
    """The subpackage a module is in (``net``, ``actor``, ...), or "" for the top-level modules."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and (ROOT / PKG / parts[1]).is_dir() else ""


def test_every_module_is_in_a_layer_and_no_import_goes_up():
    g = graph()
    assert upward_imports(g) == []


def test_the_transport_imports_only_credentials_and_errors():
    g = graph()
    allowed = {f"{PKG}.credentials", f"{PKG}.errors"}
    bad = [
        f"{name}:{line} imports {t}"
        for name, edges in g.items()
        if package(name) == "net"
        for line, t, _ in edges
        if package(t) != "net" and t not in allowed
    ]
    assert bad == []


def test_the_actor_runtime_and_the_agent_never_import_each_other():
    g = graph()
    bad = [
        f"{name}:{line} imports {t}"
        for name, edges in g.items()
        for line, t, _ in edges
        if {package(name), package(t)} == {"actor", "agent"}
    ]
    assert bad == []


def test_no_import_cycle_spans_two_packages():
    """Strongly connected components of the module graph: a cycle inside one package is its own
    business; one across two (``actor`` and ``agent``, ``pool`` and ``schedulers``) is a wall missing."""
    g = {name: sorted({t for _, t, _ in edges}) for name, edges in graph().items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    sccs: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's, recursive: the graph is a few hundred modules
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, []):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            sccs.append(comp)

    for v in g:
        if v not in index:
            visit(v)
    assert [sorted(c) for c in sccs if len({package(m) for m in c}) > 1] == []


def test_front_ends_use_only_public_names():
    """``job``, the submitit plugin and the Monarch backend are written as a user would write
    them: no module or name of ours that starts with ``_``."""
    g = graph()
    bad = [
        f"{name}:{line} takes {t}.{n}" if n else f"{name}:{line} imports {t}"
        for name in (f"{PKG}.{m}" for m in FRONT_ENDS)
        for line, t, names in g[name]
        for n in names or [""]
        if (n.startswith("_") and n != "__version__") or any(p.startswith("_") for p in t.split(".")[1:])
    ]
    assert bad == []


def test_benchmarks_and_examples_use_only_public_names():
    """They are written as users' code: nothing of ours that starts with ``_``."""
    bad = []
    for path in sorted([*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "examples").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PKG):
                private = [a.name for a in node.names if a.name.startswith("_")]
                if private or any(p.startswith("_") for p in (node.module or "").split(".")):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.module} {private}")
            elif isinstance(node, ast.Import):
                bad += [
                    f"{path.relative_to(ROOT)}:{node.lineno} {a.name}"
                    for a in node.names
                    if a.name.startswith(PKG) and any(p.startswith("_") for p in a.name.split("."))
                ]
    assert bad == []


def test_a_new_upward_import_is_caught(tmp_path):
    """The checker itself: a records-layer module that imports the pool is named, with its line."""
    pkg = tmp_path / PKG
    (pkg / "net").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "net" / "__init__.py").write_text("from ..errors import MonarchError\n")
    (pkg / "errors.py").write_text("")
    (pkg / "pool.py").write_text("from . import registry\n")
    (pkg / "registry.py").write_text("import os\n\n\ndef f():\n    from .pool import Pool\n")
    assert upward_imports(graph(tmp_path)) == [f"{PKG}.registry:5 (records) imports {PKG}.pool (pool)"]


@pytest.mark.parametrize("section", ["## Architecture"])
def test_the_readme_writes_the_layers_down(section):
    readme = (ROOT / "README.md").read_text()
    text = readme[readme.index(section) :]
    for name, _ in LAYERS:
        assert f"**{name}**" in text, f"the README's {section} section does not name the layer {name!r}"
