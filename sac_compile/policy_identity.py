"""What a policy's decisions can depend on, named the same way in every process.

One rule, used for two things: a compiled region's group (identical blocks with policies of
the same identity share one Dynamo graph and one split; :mod:`.region_groups`) and the key
of AOTAutograd's and Inductor's persistent caches (:mod:`.compiler.cache_keys`). A stale
cache hit is a wrong split, possibly a wrong gradient (hooks that cast to bf16 served to a
policy that now saves in full), so the rule errs towards "no key":

* Our policy values (:class:`~sac_compile.policy.PolicyValue`, frozen dataclasses) are
  keyed by their class's source and their fields, each keyed by this rule.
* A function is keyed by its qualified name and source, its defaults, its closure cells
  and the globals its code reads - transitively, through helper functions, partials,
  bound methods, containers, enums and frozen dataclasses.
* Values with a stable text: ``None``, bools, numbers, strings, ops, dtypes, devices,
  ``CheckpointPolicy`` and other enum members, ``SaveWithHooks`` (its hooks by this rule).
* Modules: ``torch``, ``sac_compile`` and pure standard modules (``math``, ``operator``,
  ...) are code, covered by the versions in the caches' keys. Any other module
  (``os``, whose ``environ`` can differ between processes, or a user's config module),
  a plain object's attributes, a class's attributes, a generator, a file: state that this
  rule cannot see change. A policy that reads one has no key: its region bypasses the
  persistent caches, and one log line says which value and why.
* An object (or function) with a ``cache_hash`` string names its own identity.

``reads_region``: whether the policy's code (or anything it reaches) mentions ``region`` or
``region_path`` - a policy that may decide by the region's name. It is a static look at the
code; the tagging mode also counts real reads (:func:`sac_compile.policy.region_reads`).
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import inspect
import logging
import types
import weakref
from typing import Any

import torch

from .policy import PolicyValue, SaveWithHooks, op_qualname
from .torch_internals import HigherOrderOperator, OpNamespace, OpOverload, OpOverloadPacket

__all__ = ["Identity", "policy_identity", "policy_key", "hooks_key"]

log = logging.getLogger("sac_compile")

_SCALARS = (str, int, float, complex, bool, type(None), bytes)
_CODE_MODULES = frozenset({"torch", "sac_compile", "math", "operator", "functools", "itertools",
                           "collections", "typing", "dataclasses", "enum", "numpy", "re",
                           "builtins", "abc", "numbers", "warnings", "logging"})
_REGION_ATTRS = frozenset({"region", "region_path"})
_MAX_DEPTH = 12


@dataclasses.dataclass(frozen=True)
class Identity:
    """``key``: a text naming the policy's behaviour in every process, or None, then
    ``why_not`` says which value has no stable name. ``reads_region``: its code may read
    the region's name."""

    key: str | None
    why_not: str | None
    reads_region: bool
    #: State that belongs to this object (a closure cell, a default, a partial's argument,
    #: a field) holds a list, dict or set: it may change after the key was taken, so two
    #: objects with equal keys now are not the same policy later (a counter in a closure).
    own_mutable_state: bool = False


class _NoKey(Exception):
    """A value the rule cannot name stably; the message says which and why."""


