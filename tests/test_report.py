"""PartitionReport snapshots: a change in partitioning shows up as a reviewed diff.

Regenerate with ``EXPECTTEST_ACCEPT=1 pytest tests/test_report.py``.
"""
from __future__ import annotations

import expecttest
import torch

from fixtures.models import loss_fn, make_model
from sac_compile import CheckpointPolicy as CP
from sac_compile import policies, sac_region
from sac_compile.report import PartitionReport, SavedTensorRecord, explain, fmt_bytes

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
saved 44.6 KiB, recomputed 54 ops (0 FLOPs)
  keep 19 parameters (98.2 KiB, not counted)
  save input 2 KiB: input
  save aten.addmm.default 6 KiB: MUST_SAVE by policy in region 'GPTBlock'
  save aten._scaled_dot_product_flash_attention_for_cpu.default[0] 2 KiB: MUST_SAVE by policy in region 'GPTBlock'
  save aten._scaled_dot_product_flash_attention_for_cpu.default[1] 256 B: MUST_SAVE by policy in region 'GPTBlock'
  save aten.add.Tensor 2 KiB: PREFER_RECOMPUTE overridden: saving 2 KiB costs no more than recomputing from 2 KiB, and saves the recompute
  save aten.addmm.default 8 KiB: MUST_SAVE by policy in region 'GPTBlock'
  save aten.addmm.default 2 KiB: MUST_SAVE by policy in region 'GPTBlock'
  save aten.addmm.default 6 KiB: MUST_SAVE by policy in region 'GPTBlock'
  save aten._scaled_dot_product_flash_attention_for_cpu.default[0] 2 KiB: MUST_SAVE by policy in region 'GPTBlock'
  save aten._scaled_dot_product_flash_attention_for_cpu.default[1] 256 B: MUST_SAVE by policy in region 'GPTBlock'
  save aten.add.Tensor 2 KiB: PREFER_RECOMPUTE overridden: saving 2 KiB is cheaper than recomputing from 4 KiB
  save aten.addmm.default 8 KiB: MUST_SAVE by policy in region 'GPTBlock'
  save aten.addmm.default 2 KiB: MUST_SAVE by policy in region 'GPTBlock'
  save aten.native_layer_norm.default[0] 2 KiB: min-cut
  save aten.native_layer_norm.default[1] 64 B: min-cut
  save aten.native_layer_norm.default[2] 64 B: min-cut
  recompute aten.add.Tensor x2
  recompute aten.gelu.default x2
  recompute aten.native_dropout.default x4
  recompute aten.native_layer_norm.default x4
  recompute aten.split.Tensor x2
  recompute aten.t.default x9
  recompute aten.transpose.int x8
  recompute aten.view.default x23""")

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
saved 16.5 KiB, recomputed 116 ops (0 FLOPs)
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
  save aten._softmax.default 256 B: PREFER_RECOMPUTE overridden: saving 256 B costs no more than recomputing from 256 B, and saves the recompute
  save aten.addmm.default 1.2 KiB: MUST_SAVE by policy in region 'MoEBlock'
  save aten.addmm.default 640 B: MUST_SAVE by policy in region 'MoEBlock'
  save aten.addmm.default 1.2 KiB: MUST_SAVE by policy in region 'MoEBlock'
  save aten.addmm.default 640 B: MUST_SAVE by policy in region 'MoEBlock'
  save aten.addmm.default 1.2 KiB: MUST_SAVE by policy in region 'MoEBlock'
  save aten.addmm.default 640 B: MUST_SAVE by policy in region 'MoEBlock'
  save aten.addmm.default 1.2 KiB: MUST_SAVE by policy in region 'MoEBlock'
  save aten.addmm.default 640 B: MUST_SAVE by policy in region 'MoEBlock'
  recompute aten.add.Tensor x2
  recompute aten.detach.default x12
  recompute aten.div.Tensor x2
  recompute aten.gelu.default x8
  recompute aten.index_add.default x8
  recompute aten.index_select.default x8
  recompute aten.mul.Tensor x8
  recompute aten.native_layer_norm.default x2
  recompute aten.scatter.src x2
  recompute aten.select.int x8
  recompute aten.slice.Tensor x8
  recompute aten.sum.dim_IntList x2
  recompute aten.t.default x19
  recompute aten.topk.default x10
  recompute aten.unsqueeze.default x8
  recompute aten.view.default x5
  recompute aten.zeros_like.default x4""")

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
    assert eager.saved_ops == compiled.saved_ops == {"aten.mm.default": 2} or \
        set(eager.saved_ops) == set(compiled.saved_ops)
    assert set(eager.recomputed) == set(compiled.recomputed) - {"aten.t.default"}
