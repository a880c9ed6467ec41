"""Issue 19 on an accelerator: eager memory budgets (kept bytes, allocator peak, gradients)
and the same blocks compiled one by one (kept bytes), on the GPT fixture at its bench size.
Prints one line per budget. Usage: PYTHONPATH=. python benchmarks/gpu_budget_check.py"""
from __future__ import annotations

import sys

import torch

from fixtures.budget_model import POLICY, budget_model, compile_blocks
from fixtures.models import grads_of, loss_fn, max_grad_diff, reference_grads
from sac_compile import apply_regions
from sac_compile.runtime import collect_stats

CUDA = torch.cuda.is_available()


def _sync():
    if CUDA:
        torch.cuda.synchronize()


def _allocated():
    return torch.cuda.memory_allocated() if CUDA else 0


def step(model, inputs):
    for p in model.parameters():
        p.grad = None
    inputs[0].grad = None
    _sync()
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    base = _allocated()
    with collect_stats() as stats:
        torch.manual_seed(0)
        out = model(*inputs)
    _sync()
    after_fwd = _allocated() - base
    loss_fn(out).backward()
    _sync()
    peak = (torch.cuda.max_memory_allocated() - base) if CUDA else 0
    return stats, after_fwd, peak, grads_of(model, inputs)


def main(size: str) -> None:
    dev = "cuda" if CUDA else "cpu"
    print(torch.__version__, torch.cuda.get_device_name() if CUDA else "cpu", size)
    for budget in (None, 1.0, 0.5, 0.3):
        model, inputs = budget_model("gpt", size, device=dev)
        ref = reference_grads(model, inputs, 0)
        apply_regions(model, POLICY, where=type(model.blocks[0]), memory_budget=budget)
        step(model, inputs)
        stats, held, peak, grads = step(model, inputs)
        eager = sum(r.nbytes for r in stats.saved)
        caps = compile_blocks(model)
        _, _, cpeak, cgrads = step(model, inputs)
        comp = sum(s.nbytes for c in caps for s in c.report.saved if not s.is_input)
        print(f"budget={budget}: eager kept {eager:,} B (held after forward {held:,} B, peak "
              f"{peak:,} B, grad diff {max_grad_diff(ref, grads):.2e}); compiled per block "
              f"kept {comp:,} B (peak {cpeak:,} B, grad diff {max_grad_diff(ref, cgrads):.2e})")
        for n in stats.budget_notes[:1]:
            print("   ", n)
        sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench")
