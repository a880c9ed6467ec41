"""Eager overhead of selective activation checkpointing: sac_compile vs torch.utils.checkpoint.

Run with ``make bench`` (or ``python benchmarks/eager_overhead.py``). Everything is measured
in this one run, strategies interleaved round-robin, medians reported as ratios.

1. Per-op overhead on two 16-element chains of 1000 steps, recompute-everything policy:
   A: ``x = x*1.0001 + 0.0001`` (nothing needs recomputing), B: ``x = (x*1.0001).sin()``
   (every ``sin`` input is recomputed). Forward+backward timed; overhead per op =
   median over rounds of (t_strategy - t_noAC) / (ATen ops in the chain's forward).
   Targets (issue 28), against the empty dispatch mode (the floor of any dispatch-mode
   design): ours <= 1.25x on A, <= 2x on B; ours/empty mode is the median of the per-round
   ratios.
2. The 8-layer MLP fixture (64x1024, 1024->4096->1024, LayerNorm) with every block
   checkpointed saving matmuls (torch: mm/addmm/bmm/baddbmm and SDPA ops; ours
   ``policy="save_matmuls"``): step time / no-AC (target <= 1.03) and activation bytes kept
   (target <= torch SAC's), measured as in ``fixtures.measure.measure_ours``.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import time
from functools import partial

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fixtures import make_model  # noqa: E402
from fixtures.measure import (TORCH_SAVE_MATMUL_OPS, count_aten_ops,  # noqa: E402
                              interleaved_medians, measure_noac, measure_torch_sac, paired,
                              torch_sac_blocks, TorchSAC)
from fixtures.models import clear_grads, loss_fn, max_grad_diff  # noqa: E402
from sac_compile.report import fmt_bytes  # noqa: E402

try:
    import sac_compile
    from fixtures.measure import measure_ours, ours_blocks
    OURS_ERROR = None
except Exception as e:  # the benchmark still measures the upstream side
    sac_compile = None
    OURS_ERROR = f"{type(e).__name__}: {e}"

N_STEPS = 1000
CHAIN_TARGETS = (1.25, 2.0)  # ours per-op overhead / the empty mode's, chains A and B
MLP_TIME_TARGET = 1.03  # ours step time / no-AC

#: Column names of the rows bench_chains and bench_mlp return.
CHAIN_HEADER = ["chain", "no-AC ms", "empty mode us/op", "torch SAC us/op", "ours us/op",
                "ours/empty mode", "ours/torch", "target", "result"]
MLP_TIME_HEADER = ["strategy", "step ms", "vs no AC", "target", "result"]
MLP_BYTES_HEADER = ["strategy", "activations kept", "policy-saved", "recomputed ops",
                    "max |grad diff|", "target", "result"]


def chain_a(x: torch.Tensor) -> torch.Tensor:
    for _ in range(N_STEPS):
        x = x * 1.0001 + 0.0001
    return x


def chain_b(x: torch.Tensor) -> torch.Tensor:
    for _ in range(N_STEPS):
        x = (x * 1.0001).sin()
    return x


def _torch_recompute_all(ctx, op, *args, **kwargs):
    return CheckpointPolicy.PREFER_RECOMPUTE


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "MISS")


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def fmt(r: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([fmt(header), "  ".join("-" * w for w in widths), *map(fmt, rows)])


class _PassThroughMode(TorchDispatchMode):
    """Runs every op unchanged: the floor any dispatch-mode SAC pays per op, before it does
    any bookkeeping (torch SAC and ours both sit on this mechanism)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _pass_through(chain, x) -> None:
    with _PassThroughMode():
        out = chain(x)
    out.sum().backward()


def _synced(fn, device: str):
    """``fn`` followed by a device synchronisation (timings then include the kernels)."""
    if not str(device).startswith("cuda"):
        return fn

    def run():
        fn()
        torch.cuda.synchronize()
    return run


def bench_chains(reps: int, device: str = "cpu") -> list[list[str]]:
    rows = []
    x = torch.randn(16, device=device, requires_grad=True)
    torch_ctx = partial(create_selective_checkpoint_contexts, _torch_recompute_all)
    for (label, chain), target in zip((("A: x*1.0001+0.0001", chain_a),
                                       ("B: (x*1.0001).sin()", chain_b)), CHAIN_TARGETS):
        n_ops = sum(count_aten_ops(chain, x).values())
        fns = {
            "noac": lambda: chain(x).sum().backward(),
            "torch": lambda: checkpoint(chain, x, use_reentrant=False,
                                        context_fn=torch_ctx).sum().backward(),
            "floor": lambda: _pass_through(chain, x),
        }
        if sac_compile is not None:
            fns["ours"] = lambda: sac_compile.checkpoint(chain, x, policy="recompute_all"
                                                         ).sum().backward()
        fns = {k: _synced(fn, device) for k, fn in fns.items()}
        timings = interleaved_medians(fns, reps=reps, warmup=2)
        t = {k: v.median for k, v in timings.items()}
        per_op = {k: paired(timings, k, "noac", lambda a, b: a - b) / n_ops
                  for k in fns if k != "noac"}
        ratio = per_op["ours"] / per_op["torch"] if "ours" in per_op else None
        floor = _paired_overhead_ratio(timings, "ours") if "ours" in per_op else None
        rows.append([
            f"{label} x{N_STEPS} ({n_ops} ops)",
            f"{t['noac'] * 1e3:.1f}",
            f"{per_op['floor'] * 1e6:.2f}",
            f"{per_op['torch'] * 1e6:.2f}",
            f"{per_op['ours'] * 1e6:.2f}" if "ours" in per_op else "n/a",
            f"{floor:.2f}" if floor is not None else "n/a",
            f"{ratio:.2f}" if ratio is not None else "n/a",
            f"<= {target}",
            _verdict(None if floor is None else floor <= target),
        ])
        x.grad = None
    return rows


