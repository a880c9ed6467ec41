"""The measured Pareto of the step (issue 27): measured step peak against recompute FLOPs,
ours under ``PeakBudget`` against torch's ``activation_memory_budget`` sweep, torch's SAC,
full AC and no checkpointing, each point one measured step of the model compiled whole
(``sac_compile._bench.step_budget``: the step after the compiling one, measured by
``sac_compile.measured_peak``: the CPU allocator's events, gradients included).

Per model (HF GPT-2 / Llama at ``--size``, every decoder layer wrapped; dropout 0, since
torch's partitioner recomputes a dropout with a fresh mask under ``aot_eager``):

* torch: no AC, full AC (``torch.utils.checkpoint``), and SAC regions (matmuls
  ``PREFER_SAVE``) under ``activation_memory_budget`` 1.0 / 0.7 / 0.5 / 0.3;
* ours (``relaxed(save_matmuls)`` regions): no budget, then ``PeakBudget(P)`` at each torch
  point's measured peak P (full AC's among them): measured <= P, and fewer FLOPs?

Columns: measured step peak (MiB), modelled (ours: ``report.budget_peak`` of the final
graphs), recompute FLOPs, kept bytes (MiB), gradient error against no checkpointing. Ratios
printed per torch point: ours / torch, peak and FLOPs. ``--plot`` writes
``benchmarks/out/step_pareto.png`` when matplotlib is installed.

``--compiler eager``: our eager regions instead (``apply_regions(...,
memory_budget=PeakBudget(n))``, held by measuring its first steps,
``sac_compile.budgets.step_peak``): no budget, ``recompute_all`` (full AC, ours), then
PeakBudget at full AC's measured peak and at 1/2 and 9/10 of the way to no budget's, each
twice: caps placed in time (the default: per depth of the calls holding their values,
``sac_compile.budgets.nested``) and one cap over the step (``step_peak.PLACED = False``,
the former rule), with the FLOPs the backward recomputed (the replayed ops' FLOPs, counted
as the compiler counts them) and the ops it replayed.

``--apply-regions`` (compiled): beside each of ours, ``apply_regions(...,
memory_budget=PeakBudget(P))`` with the model compiled whole: its cap set by measured
steps (each cap tried compiles once more), the steps it took.

``--compile-blocks`` (compiled): ``apply_regions(..., memory_budget=PeakBudget(n))`` with
each block compiled on its own (torchtitan's order): no budget, ``recompute_all`` (full
AC), then n at full AC's measured peak and at 1/2 and 9/10 of the way to no budget's,
each beside the model compiled whole at the same n.

    python benchmarks/step_budget.py [--models gpt2,llama] [--compiler aot_eager|inductor|eager]
        [--size bench] [--json out.json] [--plot] [--apply-regions] [--compile-blocks]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sac_compile import PeakBudget  # noqa: E402
from sac_compile import policies  # noqa: E402
from sac_compile._bench.step_budget import (StepPoint, reference_step, run_eager_step,  # noqa: E402
                                            run_step)

OUT = Path(__file__).resolve().parent / "out"
TORCH_BUDGETS = (1.0, 0.7, 0.5, 0.3)


def _mib(n: int | None) -> str:
    return f"{'-':>8s}" if n is None else f"{n / 2**20:8.2f}"


def _gf(n: int | None) -> str:
    return f"{'-':>6s}" if n is None else f"{n / 1e9:6.2f}"


def row(model: str, label: str, p: StepPoint) -> str:
    err = "-" if p.grad_rel is None else f"{p.grad_rel:.0e}"
    status = "" if p.status == "ok" else f"  {p.status}: {p.note[:70]}"
    return (f"{model:6s} {label:34s} {_mib(p.measured)} {_mib(p.modelled)} {_gf(p.flops)} "
            f"{_mib(p.kept)} {err:>6s}{status}")


def sweep(model: str, size: str, compiler: str, apply_rows: bool = False
          ) -> list[tuple[str, StepPoint, StepPoint | None]]:
    """(label, torch point, ours at its measured peak) per torch point, and ours alone;
    ``apply_rows``: also ``apply_regions(..., memory_budget=PeakBudget(P))`` with the model
    compiled whole (its cap set by measured steps, each cap compiled once more)."""
    ref = reference_step(model, size, dropout=False)

    def run(strategy: str, **kw) -> StepPoint:
        return run_step(model, size, strategy, compiler=compiler, reference=ref,
                        dropout=False, **kw)

    out = []
    free = run("ours")
    out.append(("ours, no budget", free, None))
    print(row(model, "ours, no budget", free), flush=True)
    torch_points = [("torch no AC", run("torch none")), ("torch full AC", run("torch full AC"))]
    torch_points += [(f"torch SAC, budget {b:g}", run("torch SAC", torch_budget=b))
                     for b in TORCH_BUDGETS]
    for label, theirs in torch_points:
        print(row(model, label, theirs), flush=True)
        mine = None
        if theirs.measured is not None:
            mine = run("ours", budget=PeakBudget(theirs.measured))
            print(row(model, f"  ours, PeakBudget({theirs.measured})", mine), flush=True)
            if mine.measured is not None and theirs.flops:
                print(f"{'':6s}   ours / torch: peak {mine.measured / theirs.measured:.3f}, "
                      f"FLOPs {(mine.flops or 0) / theirs.flops:.3f}", flush=True)
            if apply_rows:
                applied = run_eager_step(
                    model, size, policies.relaxed(policies.save_matmuls), reference=ref,
                    budget=PeakBudget(theirs.measured), dropout=False, compiler=compiler)
                print(row(model, f"  apply_regions, PeakBudget({theirs.measured})", applied)
                      + f"  after {applied.steps} steps, {applied.note}", flush=True)
        out.append((label, theirs, mine))
    return out


def eager_sweep(model: str, size: str) -> list[tuple[str, StepPoint, StepPoint | None]]:
    """Ours in eager mode: no budget, full AC (``recompute_all``), and PeakBudget at three
    measured peaks between them, placed in time and under one cap."""
    from sac_compile.budgets import step_peak
    ref = reference_step(model, size)
    relaxed = policies.relaxed(policies.save_matmuls)

    def show(label: str, p: StepPoint) -> StepPoint:
        print(row(model, label, p) + f"  {p.replayed} ops replayed" +
              (f", after {p.steps} steps" if p.steps else ""), flush=True)
        return p

    free = show("ours eager, no budget", run_eager_step(model, size, relaxed, reference=ref))
    full = show("ours eager recompute_all (full AC)",
                run_eager_step(model, size, policies.recompute_all, reference=ref))
    out = [("ours eager, no budget", free, None), ("full AC", full, None)]
    if free.measured is None or full.measured is None:
        return out
    for f in (0.0, 0.5, 0.9):
        n = full.measured + int(f * (free.measured - full.measured))
        for placed in (True, False):
            step_peak.PLACED = placed
            how = "placed in time" if placed else "one cap"
            try:
                mine = show(f"  ours eager, PeakBudget({n}), {how}", run_eager_step(
                    model, size, relaxed, budget=PeakBudget(n), reference=ref))
            finally:
                step_peak.PLACED = True
            if mine.measured is not None:
                print(f"{'':6s}   measured / budget {mine.measured / n:.3f}; FLOPs / full AC's "
                      f"{(mine.flops or 0) / max(full.flops or 1, 1):.3f}", flush=True)
            out.append((f"PeakBudget({n}), {how}", full, mine))
    return out


def blocks_sweep(model: str, size: str, compiler: str
                 ) -> list[tuple[str, StepPoint, StepPoint | None]]:
    """``apply_regions(..., memory_budget=PeakBudget(n))`` with each block compiled on its
    own (torchtitan's order): no budget, ``recompute_all`` (full AC, ours), then n at full
    AC's measured peak and 1/2 and 9/10 of the way to no budget's; beside each, the model
    compiled whole at the same n (one graph, split under the step's peak budget)."""
    ref = reference_step(model, size, dropout=False)
    relaxed = policies.relaxed(policies.save_matmuls)

    def run(policy, budget=None, blocks=True) -> StepPoint:
        return run_eager_step(model, size, policy, budget=budget, reference=ref,
                              dropout=False, compiler=compiler, compile_blocks=blocks)

    def show(label: str, p: StepPoint) -> StepPoint:
        print(row(model, label, p) + f"  after {p.steps} steps, {p.note}", flush=True)
        return p

    free = show("blocks, no budget", run(relaxed))
    full = show("blocks, recompute_all (full AC)", run(policies.recompute_all))
    out = [("blocks, no budget", free, None), ("blocks, full AC", full, None)]
    if free.measured is None or full.measured is None:
        return out
    for f in (0.0, 0.5, 0.9):
        n = full.measured + int(f * (free.measured - full.measured))
        for blocks in (True, False):
            how = "blocks" if blocks else "whole"
            mine = show(f"  {how}, PeakBudget({n})", run(relaxed, PeakBudget(n), blocks))
            if mine.measured is not None:
                print(f"{'':6s}   measured / budget {mine.measured / n:.3f}; FLOPs / full AC's "
                      f"{(mine.flops or 0) / max(full.flops or 1, 1):.3f}", flush=True)
            out.append((f"PeakBudget({n}), {how}", full, mine))
    return out


def plot(rows: dict[str, list], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no matplotlib: no plot)")
        return
    fig, axes = plt.subplots(1, len(rows), figsize=(6 * len(rows), 4.5), squeeze=False)
    for ax, (model, points) in zip(axes[0], rows.items()):
        theirs = [(p.measured, p.flops, lbl) for lbl, p, _ in points if p.measured]
        ours = [(m.measured, m.flops) for _, _, m in points if m is not None and m.measured]
        ax.scatter([t[0] / 2**20 for t in theirs], [(t[1] or 0) / 1e9 for t in theirs],
                   marker="x", label="torch")
        for x, y, lbl in theirs:
            ax.annotate(lbl.replace("torch ", ""), (x / 2**20, (y or 0) / 1e9), fontsize=7)
        ax.scatter([o[0] / 2**20 for o in ours], [(o[1] or 0) / 1e9 for o in ours],
                   marker="o", label="ours (PeakBudget at torch's peak)")
        ax.set_xlabel("measured step peak (MiB)")
        ax.set_ylabel("recompute GFLOPs")
        ax.set_title(model)
        ax.legend(fontsize=8)
    path.parent.mkdir(exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gpt2,llama")
    ap.add_argument("--compiler", default="aot_eager")
    ap.add_argument("--size", default="bench")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", action="store_true")
    ap.add_argument("--apply-regions", action="store_true",
                    help="also apply_regions' PeakBudget, the model compiled whole")
    ap.add_argument("--compile-blocks", action="store_true",
                    help="apply_regions' PeakBudget with each block compiled on its own, "
                         "beside the model compiled whole")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("step_budget: skipped, transformers is not installed")
        return
    print(f"size {args.size}, {args.compiler}, CPU allocator via torch.profiler; MiB, GFLOPs")
    print(f"{'model':6s} {'strategy':34s} {'measured':>8s} {'modelled':>8s} {'GFLOPs':>6s} "
          f"{'kept':>8s} {'grad':>6s}")
    rows = {m: eager_sweep(m, args.size) if args.compiler == "eager" else
            blocks_sweep(m, args.size, args.compiler) if args.compile_blocks else
            sweep(m, args.size, args.compiler, args.apply_regions)
            for m in args.models.split(",")}
    if args.json:
        Path(args.json).write_text(json.dumps(
            {m: [(lbl, dataclasses.asdict(t), m2 and dataclasses.asdict(m2))
                 for lbl, t, m2 in pts] for m, pts in rows.items()}, default=str, indent=2))
    if args.plot:
        plot(rows, OUT / "step_pareto.png")


if __name__ == "__main__":
    main()
