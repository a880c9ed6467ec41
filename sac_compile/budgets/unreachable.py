"""The error for a budget no cut meets (:class:`~sac_compile.errors.BudgetUnreachableError`),
built in one place: :func:`unreachable_error` words every budget's (a split's, a region's,
a whole model's, a step peak's) and proposes a budget that is met; :func:`budget_unreachable`
finds, for a kept-byte budget on one split, the values that keep it out of reach and why.
"""
from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch.fx as fx

from .. import graph_meta
from ..cut import costs
from ..cut.network import FlowNetwork
from ..cut.reasons import ReasonKind, kind_of
from ..errors import BudgetUnreachableError
from .search import is_activation
from .values import PeakBudget, budget_label, proposed_budget

__all__ = ["unreachable_error", "budget_unreachable"]

# Keys of :data:`_BAN_FIX` beyond the reason kinds.
_HOOKS = "SaveWithHooks"
_RNG_STATE = "RNG state"


def unreachable_error(given: str, findings: str, fixes: Sequence[str], *,
                      budget: Any, least: float, unconstrained: float,
                      note: str = "", prefix: str = "") -> BudgetUnreachableError:
    """``{prefix}sac_compile: {given} cannot be met: {findings}. To fix: raise the budget to
    at least {least}: memory_budget={proposed}, or {fixes...}; {note}.`` The proposed
    budget is :func:`~.values.proposed_budget`'s (valid, met, of the kind given; a
    :class:`~.values.PeakBudget` for one); the error carries the figures (``least_bytes``,
    ``unconstrained_bytes``, ``proposed_budget``)."""
    from ..report import fmt_bytes
    if isinstance(budget, PeakBudget):
        proposed: Any = PeakBudget(proposed_budget(budget.value, least, unconstrained))
    else:
        proposed = proposed_budget(budget, least, unconstrained)
    meaning = " (keep what the policy keeps)" if proposed == 1.0 else ""
    fix = (f"raise the budget to at least {fmt_bytes(least)}: memory_budget={proposed!r}"
           f"{meaning}" + "".join(f", or {f}" for f in fixes) + (f"; {note}" if note else ""))
    return BudgetUnreachableError(
        f"{prefix}sac_compile: {given} cannot be met: {findings}. To fix: {fix}.",
        budget=budget, least_bytes=int(least), unconstrained_bytes=int(unconstrained),
        proposed_budget=proposed)


_BAN_FIX = {
    ReasonKind.MUST_SAVE: "relax those MUST_SAVE decisions to PREFER_SAVE "
                          "(policies.relaxed(policy)) so they may be recomputed",
    # A SaveWithHooks is a MUST that relaxed(policy) leaves alone: its hooks=True form
    # turns it into PREFER_SAVE (and relaxes the other MUSTs too).
    _HOOKS: "let the budget recompute the values SaveWithHooks packs: "
            "policies.relaxed(policy, hooks=True) turns SaveWithHooks (and the other MUSTs) "
            "into PREFER_SAVE, so they may be recomputed (a value the budget still keeps is "
            "then kept unpacked)",
    ReasonKind.UPSTREAM_BAN: "put those ops in a region whose policy returns PREFER_RECOMPUTE "
                             "for them (outside every region they keep upstream's ban)",
    ReasonKind.RANDOM: "let their random ops be recomputed (torch's RNG functionalisation)",
    ReasonKind.EFFECTFUL: "keep collectives and effectful ops out of the budget's reach "
                          "(they are never replayed)",
    ReasonKind.MUST_RUN_IN_FORWARD: "none for those: torch runs them in the forward",
    # Kept because recomputing them would keep more (a CPU generator's state): recomputing
    # more is not the fix.
    _RNG_STATE: "run on an accelerator, where a recomputed random op keeps 16 bytes of RNG "
                "state instead of the CPU generator's 5,056",
}


def _fix_kind(v: fx.Node, reason: Any) -> Any:
    """What fixes ``v``'s ban: its reason's kind, or :data:`_HOOKS` for a SaveWithHooks
    decision (a MUST_SAVE that ``relaxed(policy)`` does not relax)."""
    kind = kind_of(reason)
    dec = graph_meta.decision(v)
    if kind is ReasonKind.MUST_SAVE and getattr(dec, "hooks", None) is not None:
        return _HOOKS
    return kind


def _random_ancestor(net: FlowNetwork, v: fx.Node, kept: set[fx.Node]) -> fx.Node | None:
    """A random op that recomputing ``v`` would replay (not through kept values), keeping
    its generator's state (:attr:`FlowNetwork.recompute_bytes`); None if there is none."""
    idx = net.cls.index
    seen, stack = {v}, list(v.all_input_nodes)
    while stack:
        u = stack.pop()
        if u in seen or u not in idx or u in kept or u.op == "placeholder":
            continue
        seen.add(u)
        if idx[u] in net.recompute_bytes:
            return u
        stack.extend(u.all_input_nodes)
    return None