class _Keyer:
    """Walks what a policy's decisions can depend on. A value with no stable name is noted
    (the first one, in ``why_not``) and the walk goes on, so that ``reads_region`` still
    sees the code behind it."""

    def __init__(self) -> None:
        self.reads_region = False
        self.why_not: str | None = None
        self.own_mutable_state = False
        self._own = 0  # > 0 while walking state that belongs to the object keyed
        self._active: set[int] = set()

    def own(self, value: Any, depth: int) -> str:
        """The key of ``value``, which belongs to the object being keyed."""
        self._own += 1
        try:
            return self.key(value, depth)
        finally:
            self._own -= 1

    def _fail(self, why: str) -> str:
        if self.why_not is None:
            self.why_not = why
        return "<no key>"

    def key(self, value: Any, depth: int = 0) -> str:
        if depth > _MAX_DEPTH:
            self.reads_region = True  # unseen code may read the name
            return self._fail(f"{_describe(value)} is nested too deeply to follow")
        if isinstance(value, _SCALARS):
            return repr(value)
        own = getattr(value, "cache_hash", None) if not isinstance(value, type) else None
        if isinstance(own, str):
            return f"cache_hash:{own}"
        if isinstance(value, enum.Enum):
            return f"{_qualname(type(value))}.{value.name}"
        if isinstance(value, (OpOverload, OpOverloadPacket,
                              HigherOrderOperator)):
            return op_qualname(value)
        if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
            return str(value)
        if isinstance(value, OpNamespace):
            return f"torch.ops.{value.name}"
        if isinstance(value, types.ModuleType):
            return self._module(value)
        if id(value) in self._active:  # a cycle (a recursive helper): named, not followed
            return f"<cycle {_describe(value)}>"
        self._active.add(id(value))
        try:
            return self._compound(value, depth + 1)
        finally:
            self._active.discard(id(value))

    def _compound(self, value: Any, depth: int) -> str:
        if self._own and isinstance(value, (list, dict, set)):
            self.own_mutable_state = True
        if isinstance(value, (list, tuple)):
            return f"{type(value).__name__}[{', '.join(self.key(v, depth) for v in value)}]"
        if isinstance(value, (set, frozenset)):
            return f"set[{', '.join(sorted(self.key(v, depth) for v in value))}]"
        if isinstance(value, dict):
            items = sorted(f"{self.key(k, depth)}: {self.key(v, depth)}"
                           for k, v in value.items())
            return f"{{{', '.join(items)}}}"
        if isinstance(value, SaveWithHooks):
            return f"SaveWithHooks({self.key(value.pack, depth)}; {self.key(value.unpack, depth)})"
        if isinstance(value, functools.partial):
            return (f"partial({self.key(value.func, depth)}, {self.own(value.args, depth)}, "
                    f"{self.own(value.keywords, depth)})")
        if isinstance(value, types.MethodType):
            return f"method({self.key(value.__func__, depth)} of {self.own(value.__self__, depth)})"
        if isinstance(value, types.FunctionType):
            return self._function(value, depth)
        if isinstance(value, (types.BuiltinFunctionType, types.BuiltinMethodType)):
            owner = getattr(value, "__self__", None)
            if owner is None or isinstance(owner, types.ModuleType):
                return f"builtin {getattr(value, '__module__', None)}.{value.__qualname__}"
            return self._fail(f"{_describe(value)} is a method of an object whose state "
                              f"can change")
        if isinstance(value, type):
            return self._class(value, depth)
        if dataclasses.is_dataclass(value) and type(value).__dataclass_params__.frozen:
            return self._frozen_dataclass(value, depth)
        call = getattr(type(value), "__call__", None)
        if isinstance(call, types.FunctionType):  # still look at its code and state
            self.key(call, depth)
        for attr in getattr(value, "__dict__", {}).values():
            self.own(attr, depth)
        return self._fail(f"{_describe(value)} is an object whose attributes can change "
                          f"(give it a 'cache_hash' string, or make it a frozen dataclass)")

    def _module(self, module: types.ModuleType) -> str:
        root = module.__name__.split(".")[0]
        if root in _CODE_MODULES:
            return f"module {module.__name__}"
        return self._fail(f"the module {module.__name__!r} (its attributes, such as os.environ "
                          f"or a config module's settings, can differ between processes)")

    def _class(self, cls: type, depth: int) -> str:
        if issubclass(cls, enum.Enum):
            members = ", ".join(f"{m.name}={self.key(m.value, depth)}" for m in cls)
            return f"enum {_qualname(cls)}({members})"
        root = (cls.__module__ or "").split(".")[0]
        if root in _CODE_MODULES:
            return f"class {_qualname(cls)}"
        return self._fail(f"the class {_qualname(cls)} (its attributes can change)")

    def _frozen_dataclass(self, value: Any, depth: int) -> str:
        cls = type(value)
        fields = ", ".join(f"{f.name}={self.own(getattr(value, f.name), depth)}"
                           for f in dataclasses.fields(value))
        if isinstance(value, PolicyValue) and cls.__module__.startswith("sac_compile."):
            code = self._source(cls)  # ours: its code, not the caches its globals hold
        else:
            call = getattr(cls, "__call__", None)
            code = self.key(call, depth) if isinstance(call, types.FunctionType) \
                else self._source(cls)
        return f"{_qualname(cls)}({fields}) code={code}"

    def _function(self, fn: types.FunctionType, depth: int) -> str:
        parts = [_qualname(fn), self._source(fn)]
        if fn.__defaults__:
            parts.append(f"defaults={self.own(fn.__defaults__, depth)}")
        if fn.__kwdefaults__:
            parts.append(f"kwdefaults={self.own(fn.__kwdefaults__, depth)}")
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell (a name bound later)
                parts.append(f"{name}=<empty>")
                continue
            parts.append(f"{name}={self.own(contents, depth)}")
        names = _names_read(fn.__code__)
        if names & _REGION_ATTRS or _strings_of(fn.__code__) & _REGION_ATTRS:
            self.reads_region = True
        globals_ = fn.__globals__
        for name in sorted(names & set(globals_)):
            parts.append(f"{name}={self.key(globals_[name], depth)}")
        return "fn(" + " ".join(parts) + ")"

    def _source(self, obj: Any) -> str:
        try:
            return _source_hash(obj)
        except _NoKey as e:
            return self._fail(str(e))


