"""Peak memory, not bytes at forward end (issue 17): the backward peak and the kept bytes of
ours against torch's partitioner and eager checkpointing, ratios in one run.

Cases: issue 17's stack (``fixtures/stack.py``: 6 blocks ``x + fc2(gelu(fc1(LN(x))))``,
d=64, hidden 256, input 4x64x64, whole model compiled), traversed once and twice, with
``recompute_all`` (torch: ``torch.utils.checkpoint``), ``save_matmuls`` (torch: SAC with
the same op list) and ours with ``memory_budget=0.5`` (``save_matmuls``, MUSTs relaxed);
and the GPT fixture (``make_model("gpt")``). Figures:

* aot_eager, at run time (``fixtures.measure.step_peak``: storages ATen ops create until
  freed; parameters, inputs and the leaves' gradients excluded): kept = bytes alive when
  the backward starts, bw peak = most bytes alive during it;
* the peak model of each partition (``PartitionReport.peak``; torch's split walked the same
  way), largest split;
* Inductor: its own peak estimate of the backward graph (``torch._inductor.memory``'s log:
  the best of its reorderings), when ``--inductor``.

    python benchmarks/peak.py [--quick] [--inductor [--no-distant-fusion]]
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import sys
from pathlib import Path

import torch
import torch.utils.checkpoint as tuc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fixtures.inductor_memory import inductor_estimates, no_distant_fusion  # noqa: E402
from fixtures.measure import TORCH_SAVE_MATMUL_OPS, step_peak  # noqa: E402
from fixtures.models import loss_fn, make_model  # noqa: E402
from fixtures.stack import Stack, stack_inputs  # noqa: E402
from sac_compile import policies, sac_region  # noqa: E402
from sac_compile.compiler import make_backend  # noqa: E402
from sac_compile._bench.partition_figures import PartitionFigures, _record_upstream  # noqa: E402


def _kib(n: float) -> str:
    return f"{n / 1024:,.1f} KiB"


def _torch_sac(block):
    # torch's own SAC; through torch_sac_contexts so torch's "context_fn under
    # torch.compile" warning stays out of the table (as the report's harness does)
    from sac_compile.compiler.regions_compiled import torch_sac_contexts
    ctx = functools.partial(torch_sac_contexts, TORCH_SAVE_MATMUL_OPS)
    return lambda x: tuc.checkpoint(block, x, use_reentrant=False, context_fn=ctx)


def _upstream_aot_eager(figures: PartitionFigures):
    """torch's aot_eager, recording what torch's partitioner keeps and its peak model."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop

    def partition(gm, inputs, **kwargs):
        return _record_upstream(figures, gm, inputs, **kwargs)

    return aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=partition)


class _Model(torch.nn.Module):
    """A stack (or the GPT fixture) for one strategy: ``ours`` (regions, ``policy``),
    ``torch`` (torch's checkpoint / SAC) or ``none``."""

    def __init__(self, case: str, strategy: str, policy: str) -> None:
        super().__init__()
        if case.startswith("stack"):
            traversals = 2 if case == "stack x2" else 1
            self.inner = Stack(checkpoint="none", traversals=traversals)
            self.inputs = (stack_inputs(traversals),)
        else:
            self.inner, self.inputs = make_model("gpt", size="test", seed=0)
            self.inner.loss = loss_fn
        for i, block in enumerate(self.inner.blocks):
            if strategy == "ours":
                pol = policies.relaxed(policies.save_matmuls) if policy == "budget" else policy
                sac_region(pol, name=f"blocks.{i}")(block)
            elif strategy == "torch":
                block.forward = (_torch_sac(block.forward) if policy != "recompute_all" else
                                 functools.partial(tuc.checkpoint, block.forward,
                                                   use_reentrant=False))

    def forward(self, *args):
        out = self.inner(*args)
        return out if out.dim() == 0 else loss_fn(out)


def _run(case: str, strategy: str, policy: str, backend) -> dict:
    torch.manual_seed(0)
    model = _Model(case, strategy, policy)
    params = list(model.parameters())
    fn = model
    if backend is not None:
        torch._dynamo.reset()
        fn = torch.compile(model, backend=backend)
        step_peak(fn, params, model.inputs)  # compile outside the count
    with torch.random.fork_rng():
        meter, _ = step_peak(fn, params, model.inputs)
    return {"kept": meter.at("backward"), "peak": meter.peak("backward")}


def _inductor_bw(case: str, strategy: str, policy: str, near_fusion: bool = False) -> int | None:
    """Inductor's peak estimate of the backward graph (the last graph it compiles);
    ``near_fusion``: with :func:`no_distant_fusion`."""
    from torch._inductor import config
    torch.manual_seed(0)
    model = _Model(case, strategy, policy)
    budget = 0.5 if policy == "budget" else None
    backend = make_backend(memory_budget=budget) if strategy == "ours" else "inductor"
    torch._dynamo.reset()
    fusion = no_distant_fusion() if near_fusion else contextlib.nullcontext()
    with inductor_estimates() as found, config.patch(force_disable_caches=True), fusion:
        fn = torch.compile(model, backend=backend)
        step_peak(fn, list(model.parameters()), model.inputs)
    return found[-1] if found else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the stack traversed once only")
    ap.add_argument("--inductor", action="store_true", help="also Inductor's own estimate")
    ap.add_argument("--no-distant-fusion", action="store_true",
                    help="Inductor's estimate with kernels more than 64 nodes apart not fused "
                         "(torch's unused are_long_distant_nodes heuristic)")
    args = ap.parse_args()
    cases = ["stack"] if args.quick else ["stack", "stack x2", "gpt"]
    policies_ = ["recompute_all", "save_matmuls", "budget"]
    header = (f"{'case':9s} {'policy':14s} {'eager ckpt':>12s} {'torch kept':>11s} "
              f"{'torch peak':>11s} {'ours kept':>11s} {'ours peak':>11s} "
              f"{'ours/eager':>10s} {'ours/torch':>10s}" + ("  inductor torch / ours"
                                                            if args.inductor else ""))
    print(header)
    print("-" * len(header))
    for case in cases:
        for policy in policies_:
            eager = _run(case, "torch", policy if policy != "budget" else "save_matmuls", None)
            theirs = _run(case, "torch", policy if policy != "budget" else "save_matmuls",
                          _upstream_aot_eager(PartitionFigures()))
            ours = _run(case, "ours", policy, make_backend(
                compiler="aot_eager", memory_budget=0.5 if policy == "budget" else None))
            line = (f"{case:9s} {policy:14s} {_kib(eager['peak']):>12s} "
                    f"{_kib(theirs['kept']):>11s} {_kib(theirs['peak']):>11s} "
                    f"{_kib(ours['kept']):>11s} {_kib(ours['peak']):>11s} "
                    f"{ours['peak'] / eager['peak']:>9.2f}x "
                    f"{ours['peak'] / theirs['peak']:>9.2f}x")
            if args.inductor:
                near = args.no_distant_fusion
                t = _inductor_bw(case, "torch", policy if policy != "budget" else "save_matmuls",
                                 near)
                o = _inductor_bw(case, "ours", policy, near)
                line += f"  {_kib(t or 0)} / {_kib(o or 0)}"
            print(line, flush=True)
    print("\neager ckpt: eager torch.utils.checkpoint (recompute_all) or torch SAC (matmuls) "
          "backward peak; kept/peak at run time under aot_eager; 'budget' = ours with "
          "memory_budget=0.5 (save_matmuls relaxed) against torch's SAC without one")


if __name__ == "__main__":
    main()
