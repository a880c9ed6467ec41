"""``sac_compile.graph_meta`` owns every ``node.meta`` key: no other module of the package
indexes a ``.meta`` dict with a string literal, nor spells one of the keys it names.

An AST walk over the package: a mistyped key in ``node.meta`` is a silent ``None``, so the
strings live in one module and code elsewhere calls its typed accessors.
"""
from __future__ import annotations

import ast
from pathlib import Path

from sac_compile import graph_meta

PACKAGE = Path(__file__).resolve().parent.parent / "sac_compile"
OWNER = PACKAGE / "graph_meta.py"
KEYS = {value for name, value in vars(graph_meta).items()
        if name.isupper() and isinstance(value, str)}
VAL = graph_meta.VAL


def _is_meta(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "meta"


def _str(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def _raw_accesses(tree: ast.AST) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    seen: set[int] = set()  # the key constants reported with their access
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Subscript) and _is_meta(node.value):
            key = node.slice
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                _is_meta(node.func.value) and node.func.attr in ("get", "pop", "setdefault") \
                and node.args:
            key = node.args[0]
        elif isinstance(node, ast.Compare) and any(_is_meta(c) for c in node.comparators) \
                and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            key = node.left
        if _str(key):
            found.append((node.lineno, ast.unparse(node)))
            seen.add(id(key))
    for node in ast.walk(tree):  # a key spelled out anywhere else ("val": too common a word)
        if _str(node) and node.value in KEYS and node.value != VAL and id(node) not in seen:
            found.append((node.lineno, repr(node.value)))
    return sorted(found)


def test_keys_are_accessed_only_through_graph_meta():
    offences = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == OWNER:
            continue
        for line, text in _raw_accesses(ast.parse(path.read_text())):
            offences.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {text}")
    assert offences == []


def test_the_walk_finds_each_form():
    code = ('n.meta["sac_decision"]\nn.meta.get("val")\nn.meta.pop("x", None)\n'
            '"recompute" in n.meta\nkey = "sac_region_path"\n')
    assert [line for line, _ in _raw_accesses(ast.parse(code))] == [1, 2, 3, 4, 5]


def test_our_keys_are_stripped_and_named_once():
    assert len(set(graph_meta.OURS)) == len(graph_meta.OURS)
    assert all(key.startswith("sac_") for key in graph_meta.OURS)
