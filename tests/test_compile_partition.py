"""The compile path with aot_eager: gradients, MUST/PREFER semantics, torch's own SAC code."""
from __future__ import annotations

import functools

import pytest
import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from fixtures.capture import Captured
from fixtures.models import grads_of, loss_fn, make_model, max_grad_diff, reference_grads
from sac_compile import CheckpointPolicy as CP
from sac_compile import policies, sac_region
from sac_compile.compiler import SACPartitioner
from sac_compile.cut.network import CostModel

aten = torch.ops.aten


def _wrap_blocks(model, policy, *, outer=None):
    for block in model.blocks:
        sac_region(policy)(block)
    if outer is not None:
        sac_region(outer, name="Model")(model)
    return model


def _compiled_grads(model, inputs, seed=0):
    cap = Captured()
    compiled = torch.compile(model, backend=cap.backend())
    torch.manual_seed(seed)
    loss_fn(compiled(*inputs)).backward()
    grads = grads_of(model, inputs)
    return grads, cap.reports


POLICY_CASES = {
    "save_matmuls": dict(policy=policies.save_matmuls),
    "recompute_all": dict(policy="recompute_all"),
    "nested": dict(policy="recompute_all", outer=policies.save_matmuls),
}


@pytest.mark.parametrize("case", sorted(POLICY_CASES))
@pytest.mark.parametrize("model_name", ["mlp", "gpt", "conv", "moe"])
def test_gradient_parity(model_name, case):
    ref_model, ref_inputs = make_model(model_name, size="test", seed=0)
    ref = reference_grads(ref_model, ref_inputs, seed=0)
    model, inputs = make_model(model_name, size="test", seed=0)
    _wrap_blocks(model, **POLICY_CASES[case])
    got, reports = _compiled_grads(model, inputs)
    assert reports, "the partitioner did not run"
    assert set(got) == set(ref)
    assert max_grad_diff(ref, got) <= 1e-5


def test_must_save_is_saved_and_must_recompute_is_not(capture):
    def policy(ctx, op, *args, **kwargs):
        if op is aten.mm.default:
            return CP.MUST_SAVE
        if op is aten.sin.default:
            return CP.MUST_RECOMPUTE
        return None

    @sac_region(policy, name="Block")
    def block(x, w):
        return (x @ w).sin().cos() @ w

    fn = torch.compile(lambda x, w: block(x, w).sum(),
                       backend=capture.backend())
    x = torch.randn(16, 16, requires_grad=True)
    w = torch.randn(16, 16, requires_grad=True)
    fn(x, w).backward()
    (report,) = capture.reports
    ops = {r.op: r.reason for r in report.saved}
    assert ops["aten.mm.default"] == "MUST_SAVE by policy in region 'Block'"
    assert "aten.sin.default" not in ops
    assert "aten.sin.default" in report.recomputed


def test_prefer_recompute_overridden_when_saving_is_cheaper(capture):
    # y is tiny; recomputing it would need the big input x kept for backward.
    @sac_region("recompute_all", name="Reduce")
    def block(x, w):
        return (x.sin().sum(-1) * w).exp()

    fn = torch.compile(lambda x, w: block(x, w).sum(),
                       backend=capture.backend())
    x = torch.randn(64, 1024)
    w = torch.ones(64, requires_grad=True)
    fn(x, w).backward()
    (report,) = capture.reports
    reasons = [r.reason for r in report.saved if not r.is_input]
    assert "PREFER_RECOMPUTE overridden: saving 256 B is cheaper than recomputing from 256 KiB" \
        in reasons, reasons
    assert report.saved_bytes < 64 * 1024 * 4


def test_prefer_save_overridden_for_cheap_pointwise_of_saved_value(capture):
    def policy(ctx, op, *args, **kwargs):
        return CP.MUST_SAVE if op is aten.mm.default else CP.PREFER_SAVE

    @sac_region(policy, name="P")
    def block(x, w):
        y = x @ w
        z = y * 2
        return y.sin() + z.sin()

    fn = torch.compile(lambda x, w: block(x, w).sum(),
                       backend=capture.backend())
    x = torch.randn(32, 32, requires_grad=True)
    w = torch.randn(32, 32, requires_grad=True)
    fn(x, w).backward()
    (report,) = capture.reports
    saved_ops = report.saved_ops
    assert saved_ops["aten.mm.default"] == 1
    assert "aten.mul.Tensor" not in saved_ops  # recomputed from the saved mm: cheaper
    assert "aten.mul.Tensor" in report.recomputed


def test_torch_sac_context_fn_and_full_ac():
    def policy(ctx, op, *args, **kwargs):
        return CP.MUST_SAVE if op is aten.mm.default else CP.PREFER_RECOMPUTE

    def body(x, w):
        return torch.nn.functional.gelu(x @ w) @ w

    def sac(x, w):
        return torch_checkpoint(body, x, w, use_reentrant=False, context_fn=functools.partial(
            create_selective_checkpoint_contexts, policy)).sum()

    def full(x, w):
        return torch_checkpoint(body, x, w, use_reentrant=False).sum()

    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(16, 16, requires_grad=True)
    for fn, expect_mm_saved in ((sac, True), (full, False)):
        body(x, w).sum().backward()
        ref = (x.grad.clone(), w.grad.clone())
        x.grad = w.grad = None
        cap = Captured()
        torch.compile(fn, backend=cap.backend())(x, w).backward()
        assert torch.allclose(x.grad, ref[0]) and torch.allclose(w.grad, ref[1])
        x.grad = w.grad = None
        mm_saved = [r for r in cap.reports[0].saved if r.op == "aten.mm.default"]
        assert bool(mm_saved) == expect_mm_saved
        if expect_mm_saved:
            assert mm_saved[0].reason == "MUST_SAVE by policy in region 'checkpoint'"


def test_untagged_graph_goes_to_upstream(capture):
    fn = torch.compile(lambda x: (x.sin() @ x).cos().sum(),
                       backend=capture.backend())
    fn(torch.randn(8, 8, requires_grad=True)).backward()
    assert capture.reports[0].solver == "upstream"


def test_solvers_agree():
    pytest.importorskip("scipy")
    model, inputs = make_model("gpt", size="test", seed=0)
    _wrap_blocks(model, policies.save_matmuls)
    saved = {}
    for solver in ("networkx", "scipy"):
        cap = Captured()
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=cap.backend(solver=solver))
        torch.manual_seed(0)
        loss_fn(compiled(*inputs)).backward()
        saved[solver] = (cap.reports[0].saved_bytes, cap.reports[0].recompute_flops)
    assert saved["networkx"] == saved["scipy"]


def test_uuid_is_a_hash_of_code_and_options():
    a, b = SACPartitioner(), SACPartitioner()
    assert a.uuid() == b.uuid() and len(a.uuid()) == 64
    assert SACPartitioner(solver="networkx").uuid() != a.uuid()
    assert SACPartitioner(cost_model=CostModel(recompute_weight=1.0)).uuid() != a.uuid()
