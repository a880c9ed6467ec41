"""One op's decision on the eager hot path: :func:`sac_compile.policy.decide`, specialised to
one stack of regions so that the recorder does no more per op than the policies need.

* Every region's policy is constant (``recompute_all``, ``save_all``, ``relaxed`` of them):
  one decision for every op, :func:`fixed_decision`; the recorder then calls nothing.
* Every policy is one of our values that answers by the op alone (``save_matmuls``,
  ``save_ops``, ``offload_ops``, op lists, ``compose``/``relaxed`` of those: see
  :func:`sac_compile.policy.answers_by_op`): each op overload is decided once per stack of
  regions, equal stacks (same names, equal policies) sharing the answers across calls.
* Otherwise (a user's function: it may read the arguments, the output, a counter) every op
  is asked, with one reused context for a single region.

Each gives what :func:`decide` gives; they only skip work whose answer cannot differ.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..policy import (CheckpointPolicy, Decision, PolicyContext, RegionFrame, SaveWithHooks,
                      Vote, _ask, answers_by_op, coerce_opinion, decide, resolve_decision)

__all__ = ["Decider", "fixed_decision", "make_decider", "by_op_calls"]

Decider = Callable[[Any, tuple, dict, Any], Decision]
_CACHED_TYPES = frozenset({bool, CheckpointPolicy, SaveWithHooks})

# Per stack of regions, by (name, policy value) - not by the frames, which hold the regions'
# slots and budgets: a cache entry must not keep a region (its group membership) alive -
# id(op) -> (op, decision). The entry holds the op, so its id is not reused while cached. Bounded: a
# program with more distinct stacks than this starts the cache again.
_BY_OP: dict[tuple[tuple[str, Any], ...], dict[int, tuple[Any, Decision]]] = {}
_BY_OP_LIMIT = 512
_BY_OP_CALLS = [0]  # how often a by-op decider asked the policies (tests count it)


def by_op_calls() -> int:
    """How many times, in this process, a by-op decider asked the policies (a cache miss)."""
    return _BY_OP_CALLS[0]


def fixed_decision(frames: Sequence[RegionFrame]) -> Decision | None:
    """The decision for every op when every region's policy is constant, else None."""
    constants = [getattr(f.policy, "constant", None) for f in frames]
    if not frames or any(c is None for c in constants):
        return None
    return resolve_decision("<any op>", [Vote(c, f.name, "policy")
                                         for c, f in zip(constants, frames)])


def make_decider(frames: Sequence[RegionFrame]) -> Decider:
    """``decide`` specialised to one stack of regions, for the per-op hot path."""
    frames = tuple(frames)
    fixed = fixed_decision(frames)
    if fixed is not None:
        return lambda op, args, kwargs, output: fixed
    if frames and all(answers_by_op(f.policy) for f in frames):
        return _by_op_decider(frames)
    if len(frames) != 1:
        return lambda op, args, kwargs, output: decide(frames, op, args, kwargs, output)
    return _single_region_decider(frames[0])


def _by_op_decider(frames: tuple[RegionFrame, ...]) -> Decider:
    key = tuple((f.name, f.policy) for f in frames)
    cache = _BY_OP.get(key)
    if cache is None:
        if len(_BY_OP) >= _BY_OP_LIMIT:
            _BY_OP.clear()
        cache = _BY_OP[key] = {}

    def decide_by_op(op: Any, args: tuple, kwargs: dict, output: Any) -> Decision:
        hit = cache.get(id(op))
        if hit is not None and hit[0] is op:
            return hit[1]
        _BY_OP_CALLS[0] += 1
        decision = decide(frames, op, args, kwargs, output)  # raises on conflicting MUSTs
        cache[id(op)] = (op, decision)
        return decision

    return decide_by_op


def _single_region_decider(frame: RegionFrame) -> Decider:
    ctx = PolicyContext(region=frame.name, region_path=(frame.name,))
    # Keyed by the identity of the returned value, never by equality: 1 == True and
    # hash(1) == hash(True), and a cache keyed by value would accept 1 after a True (and
    # the enum's Python-level __hash__ is slow). The entry holds the value, so its id is
    # not reused while cached; only values that recur as the same object are cached.
    cache: dict[int, tuple[Any, Decision]] = {}

    def decide_single(op: Any, args: tuple, kwargs: dict, output: Any) -> Decision:
        # One context object serves every call: a policy sees it valid during its call.
        # It must not keep the output alive afterwards (autograd keeps the hooks, hence
        # the recorder and this closure, until the graph is freed).
        ctx.op_output = output
        try:
            raw = _ask(frame, ctx, op, args, kwargs)
        finally:
            ctx.op_output = None
        hit = cache.get(id(raw))
        if hit is not None and hit[0] is raw:
            return hit[1]
        opinion = coerce_opinion(raw, op, frame.name)
        decision = resolve_decision(op, [Vote(opinion, frame.name, "policy")]
                                    if opinion is not None else [])
        if raw is None or raw.__class__ in _CACHED_TYPES:
            cache[id(raw)] = (raw, decision)
        return decision

    return decide_single
