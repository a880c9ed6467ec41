"""What a partition (compile) or a region run (eager) keeps for backward, and why.

``PartitionReport`` has the same shape in both modes, so tests can diff them:

* ``saved``: one :class:`SavedTensorRecord` per saved value (``name``, ``op``, ``nbytes``,
  ``reason``, and facts to match on: ``is_input``, ``is_parameter``, ``must``, ``on_host``);
* ``recomputed``: op names recomputed in backward, with repeats;
* ``saved_bytes`` (parameters excluded), ``activation_bytes`` (inputs excluded too) and
  ``recompute_flops`` (``torch.utils.flop_counter``'s rules, in both modes);
* ``coverage``: what part of the program the figures cover. Eager: the values the eager
  runtime keeps *inside* regions (``outside_bytes``: what autograd itself keeps outside every
  region, parameters excluded). Compile: the whole compiled graph, inside and outside
  regions (what each forward hands to its backward);
* ``cost_estimated``: ops whose FLOPs were estimated from shapes (custom ops, matmuls with no
  ``flop_counter`` formula, see ``sac_compile.op_costs.op_flops``);
* with a memory budget (compile): ``memory_budget`` as given, ``budget_bytes`` (the cap on
  ``activation_bytes``; under a ``PeakBudget``, the cap on the step's modelled peak,
  ``budget_peak``; with Inductor, ``budget_measured``: the split's step run once before the
  first step) and ``evicted``: values saved without the budget and recomputed with it,
  with the reason;
* ``snapshot()``: deterministic text for expecttest; ``str(report)``: a readable table.

``sac_compile.explain(fn, *args, mode="eager" | "compile")`` (:mod:`.explaining`) runs
``fn`` once, forward and backward, and returns the report.
"""
from __future__ import annotations

import dataclasses
from typing import Any
from collections import Counter


__all__ = ["PartitionReport", "SavedTensorRecord", "MemoryPeak", "fmt_bytes"]


def fmt_bytes(n: float | None, digits: int | None = None) -> str:
    """Bytes in binary units, for people: ``4096`` -> ``"4 KiB"``, ``1536`` -> ``"1.5 KiB"``
    (one decimal where the value is not whole). ``digits``: that many decimals always, for
    tables whose columns line up (``fmt_bytes(1536, 2)`` -> ``"1.50 KiB"``). Below 1 KiB the
    count is whole bytes; ``None`` (not measured) is ``"n/a"``."""
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            if unit == "B":
                return f"{n:.0f} B" if digits is None else f"{int(n)} B"
            if digits is not None:
                return f"{n:.{digits}f} {unit}"
            return f"{n:.0f} {unit}" if n == int(n) else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable: GiB takes every value left")  # pragma: no cover


@dataclasses.dataclass(frozen=True)
class SavedTensorRecord:
    name: str
    op: str
    nbytes: int
    reason: str
    is_input: bool = False
    region: str = ""  # the innermost region that decided it; "" outside every region
    on_host: bool = False  # offloaded: kept in host memory, not on the device
    is_parameter: bool = False  # a parameter or buffer (an input): not in saved_bytes
    must: bool = False  # kept by a MUST decision about this very value (reason names it)


