"""``python -m sac_compile report``: one model, seven checkpointing strategies, one row
each (the strategies and how each figure is measured: :mod:`sac_compile._bench.runner`)."""
from __future__ import annotations

import os
import time
from typing import Any

from .args import UsageError

__all__ = ["run_report_command"]


def run_report_command(args: Any) -> int:
    """``python -m sac_compile report``: measure, print the table, write report.json/.png."""
    from .args import check_device, load_target, parse_budget, resolve_policy
    budget = parse_budget(args.budget)
    device = check_device(args.device)
    if args.steps is not None and args.steps < 1:
        raise UsageError(f"--steps {args.steps}: give at least 1 timed round, e.g. --steps 5")
    steps, time_budget = (args.steps, None) if args.steps is not None else (15, 30.0)
    policy_label, policy = resolve_policy(args.policy)
    target = load_target(args.model, size=args.size, seed=args.seed, device=device)
    _check_something_requires_grad(args.model, target)
    out_dir = args.out
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--out {out_dir!r}: cannot create the directory ({e.strerror}); "
                         f"give a writable directory") from None

    from .._bench.runner import STRATEGIES, ReportConfig, run_report
    from .._bench.strategies import UnusableModel
    from .progress import Progress
    from .table import format_table, meta, write_json
    from ..report import fmt_bytes
    cfg = ReportConfig(target, policy_label, policy, budget, device, steps, args.seed,
                       compile=not args.no_compile, time_budget_s=time_budget)
    n_live = sum(1 for _, _, kind in STRATEGIES if kind == "eager" or cfg.compile)
    progress = Progress(len(STRATEGIES) + n_live * (steps + 1))
    m0 = meta(cfg, 0.0)
    progress.say(f"model {target.label}" + (f" ({target.size})" if target.size else "")
                 + f": {m0['blocks']} blocks, {m0['parameters'] / 1e6:.3f} M parameters, "
                 f"inputs {m0['inputs']}; policy {policy_label}; device {device}; "
                 f"torch {m0['torch']}")
    t0 = time.perf_counter()
    try:
        rows = run_report(cfg, progress)
    except UnusableModel as e:
        raise UsageError(str(e)) from None
    elapsed = time.perf_counter() - t0
    progress.finish()

    json_path = os.path.join(out_dir, "report.json")
    write_json(json_path, cfg, rows, elapsed)
    png_path = os.path.join(out_dir, "report.png")
    wrote_png = False
    if not args.no_plot:
        from .plot import write_plot
        wrote_png = write_plot(png_path, rows, meta(cfg, elapsed))
    m = meta(cfg, elapsed)
    print(f"sac_compile report: model {target.label}"
          + (f" ({target.size})" if target.size else "")
          + f", policy {policy_label}, device {device}, "
          f"{_rounds(rows)} timed rounds; "
          f"{m['machine']}; torch {m['torch']}; {m['date'][:16]}")
    print()
    print(format_table(rows, device))
    print()
    budgeted = next((r for r in rows if r.key == "ours_eager_budget" and r.status == "ok"), None)
    if budgeted is not None and budgeted.note:  # each region's share of the budget
        print("memory budget, eager (one line per region: its plan, and its share of a "
              "whole-model budget):")
        for line in budgeted.note.splitlines():
            print("  " + line)
        print()
    peak = ("peak: measured, every row alike: the most bytes torch's allocator held at once "
            "during one step, above its start (" +
            ("torch.cuda.max_memory_allocated" if device.startswith("cuda") else
             "CPU: torch.profiler's allocation events, Inductor's buffers included") +
            "); the step's gradients included")
    grads = next((r.grad_bytes for r in rows if r.status == "ok" and r.grad_bytes), None)
    if grads:
        peak += f" ({fmt_bytes(grads, 2)} of gradients at the step's end)"
    peak += (". working peak (CPU): the same events, only what the step also frees "
             "(activations, recomputed values, temporaries; not the gradients it leaves)")
    peak += (". modelled peak: the partitioner's model of its graphs' activations (the "
             "largest split's), an explanation beside the measurement")
    print("kept: activation bytes kept for backward (eager: counted at run time; compiled: the "
          "partition); parameters excluded.")
    print(peak + ".")
    print("time: median of per-round ratios to no AC, interleaved in this run; compiled rows "
          "exclude compile time. Compiled rows use inductor fallback_random (eager dropout "
          "masks).")
    print(f"wrote {json_path}" + (f" and {png_path}" if wrote_png else
                                  " (report.png skipped: " + ("--no-plot" if args.no_plot else
                                  "matplotlib is not installed; pip install 'sac_compile"
                                  "[report]'") + ")")
          + f" [{elapsed:.1f} s]")
    if target.is_fixture and target.size == "test":
        print("note: the test-size fixtures are tiny, so eager step times are mostly Python "
              "overhead; --size bench gives realistic ratios (and longer compiles).")
    bad = [r for r in rows if r.status == "ok" and r.grad_rel is not None and r.grad_rel > 1e-3]
    if bad:
        print("gradients DIFFER from no AC for: " + ", ".join(r.label for r in bad))
        return 1
    return 0


def _check_something_requires_grad(spec: str, target: Any) -> None:
    import torch
    params = target.fn.parameters() if isinstance(target.fn, torch.nn.Module) else ()
    if any(p.requires_grad for p in params) or any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in target.inputs):
        return
    raise UsageError(f"--model {spec}: no parameter or input requires grad (a model frozen with "
                     f"requires_grad_(False), or built under torch.no_grad()?); the report runs "
                     f"forward and backward, so give it trainable parameters or inputs with "
                     f"requires_grad=True")


def _rounds(rows: list) -> int:
    return max((r.rounds or 0 for r in rows), default=0)
