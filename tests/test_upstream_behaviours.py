"""The behaviours torch's own SAC tests pin down, restated for our API (docs/compat.md).

From ``TestSelectiveActivationCheckpoint`` (test/test_autograd.py): storage lifetime,
version counter, more than one output, non-tensor output, policy with state, bad inputs,
flops and memory. From the SAC tests of test/dynamo/test_activation_checkpointing.py: must
recompute, must-not-recompute gemm (mm counted in forward and backward), list of ops,
partial ctx fn, random op, outplace/inplace op, tags through a custom autograd.Function,
tags through decompositions. Written from the behaviours, not copied.
"""
from __future__ import annotations

import functools
import gc
import weakref

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from fixtures.capture import Captured
import sac_compile as sc
from sac_compile import CheckpointError, CheckpointPolicy as CP
from sac_compile.compiler import SACPartitioner, make_backend
from sac_compile.runtime import collect_stats

aten = torch.ops.aten
MM = aten.mm.default


def _inputs(n=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, n, generator=g, requires_grad=True),
            torch.randn(n, n, generator=g, requires_grad=True))


def _grads(fn, *inputs, seed=0):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    torch.manual_seed(seed)
    out = fn(*leaves)
    out.sum().backward()
    return [out.detach()] + [t.grad for t in leaves]


def _assert_same(fn, region_fn, *inputs, seed=0, **tol):
    for a, b in zip(_grads(fn, *inputs, seed=seed), _grads(region_fn, *inputs, seed=seed)):
        torch.testing.assert_close(b, a, **tol)


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] = self.counts.get(func, 0) + 1
        return func(*args, **(kwargs or {}))


