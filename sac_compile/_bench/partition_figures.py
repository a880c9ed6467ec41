"""Compiled strategies: what each forward/backward split saves and recomputes, for
upstream's partitioner (recorded around ``min_cut_rematerialization_partition``) and ours
(its ``PartitionReport``, through ``on_partition``)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from ..report import fmt_bytes

__all__ = ["PartitionFigures", "upstream_backend", "upstream_aot_eager", "OnPartition"]


class Progress(Protocol):
    def say(self, text: str) -> None: ...


class PartitionFigures:
    """Saved bytes / recomputed ops / recompute FLOPs of each forward-backward split."""

    def __init__(self) -> None:
        self.splits: list[dict[str, Any]] = []

    @property
    def kept_bytes(self) -> int:
        return sum(s["saved_bytes"] for s in self.splits)

    @property
    def recompute_flops(self) -> int:
        return sum(s["recompute_flops"] for s in self.splits)

    @property
    def recomputed_ops(self) -> int:
        return sum(s["recomputed_ops"] for s in self.splits)

    @property
    def peak_bytes(self) -> int | None:
        """The largest split's peak of live activation bytes (the peak model of
        :mod:`sac_compile.compiler.peak`; splits run one after another)."""
        peaks = [s["peak_bytes"] for s in self.splits if s.get("peak_bytes") is not None]
        return max(peaks) if peaks else None

    def add_report(self, report: Any) -> None:
        self.splits.append({"saved_bytes": report.saved_bytes,
                            "recompute_flops": report.recompute_flops,
                            "recomputed_ops": len(report.recomputed),
                            "peak_bytes": report.peak.bytes if report.peak else None})


def _upstream_recorder(figures: PartitionFigures) -> Any:
    """A ``CustomPartitionerFn`` that calls torch's ``min_cut_rematerialization_partition``
    with exactly the arguments Inductor would pass it, and records what the split saves."""
    from ..torch_internals import CustomPartitionerFn

    global _UpstreamRecorder
    if _UpstreamRecorder is None:
        class UpstreamRecorder(CustomPartitionerFn):
            def __init__(self, figures: PartitionFigures) -> None:
                self.figures = figures

            def uuid(self) -> str:
                return "sac_compile._bench.partition_figures:upstream-recorder:1"

            def __reduce__(self) -> Any:  # Inductor's cache pickles its config: by name
                return (_upstream_recorder, (PartitionFigures(),))

            def __call__(self, gm: torch.fx.GraphModule, joint_inputs: Any, **kwargs: Any):
                return _record_upstream(self.figures, gm, joint_inputs, **kwargs)

        UpstreamRecorder.__qualname__ = UpstreamRecorder.__name__ = "_UpstreamRecorder"
        _UpstreamRecorder = UpstreamRecorder
    return _UpstreamRecorder(figures)


_UpstreamRecorder: Any = None


def _record_upstream(figures: PartitionFigures, gm: torch.fx.GraphModule, joint_inputs: Any,
                     **kwargs: Any) -> Any:
    from ..torch_internals import min_cut_rematerialization_partition

    from ..cut import costs
    from ..compiler.final_graphs import recomputed_names
    from ..compiler.peak import estimate_peak
    static_idx = set(kwargs.get("static_lifetime_input_indices") or ())
    primals = [n.name for n in gm.graph.find_nodes(op="placeholder")
               if str(n.target).startswith("primals")]
    static = {primals[i] for i in static_idx if i < len(primals)}
    joint = {n.name: n for n in gm.graph.nodes}
    fw, bw = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
    recomputed = [joint[name] for name in recomputed_names(fw, bw) if name in joint]
    saved = [joint[n.name] for n in bw.graph.find_nodes(op="placeholder")
             if n.name in joint and "tangents" not in n.name and n.name not in static
             and not costs.is_sym(joint[n.name])]
    figures.splits.append({
        "saved_bytes": sum(costs.nbytes(n) for n in saved),
        "recompute_flops": sum(costs.flops(n) for n in recomputed),
        "recomputed_ops": len(recomputed),
        "peak_bytes": estimate_peak(fw, bw, gm).bytes})  # the same model as ours
    return fw, bw


class OnPartition:
    """``on_partition`` callback: records the split and says what it did (the partitioner
    itself logs the report to the ``sac_partition`` artifact). Pickles as a no-op (Inductor's cache pickles the
    partitioner, callback included, to build its key)."""

    def __init__(self, figures: PartitionFigures, progress: Progress | None) -> None:
        self.figures = figures
        self.progress = progress

    def __reduce__(self) -> Any:
        return (OnPartition, (PartitionFigures(), None))

    def __call__(self, report: Any) -> None:
        self.figures.add_report(report)
        if self.progress is not None:
            self.progress.say(f"  partitioned: saves {fmt_bytes(report.saved_bytes, 2)} in "
                              f"{len(report.saved)} values, recomputes {len(report.recomputed)}"
                              f" ops in backward")


def upstream_backend(figures: PartitionFigures) -> Callable[..., Any]:
    recorder = _upstream_recorder(figures)

    def inductor_with_torch_partitioner(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        from ..torch_internals import compile_fx
        return compile_fx(gm, example_inputs, config_patches={"custom_partitioner_fn": recorder})
    return inductor_with_torch_partitioner


def upstream_aot_eager(figures: PartitionFigures,
                       after: Callable[[Any, Any], None] | None = None) -> Callable[..., Any]:
    """``aot_eager`` with torch's partitioner, recording each split as the report does;
    ``after(fw, bw)`` is called with each split's graphs."""
    from ..torch_internals import AotAutograd, boxed_nop

    def partition(gm: torch.fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
        fw, bw = _record_upstream(figures, gm, joint_inputs, **kwargs)
        if after is not None:
            after(fw, bw)
        return fw, bw
    return AotAutograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=partition)