def _blocking_bans(net: FlowNetwork, v: fx.Node) -> list[fx.Node]:
    """The nearest ancestors of ``v`` that cannot be recomputed even under a budget (not
    graph inputs): what stops ``v`` from being recomputed."""
    idx = net.cls.index
    out, seen, stack = [], {v}, list(v.all_input_nodes)
    while stack and len(out) < 3:
        u = stack.pop()
        if u in seen or u not in idx:
            continue
        seen.add(u)
        if u.op == "placeholder":
            continue
        if u in net.ban_reason and idx[u] not in net.lifted_under_budget:
            out.append(u)
            continue
        stack.extend(u.all_input_nodes)
    return out


def budget_unreachable(net: FlowNetwork, saved: list[fx.Node], budget: float | int,
                       cap: float, min_bytes: int, base_bytes: int, rng_bytes: float = 0.0,
                       prefix: str = "") -> BudgetUnreachableError:
    """The error for a budget no cut meets: the values that keep it out of reach, why, and
    fixes that work, among them ``proposed_budget`` (valid, met: see
    :func:`~.values.proposed_budget`)."""
    from ..report import fmt_bytes
    idx = net.cls.index

    def where(v: fx.Node) -> str:
        path = graph_meta.region_path(v)
        return f" in region {path[-1]!r}" if path else " (outside every region)"

    acts = sorted((v for v in saved if is_activation(net, idx[v])),
                  key=lambda v: -net.save_cost[idx[v]])
    items, kinds = [], []
    for v in acts[:5]:
        base = v.args[0] if v.target is operator.getitem and v.args else v
        if v in net.ban_reason and idx[v] not in net.lifted_under_budget:
            why = net.ban_reason[v]
            kinds.append(_fix_kind(v, why))
        elif idx.get(base) in net.recompute_bytes:
            rng = net.recompute_bytes[idx[base]]
            kinds.append(_RNG_STATE)
            why = (f"a random op: recomputing it keeps its generator's RNG state, "
                   f"{fmt_bytes(rng)} (a CPU generator's whole state), more than its outputs")
        elif (random := _random_ancestor(net, v, set(saved))) is not None:
            kinds.append(_RNG_STATE)
            why = (f"recomputing it replays {random.name} ({costs.op_label(random)}), a random "
                   f"op whose generator state "
                   f"({fmt_bytes(net.recompute_bytes[idx[random]])}) is larger to keep")
        else:
            blockers = _blocking_bans(net, v)
            kinds.extend(_fix_kind(b, net.ban_reason[b]) for b in blockers)
            why = ("recomputing it needs " + ", ".join(
                f"{b.name} ({costs.op_label(b)}{where(b)}: {net.ban_reason[b]})"
                for b in blockers) + ", which cannot be recomputed and is larger to keep"
                   ) if blockers else "kept so that others can be recomputed"
        items.append(f"{v.name} ({costs.op_label(v)}, {fmt_bytes(net.save_cost[idx[v]])}"
                     f"{where(v)}: {why})")
    if rng_bytes:
        kinds.append(_RNG_STATE)
        items.append(f"the RNG states of the random ops it recomputes ({fmt_bytes(rng_bytes)}"
                     f"; a CPU generator's state is 5,056 bytes, an accelerator's 16)")
    given = (f"{budget_label(budget)} of {fmt_bytes(base_bytes)} = {fmt_bytes(cap)}"
             if isinstance(budget, float) else fmt_bytes(cap))
    least = min(min_bytes, base_bytes) if base_bytes else min_bytes
    if _HOOKS in kinds:  # relaxed(policy, hooks=True) relaxes the plain MUSTs as well
        kinds = [k for k in kinds if k is not ReasonKind.MUST_SAVE]
    # (No "recompute more": at the least reachable all that may be recomputed is.)
    return unreachable_error(
        f"memory budget {given}",
        f"even with everything recomputed or offloaded that may be, this forward/backward "
        f"split keeps {fmt_bytes(least)} of activations on the device. Largest values it "
        f"must still keep: {'; '.join(items) or 'none'}",
        [_BAN_FIX[k] for k in dict.fromkeys(kinds) if k in _BAN_FIX],
        budget=budget, least=least, unconstrained=base_bytes,
        note="on an accelerator, values may also be offloaded (MUST/PREFER_CPU_OFFLOAD)",
        prefix=prefix)
