"""The memory behind a tensor: which storage it is, how many bytes that storage holds, and
which ops return a view of an input's memory rather than new memory.

One rule each, for every part that asks: the eager runtime (copy-on-write before an
in-place op, what a saved output aliases, the bytes it reports), the compiled cut (views
cost nothing and are never saved on their own), ``explain`` and the report's measurements
(unique storages, parameters left out).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from .torch_internals import OpOverload

__all__ = ["storage_key", "storage_nbytes", "param_storages", "is_view_op"]


def storage_key(t: torch.Tensor) -> int:
    """The identity of the storage behind ``t``: equal for two tensors exactly when they
    share memory (a view and its base, an alias, a tensor an in-place op wrote). The
    storage's C++ object, not its data pointer, which is 0 for every empty storage. A tensor
    without one (a subclass, a sparse tensor) is its own key."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return id(t)


def storage_nbytes(t: torch.Tensor) -> int:
    """Bytes of the storage behind ``t`` (a view holds its whole base); a tensor without a
    storage, the bytes of its elements."""
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return t.numel() * t.element_size()


def param_storages(module: nn.Module) -> set[int]:
    """The :func:`storage_key` of every parameter and buffer of ``module``."""
    return {storage_key(t) for t in (*module.parameters(), *module.buffers())}


def is_view_op(op: Any) -> bool:
    """An ATen op whose output is a view of an input: it returns an alias of an argument
    (``Tensor(a)`` in its schema) that it does not write (``Tensor(a!)``: an in-place or
    ``out=`` op). ``detach`` and ``alias`` are views too. Not an ATen op: False."""
    if not isinstance(op, OpOverload):
        return False
    return any(r.alias_info is not None and not r.alias_info.is_write
               for r in op._schema.returns)
