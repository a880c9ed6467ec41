"""The inert-policy warning, in both modes: a policy function whose region ran ops but
which decided nothing (every op ended PREFER_RECOMPUTE) is almost always a policy that
compares ``op`` with a packet while it is called with overloads."""
from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterable
from typing import Any, NamedTuple

from .policy import PREFER_RECOMPUTE, Decision, PolicyValue, RegionFrame, op_name

__all__ = ["DecidedOp", "may_warn_inert", "warn_inert_policies"]


class DecidedOp(NamedTuple):
    """One op of a region call and its decision (the compiler's form of an eager OpNode)."""

    frames: tuple[RegionFrame, ...]
    op: Any
    decision: Decision


# Policies already checked by warn_inert_policies (each is checked on its first region call,
# eager or compiled).
_CHECKED_POLICIES: weakref.WeakSet = weakref.WeakSet()


def _unchecked(policy: Any) -> bool:
    try:
        weakref.ref(policy)
    except TypeError:  # not weak-referenceable: never checked
        return False
    return policy not in _CHECKED_POLICIES


def may_warn_inert(frames: Iterable[RegionFrame]) -> bool:
    """Whether ``warn_inert_policies`` could warn for ops run under ``frames``: some policy
    is a function not checked yet (a checked policy stays checked while a frame holds it)."""
    return any(not isinstance(f.policy, PolicyValue) and _unchecked(f.policy) for f in frames)


def warn_inert_policies(decided: Iterable[Any]) -> None:
    """Warn once per policy function whose region ran ops but which decided nothing: every
    op of its region ended PREFER_RECOMPUTE. Usually it compares ``op`` with a packet
    (``op == torch.ops.aten.mm``) while it is called with overloads (``aten.mm.default``).
    ``decided``: the region call's ops, anything with ``frames``, ``op`` and ``decision``."""
    counts: dict[int, list[Any]] = {}
    last = None
    fresh: list[RegionFrame] = []
    for node in decided:
        if node.frames is not last:
            last = node.frames
            fresh = [f for f in last
                     if not isinstance(f.policy, PolicyValue) and _unchecked(f.policy)]
        for frame in fresh:
            entry = counts.setdefault(id(frame.policy), [frame, 0, set(), False])
            entry[1] += 1
            entry[2].add(op_name(node.op))
            if node.decision.policy is not PREFER_RECOMPUTE or node.decision.source == "tag":
                entry[3] = True
    for frame, n, ops, was_decided in counts.values():
        _CHECKED_POLICIES.add(frame.policy)
        if was_decided or not n:
            continue
        some = ", ".join(sorted(ops)[:4]) + (", ..." if len(ops) > 4 else "")
        warnings.warn(
            f"the policy {getattr(frame.policy, '__name__', frame.policy)!r} of region "
            f"{frame.name!r} decided nothing for any of the region's {n} ops ({some}): every "
            f"one is PREFER_RECOMPUTE, as with 'recompute_all'. A policy is called with op "
            f"overloads such as torch.ops.aten.mm.default; if it compares with a packet "
            f"(op == torch.ops.aten.mm), compare op.overloadpacket or list the overload "
            f"(warned once per policy)", stacklevel=2)