def _paired_overhead_ratio(timings, key: str) -> float:
    """Median over rounds of (t_key - t_noAC) / (t_empty mode - t_noAC): the rounds run the
    strategies back to back, so a slow spell on a shared machine cancels out of each ratio."""
    rounds = zip(timings[key].samples, timings["floor"].samples, timings["noac"].samples)
    return statistics.median([(a - n) / (f - n) for a, f, n in rounds if f > n])


def bench_mlp(reps: int, budget_s: float, device: str = "cpu",
              size: str = "bench") -> tuple[list[list[str]], list[list[str]], int]:
    model, inputs = make_model("mlp", size=size, seed=0, device=device)

    # Gradients accumulate across timed steps (no zeroing) for every strategy alike: freeing
    # and reallocating 256 MiB of grads each step made the timings bimodal on this machine.
    def step(ctx_factory):
        def run():
            with ctx_factory():
                out = loss_fn(model(*inputs))
            out.backward()
        return _synced(run, device)

    fns = {"noac": step(contextlib.nullcontext),
           "torch": step(lambda: torch_sac_blocks(model, TorchSAC(TORCH_SAVE_MATMUL_OPS)))}
    if sac_compile is not None:
        fns["ours"] = step(lambda: ours_blocks(model, "save_matmuls"))
    clear_grads(model, inputs)
    timings = interleaved_medians(fns, reps=reps, warmup=1, budget_s=budget_s)
    t = {k: v.median for k, v in timings.items()}
    ratio = {k: paired(timings, k, "noac") for k in t}
    n = len(timings["noac"].samples)
    clear_grads(model, inputs)

    noac = measure_noac(model, inputs, seed=0)
    tsac = measure_torch_sac(model, inputs, TORCH_SAVE_MATMUL_OPS, seed=0,
                             strategy="torch SAC (save matmuls)")
    ours = (measure_ours(model, inputs, "save_matmuls", seed=0,
                         strategy="sac_compile (save_matmuls)") if sac_compile else None)
    clear_grads(model, inputs)

    time_rows = [["no AC", f"{t['noac'] * 1e3:.0f}", "1.00", "", ""],
                 ["torch SAC (save matmuls)", f"{t['torch'] * 1e3:.0f}",
                  f"{ratio['torch']:.3f}", "", ""]]
    if "ours" in t:
        r = ratio["ours"]
        time_rows.append(["sac_compile (save_matmuls)", f"{t['ours'] * 1e3:.0f}", f"{r:.3f}",
                          f"<= {MLP_TIME_TARGET}", _verdict(r <= MLP_TIME_TARGET)])
    else:
        time_rows.append(["sac_compile (save_matmuls)", "n/a", "n/a", f"<= {MLP_TIME_TARGET}",
                          "n/a"])

    byte_rows = []
    for r in (noac, tsac, ours):
        if r is None:
            byte_rows.append(["sac_compile (save_matmuls)", "n/a", "n/a", "n/a", "n/a", "", "n/a"])
            continue
        is_ours = r is ours
        target = ""
        verdict = ""
        if is_ours:
            target = "<= torch SAC"
            verdict = _verdict(r.saved_bytes <= tsac.saved_bytes
                               and r.policy_bytes <= tsac.policy_bytes)
        byte_rows.append([
            r.strategy,
            fmt_bytes(r.saved_bytes, 2),
            fmt_bytes(r.policy_bytes, 2) if r.policy_bytes is not None else "-",
            str(r.recomputed_ops),
            f"{max_grad_diff(noac.grads, r.grads):.1e}",
            target, verdict,
        ])
    return time_rows, byte_rows, n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chain-reps", type=int, default=21)
    parser.add_argument("--mlp-reps", type=int, default=15)
    parser.add_argument("--mlp-budget-s", type=float, default=60.0,
                        help="stop MLP rounds early (after 3) once this much time is spent")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (timings synchronised)")
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    print(f"sac_compile eager overhead benchmark — torch {torch.__version__}, "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"{torch.get_num_threads()} threads, {time.strftime('%Y-%m-%d %H:%M')}")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if load > 0.5:
        print(f"warning: 1-minute load average is {load:.2f} before starting; other work on "
              f"this machine makes the timings noisy (ratios are paired per round to limit it)")
    if OURS_ERROR:
        print(f"sac_compile unavailable, its rows are n/a: {OURS_ERROR}")

    print("\n1. Per-op overhead vs no checkpointing, recompute-everything policy, 16 elements, "
          "forward+backward")
    print(_table(bench_chains(args.chain_reps, args.device), CHAIN_HEADER))
    print("empty mode: a dispatch mode that only runs each op, the floor under both torch SAC "
          "and ours;\nours/empty mode: median of the per-round ratios of the overheads.")

    print("\n2. 8-layer MLP [64x1024, 1024->4096->1024, LayerNorm], every block checkpointed, "
          "save matmuls")
    time_rows, byte_rows, rounds = bench_mlp(args.mlp_reps, args.mlp_budget_s, args.device)
    print(_table(time_rows, MLP_TIME_HEADER))
    print(f"step: forward+backward; ms: median of {rounds} interleaved rounds; vs no AC: "
          f"median of the per-round ratios.")
    print()
    print(_table(byte_rows, MLP_BYTES_HEADER))
    print("activations kept: unique storages held for backward after forward, parameters "
          "excluded, block inputs included for both checkpointing strategies; policy-saved: "
          "torch SAC's cache / sac_compile's collect_stats().saved_bytes.")
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
