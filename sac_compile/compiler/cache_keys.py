"""Keys that let AOTAutograd's and Inductor's caches serve our regions' compiled graphs.

AOTAutograd caches a graph that contains a selective-checkpoint region only if the region's
``context_fn`` has a ``cache_hash`` attribute (``autograd_cache._collect_context_fn_hashes``
reads ``module.meta["_checkpoint_context_fn"].cache_hash`` on each region's subgraph);
without one it bypasses the cache, and every warm run recompiles. Dynamo rebuilds that
``functools.partial`` while it traces (``FunctoolsPartialVariable.guard_as_python_constant``),
so an attribute set on the function or on the partial our region code creates is lost:
:func:`annotate_regions`, run by our backends on Dynamo's graph before AOTAutograd sees it,
sets it on the partial torch will read. The cache key also pickles each subgraph's ``meta``,
the partial included, whose policy (a closure over an op list) may not pickle: the partial
is replaced by a :class:`KeyedContextFn`, the same call, which pickles as its hash.

The hash must change whenever the split could: it covers the region's name, the
``allow_cache_entry_mutation`` flag and the policy's identity (:func:`policy_key`). The
code of the tagging, normalisation and cut is covered by the partitioner's ``uuid()``,
which Inductor's cache key includes. A policy with no stable identity (a lambda, a closure,
a callable object) gets no hash: that region bypasses the cache, as before (logged at
debug level on the ``sac_compile`` logger). A policy may name its own identity with a
``cache_hash`` attribute.

``SaveWithHooks`` are covered the same way (:func:`hooks_key`: the identity of ``pack`` and
``unpack`` by the rules above): returned by a policy, a ``SaveWithHooks`` global the policy
reads is part of its key; given to ``tag()``, the marker's string in the region's graph
names the hooks' identity (:mod:`.markers`), and a region holding a tag whose hooks have
none gets no hash either.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import logging
from typing import Any

import torch

from ..policy import SaveWithHooks

__all__ = ["policy_key", "hooks_key", "region_cache_hash", "annotate_regions",
           "KeyedContextFn"]

log = logging.getLogger("sac_compile")

_SCALARS = (str, int, float, bool, type(None))


def policy_key(policy: Any) -> str | None:
    """A text that names ``policy`` the same way in every process, or None when there is
    none (then caching that region would risk serving a split made for another policy)."""
    own = getattr(policy, "cache_hash", None)
    if isinstance(own, str):
        return f"cache_hash:{own}"
    if isinstance(policy, str):  # a preset's name: look the preset itself up
        from ..policy import PRESETS
        preset = PRESETS.get(policy)
        inner = policy_key(preset) if preset is not None else None
        return None if inner is None else f"preset {policy}: {inner}"
    if isinstance(policy, (list, tuple, set, frozenset)):
        names = _op_names(policy)
        return None if names is None else f"ops[{', '.join(names)}]"
    from ..policy import NamedPolicy
    if isinstance(policy, NamedPolicy):
        # The name spells out what the library's constructors were given (op lists, labels,
        # the policies composed); a repr with an address in it is not stable.
        if " at 0x" in policy.name:
            return None
        fn = policy.fn
        if (getattr(fn, "__module__", "") or "").startswith("sac_compile."):
            # Ours: a closure over what the name spells out. Its code changes the key.
            source = _source_hash(fn)
            return None if source is None else \
                f"NamedPolicy {policy.name}: {_qualname(fn)} {source}"
        inner = policy_key(fn)
        return None if inner is None else f"NamedPolicy {policy.name}: {inner}"
    if inspect.isfunction(policy):
        return _function_key(policy)
    return None  # a callable object, a bound method, a builtin: state we cannot see


def hooks_key(hooks: Any) -> str | None:
    """A text that names a ``SaveWithHooks`` the same way in every process: its ``pack``
    and ``unpack`` by :func:`policy_key`'s rules (module-level functions, or a
    ``cache_hash`` attribute); None when either has no stable identity."""
    own = getattr(hooks, "cache_hash", None)
    if isinstance(own, str):
        return f"cache_hash:{own}"
    pack, unpack = policy_key(hooks.pack), policy_key(hooks.unpack)
    if pack is None or unpack is None:
        return None
    return f"SaveWithHooks({pack}; {unpack})"


def region_cache_hash(kind: str, name: str, policy: Any, allow: bool) -> str | None:
    key = policy_key(policy)
    if key is None:
        return None
    text = f"sac_compile {kind} region {name!r} allow={allow} policy={key}"
    return hashlib.sha256(text.encode()).hexdigest()


def annotate_regions(gm: torch.fx.GraphModule) -> int:
    """Give each of our regions' ``context_fn`` in Dynamo's graph ``gm`` its
    ``cache_hash``. Returns how many regions got one."""
    from .regions_compiled import context_fn_kind

    annotated = 0
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        context_fn = module.meta.get("_checkpoint_context_fn")
        kind = context_fn_kind(context_fn)
        if kind is None or hasattr(context_fn, "cache_hash"):
            continue  # not ours (torch's caching rules apply), or done already
        name, policy, *rest = context_fn.args
        allow = bool(rest[0]) if rest else False
        if _has_unstable_hooks_tag(module):
            log.debug("sac_compile: region %r: a tag(..., SaveWithHooks) in it has hooks with "
                      "no stable identity (a lambda, a closure or a callable object), so "
                      "AOTAutograd's cache is bypassed for the graph that contains it; use "
                      "module-level functions for pack and unpack to cache it", name)
            continue
        digest = region_cache_hash(kind, name, policy, allow)
        if digest is None:
            log.debug("sac_compile: region %r: its policy %r has no stable identity (a "
                      "lambda, a closure or a callable object), so AOTAutograd's cache is "
                      "bypassed for the graph that contains it; give the policy a "
                      "'cache_hash' string attribute to cache it", name, policy)
            continue
        module.meta["_checkpoint_context_fn"] = KeyedContextFn.of(context_fn, digest)
        annotated += 1
    return annotated


def _has_unstable_hooks_tag(module: torch.fx.GraphModule) -> bool:
    """A tag() marker in ``module``'s own graph whose SaveWithHooks string is a number that
    means nothing in another process (:func:`.markers.is_stable_text`)."""
    from .markers import TAG_OP, is_stable_text
    for node in module.graph.find_nodes(op="call_function", target=TAG_OP):
        text = node.args[1]
        if isinstance(text, str) and not is_stable_text(text):
            return True
    return False


class KeyedContextFn(functools.partial):
    """A region's ``context_fn`` with its ``cache_hash``. Pickles (for a cache key, a deep
    copy) as a lookup of that hash: the same call in this process, stable bytes in every
    process. Equal hashes mean the same name, flag and policy identity: the same call."""

    cache_hash: str
    _by_hash: dict[str, KeyedContextFn] = {}

    @classmethod
    def of(cls, context_fn: functools.partial, digest: str) -> KeyedContextFn:
        keyed = cls(context_fn.func, *context_fn.args, **context_fn.keywords)
        keyed.cache_hash = digest
        cls._by_hash.setdefault(digest, keyed)
        return keyed

    def __reduce__(self) -> Any:
        return (_context_fn_by_hash, (self.cache_hash,))


def _context_fn_by_hash(digest: str) -> KeyedContextFn:
    return KeyedContextFn._by_hash[digest]


def _qualname(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}"


def _function_key(fn: Any) -> str | None:
    """A module-level function: its qualified name, a hash of its source, and the values
    of the globals it reads that are ops or plain data (an op list defined next to it)."""
    qualname = _qualname(fn)
    if fn.__closure__ or "<lambda>" in qualname or "<locals>" in qualname:
        return None
    source = _source_hash(fn)
    if source is None:
        return None
    parts = [qualname, source]
    for global_name in sorted(set(fn.__code__.co_names) & set(fn.__globals__)):
        value = fn.__globals__[global_name]
        if isinstance(value, _SCALARS):
            parts.append(f"{global_name}={value!r}")
        elif isinstance(value, (list, tuple, set, frozenset)):
            names = _op_names(value)
            if names is None:
                return None  # data we cannot name stably: no key rather than a stale one
            parts.append(f"{global_name}=[{', '.join(names)}]")
        elif isinstance(value, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            parts.append(f"{global_name}={value}")
        elif isinstance(value, SaveWithHooks):  # the policy returns these hooks
            hooks = hooks_key(value)
            if hooks is None:
                return None
            parts.append(f"{global_name}={hooks}")
    return " ".join(parts)


def _source_hash(fn: Any) -> str | None:
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        return None
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def _op_names(values: Any) -> list[str] | None:
    names = []
    for v in values:
        if isinstance(v, (torch._ops.OpOverload, torch._ops.OpOverloadPacket,
                          torch._ops.HigherOrderOperator)):
            names.append(str(v))
        elif isinstance(v, _SCALARS):
            names.append(repr(v))
        else:
            return None
    return sorted(names)