@dataclasses.dataclass(frozen=True)
class MemoryPeak:
    """The most activation bytes alive at once over a forward and its backward, in the order
    they run (compile: a walk of the split's final graphs, :mod:`.compiler.peak`; eager: the
    runtime's accounting of kept values plus the replay working set).

    Counted: every value the forward or the backward computes (recomputed values and the
    backward's gradients of activations included), from the op that makes it until its last
    use; a view shares its base's storage; what the forward hands to the backward (and a
    graph's outputs) until the backward has read it the last time. Not counted: inputs and
    parameters, and the gradients handed back to autograd (the backward's outputs).
    ``with_gradients`` (compile; None otherwise): the same walk with the gradients the
    backward hands back counted too, from the node that makes each until the step's end
    (they outlive the backward), and ops' own temporaries (a matmul's copy of an operand
    BLAS cannot read, :mod:`.compiler.op_temporaries`): the step's peak above its start
    as an allocator sees it,
    when the graphs run in this order (``aot_eager``; ``sac_compile.measured_peak`` measures
    it), the larger of the forward's and this backward's.
    ``at_peak``: what is alive at the peak, as ``(kind, region, bytes)``: kind ``forward``,
    ``kept`` (handed from forward to backward), ``recomputed``, ``backward`` (gradients and
    the backward's own working values); region: the innermost region that made the value
    (eager: ran or replayed its op), ``""`` outside every region or not known (gradients)."""

    forward: int                   # the forward's peak
    backward: int                  # the backward's peak
    phase: str                     # "forward" | "backward": where the larger one is
    after: str = ""                # the op after which the peak is reached
    at_peak: tuple[tuple[str, str, int], ...] = ()
    with_gradients: int | None = None  # the step's peak, the backward's gradients counted
    #: compile: the same figures as Inductor allocates (values it computes inside the
    #: kernels that read them not counted; ``at_peak`` empty), None otherwise.
    fused: "MemoryPeak | None" = None

    @property
    def bytes(self) -> int:
        return max(self.forward, self.backward)

    def step(self, fused: bool = False) -> int:
        """The step's modelled peak (``with_gradients``; eager, without one: ``bytes``), as
        Inductor allocates where ``fused`` and the walk has that figure."""
        peak = self.fused if fused and self.fused is not None else self
        return peak.with_gradients if peak.with_gradients is not None else peak.bytes

    def by_kind(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for kind, _, n in self.at_peak:
            out[kind] = out.get(kind, 0) + n
        return out

    def line(self) -> str:
        """One line: the peak, where, and what is alive then by kind and region."""
        parts = []
        for kind, total in self.by_kind().items():
            regions = [(r, n) for k, r, n in self.at_peak if k == kind and r]
            detail = ", ".join(f"{r} {fmt_bytes(n)}" for r, n in regions[:4])
            more = f", +{len(regions) - 4} regions" if len(regions) > 4 else ""
            parts.append(f"{kind} {fmt_bytes(total)}" + (f" ({detail}{more})" if detail else ""))
        where = f" after {self.after}" if self.after else ""
        return (f"peak {fmt_bytes(self.bytes)} in {self.phase}{where} (forward "
                f"{fmt_bytes(self.forward)}, backward {fmt_bytes(self.backward)}): "
                + "; ".join(parts))


@dataclasses.dataclass
class PartitionReport:
    mode: str = "compile"
    saved: list[SavedTensorRecord] = dataclasses.field(default_factory=list)
    recomputed: list[str] = dataclasses.field(default_factory=list)
    recomputed_regions: list[str] = dataclasses.field(default_factory=list)  # per recomputed op
    recompute_flops: int = 0
    solver: str = ""
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)
    memory_budget: float | int | Any = None   # (Any: a PeakBudget)
    budget_bytes: int | None = None
    # under a PeakBudget: the final graphs' modelled step peak, what budget_bytes caps
    # (``peak.with_gradients``; under Inductor ``peak.fused.with_gradients``)
    budget_peak: int | None = None
    # under a PeakBudget with Inductor: the step peak measured by running the compiled split
    # once on copies of its inputs before the first step (compiler.measured_fit)
    budget_measured: int | None = None
    evicted: list[SavedTensorRecord] = dataclasses.field(default_factory=list)
    # eager explain: bytes autograd keeps outside every region (parameters excluded)
    outside_bytes: int | None = None
    # live activation bytes over forward and backward (None: not measured)
    peak: MemoryPeak | None = None
    # labels of the ops whose FLOPs the cost model estimated from shapes, as the report's
    # builder found them on the ops themselves (see cost_estimated)
    estimated_labels: set[str] = dataclasses.field(default_factory=set)
    # compile, Inductor: matrix products kept apart from the adds that read them
    # (compiler.products_apart), where Inductor's addmm would hold more memory
    products_apart: int = 0

    @property
    def coverage(self) -> str:
        """Which part of the program the saved/recomputed figures cover."""
        if self.mode == "eager":
            text = ("region internals: the values the eager runtime keeps inside sac regions; "
                    "what autograd keeps outside regions is not in saved_bytes")
            if self.outside_bytes is not None:
                text += f" (outside: {fmt_bytes(self.outside_bytes)})"
            return text
        return ("the whole compiled graph: every value each forward hands to its backward, "
                "inside and outside regions")

    @property
    def cost_estimated(self) -> list[str]:
        """Ops (labels, sorted) whose FLOPs the cost model estimated from shapes, among the
        recomputed ops and (compile: the partitioner weighed them) the saved ones."""
        labels = set(self.recomputed)
        if self.mode != "eager":
            labels.update(r.op for r in self.saved if not r.is_input)
            labels.update(r.op for r in self.evicted)
        return sorted(labels & self.estimated_labels)

    @property
    def saved_bytes(self) -> int:
        """Device bytes of saved activations and non-parameter inputs (parameters cost
        nothing; offloaded values are in :attr:`offloaded_bytes`)."""
        return sum(r.nbytes for r in self.saved
                   if not r.is_parameter and not r.on_host)

    @property
    def activation_bytes(self) -> int:
        """Device bytes of saved values that are not graph inputs: what a memory budget
        caps."""
        return sum(r.nbytes for r in self.saved if not r.is_input and not r.on_host)

    @property
    def offloaded_bytes(self) -> int:
        """Bytes of saved values kept in host memory (CPU offload) until the backward."""
        return sum(r.nbytes for r in self.saved if r.on_host)

    def _budget_line(self) -> str:
        b = self.memory_budget
        if hasattr(b, "label"):  # a PeakBudget: it caps the peak
            peak = f"modelled step peak {fmt_bytes(self.budget_peak)}, " \
                if self.budget_peak is not None else ""
            if self.budget_measured is not None:
                peak += f"measured {fmt_bytes(self.budget_measured)}, "
            return (f"{b.label()} = {fmt_bytes(self.budget_bytes or 0)}: {peak}"
                    f"{fmt_bytes(self.activation_bytes)} of activations saved")
        given = f"{b * 100:g}%" if isinstance(b, float) else fmt_bytes(b)
        return (f"memory budget {given} = {fmt_bytes(self.budget_bytes or 0)}: "
                f"{fmt_bytes(self.activation_bytes)} of activations saved")

    @property
    def saved_ops(self) -> Counter:
        return Counter(r.op for r in self.saved if not r.is_input)

    @property
    def recomputed_ops(self) -> Counter:
        return Counter(self.recomputed)

    def snapshot(self, *, peak: bool = False) -> str:
        """Deterministic text: saved values in graph order, recomputed ops counted; with
        ``peak``, the peak line last (:meth:`MemoryPeak.line`; compile: a graph walk,
        deterministic; eager: a run-time count)."""
        lines = [f"saved {fmt_bytes(self.saved_bytes)}, recomputed {len(self.recomputed)} ops "
                 f"({self.recompute_flops} FLOPs)"]
        if self.memory_budget is not None:
            lines.append("  " + self._budget_line())
        params = [r for r in self.saved if r.is_parameter]
        if params:
            lines.append(f"  keep {len(params)} parameters ({fmt_bytes(sum(r.nbytes for r in params))}"
                         f", not counted)")
        for r in self.saved:
            if r not in params:
                lines.append(f"  save {r.op} {fmt_bytes(r.nbytes)}: {r.reason}")
        for r in self.evicted:
            lines.append(f"  evict {r.op} {fmt_bytes(r.nbytes)}: {r.reason}")
        for op, n in sorted(self.recomputed_ops.items()):
            lines.append(f"  recompute {op} x{n}")
        estimated = self.cost_estimated
        if estimated:
            lines.append(f"  cost estimated (no FLOP formula): {', '.join(estimated)}")
        if peak and self.peak is not None:
            lines.append(f"  {self.peak.line()}")
        return "\n".join(lines)

    def __str__(self) -> str:
        rows = [("name", "op", "bytes", "reason")]
        rows += [(r.name, r.op, fmt_bytes(r.nbytes), r.reason) for r in self.saved]
        widths = [max(len(row[i]) for row in rows) for i in range(3)]
        out = [f"PartitionReport ({self.mode}): saved {fmt_bytes(self.saved_bytes)} in "
               f"{len(self.saved)} values; recomputed {len(self.recomputed)} ops, "
               f"{self.recompute_flops:,} FLOPs"]
        if self.memory_budget is not None:
            out[0] += "; " + self._budget_line()
        for row in rows:
            out.append("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[3])
        for r in self.evicted:
            out.append(f"  evicted {r.name} ({r.op}, {fmt_bytes(r.nbytes)}): {r.reason}")
        if self.recomputed:
            counts = ", ".join(f"{op} x{n}" for op, n in sorted(self.recomputed_ops.items()))
            out.append(f"  recomputed: {counts}")
        estimated = self.cost_estimated
        if estimated:
            out.append(f"  cost estimated (no FLOP formula; from shapes): {', '.join(estimated)}")
        if self.peak is not None:
            out.append(f"  {self.peak.line()}")
        out.append(f"  covers {self.coverage}")
        if self.timings:
            out.append("  time: " + ", ".join(f"{k} {v * 1e3:.1f} ms"
                                              for k, v in self.timings.items()))
        out.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(out)
