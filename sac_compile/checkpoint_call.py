"""``sac_compile.checkpoint``: the function-call form of a region, with
``torch.utils.checkpoint.checkpoint``'s keywords (re-exported by :mod:`.regions`)."""
from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.utils.checkpoint as _torch_checkpoint

from .per_call import PerCall, build as build_per_call
from .policy import PolicyLike, RegionFrame, normalize_policy
from .region_run import run_region
from .region_names import _check_target, _region_name

__all__ = ["checkpoint"]

_NOT_GIVEN: Any = object()
_DETERMINISM_CHECKS = ("default", "none")


def checkpoint(fn: Callable[..., Any], *args: Any, policy: PolicyLike = _NOT_GIVEN,
               use_reentrant: bool | None = None, context_fn: Any = None,
               preserve_rng_state: bool = True, determinism_check: str = "default",
               debug: bool = False, early_stop: bool = True,
               fn_kwargs: Mapping[str, Any] | None = None, **kwargs: Any) -> Any:
    """Call ``fn(*args, **kwargs, **fn_kwargs)`` as a region with ``policy`` (default
    ``"recompute_all"``).

    ``torch.utils.checkpoint.checkpoint``'s keywords are recognised, so a call written for
    torch runs unchanged (they are not passed to ``fn``; every other keyword is):

    * ``use_reentrant``: ``False`` or omitted. The runtime is always non-reentrant
      (saved-tensor hooks); ``True`` raises ``TypeError``.
    * ``context_fn``: ``functools.partial(torch.utils.checkpoint.
      create_selective_checkpoint_contexts, policy_fn_or_list[, allow_cache_entry_mutation])``
      becomes this region's policy (and ``allow_cache_entry_mutation``); torch's
      ``noop_context_fn`` means no policy (full recomputation). Any other function is
      called once per region call, as torch does, and the policy is taken from the
      contexts it returns (``lambda: create_selective_checkpoint_contexts(make_policy())``:
      a fresh policy per call, see :mod:`sac_compile.per_call`). One together with
      ``policy=`` raises ``TypeError``.
    * ``preserve_rng_state``: accepted; random ops always replay the generator state they
      saw (as torch's ``True``), so ``False`` changes nothing.
    * ``determinism_check``: ``"default"`` or ``"none"``; accepted. Recomputation replays
      the recorded ATen ops, so recomputed values always match the forward's in shape,
      dtype and device; there is nothing for torch's check to catch.
    * ``debug``: accepted; there is no recomputation mismatch to trace. Use
      ``sac_compile.explain`` or ``SAC_COMPILE_LOGS`` to see what was saved and why.
    * ``early_stop``: accepted; backward always recomputes only the values it unpacks
      (as torch's ``True``), so ``False`` changes nothing.

    ``fn_kwargs``: keyword arguments for ``fn`` itself, passed as they are, whatever their
    names: the way to give ``fn`` its own ``policy=`` (``policy`` is this region's; torch's
    ``checkpoint`` would pass it on) or a keyword named like one of torch's above, which
    ``**kwargs`` cannot carry, as with torch's ``checkpoint``. A name both in ``kwargs``
    and in ``fn_kwargs`` raises ``TypeError``.
    """
    _check_target(fn)
    if fn_kwargs:
        both = sorted(set(kwargs) & set(fn_kwargs))
        if both:
            raise TypeError(f"sac_compile.checkpoint got {both} both as keywords and in "
                            f"fn_kwargs; pass each of fn's keywords once")
        kwargs = {**kwargs, **fn_kwargs}
    name = _region_name(fn)
    try:
        policy, allow = _checkpoint_options(policy, use_reentrant, context_fn,
                                            determinism_check)
        if torch.compiler.is_compiling() or isinstance(policy, PerCall) or \
                policy is _FROM_CONTEXT_FN:
            frame = None
        else:
            frame = RegionFrame(name, normalize_policy(policy))
    except TypeError as e:
        raise _policy_meant_for_fn(e, fn, name, "policy" in kwargs) from e
    if policy is _FROM_CONTEXT_FN or isinstance(policy, PerCall):  # a policy per call
        make, kind = (context_fn, "contexts") if policy is _FROM_CONTEXT_FN else \
            (policy.factory, "policy")
        return _checkpoint_per_call(fn, args, kwargs, make, kind, name)
    if torch.compiler.is_compiling():  # the policy is normalised where AOTAutograd traces
        from .compiler import regions_compiled
        return regions_compiled.checkpoint(fn, args, kwargs, policy, name, allow)
    return run_region(frame, fn, args, kwargs, allow)


