"""PartitionReport snapshots: a change in partitioning shows up as a reviewed diff.

Regenerate with ``EXPECTTEST_ACCEPT=1 pytest tests/test_report.py``.
"""
from __future__ import annotations

import expecttest
import pytest
import torch

from fixtures.models import loss_fn, make_model
from sac_compile import CheckpointPolicy as CP
import sac_compile as sc
from sac_compile import policies, sac_region
from sac_compile.explaining import explain
from sac_compile.report import PartitionReport, SavedTensorRecord, fmt_bytes

aten = torch.ops.aten


def _fixture_report(model_name: str, policy) -> PartitionReport:
    model, inputs = make_model(model_name, size="test", seed=0)
    for block in model.blocks:
        sac_region(policy)(block)
    torch.manual_seed(0)
    return explain(lambda *a: loss_fn(model(*a)), *inputs, mode="compile")


class TestSnapshots(expecttest.TestCase):
    def test_mlp_save_matmuls(self):
        self.assertExpectedInline(_fixture_report("mlp", policies.save_matmuls).snapshot(), """\
saved 2.8 KiB, recomputed 9 ops (0 FLOPs)
  keep 9 parameters (16.8 KiB, not counted)
  save input 256 B: input
  save aten.addmm.default 1 KiB: MUST_SAVE by policy in region 'MLPBlock'
  save aten.add.Tensor 256 B: PREFER_RECOMPUTE overridden: saving 256 B costs no more than recomputing from 256 B, and saves the recompute
  save aten.addmm.default 1 KiB: MUST_SAVE by policy in region 'MLPBlock'
  save aten.add.Tensor 256 B: PREFER_RECOMPUTE overridden: saving 256 B is cheaper than recomputing from 512 B
  recompute aten.gelu.default x2
  recompute aten.native_layer_norm.default x2
  recompute aten.t.default x5""")

    def test_gpt_save_matmuls(self):
        self.assertExpectedInline(_fixture_report("gpt", policies.save_matmuls).snapshot(), """\
saved 50.6 KiB, recomputed 42 ops (0 FLOPs)
  keep 19 parameters (98.2 KiB, not counted)
  save input 2 KiB: input
  save aten.addmm.default 6 KiB: MUST_SAVE by policy in region 'GPTBlock'
  save aten._scaled_dot_product_flash_attention_for_cpu.default[0] 2 KiB: MUST_SAVE by policy in region 'GPTBlock'
  save aten._scaled_dot_product_flash_attention_for_cpu.default[1] 256 B: MUST_SAVE by policy in region 'GPTBlock'
  save aten.native_dropout.default[0] 2 KiB: PREFER_RECOMPUTE overridden: saving 2 KiB costs no more than recomputing from 2 KiB, and saves the recompute
  save aten.native_dropout.default[1] 512 B: PREFER_RECOMPUTE overridden: saving 512 B is cheaper than recomputing from 2 KiB
  save aten.add.Tensor 2 KiB: PREFER_RECOMPUTE overridden: saving 2 KiB costs no more than recomputing from 2 KiB, and saves the recompute
  save aten.addmm.default 8 KiB: MUST_SAVE by policy in region 'GPTBlock'
  save aten.native_dropout.default[1] 512 B: PREFER_RECOMPUTE overridden: saving 512 B is cheaper than recomputing from 2 KiB
  save aten.add.Tensor 2 KiB: PREFER_RECOMPUTE overridden: saving 2 KiB costs no more than recomputing from 2 KiB, and saves the recompute
  save aten.addmm.default 6 KiB: MUST_SAVE by policy in region 'GPTBlock'
  save aten._scaled_dot_product_flash_attention_for_cpu.default[0] 2 KiB: MUST_SAVE by policy in region 'GPTBlock'
  save aten._scaled_dot_product_flash_attention_for_cpu.default[1] 256 B: MUST_SAVE by policy in region 'GPTBlock'
  save aten.native_dropout.default[0] 2 KiB: PREFER_RECOMPUTE overridden: saving 2 KiB costs no more than recomputing from 2 KiB, and saves the recompute
  save aten.native_dropout.default[1] 512 B: PREFER_RECOMPUTE overridden: saving 512 B is cheaper than recomputing from 2 KiB
  save aten.add.Tensor 2 KiB: PREFER_RECOMPUTE overridden: saving 2 KiB costs no more than recomputing from 2 KiB, and saves the recompute
  save aten.addmm.default 8 KiB: MUST_SAVE by policy in region 'GPTBlock'
  save aten.native_dropout.default[1] 512 B: PREFER_RECOMPUTE overridden: saving 512 B is cheaper than recomputing from 2 KiB
  save aten.add.Tensor 2 KiB: PREFER_RECOMPUTE overridden: saving 2 KiB costs no more than recomputing from 2 KiB, and saves the recompute
  save aten.native_layer_norm.default[0] 2 KiB: min-cut
  save aten.native_layer_norm.default[1] 64 B: min-cut
  save aten.native_layer_norm.default[2] 64 B: min-cut
  recompute aten.gelu.default x2
  recompute aten.native_layer_norm.default x4
  recompute aten.split.Tensor x2
  recompute aten.t.default x9
  recompute aten.transpose.int x6
  recompute aten.view.default x19""")

    def test_conv_recompute_all(self):
        self.assertExpectedInline(_fixture_report("conv", "recompute_all").snapshot(), """\
saved 13.9 KiB, recomputed 5 ops (350208 FLOPs)
  keep 7 parameters (5.6 KiB, not counted)
  save input 1.5 KiB: input
  save aten._native_batch_norm_legit_functional.default[1] 32 B: PREFER_RECOMPUTE overridden: saving 32 B is cheaper than recomputing from 4.1 KiB
  save aten._native_batch_norm_legit_functional.default[2] 32 B: PREFER_RECOMPUTE overridden: saving 32 B is cheaper than recomputing from 4.1 KiB
  save aten._native_batch_norm_legit_functional.default[3] 32 B: PREFER_RECOMPUTE overridden: saving 32 B is cheaper than recomputing from 4.1 KiB
  save aten._native_batch_norm_legit_functional.default[4] 32 B: PREFER_RECOMPUTE overridden: saving 32 B is cheaper than recomputing from 4.1 KiB
  save aten.relu.default 4 KiB: PREFER_RECOMPUTE overridden: saving 4 KiB costs no more than recomputing from 4 KiB, and saves the recompute
  save aten._native_batch_norm_legit_functional.default[1] 32 B: PREFER_RECOMPUTE overridden: saving 32 B is cheaper than recomputing from 4.1 KiB
  save aten._native_batch_norm_legit_functional.default[2] 32 B: PREFER_RECOMPUTE overridden: saving 32 B is cheaper than recomputing from 4.1 KiB
  save aten._native_batch_norm_legit_functional.default[3] 32 B: PREFER_RECOMPUTE overridden: saving 32 B is cheaper than recomputing from 4.1 KiB
  save aten._native_batch_norm_legit_functional.default[4] 32 B: PREFER_RECOMPUTE overridden: saving 32 B is cheaper than recomputing from 4.1 KiB
  save aten.relu.default 4 KiB: PREFER_RECOMPUTE overridden: saving 4 KiB costs no more than recomputing from 4 KiB, and saves the recompute
  save aten._native_batch_norm_legit_functional.default[1] 32 B: PREFER_RECOMPUTE overridden: saving 32 B is cheaper than recomputing from 4.1 KiB
  save aten._native_batch_norm_legit_functional.default[2] 32 B: PREFER_RECOMPUTE overridden: saving 32 B is cheaper than recomputing from 4.1 KiB
  save aten._native_batch_norm_legit_functional.default[3] 32 B: PREFER_RECOMPUTE overridden: saving 32 B is cheaper than recomputing from 4.1 KiB
  save aten._native_batch_norm_legit_functional.default[4] 32 B: PREFER_RECOMPUTE overridden: saving 32 B is cheaper than recomputing from 4.1 KiB
  save aten.relu.default 4 KiB: PREFER_RECOMPUTE overridden: saving 4 KiB costs no more than recomputing from 4 KiB, and saves the recompute
  save aten.mean.dim 64 B: min-cut
  recompute aten.add.Tensor x1
  recompute aten.convolution.default x3
  recompute aten.t.default x1""")

    def test_moe_save_matmuls(self):
        self.assertExpectedInline(_fixture_report("moe", policies.save_matmuls).snapshot(), """\
saved 17.5 KiB, recomputed 92 ops (0 FLOPs)
  keep 23 parameters (33.2 KiB, not counted)
  save input 1 KiB: input
  save aten._softmax.default 256 B: PREFER_RECOMPUTE overridden: saving 256 B costs no more than recomputing from 256 B, and saves the recompute
  save aten.addmm.default 1.2 KiB: MUST_SAVE by policy in region 'MoEBlock'
  save aten.addmm.default 640 B: MUST_SAVE by policy in region 'MoEBlock'
  save aten.addmm.default 1.2 KiB: MUST_SAVE by policy in region 'MoEBlock'
  save aten.addmm.default 640 B: MUST_SAVE by policy in region 'MoEBlock'
  save aten.addmm.default 1.2 KiB: MUST_SAVE by policy in region 'MoEBlock'
  save aten.addmm.default 640 B: MUST_SAVE by policy in region 'MoEBlock'
  save aten.addmm.default 1.2 KiB: MUST_SAVE by policy in region 'MoEBlock'
  save aten.addmm.default 640 B: MUST_SAVE by policy in region 'MoEBlock'
  save aten.add.Tensor 1 KiB: made by one call of region 'MoEBlock', read by another's recompute: kept so that each region is recomputed from its own inputs, as eager checkpointing does
  save aten._softmax.default 256 B: PREFER_RECOMPUTE overridden: saving 256 B costs no more than recomputing from 256 B, and saves the recompute
  save aten.addmm.default 1.2 KiB: MUST_SAVE by policy in region 'MoEBlock'
  save aten.addmm.default 640 B: MUST_SAVE by policy in region 'MoEBlock'
  save aten.addmm.default 1.2 KiB: MUST_SAVE by policy in region 'MoEBlock'
  save aten.addmm.default 640 B: MUST_SAVE by policy in region 'MoEBlock'
  save aten.addmm.default 1.2 KiB: MUST_SAVE by policy in region 'MoEBlock'
  save aten.addmm.default 640 B: MUST_SAVE by policy in region 'MoEBlock'
  save aten.addmm.default 1.2 KiB: MUST_SAVE by policy in region 'MoEBlock'
  save aten.addmm.default 640 B: MUST_SAVE by policy in region 'MoEBlock'
  recompute aten.add.Tensor x1
  recompute aten.detach.default x7
  recompute aten.div.Tensor x2
  recompute aten.gelu.default x8
  recompute aten.index_add.default x4
  recompute aten.index_select.default x8
  recompute aten.mul.Tensor x4
  recompute aten.native_layer_norm.default x2
  recompute aten.scatter.src x2
  recompute aten.select.int x8
  recompute aten.sum.dim_IntList x2
  recompute aten.t.default x19
  recompute aten.topk.default x10
  recompute aten.unsqueeze.default x8
  recompute aten.view.default x4
  recompute aten.zeros_like.default x3""")

    def test_prefer_recompute_override_reason(self):
        @sac_region("recompute_all", name="Reduce")
        def block(x, w):
            return (x.sin().sum(-1) * w).exp()

        report = explain(lambda x, w: block(x, w).sum(), torch.randn(64, 1024),
                         torch.ones(64, requires_grad=True), mode="compile")
        self.assertExpectedInline(report.snapshot(), """\
saved 512 B, recomputed 0 ops (0 FLOPs)
  save aten.sum.dim_IntList 256 B: PREFER_RECOMPUTE overridden: saving 256 B is cheaper than recomputing from 256 KiB
  save aten.exp.default 256 B: PREFER_RECOMPUTE overridden: saving 256 B costs no more than recomputing from 256 B, and saves the recompute""")


