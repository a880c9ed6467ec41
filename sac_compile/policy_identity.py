"""What a policy's identity is, where it can be proven.

Two things rest on it: the key of AOTAutograd's and Inductor's persistent caches
(:mod:`.compiler.cache_keys`; another process may read that entry) and the group of
regions that share one compiled graph in this process (:mod:`.region_groups`). A stale
identity is a wrong split, possibly a wrong gradient (hooks that cast to bf16 served to a
policy that now saves in full), so the rule names only what it can prove:

* **Our policy values** (:class:`~sac_compile.policy.PolicyValue` subclasses defined in
  ``sac_compile``: the presets, ``compose``, ``relaxed``, op lists): frozen dataclasses
  whose every piece of state is a field (checked: an attribute outside the fields, an
  ``InitVar`` kept in ``__post_init__``, has no key), each field proven by this rule. Their
  code is ours, covered by the partitioner's ``uuid()``.
* **Plain data**: ``None``, bools, numbers, strings, bytes; ops; dtypes, devices, layouts;
  enum members of torch's and ours (``CheckpointPolicy``); tuples and frozensets of proven
  values; functions and classes defined in ``sac_compile`` or ``torch``.
* **``SaveWithHooks``** whose ``pack`` and ``unpack`` are proven.
* **A declared identity**: an object (or function) with a ``cache_hash`` string names its
  own identity; the user promises that equal strings decide alike in every process.

Anything else - a function of the user's, a closure, a partial, a user dataclass or enum, a
callable object - has no key, whatever its code looks like: the globals, class attributes,
environment variables and helper methods it may read cannot all be followed (each one the
earlier, inspecting rule missed was a stale split). Its regions bypass the persistent caches
(a slower compile, never a stale one; one log line says so) and, in this process, are
grouped by the object itself (:func:`object_serial`: a number never reused).
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import itertools
import threading
import types
import weakref
from typing import Any

import torch

from .policy import PolicyValue, SaveWithHooks, op_qualname
from .torch_internals import HigherOrderOperator, OpNamespace, OpOverload, OpOverloadPacket

__all__ = ["Identity", "policy_identity", "policy_key", "hooks_key", "object_serial"]

_SCALARS = (str, int, float, complex, bool, type(None), bytes)
_OUR_ROOTS = ("sac_compile", "torch")
#: Attributes our policy values compute from their fields and cache on the instance.
_DERIVED = frozenset({"_op_set"})


@dataclasses.dataclass(frozen=True)
class Identity:
    """``key``: a text that names the policy's behaviour in every process, or None, then
    ``why_not`` says which value has no proven name."""

    key: str | None
    why_not: str | None


class _NoKey(Exception):
    """A value whose identity cannot be proven; the message says which and why."""


def _text(value: Any) -> str:
    """The proven text of ``value``, or :class:`_NoKey`."""
    if isinstance(value, _SCALARS):
        return repr(value)
    own = getattr(value, "cache_hash", None)
    if isinstance(own, str) and not isinstance(value, type):
        return f"cache_hash:{own}"
    if isinstance(value, enum.Enum):
        if _ours(type(value)):
            return f"{_qualname(type(value))}.{value.name}"
        raise _NoKey(f"{_describe(value)} is an enum member of yours (its methods and class "
                     f"can read anything)")
    if isinstance(value, (OpOverload, OpOverloadPacket, HigherOrderOperator)):
        return op_qualname(value)
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return str(value)
    if isinstance(value, OpNamespace):
        return f"torch.ops.{value.name}"
    if isinstance(value, tuple):
        return f"tuple[{', '.join(_text(v) for v in value)}]"
    if isinstance(value, frozenset):
        return f"frozenset[{', '.join(sorted(_text(v) for v in value))}]"
    if isinstance(value, SaveWithHooks):
        return f"SaveWithHooks({_text(value.pack)}; {_text(value.unpack)})"
    if isinstance(value, PolicyValue) and _ours(type(value)):
        return _policy_value(value)
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, type)) \
            and _ours(value) and getattr(value, "__self__", None) is None:
        return f"code {_qualname(value)}"
    raise _NoKey(f"{_describe(value)} has no identity that can be proven: give it a "
                 f"'cache_hash' string that names what it decides, or use the presets")


def _policy_value(value: PolicyValue) -> str:
    cls = type(value)
    if not (dataclasses.is_dataclass(value) and cls.__dataclass_params__.frozen):
        raise _NoKey(f"{_describe(value)} is not a frozen dataclass")
    fields = [f.name for f in dataclasses.fields(value)]
    extra = set(getattr(value, "__dict__", {})) - set(fields) - _DERIVED
    if extra:
        raise _NoKey(f"{_describe(value)} holds state outside its fields "
                     f"({', '.join(sorted(extra))})")
    return f"{_qualname(cls)}({', '.join(f'{n}={_text(getattr(value, n))}' for n in fields)})"


def _ours(obj: Any) -> bool:
    return (getattr(obj, "__module__", None) or "").split(".")[0] in _OUR_ROOTS


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', '?')}"


def _describe(value: Any) -> str:
    if isinstance(value, (types.FunctionType, type)):
        return _qualname(value)
    return f"a {type(value).__qualname__} ({_qualname(type(value))})"


def policy_identity(policy: Any) -> Identity:
    """The :class:`Identity` of ``policy`` (any accepted form, normalised or not)."""
    from .policy import normalize_policy
    if isinstance(policy, (str, list, set)) or (
            isinstance(policy, (tuple, frozenset)) and not isinstance(policy, PolicyValue)):
        try:
            policy = normalize_policy(policy)
        except TypeError:
            return Identity(None, f"{policy!r} is not a policy")
    try:
        return Identity(_text(policy), None)
    except _NoKey as e:
        return Identity(None, str(e))


def policy_key(policy: Any) -> str | None:
    """A text that names ``policy`` the same way in every process, or None when none can be
    proven (then a cache entry for its regions could serve a split made for another)."""
    return policy_identity(policy).key


def hooks_key(hooks: SaveWithHooks) -> str | None:
    """A text that names a ``SaveWithHooks`` the same way in every process, or None."""
    try:
        return _text(hooks)
    except _NoKey:
        return None


# id -> (a reference to the object, its serial). Keyed by identity, never by equality: two
# equal objects (a user's dataclass whose state lies outside its fields) are two policies.
_SERIALS: dict[int, tuple[Any, int]] = {}
_COUNTER = itertools.count(1)
_LOCK = threading.Lock()


def object_serial(obj: Any) -> str:
    """A name for ``obj`` itself in this process, never given to another object (an ``id``
    is reused once its object is gone; a group keyed by it would hand the old object's
    compiled graph to the new one). A bound method is named by its function and object."""
    if isinstance(obj, types.MethodType):
        return f"method {object_serial(obj.__func__)} of {object_serial(obj.__self__)}"
    key = id(obj)
    with _LOCK:
        entry = _SERIALS.get(key)
        if entry is None or entry[0]() is not obj:
            try:
                ref: Any = weakref.ref(obj, functools.partial(_forget, key))
            except TypeError:  # no weak reference: pinned, so that its id stays its own
                ref = functools.partial(_pinned, obj)
            entry = _SERIALS[key] = (ref, next(_COUNTER))
    return f"object #{entry[1]}"


def _pinned(obj: Any) -> Any:
    return obj


def _forget(key: int, ref: Any) -> None:
    with _LOCK:
        entry = _SERIALS.get(key)
        if entry is not None and entry[0] is ref:
            del _SERIALS[key]
