"""The SAC partitioner vs upstream's ``min_cut_rematerialization_partition``.

Both partition the same tagged joint graphs (the same model, policy and trace, once per
partitioner). Printed per case: saved bytes (activations and non-parameter inputs),
recompute FLOPs (``torch.utils.flop_counter`` rules), partition time as a ratio (ours /
upstream), where our time goes, and for the MLP and GPT cases the compiled (Inductor)
forward+backward step time as a ratio.

    python benchmarks/partition.py [--quick] [--no-step]
"""
from __future__ import annotations

import argparse
import copy
import statistics
import operator
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fixtures.measure import interleaved_medians  # noqa: E402
from fixtures.models import loss_fn, make_model  # noqa: E402
from sac_compile import CheckpointPolicy as CP  # noqa: E402
from sac_compile import policies, sac_region  # noqa: E402
from sac_compile.compiler import SACPartitioner  # noqa: E402
from sac_compile.cut import costs  # noqa: E402
from sac_compile.cut.network import build_flow_network, classify  # noqa: E402
from sac_compile.cut.solvers import solve  # noqa: E402
from sac_compile.report import fmt_bytes  # noqa: E402


def prefer_policy(ctx, op, *args, **kwargs):
    """PREFER tags only: keep matmuls/attention if sensible, recompute the rest if sensible."""
    return CP.PREFER_SAVE if op in policies.MATMUL_OPS else CP.PREFER_RECOMPUTE


CASES = {
    "mlp-bench save_matmuls": ("mlp", "bench", policies.save_matmuls, True),
    "gpt-bench PREFER tags": ("gpt", "bench", prefer_policy, True),
    "gpt-stack32 save_matmuls": ("gpt", "stack32", policies.save_matmuls, False),
}


def split_stats(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule, params: set[str]):
    """Saved bytes (parameters excluded) and recompute FLOPs of a forward/backward split."""
    fw_ops = {n.name for n in fw.graph.nodes if n.op == "call_function"}
    saved = sum(costs.nbytes(n) for n in bw.graph.find_nodes(op="placeholder")
                if "tangents" not in n.name and n.name not in params
                and isinstance(n.meta.get("val"), torch.Tensor))
    flops = sum(costs.flops(n) for n in bw.graph.nodes
                if n.op == "call_function" and n.name in fw_ops
                and n.target is not operator.getitem)
    return saved, flops


def _params(gm: torch.fx.GraphModule, kwargs: dict) -> set[str]:
    primals = [n.name for n in gm.graph.find_nodes(op="placeholder") if "primals" in n.name]
    return {primals[i] for i in kwargs.get("static_lifetime_input_indices") or []
            if i < len(primals)}


def capture_joint(model_name: str, size: str, policy):
    """Trace once; return the tagged joint graph, its inputs, kwargs and tracing context."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    captured = []

    def record(gm, joint_inputs, **kwargs):
        captured.append((copy.deepcopy(gm), joint_inputs, dict(kwargs),
                         torch._guards.TracingContext.try_get()))
        return min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)

    backend = aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm.forward),
                           bw_compiler=lambda gm, _: make_boxed_func(gm.forward),
                           partition_fn=record)
    model, inputs = build(model_name, size, policy)
    torch._dynamo.reset()
    torch.manual_seed(0)
    loss_fn(torch.compile(model, backend=backend)(*inputs)).backward()
    return captured[0]


def run_partitioner(which: str, captured, solver: str | None = None) -> dict:
    """Partition a fresh copy of the captured joint graph; time it and measure the split."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    gm0, joint_inputs, kwargs, tracing_ctx = captured
    gm = copy.deepcopy(gm0)
    params = _params(gm, kwargs)
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    # Both partitioners under the same conditions as inside dynamo: lazy module codegen.
    with torch._guards.tracing(tracing_ctx), _use_lazy_graph_module(True):
        t0 = time.perf_counter()
        if which == "ours":
            part = SACPartitioner(solver=solver)
            fw, bw = part(gm, joint_inputs, **kwargs)
            timings = dict(part.last_report.timings)
        else:
            fw, bw = min_cut_rematerialization_partition(gm, joint_inputs, compiler="inductor",
                                                         **kwargs)
            timings = {}
        elapsed = time.perf_counter() - t0
    saved, flops = split_stats(fw, bw, params)
    return dict(time=elapsed, saved=saved, flops=flops, nodes=len(gm0.graph.nodes),
                timings=timings)


def build(model_name: str, size: str, policy):
    model, inputs = make_model(model_name, size=size, seed=0)
    for block in model.blocks:
        sac_region(policy)(block)
    return model, inputs


def step_time_ratio(model_name, size, policy, reps):
    fns = {}
    for which in ("upstream", "ours"):
        model, inputs = build(model_name, size, policy)
        patch = {"custom_partitioner_fn": SACPartitioner()} if which == "ours" else {}
        with torch._inductor.config.patch(patch):
            compiled = torch.compile(model, backend="inductor")

            def step(compiled=compiled, inputs=inputs, model=model):
                loss_fn(compiled(*inputs)).backward()
                model.zero_grad(set_to_none=True)

            step()  # compile
        fns[which] = step
    med = interleaved_medians(fns, reps=reps, warmup=1)
    return med


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-step", action="store_true", help="skip compiled step times")
    parser.add_argument("--reps", type=int, default=7, help="compiled step repetitions")
    parser.add_argument("--partition-reps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; objective: saved "
          f"bytes + weighted recompute cost (see sac_compile/compiler/network.py)")
    for label, (model_name, size, policy, step) in CASES.items():
        captured = capture_joint(model_name, size, policy)
        runs = {"upstream": [], "ours": []}
        for r in range(args.partition_reps):  # alternate, medians: the machine may be busy
            for which in (("upstream", "ours") if r % 2 == 0 else ("ours", "upstream")):
                runs[which].append(run_partitioner(which, captured))
        up, ours = (min(runs[w], key=lambda x: x["time"]) for w in ("upstream", "ours"))
        up["time"] = statistics.median(x["time"] for x in runs["upstream"])
        ours["time"] = statistics.median(x["time"] for x in runs["ours"])
        nx_ours = run_partitioner("ours", captured, solver="networkx")
        print(f"\n== {label} ({up['nodes']} joint nodes, medians of {args.partition_reps})")
        print(f"  saved bytes      upstream {fmt_bytes(up['saved']):>10}   ours "
              f"{fmt_bytes(ours['saved']):>10}")
        print(f"  recompute FLOPs  upstream {up['flops']:>10,}   ours {ours['flops']:>10,}")
        print(f"  partition time   upstream {up['time'] * 1e3:8.1f} ms   ours "
              f"{ours['time'] * 1e3:8.1f} ms   ratio {ours['time'] / up['time']:.2f}x")
        where = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in ours["timings"].items())
        print(f"  ours, where the time goes (ms): {where}")
        print(f"  max-flow: scipy {ours['timings'].get('solve', 0) * 1e3:.1f} ms vs networkx "
              f"{nx_ours['timings'].get('solve', 0) * 1e3:.1f} ms (same cut: "
              f"{(nx_ours['saved'], nx_ours['flops']) == (ours['saved'], ours['flops'])})")
        if step and not args.no_step:
            med = step_time_ratio(model_name, size, policy, args.reps)
            print(f"  compiled fw+bw   upstream {med['upstream'].median * 1e3:8.2f} ms   ours "
                  f"{med['ours'].median * 1e3:8.2f} ms   ratio {med['ours'].median / med['upstream'].median:.2f}x")


if __name__ == "__main__":
    main()