def _names_read(code: types.CodeType) -> set[str]:
    """The global and attribute names a code object and the code nested in it read."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names_read(const)
    return names


def _strings_of(code: types.CodeType) -> set[str]:
    """The string constants of a code object and its nested code (``getattr(ctx, "region")``)."""
    out = {c for c in code.co_consts if isinstance(c, str)}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            out |= _strings_of(const)
    return out


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', '?')}"


def _describe(value: Any) -> str:
    if isinstance(value, (types.FunctionType, type)):
        return f"{_qualname(value)}"
    return f"a {type(value).__qualname__} ({_qualname(type(value))})"


def _source_hash(obj: Any) -> str:
    """A hash of the source text and, for a function, of its compiled code (two lambdas on
    one line share their source text); a function typed at a prompt has only its code."""
    digest = hashlib.sha256()
    try:
        digest.update(inspect.getsource(obj).encode())
    except (OSError, TypeError):
        if getattr(obj, "__code__", None) is None:
            raise _NoKey(f"{_describe(obj)} has no source to key it by") from None
    code = getattr(obj, "__code__", None)
    if code is not None:
        _digest_code(code, digest)
    return digest.hexdigest()[:16]


def _digest_code(code: types.CodeType, digest: Any) -> None:
    """The code's bytes, names and constants (``marshal`` output is not stable between
    processes: it marks shared objects by reference count)."""
    digest.update(code.co_code)
    digest.update(repr((code.co_names, code.co_varnames, code.co_freevars)).encode())
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _digest_code(const, digest)
        else:
            digest.update(repr(const).encode())


_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def policy_identity(policy: Any, *, cached: bool = True) -> Identity:
    """The :class:`Identity` of ``policy`` (any accepted form, normalised or not).

    ``cached``: reuse what was computed for this object earlier in the process (the region
    groups; a new region of the same policy is one lookup). The persistent caches' keys
    are computed afresh at each compile (``cached=False``): a global the policy reads may
    have changed since."""
    if isinstance(policy, str):  # a preset's name: the preset itself
        from .policy import normalize_policy
        try:
            policy = normalize_policy(policy)
        except TypeError:
            return Identity(None, f"{policy!r} is not a policy name", False)
    elif isinstance(policy, (list, tuple, set, frozenset)):
        from .policy import normalize_policy
        policy = normalize_policy(policy)
    if cached:
        try:
            found = _CACHE.get(policy)
        except TypeError:  # not weak-referenceable
            found = None
        if found is not None:
            return found
    keyer = _Keyer()
    key = keyer.key(policy)
    identity = Identity(None if keyer.why_not else key, keyer.why_not, keyer.reads_region,
                        keyer.own_mutable_state)
    try:
        _CACHE[policy] = identity
    except TypeError:
        pass
    return identity


def policy_key(policy: Any) -> str | None:
    """A text that names ``policy`` the same way in every process, or None when there is
    none (then caching its regions would risk serving a split made for another policy)."""
    return policy_identity(policy, cached=False).key


def hooks_key(hooks: SaveWithHooks) -> str | None:
    """A text that names a ``SaveWithHooks`` the same way in every process (its ``pack``
    and ``unpack`` by the same rule), or None."""
    keyer = _Keyer()
    key = keyer.key(hooks)
    return None if keyer.why_not else key
