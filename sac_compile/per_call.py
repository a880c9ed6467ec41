"""Per-call policies: a policy built fresh for each region call, as torch's SAC builds one
for each ``checkpoint`` call from its ``context_fn``.

A policy with state - torchtitan's "save every other matmul" counts matmuls in a closure -
decides by what it has seen *in this call*. torch rebuilds it per call::

    checkpoint(block, x, use_reentrant=False,
               context_fn=lambda: create_selective_checkpoint_contexts(make_policy()))

Two ways to have the same here:

* that very call through :func:`sac_compile.checkpoint`: ``context_fn`` is called once per
  region call and the policy is taken from the contexts it returns (torch's
  ``_CachingTorchDispatchMode.policy_fn``; ``allow_cache_entry_mutation`` from its pair);
* a region policy ``per_call(make_policy)`` (``sac_region(per_call(make_policy))``,
  ``apply_regions(model, per_call(make_policy), where=Block)``,
  ``checkpoint(fn, x, policy=per_call(make_policy))``): ``make_policy()`` is called once per
  region call and its result is the policy for that call.

When "once per call" happens: in eager mode, at each region call (each block, each step).
Under ``torch.compile`` the policy is asked while AOTAutograd traces the region, so it is
built once per region trace, and every later call runs that split - which is what torch's
SAC does under compile too, and the same decisions as eager for a policy whose answers
depend only on the ops of one call. The decisions match torch's SAC in both modes (tested
on torchtitan's policy: ``tests/test_per_call.py``).

A ``PerCall`` is not itself asked about ops: inside ``compose``/``relaxed`` it raises a
:class:`~sac_compile.CheckpointError` (compose the policies inside the factory instead).
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

from .policy import CheckpointError, PolicyFn, PolicyLike, RegionFrame, normalize_policy

__all__ = ["PerCall", "per_call", "fresh_frame", "policy_of_context_fn",
           "build"]


def _describe(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


@dataclasses.dataclass(frozen=True)
class PerCall:
    """A region policy built by ``factory()`` for each region call (see the module
    docstring). Made by :func:`per_call`; a value: equal factories, equal ``PerCall``."""

    factory: Callable[[], PolicyLike]

    def build(self, region: str) -> PolicyFn:
        """A fresh policy for one call of ``region``."""
        try:
            policy = self.factory()
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(
                f"the policy factory {_describe(self.factory)} of region {region!r} raised "
                f"{type(e).__name__}: {e} when called to build the region's policy for this "
                f"call; per_call(factory) calls factory() with no arguments once per region "
                f"call") from e
        if isinstance(policy, PerCall):
            raise CheckpointError(
                f"the policy factory {_describe(self.factory)} of region {region!r} returned "
                f"another per_call(...); return the policy itself (a function "
                f"(ctx, op, *args, **kwargs), a list of ops or a preset)")
        try:
            return normalize_policy(policy)
        except TypeError as e:
            raise CheckpointError(
                f"the policy factory {_describe(self.factory)} of region {region!r} returned "
                f"{policy!r}, which is not a policy: {e}") from None

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        region = getattr(ctx, "region", "?")
        raise CheckpointError(
            f"per_call({_describe(self.factory)}) was asked about op {op} in region "
            f"{region!r}: it is a policy factory, built once per region call, and only a "
            f"region's own policy can be one. Inside compose(...) or relaxed(...), compose "
            f"in the factory instead: per_call(lambda: compose(make_policy(), ...))")

    @property
    def __wrapped__(self) -> Callable[[], PolicyLike]:
        # What the policy is made of, for code that looks inside policies without calling
        # them (the SaveWithHooks probe under compile).
        return self.factory

    def __repr__(self) -> str:
        return f"per_call({_describe(self.factory)})"


def per_call(factory: Callable[[], PolicyLike]) -> PerCall:
    """A region policy that ``factory()`` builds afresh for each region call, as torch's
    ``context_fn`` builds one per ``checkpoint`` call: ``sac_region(per_call(make_policy))``.
    ``factory`` takes no arguments and returns any policy form."""
    if isinstance(factory, PerCall):
        return factory
    if not callable(factory):
        raise TypeError(f"per_call(factory) takes a function of no arguments that returns a "
                        f"policy, got {factory!r} of type {type(factory).__name__}")
    return PerCall(factory)


def fresh_frame(frame: RegionFrame) -> RegionFrame:
    """``frame`` for one region call: a per-call policy built for it, else ``frame``."""
    policy = frame.policy
    if not isinstance(policy, PerCall):
        return frame
    return dataclasses.replace(frame, policy=policy.build(frame.name))


# --------------------------------------------------------------------------------------
# torch's form: checkpoint(fn, *args, context_fn=lambda: create_selective_checkpoint_contexts(...))
# --------------------------------------------------------------------------------------

def policy_of_context_fn(context_fn: Callable[[], Any], region: str) -> tuple[PolicyFn, bool]:
    """Call ``context_fn`` once and take the policy from the contexts it returns: torch's
    ``create_selective_checkpoint_contexts(policy_fn_or_list, allow_cache_entry_mutation)``
    pair (its forward mode holds ``policy_fn``, its recompute mode the flag), or torch's
    ``noop_context_fn`` pair (two null contexts: recompute everything)."""
    try:
        contexts = context_fn()
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(
            f"the context_fn {_describe(context_fn)} of region {region!r} raised "
            f"{type(e).__name__}: {e}") from e
    if isinstance(contexts, tuple) and len(contexts) == 2:
        forward, recompute = contexts
        policy = getattr(forward, "policy_fn", None)
        if callable(policy):
            allow = bool(getattr(recompute, "allow_cache_entry_mutation", False))
            return normalize_policy(policy), allow
        if all(isinstance(c, contextlib.nullcontext) for c in contexts):
            return normalize_policy("recompute_all"), False
    raise CheckpointError(
        f"sac_compile.checkpoint: the context_fn {_describe(context_fn)} of region "
        f"{region!r} returned {contexts!r}; only torch's create_selective_checkpoint_"
        f"contexts(policy_fn_or_list) pair (or noop_context_fn's) can be read as a policy. "
        f"Pass the policy itself, checkpoint(fn, *args, policy=per_call(make_policy)), and "
        f"enter other contexts around the call")


def build(make: Any, kind: str, name: str) -> tuple[PolicyFn, bool]:
    """The policy (and ``allow_cache_entry_mutation``) for one call of region ``name``."""
    if kind == "contexts":
        return policy_of_context_fn(make, name)
    return PerCall(make).build(name), False
