"""An eager memory budget: the first call of a region records and decides, later calls with
the same ops and shapes reuse the decisions.

While a budgeted region runs forward (:class:`BudgetRun`, held by the recorder), each op's
outputs are kept alive until the region ends when some decision may keep them: on the
first call every output (the region's activations live until its exit, as without
checkpointing), on a later call only those the plan keeps. At the region's exit the plan is
applied: the values it keeps are saved (on the host where it offloads them), the rest are
recomputed in backward from what is kept - also the policy's PREFER_SAVEs the budget evicts.

A plan (:class:`Plan`) is the cut of the region's flow network (:mod:`.budget_graph`)
under the budget, found by :func:`sac_compile.budgets.split.solve_with_budget`: MUST
decisions stay hard, a recomputed random op keeps its RNG state, and a budget out of reach
is the compiler's ``CheckpointError``. It is keyed by the recorded ops, their output shapes
and dtypes and the policy's decisions: a different shape (or op sequence) plans again.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from ..budgets import RegionBudget
from ..policy import CheckpointPolicy, Decision, op_name
from ..tensor_memory import storage_key, storage_nbytes
from .budget_graph import Plan
from .graph import OpNode
from .stats import SavedValueRecord

__all__ = ["BudgetRun", "Plan", "BudgetDecision"]

P = CheckpointPolicy


@dataclasses.dataclass(frozen=True)
class BudgetDecision(Decision):
    """A decision the memory budget's cut changed: ``original`` is the policy's."""

    original: Decision | None = None
    label_text: str = ""

    def reason(self) -> str:
        return self.label_text


def _entry(node: OpNode) -> tuple:
    return (node.op, tuple((f[2], f[3]) if f is not None else None for f in node.outs),
            node.decision.policy if node.decision is not None else None)


class BudgetRun:
    """One call of a budgeted region: which outputs to keep alive while it runs forward,
    and the plan applied at its exit."""

    def __init__(self, budget: RegionBudget, region: str) -> None:
        self.budget = budget
        self.region = region
        self.candidates: list[Plan]
        if budget.model is not None:  # a whole-model budget: the plans the step allows
            from .model_budget import on_region_entry
            self.candidates = on_region_entry(budget, region)
        else:
            with budget.lock:
                self.candidates = list(budget.plans.values())
        self.held: list[Any] = []

    def on_op(self, node: OpNode, out: Any) -> None:
        """After op ``node`` ran (its decision made): keep its outputs alive if a plan that
        still matches the recorded ops may keep them, or if none matches."""
        seq, entry = node.seq, _entry(node)
        if self.candidates:
            self.candidates = [p for p in self.candidates
                               if seq < len(p.signature) and p.signature[seq] == entry]
        if self.candidates and not any(seq in p.keep or seq in p.host
                                       for p in self.candidates):
            return
        self.held.append(out)

    # -- the region's exit -----------------------------------------------------------
    def plan(self, recorder: Any) -> Plan:
        nodes = recorder.decisions
        signature = tuple(_entry(n) for n in nodes)
        for p in self.candidates:
            if p.signature == signature:
                if self.budget.model is not None:  # counted in the model's step
                    from .model_budget import at_plan
                    at_plan(self, p)
                return p
        from .budget_plan import solve_region
        plan = solve_region(self, recorder, signature)
        if plan.final:
            with self.budget.lock:
                self.budget.plans[signature] = plan
        return plan

    def apply(self, recorder: Any) -> list[SavedValueRecord]:
        """Apply the plan to the recorded nodes; returns records of the partially kept
        multi-output ops (the recorder records the rest as usual)."""
        plan = self.plan(recorder)
        records: list[SavedValueRecord] = []
        seen: set[int] = set()
        for node in recorder.decisions:
            keep, host = plan.keep.get(node.seq, ()), plan.host.get(node.seq, ())
            dec = node.decision
            outputs = [i for i, f in enumerate(node.outs) if f is not None]
            if not keep and not host:
                if dec.saves:
                    node.value = node.versions = None
                    node.decision = _changed(dec, P.PREFER_RECOMPUTE, self._why(plan, False))
                continue
            whole = set(keep) | set(host) >= set(outputs) or dec.hooks is not None \
                or dec.offloads
            if whole:
                policy = P.PREFER_CPU_OFFLOAD if host and not dec.offloads else \
                    (dec.policy if dec.saves else P.PREFER_SAVE)
                if not dec.saves or policy is not dec.policy:
                    recorder._set_decision(node, _changed(dec, policy, self._why(plan, True)))
                continue
            # Some outputs of a multi-output op (layer norm's mean and rstd, not its
            # output): kept aside; the op stays recomputable for the others.
            if dec.saves:
                node.value = node.versions = None
            node.decision = _changed(dec, P.PREFER_RECOMPUTE, self._why(plan, True))
            kept, versions = [], []
            for i, facts in enumerate(node.outs):
                t = facts[0]() if facts is not None and i in keep else None
                kept.append(recorder._saved_alias(node, t) if t is not None else None)
                versions.append(facts[1] if t is not None else None)
                if t is not None:
                    key = storage_key(t)
                    records.append(SavedValueRecord(
                        f"{op_name(node.op)}#{node.seq}:{i}", op_name(node.op),
                        0 if key in seen else storage_nbytes(t), node.decision.reason(), node.region,
                        "budget", node.decision.is_must and node.decision.hooks is None))
                    seen.add(key)
            node.kept, node.kept_versions = kept, versions
        self.held.clear()
        for stats in recorder.ctx.stats:
            stats.budget_notes.extend(f"region {self.region!r}: {n}" for n in plan.notes)
            stats.evicted.extend(
                SavedValueRecord(f"{op_name(recorder.decisions[s].op)}#{s}:{i}",
                                 op_name(recorder.decisions[s].op), size, text, self.region,
                                 "evicted")
                for s, i, size, text in plan.evicted if s < len(recorder.decisions))
        return records

    def _why(self, plan: Plan, kept: bool) -> str:
        from ..budgets import budget_label
        what = "kept by" if kept else "recomputed in backward under"
        return (f"{what} the memory budget {budget_label(self.budget.value)} of region "
                f"{self.region!r} (the cut of the region's flow network; "
                f"{plan.kept_bytes:,} of {plan.unconstrained_bytes:,} B kept)")


def _changed(dec: Decision, policy: CheckpointPolicy, why: str) -> BudgetDecision:
    original = dec.original if isinstance(dec, BudgetDecision) else dec
    return BudgetDecision(policy, dec.hooks if policy in (P.MUST_SAVE, P.PREFER_SAVE) else None,
                          dec.region, "budget", original=original,
                          label_text=f"{why}; the policy said {original.label}")

