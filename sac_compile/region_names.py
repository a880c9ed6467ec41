"""Default region names and what a region may wrap: one rule, the same value in eager
mode and while Dynamo traces (used by :mod:`.regions` and :mod:`.checkpoint_call`)."""
from __future__ import annotations

import functools
import inspect
import sys
import types
from typing import Any

from torch import nn

from .module_regions import module_class

__all__ = ["_region_name", "_check_target"]

_HAS_CO_QUALNAME = sys.version_info >= (3, 11)


# --------------------------------------------------------------------------------------
# Default region names: one rule, the same value in eager mode and while dynamo traces
# --------------------------------------------------------------------------------------

def _region_name(target: Any) -> str:
    """The default name of a region for ``target``.

    A module: its class name. A ``functools.partial``: the name of what it calls. A bound
    method: its function's. A Python function: its ``__qualname__``, after following
    ``__wrapped__`` (``functools.wraps``) to the function that was wrapped, read from the
    code object (``co_qualname``): dynamo reads a function's ``__qualname__`` from its type
    (``<attribute '__qualname__' of 'function' objects>``) while it traces, and a policy
    keyed on ``ctx.region`` must see the same name in both modes. (A ``__qualname__``
    assigned by hand, without ``functools.wraps``, is therefore not used.) A builtin such as
    ``torch.sin``: its ``__name__``. Anything else: its type's name.
    """
    if isinstance(target, nn.Module):
        return module_class(target).__name__
    if isinstance(target, functools.partial):
        return _region_name(target.func)
    func = target
    if isinstance(target, types.MethodType):  # a bound method: its function
        # (direct attribute reads: dynamo's hasattr/getattr-with-default miss __self__)
        func, owner = target.__func__, target.__self__
        if getattr(func, "_sac_region_forward", False) and isinstance(owner, nn.Module):
            func = module_class(owner).forward  # a wrapped module's forward: its class's
    for _ in range(100):  # functools.wraps chains; bounded against a cycle
        if not hasattr(func, "__wrapped__"):
            break
        func = func.__wrapped__
    if isinstance(func, (nn.Module, functools.partial)):
        return _region_name(func)
    code = getattr(func, "__code__", None)
    if code is not None:
        if _HAS_CO_QUALNAME:
            return code.co_qualname
        value = getattr(func, "__qualname__", None)  # Python 3.10: right in eager mode
        if isinstance(value, str):
            return value
    value = getattr(func, "__name__", None)  # a builtin (torch.sin): "sin"
    if isinstance(value, str):
        return value
    return type(target).__name__


def _check_target(target: Any) -> None:
    """TypeErrors for what a region cannot wrap (it would checkpoint nothing)."""
    if isinstance(target, type):
        name = target.__name__
        if issubclass(target, nn.Module):
            raise TypeError(
                f"sac_region(...) was applied to the class {name}, which would checkpoint "
                f"nothing; apply it to an instance, sac_region(policy)({name}(...)), or "
                f"decorate the class's forward method with @sac_region(policy)")
        raise TypeError(f"sac_region(...) was applied to the class {name}; it decorates a "
                        f"function or is applied to an nn.Module instance")
    kind = ("an async generator function" if inspect.isasyncgenfunction(target) else
            "an async function" if inspect.iscoroutinefunction(target) else
            "a generator function" if inspect.isgeneratorfunction(target) else None)
    if kind is not None:
        raise TypeError(
            f"sac_region/checkpoint got {kind} {_region_name(target)!r}: calling it returns "
            f"before its body runs, so the region would checkpoint nothing. A region must be "
            f"a function that computes and returns tensors; move the tensor computation into "
            f"a plain function and make that the region")
