"""Keys that let AOTAutograd's and Inductor's caches serve our regions' compiled graphs.

AOTAutograd caches a graph that contains a selective-checkpoint region only if the region's
``context_fn`` has a ``cache_hash`` attribute (``autograd_cache._collect_context_fn_hashes``
reads ``module.meta["_checkpoint_context_fn"].cache_hash`` on each region's subgraph);
without one it bypasses the cache, and every warm run recompiles. Dynamo rebuilds that
``functools.partial`` while it traces (``FunctoolsPartialVariable.guard_as_python_constant``),
so an attribute set on the function or on the partial our region code creates is lost:
:func:`annotate_regions`, run by our backends on Dynamo's graph before AOTAutograd sees it,
sets it on the partial torch will read. The cache key also pickles each subgraph's ``meta``,
the partial included: it is replaced by a :class:`KeyedContextFn`, the same call, which
pickles as its hash.

The hash must change whenever the split could: it covers ``allow_cache_entry_mutation``, the
policy's proven identity (:mod:`sac_compile.policy_identity`: our policy values, or a
``cache_hash`` the user declared), the memory budget, and the name the region is decided
under (a policy may read it). The code of the tagging, normalisation and cut is covered by
the partitioner's ``uuid()``, which Inductor's cache key includes. A policy whose identity
cannot be proven - any function or object of the user's without a ``cache_hash`` - gets no
hash: the graph that holds its region bypasses the cache, and one log line per region
(``sac_compile`` logger, INFO) says why.

``SaveWithHooks`` given to ``tag()`` are covered by the marker's string in the region's
graph, which names the hooks' identity (:mod:`sac_compile.markers`); a region holding a tag whose
hooks have none gets no hash either.
"""
from __future__ import annotations

import functools
import hashlib
import logging
from typing import Any

import torch

from .. import graph_meta
from ..policy_identity import hooks_key, policy_identity, policy_key
from ..budgets import budget_cache_text
from ..region_groups import group_of_token

__all__ = ["policy_key", "hooks_key", "region_cache_hash", "annotate_regions",
           "KeyedContextFn"]

log = logging.getLogger("sac_compile")


def region_cache_hash(kind: str, name: str, policy: Any, allow: bool,
                      budget: str = "none") -> str | None:
    """The region's hash for the caches, or None (then the graph bypasses them). ``name``:
    the name the region is decided under; ``budget``:
    :func:`sac_compile.budgets.budget_cache_text` of its memory budget."""
    key = policy_key(policy)
    if key is None:
        return None
    text = f"sac_compile {kind} region {name!r} allow={allow} policy={key}"
    if budget != "none":  # (the text of regions without a budget is as it was)
        text += f" budget={budget}"
    return hashlib.sha256(text.encode()).hexdigest()


def annotate_regions(gm: torch.fx.GraphModule) -> int:
    """Give each of our regions' ``context_fn`` in Dynamo's graph ``gm`` its
    ``cache_hash``. Returns how many regions got one."""
    from .regions_compiled import context_fn_kind

    annotated = 0
    from .budget_runs import whole_models
    whole = whole_models(gm)
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        context_fn = graph_meta.checkpoint_context_fn(module)
        kind = context_fn_kind(context_fn)
        if kind is None or hasattr(context_fn, "cache_hash"):
            continue  # not ours (torch's caching rules apply), or done already
        budget: str | None = "none"
        if kind == "region":
            group = group_of_token(context_fn.args[0])
            name = context_fn.args[1] if len(context_fn.args) > 1 else group.name
            policy, allow = group.policy, group.allow
            budget = budget_cache_text(group.budget, whole=group.budget is not None and
                                       id(group.budget.model) in whole)
        else:
            name, policy = context_fn.args[:2]
            allow = bool(context_fn.args[2:3] and context_fn.args[2])
        if _has_unstable_hooks_tag(module):
            _say_bypassed(name, "a tag(..., SaveWithHooks) in it has hooks with no stable "
                                "identity; use module-level functions for pack and unpack")
            continue
        if budget is None:
            _say_bypassed(name, "its whole-model memory budget's price is not found yet (its "
                                "partitions record the blocks' networks for it)")
            continue
        digest = region_cache_hash(kind, name, policy, allow, budget)
        if digest is None:
            why = policy_identity(policy).why_not
            _say_bypassed(name, f"its policy {policy!r}: {why}")
            continue
        graph_meta.set_checkpoint_context_fn(module, KeyedContextFn.of(context_fn, digest))
        annotated += 1
    return annotated


_SAID_BYPASSED: set[str] = set()


def _say_bypassed(name: str, why: str) -> None:
    if name not in _SAID_BYPASSED:
        _SAID_BYPASSED.add(name)
        log.info("sac_compile: region %r: AOTAutograd's and Inductor's persistent caches are "
                 "bypassed for the graph that contains it (a slower compile, never a split "
                 "made for another policy): %s", name, why)


def _has_unstable_hooks_tag(module: torch.fx.GraphModule) -> bool:
    """A tag() marker in ``module``'s own graph whose SaveWithHooks string is a number that
    means nothing in another process (:func:`.markers.is_stable_text`)."""
    from ..markers import TAG_OP, is_stable_text
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