def _policy_meant_for_fn(error: TypeError, fn: Any, name: str, given: bool) -> TypeError:
    """``error`` (checkpoint's options or its policy), saying how to give ``fn`` its own
    ``policy=`` where ``fn`` takes one (the value was probably meant for it)."""
    try:
        takes = "policy" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read (some builtins)
        takes = False
    if not takes or given:
        return error
    return TypeError(f"{error}. {name} takes its own policy= keyword: checkpoint's policy= "
                     f"is the region's; pass {name}'s as "
                     f"sac_compile.checkpoint({name}, ..., fn_kwargs={{'policy': ...}})")


def _checkpoint_options(policy: Any, use_reentrant: Any, context_fn: Any,
                        determinism_check: Any) -> tuple[Any, bool]:
    """The policy and ``allow_cache_entry_mutation`` of a ``checkpoint`` call."""
    if use_reentrant:
        raise TypeError(
            "sac_compile.checkpoint(..., use_reentrant=True): the runtime is always "
            "non-reentrant (saved-tensor hooks, as torch's use_reentrant=False); pass "
            "use_reentrant=False or leave it out")
    if determinism_check not in _DETERMINISM_CHECKS:
        raise TypeError(
            f"sac_compile.checkpoint(..., determinism_check={determinism_check!r}): expected "
            f"one of {list(_DETERMINISM_CHECKS)} (torch's values); recomputation replays the "
            f"recorded ops, so it needs no check")
    allow = False
    if context_fn is not None and context_fn is not _torch_checkpoint.noop_context_fn:
        if policy is not _NOT_GIVEN:
            raise TypeError(
                "sac_compile.checkpoint got both policy= and context_fn=; pass one of them "
                "(the policy: policy=policy_fn)")
        policy, allow = _policy_of_context_fn(context_fn)
    if policy is _NOT_GIVEN:
        policy = "recompute_all"
    return policy, allow


def _policy_of_context_fn(context_fn: Any) -> tuple[Any, bool]:
    if isinstance(context_fn, functools.partial) and \
            context_fn.func is _torch_checkpoint.create_selective_checkpoint_contexts:
        args, keywords = context_fn.args, context_fn.keywords
        if len(args) > 2 or (len(args) == 2 and "allow_cache_entry_mutation" in keywords) or \
                (len(args) >= 1 and "policy_fn_or_list" in keywords) or \
                set(keywords) - {"policy_fn_or_list", "allow_cache_entry_mutation"}:
            raise TypeError(
                f"sac_compile.checkpoint: context_fn {context_fn!r} does not match "
                f"create_selective_checkpoint_contexts(policy_fn_or_list, "
                f"allow_cache_entry_mutation=False)")
        if args:
            policy = args[0]
        elif "policy_fn_or_list" in keywords:
            policy = keywords["policy_fn_or_list"]
        else:
            raise TypeError(
                "sac_compile.checkpoint: context_fn=functools.partial("
                "create_selective_checkpoint_contexts) has no policy_fn_or_list; pass "
                "policy=policy_fn instead")
        allow = args[1] if len(args) == 2 else keywords.get("allow_cache_entry_mutation", False)
        return policy, bool(allow)
    if callable(context_fn):  # called once per region call (sac_compile.per_call)
        return _FROM_CONTEXT_FN, False
    raise TypeError(
        f"sac_compile.checkpoint: context_fn={context_fn!r} is not callable; pass torch's "
        f"form, a function returning create_selective_checkpoint_contexts(policy), or the "
        f"policy itself, checkpoint(fn, *args, policy=policy_fn)")


_FROM_CONTEXT_FN: Any = object()  # the policy comes from calling context_fn, once per call


def _checkpoint_per_call(fn: Callable[..., Any], args: tuple, kwargs: dict, make: Any,
                         kind: str, name: str) -> Any:
    """``checkpoint`` with a policy made per call: ``make`` is a ``context_fn``
    (``kind="contexts"``: torch's form) or a policy factory (``kind="policy"``: the
    factory of ``policy=per_call(factory)``)."""
    if torch.compiler.is_compiling():
        # Only functions travel into the traced call (a PerCall made in traced code is not
        # a constant to Dynamo; its factory is).
        from .compiler.per_call_regions import checkpoint_per_call as compiled
        return compiled(fn, args, kwargs, make, kind, name)
    policy, allow = build_per_call(make, kind, name)
    return run_region(RegionFrame(name, policy), fn, args, kwargs, allow)
