"""Imports read top-down: no module of ``sac_compile`` imports one of a higher layer, and
there is no import cycle between files, function-local imports included.

A small walk over every module's ``import`` statements (``ast``, so function-local imports
count; those under ``if TYPE_CHECKING:`` never run and do not), rather than import-linter:
it needs no dependency, and it also counts the package an import runs first (importing
``sac_compile.compiler.x`` runs ``sac_compile/compiler/__init__.py``), which is how a
lower layer ends up loading a whole engine.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "sac_compile"

# Top to bottom. A module may import its own layer or lower ones; within a layer, only
# the import graph's acyclicity is checked.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("user surface and tools", ("sac_compile", "sac_compile.__main__", "sac_compile.cli",
                                "sac_compile._bench", "sac_compile.demo",
                                "sac_compile.explaining")),
    ("regions", ("sac_compile.regions", "sac_compile.checkpoint_call",
                 "sac_compile.module_regions", "sac_compile.region_run",
                 "sac_compile.region_steps",
                 "sac_compile.region_names")),
    ("compile engine", ("sac_compile.compiler",)),
    ("eager engine", ("sac_compile.runtime",)),
    ("memory budgets, shared by both engines", ("sac_compile.budgets",)),
    ("the cut, shared by both engines", ("sac_compile.cut",)),
    ("shared core", ("sac_compile.region_groups",
                     "sac_compile.markers", "sac_compile.report", "sac_compile.live_bytes",
                     "sac_compile.measured_peak",
                     "sac_compile.policies", "sac_compile.per_call",
                     "sac_compile.policy_identity", "sac_compile.inert_policies",
                     "sac_compile.policy",
                     "sac_compile.effects", "sac_compile.op_costs", "sac_compile.op_names",
                     "sac_compile.graph_meta", "sac_compile.tensor_memory",
                     "sac_compile.errors",
                     "sac_compile.logs", "sac_compile.torch_patches",
                     "sac_compile.torch_internals")),
]

#: Module files allowed over ~450 lines. May only shrink.
OVER_450: set[str] = set()


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        name = ".".join(rel.parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package
                for _ in range(node.level - 1):
                    parent = parent.rsplit(".", 1)[0]
                base = f"{parent}.{base}" if base else parent
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if not target.startswith("sac_compile") or target == name:
                continue
            found.add(target)
            parent = target.rpartition(".")[0]  # the package __init__ that runs first
            if parent not in ("", "sac_compile") and not name.startswith(parent):
                found.add(parent)
    return {t for t in found if not name.startswith(t + ".")}


def _layer_of(name: str) -> int:
    best, index = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best:
                best, index = len(prefix), i
    assert index >= 0, f"{name} is in no layer of tests/test_layers.py: add it to one"
    return index


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_every_module_imports_only_its_own_layer_or_lower_ones():
    upward = []
    for name, targets in _graph().items():
        for target in targets:
            if _layer_of(target) < _layer_of(name):
                upward.append(f"{name} ({LAYERS[_layer_of(name)][0]}) imports {target} "
                              f"({LAYERS[_layer_of(target)][0]})")
    assert upward == []


def test_no_import_cycle_between_files():
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert cycles == []


def test_no_module_over_450_lines_but_the_shrinking_list():
    over = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
            if len(p.read_text().splitlines()) > 450}
    assert over <= OVER_450, sorted(over - OVER_450)