def _eager_mm_counts(fn, *inputs):
    """(mm in forward, mm in backward) in eager mode, counted at dispatch."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    with _OpCounter() as fwd:
        out = fn(*leaves)
    with _OpCounter() as bwd:
        out.sum().backward()
    return fwd.counts.get(MM, 0), bwd.counts.get(MM, 0)


def _compiled_graph_counts(fn, *inputs, decompositions=None, reports=None):
    """(forward graph, backward graph) op counts under compile with our partitioner."""
    graphs = {}
    reports = [] if reports is None else reports

    def compiler(name):
        def compile_(gm, example_inputs):
            counts = graphs.setdefault(name, {})
            for n in gm.graph.nodes:
                if n.op == "call_function":
                    counts[n.target] = counts.get(n.target, 0) + 1
            from functorch.compile import make_boxed_func
            return make_boxed_func(gm.forward)
        return compile_

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=compiler("fw"), bw_compiler=compiler("bw"),
                           partition_fn=SACPartitioner(on_partition=reports.append), decompositions=decompositions or {})
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    torch.compile(fn, backend=backend, fullgraph=True)(*leaves).sum().backward()
    return graphs["fw"], graphs["bw"]


def _three_mms(x, w):
    return (((x @ w).sin() @ w).cos() @ w).sigmoid()


# --- TestSelectiveActivationCheckpoint ------------------------------------------------------

def test_storage_lifetime():
    # A value the policy caches lives while the graph can still use it, and no longer.
    x, w = _inputs()

    @sc.sac_region([MM], name="Block")
    def block(x, w):
        return (x @ w).sin()

    out = block(x, w)
    node = next(o for o in gc.get_objects() if type(o).__name__ == "OpNode" and o.op is MM)
    cached = weakref.ref(node.value[0])
    del node
    gc.collect()
    assert cached() is not None
    out.sum().backward()
    gc.collect()
    assert cached() is None  # backward freed the graph's saved values
    out = block(x, w)
    del out                  # so does dropping the graph without a backward
    gc.collect()
    assert not any(type(o).__name__ == "OpNode" for o in gc.get_objects())


@pytest.mark.parametrize("allow", [False, True])
def test_version_counter(allow):
    # Mutating a cached tensor before backward uses it: an error, unless the region allows
    # cache-entry mutation (then the runtime keeps a copy and gradients are right).
    x, _ = _inputs()

    def fn(x):
        a = x.sin()
        b = a.exp()   # saves its output: recomputing it needs the cached a
        a.mul_(2)
        return b + a

    save_sin = lambda ctx, op, *a, **k: CP.MUST_SAVE if op is aten.sin.default else None  # noqa
    region = sc.sac_region(save_sin, name="V", allow_cache_entry_mutation=allow)(fn)
    if allow:
        _assert_same(fn, region, x)
    else:
        with pytest.raises(CheckpointError, match="was mutated in place by aten.mul_.Tensor"):
            _grads(region, x)


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_function_with_more_than_one_output(mode):
    # An op with two outputs (var_mean), saved by the policy: both outputs are kept, none is
    # recomputed, gradients are right.
    x, _ = _inputs()

    def fn(x):
        var, mean = torch.var_mean(x.sin(), dim=-1, keepdim=True)
        return (x - mean) * var

    policy = [aten.var_mean.correction, aten.sin.default]
    region = sc.sac_region(policy, name="Two")(fn)
    if mode == "eager":
        _assert_same(fn, region, x)
        leaves = [x.detach().clone().requires_grad_()]
        with collect_stats() as stats:
            region(*leaves).sum().backward()
        assert "aten.var_mean.correction" not in stats.recomputed_ops
        saved = [r.op for r in stats.saved]
        assert saved.count("aten.var_mean.correction") == 2
    else:
        cap = Captured()
        compiled = torch.compile(region, backend=cap.backend())
        _assert_same(fn, compiled, x, atol=1e-5, rtol=1e-5)
        assert "aten.var_mean.correction" not in cap.reports[0].recomputed


def test_function_with_non_tensor_output():
    # A region returning a non-tensor next to a tensor, and an op with a non-tensor result.
    x, _ = _inputs()

    def fn(x):
        y = x.sin()
        return y * 2, int(y.shape[0]), None

    out, n, nothing = sc.sac_region("save_all", name="NT")(fn)(x)
    assert (n, nothing) == (16, None)
    out.sum().backward()
    torch.testing.assert_close(x.grad, 2 * x.detach().cos())


def test_policy_with_state():
    # A stateful policy: save the first mm, recompute the others. Ours asks the policy once
    # per op in the forward and never during recompute (upstream also asks it during the
    # recompute, with ctx.is_recompute=True), so state counts forward ops only.
    x, w = _inputs()
    calls = []

    def first_mm_only(ctx, op, *args, **kwargs):
        calls.append(ctx.is_recompute)
        if op is MM:
            first_mm_only.mms += 1
            return CP.MUST_SAVE if first_mm_only.mms == 1 else CP.PREFER_RECOMPUTE
        return None

    first_mm_only.mms = 0
    region = sc.sac_region(first_mm_only, name="S")(_three_mms)
    with collect_stats() as stats:
        region(*[t.detach().clone().requires_grad_() for t in (x, w)]).sum().backward()
    assert first_mm_only.mms == 3 and set(calls) == {False}
    assert len(calls) == stats.ops_recorded
    assert [r.op for r in stats.saved] == ["aten.mm.default"]
    first_mm_only.mms = 0
    _assert_same(_three_mms, region, x, w)


def test_bad_inputs():
    # A list naming something that is not an op, a policy of the wrong type: TypeError at
    # region creation. A policy returning a non-decision: CheckpointError at the op.
    with pytest.raises(TypeError, match=r"expected ATen ops such as torch.ops.aten.mm.default"):
        sc.sac_region([torch.sin])
    with pytest.raises(TypeError, match=r"got 3 of type int"):
        sc.sac_region(3)
    x, w = _inputs()
    with pytest.raises(CheckpointError, match=r"returned 7 \(type int\) for op aten.mm.default"):
        sc.sac_region(lambda ctx, op, *a, **k: 7, name="Bad")(_three_mms)(x, w)


def test_flops_and_mem():
    # Saving the matmuls: backward recomputes no mm, so backward FLOPs equal no
    # checkpointing's; saved bytes are less than what autograd keeps without checkpointing.
    from torch.utils.flop_counter import FlopCounterMode
    x, w = _inputs(32)

    def flops(fn):
        leaves = [t.detach().clone().requires_grad_() for t in (x, w)]
        out = fn(*leaves)
        with FlopCounterMode(display=False) as counter:
            out.sum().backward()
        return counter.get_total_flops()

    saved = sc.sac_region("save_matmuls", name="F")(_three_mms)
    recompute = sc.sac_region("recompute_all", name="R")(_three_mms)
    assert flops(saved) == flops(_three_mms)
    assert flops(recompute) > flops(_three_mms)
    assert _eager_mm_counts(saved, x, w) == (3, 6)

    with collect_stats() as stats:
        saved(*[t.detach().clone().requires_grad_() for t in (x, w)]).sum().backward()
    no_ac = 5 * 32 * 32 * 4  # sin, cos, sigmoid inputs/outputs and the two mm outputs kept
    assert stats.saved_bytes == 3 * 32 * 32 * 4 < no_ac


# --- test/dynamo/test_activation_checkpointing.py (SAC policies under compile) ----------------

def _must_recompute_mm(ctx, op, *args, **kwargs):
    return CP.MUST_RECOMPUTE if op is MM else CP.PREFER_SAVE


def _must_save_mm(ctx, op, *args, **kwargs):
    return CP.MUST_SAVE if op is MM else CP.PREFER_RECOMPUTE


def test_must_recompute():
    x, w = _inputs()
    region = sc.sac_region(_must_recompute_mm, name="MR")(_three_mms)
    _assert_same(_three_mms, region, x, w)
    # Eager: the last mm's output is alive (the sigmoid's input is not needed, its output
    # is), the first two are recomputed for backward (their consumers save them).
    fwd, bwd = _eager_mm_counts(region, x, w)
    assert (fwd, bwd) == (3, 6 + 2)
    reports = []
    fw, bw = _compiled_graph_counts(region, x, w, reports=reports)
    # Never saved; recomputed for the backward (our min-cut also recomputes the last one to
    # rebuild the PREFER_SAVE sigmoid rather than keep it, so 2 or 3 of them).
    assert fw.get(MM, 0) == 3 and bw.get(MM, 0) in (6 + 2, 6 + 3)
    assert "aten.mm.default" not in reports[0].saved_ops


def test_must_not_recompute_gemm():
    x, w = _inputs()
    region = sc.sac_region(_must_save_mm, name="MS")(_three_mms)
    _assert_same(_three_mms, region, x, w)
    assert _eager_mm_counts(region, x, w) == (3, 6)
    fw, bw = _compiled_graph_counts(region, x, w)
    assert fw.get(MM, 0) == 3 and bw.get(MM, 0) == 6


@pytest.mark.parametrize("form", ["list", "torch_context_fn"])
def test_list_of_ops(form):
    x, w = _inputs()
    if form == "list":
        region = sc.sac_region([aten.mm.default, aten.sin.default], name="L")(_three_mms)
    else:  # existing user code: torch's own context_fn, compiled with our backend
        def region(x, w):
            return torch_checkpoint(_three_mms, x, w, use_reentrant=False,
                                    context_fn=functools.partial(
                                        create_selective_checkpoint_contexts,
                                        [aten.mm.default, aten.sin.default]))
    _assert_same(_three_mms, region, x, w)
    reports = []
    fw, bw = _compiled_graph_counts(region, x, w, reports=reports)
    assert fw.get(MM, 0) == 3 and bw.get(MM, 0) == 6
    # (the backward's own sin is cos's derivative, not a recompute)
    assert "aten.sin.default" not in reports[0].recomputed


def test_partial_ctx_fn():
    # A policy built with functools.partial works as a policy in both modes.
    x, w = _inputs()

    def policy(saved_ops, ctx, op, *args, **kwargs):
        return CP.MUST_SAVE if op in saved_ops else CP.PREFER_RECOMPUTE

    region = sc.sac_region(functools.partial(policy, {MM}), name="P")(_three_mms)
    _assert_same(_three_mms, region, x, w)
    assert _eager_mm_counts(region, x, w) == (3, 6)
    fw, bw = _compiled_graph_counts(region, x, w)
    assert bw.get(MM, 0) == 6


@pytest.mark.parametrize("decision", [CP.MUST_SAVE, CP.PREFER_RECOMPUTE])
@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_random_op(mode, decision):
    # Saved or recomputed, a random op gives the forward's values in backward: gradients
    # equal running without checkpointing from the same seed.
    x, w = _inputs()

    def fn(x, w):
        return torch.nn.functional.dropout((x @ w).sin(), 0.5, training=True) @ w

    def policy(ctx, op, *args, **kwargs):
        return decision if op not in (MM,) else CP.MUST_SAVE

    region = sc.sac_region(policy, name="Rand")(fn)
    if mode == "compile":
        torch._dynamo.reset()
        region = torch.compile(region, backend=make_backend(compiler="aot_eager"))
    _assert_same(fn, region, x, w, seed=3)


@pytest.mark.parametrize("inplace", [False, True])
def test_outplace_and_inplace_op(inplace, capture):
    # The policy sees the op as called: sigmoid or sigmoid_ (both modes).
    x, w = _inputs()
    target = aten.sigmoid_.default if inplace else aten.sigmoid.default

    def fn(x, w):
        y = (x @ w) * 1.0
        y = y.sigmoid_() if inplace else y.sigmoid()
        return (y @ w).relu()

    seen = []

    def policy(ctx, op, *args, **kwargs):
        seen.append(op)
        return CP.MUST_SAVE if op is target else CP.PREFER_RECOMPUTE

    region = sc.sac_region(policy, name="IO")(fn)
    _assert_same(fn, region, x, w)
    assert target in seen
    with collect_stats() as stats:
        region(*[t.detach().clone().requires_grad_() for t in (x, w)]).sum().backward()
    assert dict(stats.decisions)[str(target)].policy is CP.MUST_SAVE
    seen.clear()
    compiled = torch.compile(region, backend=capture.backend())
    _assert_same(fn, compiled, x, w)
    assert target in seen
    assert "aten.sigmoid.default" not in capture.reports[0].recomputed


class _ScaledMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return (x @ w) * 2.0

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad @ w.t() * 2.0, x.t() @ grad * 2.0


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_tags_through_custom_autograd_function(mode):
    # Ops inside a custom autograd.Function's forward are decided by the region's policy;
    # gradients are the Function's.
    x, w = _inputs()

    def fn(x, w):
        return _ScaledMM.apply(x.sin(), w).cos()

    seen = []

    def policy(ctx, op, *args, **kwargs):
        seen.append(op)
        return CP.MUST_SAVE if op is MM else CP.PREFER_RECOMPUTE

    region = sc.sac_region(policy, name="Fn")(fn)
    if mode == "compile":
        torch._dynamo.reset()
        region = torch.compile(region, backend=make_backend(compiler="aot_eager"))
    _assert_same(fn, region, x, w, atol=1e-5, rtol=1e-5)
    assert MM in seen


def test_tags_through_decompositions():
    # Under Inductor's decompositions silu becomes several ATen ops; each of them inherits
    # silu's MUST_SAVE, so none is recomputed.
    from torch._inductor.decomposition import select_decomp_table
    x, w = _inputs()

    def fn(x, w):
        return torch.nn.functional.silu(x @ w).cos() @ w

    def policy(ctx, op, *args, **kwargs):
        return CP.MUST_SAVE if op in (MM, aten.silu.default) else CP.PREFER_RECOMPUTE

    region = sc.sac_region(policy, name="Dec")(fn)
    decomps = select_decomp_table()
    assert aten.silu.default in decomps
    _assert_same(fn, region, x, w)
    reports = []
    fw, bw = _compiled_graph_counts(region, x, w, decompositions=decomps, reports=reports)
    assert aten.silu.default not in fw and aten.exp.default in fw  # decomposed ...
    assert reports[0].recomputed == ["aten.cos.default"]  # ... and none of its parts recomputed
    assert bw.get(aten.mm.default, 0) == 4