def test_str_is_a_table():
    report = PartitionReport(saved=[SavedTensorRecord("mm", "aten.mm.default", 4096,
                                                      "MUST_SAVE by policy in region 'Block'")],
                             recomputed=["aten.relu.default", "aten.relu.default"],
                             recompute_flops=0)
    text = str(report)
    assert "saved 4 KiB in 1 values" in text
    assert ["mm", "aten.mm.default", "4", "KiB", "MUST_SAVE"] == text.splitlines()[2].split()[:5]
    assert "aten.relu.default x2" in text
    assert report.saved_bytes == 4096


def test_fmt_bytes():
    assert [fmt_bytes(n) for n in (0, 1023, 4096, 1536, 16 << 20)] == \
        ["0 B", "1023 B", "4 KiB", "1.5 KiB", "16 MiB"]
    # the report table's columns: fixed decimals; not measured is n/a
    assert [fmt_bytes(n, 2) for n in (0, 1023, 4096, 1536, 16 << 20, None)] == \
        ["0 B", "1023 B", "4.00 KiB", "1.50 KiB", "16.00 MiB", "n/a"]


def test_explain_eager_and_compile_have_the_same_shape():
    def policy(ctx, op, *args, **kwargs):
        return CP.MUST_SAVE if op is aten.mm.default else CP.MUST_RECOMPUTE

    @sac_region(policy, name="Block")
    def block(x, w):
        return (x @ w).relu().sin() @ w

    x = torch.randn(8, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    eager = explain(lambda x, w: block(x, w).sum(), x, w, mode="eager")
    compiled = explain(lambda x, w: block(x, w).sum(), x, w, mode="compile")
    # The same activations, with the same sizes and reasons, in both modes (the first mm;
    # the second one's output is not needed by backward).
    assert eager.saved_ops == compiled.saved_ops == {"aten.mm.default": 1}
    assert [(r.op, r.nbytes, r.reason) for r in eager.saved if not r.is_input] == \
        [(r.op, r.nbytes, r.reason) for r in compiled.saved if not r.is_input]
    assert eager.activation_bytes == compiled.activation_bytes
    assert set(eager.recomputed) == set(compiled.recomputed) - {"aten.t.default"}


# --- recompute FLOPs in both modes, parameters, coverage, estimated costs -----------------

def _mlp_region(policy="recompute_all"):
    @sac_region(policy, name="Block")
    def block(x, w1, w2):
        return torch.nn.functional.gelu(x @ w1) @ w2
    return block


def test_eager_explain_counts_recompute_flops_as_compile_does():
    """Backward needs ``x @ w1`` (for gelu's backward): recompute_all replays that mm, and
    both modes count it by flop_counter's rule, 2 x 64 x 256 x 1024."""
    x = torch.randn(64, 256, requires_grad=True)
    w1, w2 = torch.randn(256, 1024, requires_grad=True), torch.randn(1024, 256, requires_grad=True)
    block = _mlp_region()
    eager = explain(lambda *a: block(*a).sum(), x, w1, w2, mode="eager")
    compiled = explain(lambda *a: block(*a).sum(), x, w1, w2, mode="compile")
    assert eager.recomputed_ops["aten.mm.default"] == 1
    assert eager.recompute_flops == compiled.recompute_flops == 2 * 64 * 256 * 1024


def test_eager_explain_flops_ignore_backwards_own_matmuls():
    """save_matmuls: only gelu is replayed (0 FLOPs by flop_counter's rules); backward's
    own mms run meanwhile and are not recompute."""
    x = torch.randn(16, 32, requires_grad=True)
    w1, w2 = torch.randn(32, 64, requires_grad=True), torch.randn(64, 32, requires_grad=True)
    block = _mlp_region(policies.save_matmuls)
    report = explain(lambda *a: block(*a).sum(), x, w1, w2, mode="eager")
    assert report.recomputed == ["aten.gelu.default"] and report.recompute_flops == 0


def test_saved_bytes_without_regions_leave_parameters_out():
    """No region, no tag: torch's partitioner splits the graph, and the report still says
    which inputs are parameters (they are not counted)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 64))
    x = torch.randn(8, 64)
    report = explain(model, x, mode="compile")
    params = [r for r in report.saved if r.reason.startswith("parameter")]
    assert params and all(r.is_input for r in params)
    param_bytes = {p.numel() * p.element_size() for p in model.parameters()}
    assert {r.nbytes for r in params} <= param_bytes
    inputs = [r for r in report.saved if r.is_input and not r.reason.startswith("parameter")]
    assert [r.nbytes for r in inputs] == [x.numel() * 4]
    assert report.saved_bytes == sum(r.nbytes for r in report.saved if r not in params)
    assert report.saved_bytes < 64 * 1024  # the 64 KiB weight is not in it


def test_reports_say_what_each_mode_covers():
    x = torch.randn(8, 16, requires_grad=True)
    w1, w2 = torch.randn(16, 32, requires_grad=True), torch.randn(32, 16, requires_grad=True)
    block = _mlp_region(policies.save_matmuls)
    # outside the region: sin saves its input (x's storage, 512 B)
    eager = explain(lambda x, w1, w2: block(x.sin(), w1, w2).sum(), x, w1, w2, mode="eager")
    assert "region internals" in eager.coverage and eager.outside_bytes == 8 * 16 * 4
    assert "covers region internals" in str(eager)
    assert "whole compiled graph" in PartitionReport(mode="compile").coverage


# Two custom ops, as a library would register them: a matmul and an elementwise op.
@torch.library.custom_op("sac_compile_test_report::matmul", mutates_args=())
def _custom_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a @ b


@_custom_matmul.register_fake
def _(a, b):
    return a.new_empty(a.shape[0], b.shape[1])


def _custom_matmul_backward(ctx, grad):
    a, b = ctx.saved_tensors
    return grad @ b.t(), a.t() @ grad


_custom_matmul.register_autograd(_custom_matmul_backward,
                                 setup_context=lambda ctx, inputs, output:
                                 ctx.save_for_backward(*inputs))


@torch.library.custom_op("sac_compile_test_report::shift", mutates_args=())
def _custom_shift(a: torch.Tensor) -> torch.Tensor:
    return a + 1


@_custom_shift.register_fake
def _(a):
    return torch.empty_like(a)


def test_op_flops_formula_zero_or_estimate():
    from sac_compile.op_costs import is_cost_estimated, op_flops
    a, b = torch.randn(8, 16), torch.randn(16, 32)
    mm = torch.ops.sac_compile_test_report.matmul.default
    shift = torch.ops.sac_compile_test_report.shift.default
    assert op_flops(aten.mm.default, (a, b), {}, a @ b) == (2 * 8 * 16 * 32, False)
    assert op_flops(aten.sin.default, (a,), {}, a.sin()) == (0, False)  # memory-bound
    assert op_flops(mm, (a, b), {}, a @ b) == (2 * 8 * 16 * 32, True)   # like a matmul
    assert op_flops(shift, (a,), {}, a + 1) == (2 * 8 * 16 * 4, True)   # bytes in + out
    assert is_cost_estimated(mm) and is_cost_estimated(shift)
    assert not is_cost_estimated(aten.mm.default) and not is_cost_estimated(aten.sin.default)
    if hasattr(aten, "_grouped_mm"):  # no flop_counter formula: estimated, 2 x S x K x N
        x, w = torch.randn(12, 16), torch.randn(3, 16, 8)
        offs = torch.tensor([4, 8, 12], dtype=torch.int32)
        out = torch._grouped_mm(x, w, offs=offs)
        assert op_flops(aten._grouped_mm.default, (x, w), {"offs": offs}, out) == \
            (2 * 12 * 16 * 8, True)
    # the CPU flash-attention kernel is counted by the flash formula, not estimated
    q = torch.randn(1, 2, 8, 4)
    out = aten._scaled_dot_product_flash_attention_for_cpu.default(q, q, q)
    flops, estimated = op_flops(aten._scaled_dot_product_flash_attention_for_cpu.default,
                                (q, q, q), {}, out)
    assert flops > 0 and not estimated


def test_recomputed_custom_op_is_costed_and_flagged():
    @sac_region("recompute_all", name="Custom")
    def block(a, b):
        return torch.ops.sac_compile_test_report.matmul(a, b).sin()

    a = torch.randn(8, 16, requires_grad=True)
    b = torch.randn(16, 32, requires_grad=True)
    report = explain(lambda a, b: block(a, b).sum(), a, b, mode="compile")
    label = "sac_compile_test_report.matmul.default"
    assert report.recomputed_ops[label] == 1
    assert report.recompute_flops == 2 * 8 * 16 * 32
    assert report.cost_estimated == [label]
    assert f"cost estimated (no FLOP formula): {label}" in report.snapshot()


# -- explain leaves the user's tensors as they were ------------------------------------------

@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_explain_leaves_grads_rng_and_buffers_as_they_were(mode):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8),
                                torch.nn.Dropout(0.5), torch.nn.Linear(8, 8))
    sc.sac_region("save_matmuls")(model[1])
    x = torch.randn(4, 8, requires_grad=True)
    model[0].weight.grad = torch.full_like(model[0].weight, 7.0)  # the user's accumulated grad
    stats = model[1].running_mean.clone()
    rng = torch.get_rng_state()
    sc.explain(model, x, mode=mode)
    assert torch.equal(model[0].weight.grad, torch.full_like(model[0].weight, 7.0))
    assert model[3].weight.grad is None and x.grad is None
    assert torch.equal(model[1].running_mean, stats)
    assert torch.equal(torch.get_rng_state(), rng)


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_records_carry_their_facts(mode):
    """What a record is (a parameter, kept by a MUST about itself) is a field, never read
    back from its reason's wording."""
    lin = torch.nn.Linear(16, 16, bias=False)

    def policy(ctx, op, *args, **kwargs):
        return CP.MUST_SAVE if op is torch.ops.aten.mm.default else CP.PREFER_RECOMPUTE

    block = sac_region(policy, name="Lin")(lambda x: lin(x).sin())
    report = explain(lambda x: block(x).sum(), torch.randn(8, 16, requires_grad=True),
                     mode=mode)
    mm = [r for r in report.saved if r.op == "aten.mm.default"]
    assert len(mm) == 1 and mm[0].must and not mm[0].is_parameter
    assert not any(r.must for r in report.saved if r.op != "aten.mm.default")
    params = [r for r in report.saved if r.is_parameter]
    assert report.saved_bytes == sum(r.nbytes for r in report.saved if not r.is_parameter)
    if mode == "compile":  # the weight, an input of the graph, is kept for x's gradient
        assert [(r.nbytes, r.is_input) for r in params] == [(16 * 16 * 4, True)]
