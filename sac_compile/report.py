"""What a partition (compile) or a region run (eager) keeps for backward, and why.

``PartitionReport`` has the same shape in both modes, so tests can diff them:

* ``saved``: one :class:`SavedTensorRecord` per saved value (``name``, ``op``, ``nbytes``,
  ``reason``);
* ``recomputed``: op names recomputed in backward, with repeats;
* ``saved_bytes`` (parameters excluded), ``activation_bytes`` (inputs excluded too) and
  ``recompute_flops``;
* with a memory budget (compile): ``memory_budget`` as given, ``budget_bytes`` (the cap on
  ``activation_bytes``) and ``evicted``: values saved without the budget and recomputed
  with it, with the reason;
* ``snapshot()``: deterministic text for expecttest; ``str(report)``: a readable table.

``explain(fn, *args, mode="eager" | "compile")`` runs ``fn`` once, forward and backward,
and returns the report.
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["PartitionReport", "SavedTensorRecord", "explain", "fmt_bytes"]


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" or n == int(n) else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


@dataclasses.dataclass(frozen=True)
class SavedTensorRecord:
    name: str
    op: str
    nbytes: int
    reason: str
    is_input: bool = False
    region: str = ""  # the innermost region that decided it; "" outside every region


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
    memory_budget: float | int | None = None
    budget_bytes: int | None = None
    evicted: list[SavedTensorRecord] = dataclasses.field(default_factory=list)

    @property
    def saved_bytes(self) -> int:
        """Bytes of saved activations and non-parameter inputs (parameters cost nothing)."""
        return sum(r.nbytes for r in self.saved if not r.reason.startswith("parameter"))

    @property
    def activation_bytes(self) -> int:
        """Bytes of saved values that are not graph inputs: what a memory budget caps."""
        return sum(r.nbytes for r in self.saved if not r.is_input)

    def _budget_line(self) -> str:
        b = self.memory_budget
        given = f"{b * 100:g}%" if isinstance(b, float) else fmt_bytes(b)
        return (f"memory budget {given} = {fmt_bytes(self.budget_bytes or 0)}: "
                f"{fmt_bytes(self.activation_bytes)} of activations saved")

    @property
    def saved_ops(self) -> Counter:
        return Counter(r.op for r in self.saved if not r.is_input)

    @property
    def recomputed_ops(self) -> Counter:
        return Counter(self.recomputed)

    def snapshot(self) -> str:
        """Deterministic text: saved values in graph order, recomputed ops counted."""
        lines = [f"saved {fmt_bytes(self.saved_bytes)}, recomputed {len(self.recomputed)} ops "
                 f"({self.recompute_flops} FLOPs)"]
        if self.memory_budget is not None:
            lines.append("  " + self._budget_line())
        params = [r for r in self.saved if r.reason.startswith("parameter")]
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
        if self.timings:
            out.append("  time: " + ", ".join(f"{k} {v * 1e3:.1f} ms"
                                              for k, v in self.timings.items()))
        out.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(out)


def _backward_of(out: Any) -> None:
    leaves = [t for t in torch.utils._pytree.tree_leaves(out)
              if isinstance(t, torch.Tensor) and t.requires_grad]
    if leaves:
        torch.autograd.backward(leaves, [torch.ones_like(t) for t in leaves])


def explain(fn: Callable[..., Any], *args: Any, mode: str = "eager",
            compiler: str = "aot_eager", **kwargs: Any) -> PartitionReport:
    """Run ``fn(*args, **kwargs)`` and its backward once; report what was saved/recomputed.

    ``mode="eager"`` reports the eager runtime's decisions; ``mode="compile"`` compiles
    ``fn`` with :func:`sac_compile.make_backend` (``compiler``, default ``"aot_eager"``)
    and reports the partition of each forward/backward split, merged.
    """
    if mode == "eager":
        from .eager import collect_stats
        with collect_stats() as stats:
            out = fn(*args, **kwargs)
            _backward_of(out)
        report = PartitionReport(mode="eager")
        report.saved = [SavedTensorRecord(r.name, r.op, r.nbytes, r.reason, region=r.region)
                        for r in stats.saved]
        report.recomputed = list(stats.recomputed_ops)
        report.recomputed_regions = ["?"] * len(report.recomputed)
        return report
    if mode != "compile":
        raise ValueError(f"explain(mode=...) takes 'eager' or 'compile', got {mode!r}")
    from .compiler.backend import make_backend

    reports: list[PartitionReport] = []
    backend = make_backend(compiler=compiler, on_partition=reports.append)
    out = torch.compile(fn, backend=backend)(*args, **kwargs)
    _backward_of(out)
    if not reports:
        raise RuntimeError("explain(mode='compile'): nothing was partitioned; does fn's output "
                           "require grad?")
    merged = PartitionReport(mode="compile")
    for r in reports:
        merged.saved += r.saved
        merged.recomputed += r.recomputed
        merged.recomputed_regions += r.recomputed_regions
        merged.recompute_flops += r.recompute_flops
        merged.notes += r.notes
        for k, v in r.timings.items():
            merged.timings[k] = merged.timings.get(k, 0.0) + v
        merged.solver = r.solver
    return merged
