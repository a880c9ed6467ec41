"""Who will split the joint graph being traced: :class:`~.partition.SACPartitioner`, or
torch's partitioner?

A region asks while AOTAutograd traces the joint graph, before any partitioner runs (to warn
once that torch's partitioner ignores tag()/name() opinions, reports and budgets), so the
answer is read from what is about to run, not from a partitioner marking itself active:

* one of our backends (:func:`sac_partitioning`, entered around their compile);
* Inductor with ``custom_partitioner_fn`` set to ours, or to an object that holds ours;
* a user's ``aot_autograd(partition_fn=...)`` (AOTAutograd's ``partition_fn`` argument up
  the stack; it keeps no global of it) that is ours or *calls* ours: a function whose
  closure, defaults or referenced globals hold an ``SACPartitioner`` (or the class), a
  ``functools.partial``/bound method/``functools.wraps`` wrapper of one, or a callable
  object with one among its attributes (:func:`splits_with_sac`).
"""
from __future__ import annotations

import contextlib
import functools
import threading
import types
from collections.abc import Iterator
from typing import Any

from ..torch_internals import TorchAPIMissing
from ..torch_patches import partition_fn_on_stack

__all__ = ["sac_partitioning", "partitioned_by_us", "splits_with_sac", "register_partitioner"]

#: Our partitioner's class, registered by :mod:`.partition` when it is defined (this module
#: sits below the partitioner: the tagging mode asks it while a graph is traced).
_PARTITIONER_TYPES: list[type] = []


def register_partitioner(cls: type) -> type:
    _PARTITIONER_TYPES.append(cls)
    return cls

_state = threading.local()


@contextlib.contextmanager
def sac_partitioning() -> Iterator[None]:
    """Set by our backends around their compile: joint graphs traced inside are split by
    :class:`~.partition.SACPartitioner`."""
    depth = getattr(_state, "ours", 0)
    _state.ours = depth + 1
    try:
        yield
    finally:
        _state.ours = depth


def partitioned_by_us() -> bool:
    """Whether the joint graph being traced will be split by our partitioner (see the
    module docstring)."""
    if getattr(_state, "ours", 0):
        return True
    try:
        from ..torch_internals import inductor_config as config
        if splits_with_sac(getattr(config, "custom_partitioner_fn", None)):
            return True
    except TorchAPIMissing:  # pragma: no cover
        pass
    return splits_with_sac(partition_fn_on_stack())


_DEPTH = 4  # wrappers of wrappers: how far references are followed


def splits_with_sac(fn: Any) -> bool:
    """Whether ``fn`` is an ``SACPartitioner`` or a wrapper that holds or names one."""
    SACPartitioner = _PARTITIONER_TYPES[0] if _PARTITIONER_TYPES else type(None)
    seen: set[int] = set()

    def refers(obj: Any, depth: int) -> bool:
        if obj is None or depth < 0 or id(obj) in seen:
            return False
        seen.add(id(obj))
        if isinstance(obj, SACPartitioner) or \
                (isinstance(obj, type) and issubclass(obj, SACPartitioner)):
            return True
        if isinstance(obj, type):
            return False
        if isinstance(obj, functools.partial):
            parts = (obj.func, *obj.args, *obj.keywords.values())
        elif isinstance(obj, types.MethodType):
            parts = (obj.__self__, obj.__func__)
        elif isinstance(obj, types.FunctionType):
            parts = _function_refs(obj)
        elif callable(obj) and hasattr(obj, "__dict__") and \
                not isinstance(obj, types.ModuleType):
            parts = (*vars(obj).values(), getattr(type(obj), "__call__", None))
        else:
            return False
        return any(refers(part, depth - 1) for part in parts)

    return refers(fn, _DEPTH)


def _function_refs(fn: types.FunctionType) -> list[Any]:
    """What a function may call: what it wraps, its closure, its defaults, and the globals
    its code names (attribute chains through modules followed: ``sc.compiler.X``)."""
    refs: list[Any] = [getattr(fn, "__wrapped__", None)]
    for cell in fn.__closure__ or ():
        try:
            refs.append(cell.cell_contents)
        except ValueError:  # an empty cell
            pass
    refs += [*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values()]
    names = list(dict.fromkeys(_code_names(fn.__code__)))  # (code order: a set's varies)
    level = [fn.__globals__[n] for n in names if n in fn.__globals__]
    for _ in range(_DEPTH):
        modules = [v for v in level if isinstance(v, types.ModuleType)]
        refs += [v for v in level if not isinstance(v, types.ModuleType)]
        level = [vars(m)[n] for m in modules for n in names if n in vars(m)]
    return refs


def _code_names(code: types.CodeType) -> list[str]:
    names = list(code.co_names)
    for const in code.co_consts:  # nested functions and comprehensions
        if isinstance(const, types.CodeType):
            names += _code_names(const)
    return names
