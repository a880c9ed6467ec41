"""ATen ops by name: what a policy value holds instead of op objects (it pickles and
compares by name, and a name means the same op in every process)."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from .torch_internals import HigherOrderOperator, OpOverload, OpOverloadPacket

__all__ = ["expand_ops", "op_qualname", "resolve_op", "op_names"]


def expand_ops(ops: Iterable[Any], *, what: str = "policy") -> frozenset[Any]:
    """OpOverloads as given; an OpOverloadPacket stands for all of its overloads."""
    out: set[Any] = set()
    for op in ops:
        if isinstance(op, OpOverloadPacket):
            out.update(getattr(op, name) for name in op.overloads())
        elif isinstance(op, (OpOverload, HigherOrderOperator)):
            out.add(op)
        else:
            raise TypeError(
                f"{what}: expected ATen ops such as torch.ops.aten.mm.default or "
                f"torch.ops.aten.mm, got {op!r} of type {type(op).__name__}")
    return frozenset(out)


def op_qualname(op: Any) -> str:
    """An op's name that :func:`resolve_op` turns back into the op in any process:
    ``aten.mm.default``; a higher-order op is ``higher_order.<name>``."""
    if isinstance(op, HigherOrderOperator):
        return f"higher_order.{op.name()}"
    return str(op)


_RESOLVED: dict[str, Any] = {}


def resolve_op(qualname: str) -> Any:
    """The op :func:`op_qualname` named."""
    op = _RESOLVED.get(qualname)
    if op is None:
        namespace, *rest = qualname.split(".")
        op = getattr(torch.ops, namespace)
        for part in rest:
            op = getattr(op, part)
        _RESOLVED[qualname] = op
    return op


def op_names(ops: Iterable[Any], *, what: str) -> tuple[str, ...]:
    """The sorted qualified names of ``ops`` (packets expanded to their overloads): how a
    policy value holds ops, so that it pickles and compares by name."""
    return tuple(sorted(op_qualname(op) for op in expand_ops(ops, what=what)))
