"""The words of a compiled split: its :class:`~sac_compile.report.PartitionReport`.

The partitioner's steps decide and edit graphs, and hand over typed facts - the
:class:`.choose_cut.Cut`, the :class:`.extract.Split`, the :class:`.storage.StoragePlan`,
the :class:`~sac_compile.graph_meta.BoundaryFact` on a kept region boundary. This module
alone turns them into the report's reasons and notes. A record also carries its facts as
fields (``is_input``, ``is_parameter``, ``must``, ``on_host``; its reason's ``kind``), so
that no reader parses a sentence back.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import TYPE_CHECKING

import torch
import torch.fx as fx

from .. import graph_meta
from ..budgets import PeakBudget, budget_label
from ..cut import costs
from ..cut.reasons import Reason, ReasonKind
from ..cut.roles import Role, node_role
from ..op_costs import is_cost_estimated
from ..policy import CheckpointPolicy
from ..report import PartitionReport, SavedTensorRecord, fmt_bytes
from .facts import Floor, HostWhy, PeakFit, Storage, Unfused
from .peak import estimate_peak

if TYPE_CHECKING:
    from ..budgets.result import BudgetResult
    from ..budgets.groups import RegionBudgetFacts
    from .choose_cut import Cut
    from .extract import Split
    from .storage import StoragePlan, StoredValue

__all__ = ["describe_partition", "boundary_reason"]

P = CheckpointPolicy
_SAVES = (P.MUST_SAVE, P.MUST_CPU_OFFLOAD, P.PREFER_SAVE, P.PREFER_CPU_OFFLOAD)


def describe_partition(gm: fx.GraphModule, split: Split, static: set[fx.Node], *,
                       solver: str, timings: dict[str, float], cut: Cut | None = None,
                       plan: StoragePlan | None = None,
                       offload_flags: dict[str, bool] | None = None,
                       counts: dict[str, int] | None = None,
                       apart: int = 0) -> PartitionReport:
    """The report of a split: the cut's notes (``cut``: None for a split torch's
    partitioner made), what the final graphs save and recompute, how the saved values are
    kept (``plan``, and the offload flags it ran with); ``apart``: the products kept apart
    from their adds (:mod:`.products_apart`)."""
    report = PartitionReport(mode="compile", solver=solver, products_apart=apart)
    if cut is not None:
        _describe_cut(report, cut)
    if counts and counts.get("fold_markers"):
        report.notes.append(f"{counts['fold_markers']} tag()/name() markers folded")
    if counts and counts.get("keep_storage_in_region"):
        report.notes.append(
            f"{counts['keep_storage_in_region']} values read outside their region kept as "
            f"plain saves, without the region's hooks or CPU offload (a region's storage "
            f"decisions apply to its own saves only)")
    if apart:
        report.notes.append(
            f"{apart} matrix product(s) kept apart from the add that reads them (Inductor's "
            f"addmm would hold their operands until the add)")
    _describe_graphs(report, gm, split, static)
    final = report.peak.step(cut.peak_fit.fused) \
        if cut is not None and cut.peak_fit is not None and report.peak is not None else None
    report.budget_peak = final
    if final is not None and final > cut.peak_fit.cap:
        report.notes.append(
            f"{_budget_label(cut)}: the final graphs' step peaks at {fmt_bytes(final)}, "
            f"above the cap {fmt_bytes(cut.peak_fit.cap)} (the cut's model: "
            f"{fmt_bytes(cut.peak_fit.peak)})")
    report.timings = timings
    if plan is not None:
        host = _host_reason(cut) if cut is not None else ""
        _describe_storage(report, plan, host, offload_flags or {})
    return report


def boundary_reason(fact: graph_meta.BoundaryFact) -> Reason:
    """Why the region-boundary floor keeps a value (:mod:`.boundaries`)."""
    made = repr(fact.made_in) if fact.made_in is not None else "outside every region"
    read = repr(fact.read_in) if fact.read_in is not None else "outside every region"
    where = (f"made by one call of region {read}, read by another's recompute" if made == read
             else f"the boundary between {'region ' if fact.made_in is not None else ''}"
                  f"{made} and region {read}")
    return Reason(ReasonKind.REGION_BOUNDARY,
                  f"{where}: kept so that each region is recomputed from its own inputs, as "
                  f"eager checkpointing does")


# -- the cut -------------------------------------------------------------------------------

def _describe_cut(report: PartitionReport, cut: Cut) -> None:
    if cut.stand_ins:
        names = [v.name for v in cut.stand_ins]
        report.notes.append(
            f"{len(names)} values computed from values the policy offloads may not "
            f"be kept on the device in their place (recomputed from the reloaded value, "
            f"or offloaded): {', '.join(names[:4])}{', ...' if len(names) > 4 else ''}")
    if cut.torch_budget_ignored is not None:
        report.notes.append(
            f"torch._functorch.config.activation_memory_budget={cut.torch_budget_ignored:g} "
            f"not applied: memory_budget={cut.memory_budget!r} given to the partitioner")
    if cut.region_budgets is not None:
        report.notes.extend(_region_budget_notes(cut.region_budgets))
    added, left = cut.size_guards
    if added:
        report.notes.append(
            f"byte budget under dynamic shapes: the cut was chosen at the size hints and is "
            f"kept for sizes up to them (guards {', '.join(added[:4])}"
            f"{', ...' if len(added) > 4 else ''}); a larger call compiles again")
    if left:
        report.notes.append(
            f"byte budget under dynamic shapes: the sizes {', '.join(left[:4])} cannot be "
            f"guarded (data-dependent): at other values the cut may keep more than the "
            f"budget")
    report.notes.extend(_floor_notes(cut.floor))
    report.notes.extend(_unfused_notes(cut.unfused))
    res = cut.budget
    if res is None:
        return
    label = _budget_label(cut)
    if cut.peak_fit is not None:
        report.memory_budget = cut.memory_budget
        report.budget_bytes = cut.peak_fit.cap
        report.notes.append(_peak_fit_note(label, cut.peak_fit, res))
    elif cut.memory_budget is not None:
        report.memory_budget = cut.memory_budget
        report.budget_bytes = int(res.budget_bytes)
    if cut.peak_fit is None:
        cap = f"cap {fmt_bytes(res.budget_bytes)}, " if cut.memory_budget is not None else ""
        report.notes.append(
            f"memory budget {label}: {fmt_bytes(res.activation_bytes)} of activations "
            f"saved ({cap}unconstrained {fmt_bytes(res.unconstrained_bytes)}, least "
            f"reachable {fmt_bytes(res.min_bytes)}); {res.method}, {res.solves} solves"
            + (f"; {len(res.offloaded)} values offloaded" if res.offloaded else ""))
    why = (f"so that the step's modelled peak fits {fmt_bytes(cut.peak_fit.cap)}"
           if cut.peak_fit is not None else
           f"saving it would exceed {fmt_bytes(res.budget_bytes)}")
    report.estimated_labels |= {costs.op_label(v) for v in res.evicted if _cost_estimated(v)}
    for v in res.evicted:
        dec = graph_meta.decision(v)
        what = dec.label if dec is not None else "min-cut save"
        report.evicted.append(SavedTensorRecord(
            v.name, costs.op_label(v), costs.nbytes(v),
            Reason(ReasonKind.EVICTED_BY_BUDGET,
                   f"{what} overridden by {_budget_word(cut)} {label}: recomputed in "
                   f"backward ({why})"),
            region=graph_meta.region(v)))
    if res.lifted:
        ops = sorted({costs.op_label(v) for v in res.lifted})
        report.notes.append(
            f"{_budget_word(cut)} {label}: {len(res.lifted)} untagged ops recomputed that "
            f"torch's partitioner would keep ({', '.join(ops[:4])}"
            f"{', ...' if len(ops) > 4 else ''}; CostModel("
            f"budget_lifts_upstream_bans=False) keeps them)")


def _budget_label(cut: Cut) -> str:
    if isinstance(cut.memory_budget, PeakBudget):
        return cut.memory_budget.label()
    return budget_label(cut.memory_budget) if cut.memory_budget is not None \
        else "(per group above)"


def _budget_word(cut: Cut) -> str:
    return "budget" if isinstance(cut.memory_budget, PeakBudget) else "memory budget"


def _peak_fit_note(label: str, fit: PeakFit, res: BudgetResult) -> str:
    """How a peak budget was met (:mod:`.peak_budget`)."""
    how = ("the cut without a budget fits" if fit.kept_cap is None else
           f"kept-byte budget {fmt_bytes(fit.kept_cap)} ({res.method}), the cheapest "
           f"to recompute of the {fit.fitting} cuts whose peak fits")
    return (f"{label}: modelled step peak {fmt_bytes(fit.peak)} (cap {fmt_bytes(fit.cap)}; "
            f"without a budget {fmt_bytes(fit.unconstrained_peak)}, least found "
            f"{fmt_bytes(fit.least_peak)}, {fit.tried} cuts tried); {how}: "
            f"{fmt_bytes(res.activation_bytes)} of activations saved (unconstrained "
            f"{fmt_bytes(res.unconstrained_bytes)})"
            + (f"; {len(res.offloaded)} values offloaded" if res.offloaded else ""))


def _region_budget_notes(facts: RegionBudgetFacts) -> list[str]:
    lines = [f"{g.label}, {g.values} values, cap {fmt_bytes(g.cap)} (least "
             f"{fmt_bytes(g.least)}, unconstrained {fmt_bytes(g.most)}); keeps "
             f"{fmt_bytes(g.kept)}" for g in facts.groups] + facts.price_notes
    return lines + [f"{s.label}: shares " + ", ".join(f"{name} {fmt_bytes(b)}"
                                                      for name, b in s.shares.items())
                    for s in facts.shares]


def _floor_notes(floor: Floor) -> list[str]:
    if floor.refused is not None:
        return [f"region boundaries not kept: {floor.refused[:160]}"]
    if not floor.held:
        return []
    return [f"region boundaries kept: {len(floor.held)} values ({fmt_bytes(floor.held_bytes)}) "
            f"that the cut recomputed across regions; estimated peak "
            f"{fmt_bytes(floor.peak_before)} -> {fmt_bytes(floor.peak_after)} (each region "
            f"is recomputed from its own inputs, as in eager mode)"]


def _unfused_notes(fact: Unfused) -> list[str]:
    if not fact.dropped:
        return []
    names = ", ".join(v.name for v in fact.dropped[:4]) + (", ..." if len(fact.dropped) > 4
                                                            else "")
    (fb, bb), (fa, ba) = fact.peaks_before, fact.peaks_after
    return [f"not kept under Inductor: {len(fact.dropped)} values "
            f"({fmt_bytes(fact.dropped_bytes)}; {names}) it would otherwise not allocate in "
            f"the forward, recomputed from the values kept instead; estimated peaks as "
            f"Inductor allocates, forward {fmt_bytes(fb)} -> {fmt_bytes(fa)}, backward "
            f"{fmt_bytes(bb)} -> {fmt_bytes(ba)}"]


def _host_reason(cut: Cut) -> str:
    if cut.host_why is HostWhy.BUDGET:
        return (f"offloaded to meet memory budget {_budget_label(cut)}: transferring it costs "
                f"less than recomputing it")
    return ("kept on the host by the cut: transferring it costs less than keeping it on the "
            "device or recomputing it")


# -- the final graphs ------------------------------------------------------------------------

def _describe_graphs(report: PartitionReport, gm: fx.GraphModule, split: Split,
                     static: set[fx.Node]) -> None:
    joint = {n.name: n for n in gm.graph.nodes}
    saved = [joint[name] for name in split.saved_names
             if name in joint and node_role(joint[name]) is not Role.TANGENT
             and not costs.is_sym(joint[name])
             and not costs.is_opaque(joint[name])]
    names = set(split.saved_names)
    rng_states = set(split.rng_states)
    for node in split.bw.graph.find_nodes(op="placeholder"):
        if node not in rng_states:
            continue  # (added by torch's RNG functionalisation)
        val = graph_meta.val(node)
        on_cpu = isinstance(val, torch.Tensor) and val.device.type == "cpu"
        report.saved.append(SavedTensorRecord(
            node.name, "RNG state", int(torch.get_rng_state().numel()) if on_cpu else 16,
            Reason(ReasonKind.RNG_STATE, "generator state saved so that a recomputed "
                                         "random op draws the same numbers")))
    for node in saved:
        reason, must = _saved_reason(node, node in static, names)
        report.saved.append(SavedTensorRecord(
            node.name, costs.op_label(node), costs.nbytes(node), reason,
            is_input=node.op == "placeholder", region=graph_meta.region(node),
            is_parameter=reason.kind is ReasonKind.PARAMETER, must=must))
    recomputed = [joint[name] for name in split.recomputed]
    report.estimated_labels |= {costs.op_label(n) for n in (*recomputed, *saved)
                               if n.op != "placeholder" and _cost_estimated(n)}
    report.recomputed = [costs.op_label(n) for n in recomputed]
    report.recomputed_regions = [graph_meta.region(n) for n in recomputed]
    report.recompute_flops = sum(costs.flops(n) for n in recomputed)
    report.peak = estimate_peak(split.fw, split.bw, gm)


def _cost_estimated(node: fx.Node) -> bool:
    """Whether the cost model estimated the FLOPs of the op that made ``node`` from shapes
    (a getitem: of the multi-output op it reads)."""
    while node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return is_cost_estimated(node.target)


def _saved_reason(node: fx.Node, is_static: bool, saved_names: set[str]) -> tuple[Reason, bool]:
    """Why the cut saved ``node``, and whether a MUST decision about it says so."""
    if node.op == "placeholder":
        if is_static or node_role(node) is Role.PARAMETER:
            return Reason(ReasonKind.PARAMETER, "parameter (input)"), False
        return Reason(ReasonKind.INPUT, "input"), False
    base = node.args[0] if node.target is operator.getitem else node
    dec = graph_meta.decision(node)
    boundary = graph_meta.boundary(node)
    if boundary is not None:
        return boundary_reason(boundary), False
    if dec is None:
        return Reason(ReasonKind.MIN_CUT, "min-cut"), False
    must = dec.is_must and dec.hooks is None
    if dec.policy in _SAVES:
        kind = ReasonKind.MUST_SAVE if dec.is_must else ReasonKind.PREFER_SAVE
        reason = dec.reason()
        view_of = graph_meta.view_of(node)
        if view_of is not None:  # the decision is its base's
            reason, must = f"view of {view_of}: {reason}", False
        if dec.hooks is not None:
            reason += " (hooks not applied under compile: saved as is)"
        if dec.offloads:
            reason += " (kept on device under compile)"
        return Reason(kind, reason), must
    # A recompute decision overridden by the cut.
    inputs = [a for a in base.all_input_nodes if a.name not in saved_names]
    alt = sum(costs.nbytes(a) for a in inputs)
    size = fmt_bytes(costs.nbytes(node))
    if alt > costs.nbytes(node):
        text = (f"{dec.label} overridden: saving {size} is cheaper than recomputing from "
                f"{fmt_bytes(alt)}")
    elif alt:
        text = (f"{dec.label} overridden: saving {size} costs no more than recomputing from "
                f"{fmt_bytes(alt)}, and saves the recompute")
    else:
        text = f"{dec.label} overridden: saving {size} is cheaper than recomputing it"
    return Reason(ReasonKind.RECOMPUTE_OVERRIDDEN, text), must


# -- storage ---------------------------------------------------------------------------------

_ROUND_TRIP = "after its last forward use, reloaded before its first backward use"


def _storage_text(v: StoredValue, host_reason: str) -> str:
    s = v.node
    if v.decision is None:  # the cut chose the host
        if v.storage is Storage.DEVICE:
            return f"{host_reason}; kept on the device after all: {v.refusal}"
        return f"{host_reason}: offloaded to the CPU {_ROUND_TRIP}"
    dec, d = v.decision, v.decided
    prefix = dec.reason()
    if v.stands_in:
        prefix = (f"stands in for {d.name} ({costs.op_label(d)}: {dec.reason()}; the cut "
                  f"keeps this later value of {fmt_bytes(costs.nbytes(s))} in its place)")
    if v.storage is Storage.HOOKS:
        return (f"{prefix}: packed by {dec.hooks!r} after its last forward use "
                f"({fmt_bytes(costs.nbytes(s))} -> {fmt_bytes(v.traced.packed_bytes)}), "
                f"unpacked before its first backward use")
    if v.storage is Storage.OFFLOAD:
        return f"{prefix}: offloaded to the CPU {_ROUND_TRIP}"
    if v.refusal is None:
        return f"{prefix} (the value is on the CPU: CPU offload is a plain save)"
    return f"{prefix} (kept on the device under compile: {v.refusal})"


def _describe_storage(report: PartitionReport, plan: StoragePlan, host_reason: str,
                      offload_flags: dict[str, bool]) -> None:
    """Bytes and reasons of the saved values the plan keeps otherwise than as is on the
    device, and one note per kind of storage."""
    by_name = {v.node.name: v for v in plan.values}
    counts: dict[Storage, list[int]] = {}
    packed: list[int] = []
    for i, r in enumerate(report.saved):
        v = by_name.get(r.name)
        if v is None:
            continue
        counts.setdefault(v.storage, []).append(costs.nbytes(v.node))
        nbytes = r.nbytes
        if v.storage is Storage.HOOKS:
            nbytes = v.traced.packed_bytes
            packed.append(nbytes)
        kind = getattr(r.reason, "kind", None)  # a Reason keeps its kind, with the new text
        text = _storage_text(v, host_reason)
        must = v.decision is not None and not v.stands_in and v.decision.is_must and \
            v.decision.hooks is None
        report.saved[i] = dataclasses.replace(
            r, reason=text if kind is None else Reason(kind, text), nbytes=nbytes,
            on_host=v.storage is Storage.OFFLOAD, must=must)
    if Storage.OFFLOAD in counts:
        offloaded = counts[Storage.OFFLOAD]
        how = ", ".join(what for flag, what in (
            ("activation_offload_separate_stream", "async on a side stream"),
            ("activation_offload_sink_wait", "waits sunk to the end of the forward"),
            ("activation_reload_prefetch", "reloads prefetched")) if offload_flags.get(flag))
        report.notes.append(
            f"CPU offload: {len(offloaded)} values, {fmt_bytes(sum(offloaded))} leave the "
            f"device (torch's activation offloading{': ' + how if how else ''})")
    if Storage.HOOKS in counts:
        hooked = counts[Storage.HOOKS]
        report.notes.append(
            f"SaveWithHooks: {len(hooked)} values packed in the compiled graphs, "
            f"{fmt_bytes(sum(hooked))} -> {fmt_bytes(sum(packed))}")
    if Storage.DEVICE in counts:
        report.notes.append(f"{len(counts[Storage.DEVICE])} values decided for CPU offload "
                            f"kept on the device (see their reasons)")
    if plan.unkept:
        names = [f"{d.name} ({_decision_label(d)})" for d in plan.unkept]
        in_place = [f"{v.name} ({costs.op_label(v)}, {fmt_bytes(costs.nbytes(v))}, from "
                    f"{d.name})" for v, d in plan.in_place]
        what = (f"values computed from them are kept on the device in their place, "
                f"{len(in_place)}: {', '.join(in_place[:4])}{', ...' if len(in_place) > 4 else ''}"
                ) if in_place else "nor is any value computed from them"
        report.notes.append(
            f"{len(names)} values decided for offload/hooks are not kept for backward "
            f"({what}): {', '.join(names[:4])}{', ...' if len(names) > 4 else ''}")


def _decision_label(node: fx.Node) -> str:
    dec = graph_meta.decision(node)
    region = graph_meta.region(node)
    return f"{dec.label}" + (f" in region {region!r}" if region else "")
