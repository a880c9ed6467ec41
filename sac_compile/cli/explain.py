"""``python -m sac_compile explain TARGET``: the ``PartitionReport`` of a function in eager
mode and compiled, and the difference between the two.

``TARGET`` is a fixture name, ``hf:NAME`` (a Hugging Face model from a small config) or
``MODULE:FUNCTION`` returning ``(fn_or_model, inputs)``.
The function's own regions decide; ``--policy`` puts every block (or the whole function)
in a region with that policy. Fixtures get ``--policy save_matmuls`` by default.
"""
from __future__ import annotations

import re
from collections import Counter
from typing import Any

import torch

from .args import check_device, load_target, resolve_policy

__all__ = ["run_explain", "diff_reports"]


def _with_policy(fn: Any, policy: Any) -> Any:
    from .._bench.measure import wrap_blocks
    from .._bench.strategies import as_blocked_model
    from ..regions import sac_region
    model = as_blocked_model(fn)
    wrap_blocks(model, lambda i, fwd: sac_region(policy, name=f"blocks.{i}")(fwd))
    return model


def _counter_lines(title: str, a: Counter, b: Counter, names: tuple[str, str]) -> list[str]:
    lines = []
    for op in sorted(set(a) | set(b)):
        if a[op] != b[op]:
            lines.append(f"  {title} {op}: {names[0]} x{a[op]}, {names[1]} x{b[op]}")
    return lines


def _base_op(op: str) -> str:
    """``"aten.x.default[1]"`` (output 1 of a multi-output op, compile) -> ``"aten.x.default"``
    (eager lists each output of the op under the op's own name)."""
    return re.sub(r"\[\d+\]$", "", op)


def _saved(report: Any, must_only: bool = False) -> Counter:
    return Counter(_base_op(r.op) for r in report.saved
                   if not r.is_input and (not must_only or r.must))


def diff_reports(eager: Any, compiled: Any) -> list[str]:
    """Human-readable differences between two reports (saved ops, recomputed ops, bytes)."""
    lines = []
    if eager.saved_bytes != compiled.saved_bytes:
        from ..report import fmt_bytes
        lines.append(f"  saved bytes: eager {fmt_bytes(eager.saved_bytes)}, compile "
                     f"{fmt_bytes(compiled.saved_bytes)}")
    lines += _counter_lines("saved", _saved(eager), _saved(compiled), ("eager", "compile"))
    lines += _counter_lines("recomputed", eager.recomputed_ops, compiled.recomputed_ops,
                            ("eager", "compile"))
    return lines


def run_explain(args: Any) -> int:
    from ..explaining import explain
    device = check_device(args.device)
    target = load_target(args.target, size=args.size, seed=args.seed, device=device,
                         flag="explain TARGET")
    policy_name = args.policy or ("save_matmuls" if target.is_fixture else None)
    from .._bench.strategies import copy_model
    eager_fn = target.fn
    compiled_fn = copy_model(eager_fn) if isinstance(eager_fn, torch.nn.Module) else eager_fn
    if policy_name is not None:
        label, policy = resolve_policy(policy_name)
        eager_fn, compiled_fn = _with_policy(eager_fn, policy), _with_policy(compiled_fn, policy)
        where = "every block" if hasattr(target.fn, "blocks") else "the whole function"
        print(f"{target.label}: {where} in sac_region({label!r})")

    def inputs() -> tuple:
        return tuple(t.detach().clone().requires_grad_(t.requires_grad)
                     if isinstance(t, torch.Tensor) else t for t in target.inputs)

    from ..torch_internals import functorch_config as _functorch_config
    torch.manual_seed(args.seed)
    eager_report = explain(eager_fn, *inputs(), mode="eager")
    print(eager_report)
    print()
    print(f"compiling ({args.compiler}) ...", flush=True)
    torch.manual_seed(args.seed)
    with _functorch_config.patch(enable_autograd_cache=False):
        compiled_report = explain(compiled_fn, *inputs(), mode="compile", compiler=args.compiler)
    print(compiled_report)
    print()
    diff = diff_reports(eager_report, compiled_report)
    if not diff:
        print("no differences: eager and compile save and recompute the same ops")
    else:
        print("differences (eager vs compile):")
        print("\n".join(diff))
        print("  (the compiler may override PREFER_* decisions where that lowers the objective, "
              "and it sees ops after decomposition and functionalisation)")
    must_e, must_c = _saved(eager_report, True), _saved(compiled_report, True)
    if must_e == must_c:
        print(f"values kept as MUST_SAVE: the same {sum(must_e.values())} in both modes")
    else:
        print(f"values kept as MUST_SAVE: eager {sum(must_e.values())}, compile "
              f"{sum(must_c.values())} (MUST_SAVE forbids recomputing a value; one that "
              f"backward can do without, because the split keeps a later value, is not kept):")
        print("\n".join(_counter_lines("MUST_SAVE", must_e, must_c, ("eager", "compile"))))
    return 0
