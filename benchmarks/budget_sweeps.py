"""Memory budgets in eager mode and for the whole model (issue 19), on the GPT fixture.

Two tables, one run (``python benchmarks/pareto.py --eager`` runs it too):

1. **eager vs compiled**: every block a region with ``relaxed(save_matmuls)`` and the same
   budget ``b`` (``apply_regions(..., memory_budget=b)``); eager (the runtime's plan,
   measured on the second step) and each block compiled on its own (aot_eager, our
   partitioner). Per point: activation bytes the regions keep, recompute FLOPs
   (``torch.utils.flop_counter`` rules; eager: the backward's FLOPs above no
   checkpointing's), gradient difference against no checkpointing.
2. **whole model vs per region at equal total bytes**: for each ``b``, the bytes the
   per-region budgets keep together, ``T``; then one budget of ``T`` bytes for all regions
   (``memory_budget=T``, one price per byte). Recompute FLOPs side by side: the whole-model
   budget never recomputes more. The same ``T`` with each block compiled on its own
   (identical blocks: each cut at ``T`` over their number, ``budgets/kinds.py``).

Dropout is off (0): on the CPU a recomputed dropout keeps its generator's 5 KiB state,
which would dominate the test size. A PNG of table 1 (bytes against FLOPs, eager and
compiled on one plot) goes to ``benchmarks/out/budgets.png`` with matplotlib.

    python benchmarks/budget_sweeps.py [--size test|bench] [--budgets 1.0,0.7,0.5,0.3]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fixtures.budget_model import POLICY, budget_model, budget_step, compile_blocks  # noqa: E402
from fixtures.models import max_grad_diff  # noqa: E402
from sac_compile import apply_regions  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"


def _model(size: str):
    return budget_model("gpt", size)


def _step(model, inputs):
    """One step: (regions' kept bytes, backward FLOPs, gradients, budget notes)."""
    fc = FlopCounterMode(display=False)
    stats, grads = budget_step(model, inputs, backward=fc)
    return stats.saved_bytes, fc.get_total_flops(), grads, stats.budget_notes


def no_ac(size: str):
    model, inputs = _model(size)
    _, flops, grads, _ = _step(model, inputs)
    return flops, grads


def eager_point(size: str, budget, base_flops: int, ref: dict, steps: int = 2):
    model, inputs = _model(size)
    apply_regions(model, POLICY, where=type(model.blocks[0]), memory_budget=budget)
    for _ in range(steps):
        kept, flops, grads, notes = _step(model, inputs)
    return model, inputs, kept, flops - base_flops, max_grad_diff(ref, grads), notes


def compiled_point(model, inputs, ref: dict):
    caps = compile_blocks(model)
    _, _, grads, _ = _step(model, inputs)
    kept = sum(s.nbytes for c in caps for s in c.report.saved if not s.is_input and s.region)
    flops = sum(c.report.recompute_flops for c in caps)
    return kept, flops, max_grad_diff(ref, grads)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="test", help="GPT fixture size (test, bench)")
    parser.add_argument("--budgets", default="1.0,0.7,0.5,0.3")
    parser.add_argument("--png", default=str(OUT / "budgets.png"))
    args = parser.parse_args(argv)
    budgets = [float(b) for b in args.budgets.split(",")]
    base_flops, ref = no_ac(args.size)
    print(f"GPT fixture ({args.size}), relaxed(save_matmuls), dropout 0; torch "
          f"{torch.__version__}\n")
    print("1. eager vs compiled (each block its own budget; bytes the regions keep, "
          "recompute FLOPs, max |grad diff| vs no checkpointing)")
    print(f"{'budget':>7}  {'eager kept':>12} {'eager FLOPs':>12} {'grad':>8}  "
          f"{'compiled kept':>13} {'compiled FLOPs':>14} {'grad':>8}")
    points, totals = [], {}
    for b in budgets:
        model, inputs, kept, flops, diff, _ = eager_point(args.size, b, base_flops, ref)
        ckept, cflops, cdiff = compiled_point(model, inputs, ref)
        totals[b] = (kept, flops)
        points.append((b, kept, flops, ckept, cflops))
        print(f"{b:>7g}  {kept:>12,} {flops:>12,} {diff:>8.1e}  {ckept:>13,} {cflops:>14,} "
              f"{cdiff:>8.1e}")
    print("\n2. whole model vs per region at equal total bytes (eager; recompute FLOPs), and "
          "the whole-model budget with each block compiled on its own")
    print(f"{'per-region b':>12}  {'total kept':>10} {'per-region FLOPs':>16}  "
          f"{'whole-model kept':>16} {'whole-model FLOPs':>17} {'ratio':>6}  "
          f"{'per-block compiled kept':>23} {'FLOPs':>9}")
    for b, (kept, flops) in totals.items():
        if kept < 2:
            continue
        model, inputs, wkept, wflops, diff, notes = eager_point(
            args.size, int(kept), base_flops, ref, steps=3)
        ckept, cflops, cdiff = compiled_point(model, inputs, ref)
        ratio = f"{wflops / flops:.2f}" if flops else "-"
        print(f"{b:>12g}  {kept:>10,} {flops:>16,}  {wkept:>16,} {wflops:>17,} {ratio:>6}  "
              f"{ckept:>23,} {cflops:>9,}   (grad diff {diff:.1e} eager, {cdiff:.1e} "
              f"compiled)")
    _plot(points, Path(args.png), args.size)
    return 0


def _plot(points, path: Path, size: str) -> None:
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 5), dpi=110)
    ax.plot([p[2] / 1e6 for p in points], [p[1] / 1024 for p in points], "o-",
            label="ours eager (memory_budget on each block)")
    ax.plot([p[4] / 1e6 for p in points], [p[3] / 1024 for p in points], "s--",
            label="ours compiled per block (aot_eager)")
    for b, kept, flops, _, _ in points:
        ax.annotate(f"{b:g}", (flops / 1e6, kept / 1024), fontsize=8)
    ax.set_xlabel("recompute MFLOPs")
    ax.set_ylabel("activation KiB kept by the regions")
    ax.set_title(f"GPT fixture ({size}): eager and compiled memory budgets")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    sys.exit(main())
