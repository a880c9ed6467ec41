"""The cut's three options per value (issue 12): keep on the device, offload to the host,
recompute. A memory budget counts device bytes only, so it can be met by offloading as well
as by recomputing, whichever costs less per byte freed.

Graph-level tests on the "meta" device (a non-CPU device without hardware), as in
tests/test_compile_offload.py: the split graphs and the report are captured at compile time.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from sac_compile import CheckpointPolicy as CP, sac_region
from sac_compile.compiler import CostModel
from fixtures.capture import capturing_backend
from test_compile_offload import _compile_and_run_on_meta, _ops

pytest.importorskip("torch._functorch._activation_offloading.activation_offloading")
aten = torch.ops.aten


# torch's async offload ops (torch.ops.ao) first shipped in 2.12: an older torch has no
# offload to choose, so a budget is met by recomputing and MUST_CPU_OFFLOAD is an error.
needs_offload_ops = pytest.mark.skipif(
    importlib.util.find_spec("torch._functorch._activation_offloading.offload_ops") is None,
    reason=f"CPU offload under compile needs torch >= 2.12 (torch.ops.ao); this is torch "
           f"{torch.__version__}")


@pytest.fixture(autouse=True)
def fresh_state():
    if importlib.util.find_spec("torch._functorch._activation_offloading.offload_ops"):
        from torch._functorch._activation_offloading import offload_ops as ops
        for clear in (ops._transfer_streams.clear, ops._clear_wait_registry, ops._pool_clear):
            clear()


def prefer_save_matmuls(ctx, op, *args, **kwargs):
    return CP.PREFER_SAVE if op in (aten.mm.default, aten.addmm.default) else \
        CP.PREFER_RECOMPUTE


def _wide_block(policy):
    """Two matmuls with a wide inner dimension: recomputing one (2 * 8192 FLOPs per output
    element) costs far more than moving its output to the host and back; the pointwise
    ops are cheap to recompute."""
    @sac_region(policy, name="Wide")
    def block(x, w1, w2):
        h = torch.relu(x @ w1)
        return (h.sin() @ w2).cos().sum()

    args = (torch.randn(16, 8192, device="meta", requires_grad=True),
            torch.randn(8192, 8192, device="meta", requires_grad=True),
            torch.randn(8192, 8192, device="meta", requires_grad=True))
    return block, args


def _split(policy, **options):
    block, args = _wide_block(policy)
    backend, cap = capturing_backend(**options)
    _compile_and_run_on_meta(block, backend, *args)
    return cap


def _offloaded_ops(cap):
    return sorted(str(n.args[0].target) for n in _ops(cap.fw, "offload"))


def test_without_a_budget_nothing_unmarked_leaves_the_device():
    cap = _split(prefer_save_matmuls)
    assert _offloaded_ops(cap) == []
    assert cap.report.offloaded_bytes == 0
    assert cap.report.activation_bytes > 0


@needs_offload_ops
def test_a_budget_is_met_by_offloading_the_matmuls_and_recomputing_the_pointwise_ops():
    full = _split(prefer_save_matmuls)
    cap = _split(prefer_save_matmuls, memory_budget=0.3)
    r = cap.report
    assert r.activation_bytes <= r.budget_bytes < full.report.activation_bytes
    # a matmul's output costs less to move (its bytes over the host bandwidth) than to
    # recompute; a pointwise op costs less to recompute (sin, from relu's output)
    offloaded = _offloaded_ops(cap)
    assert "aten.mm.default" in offloaded and "aten.sin.default" not in offloaded
    assert "aten.mm.default" not in r.recomputed and "aten.sin.default" in r.recomputed
    assert r.offloaded_bytes == len(offloaded) * 16 * 8192 * 4
    rows = [s for s in r.saved if s.on_host]
    assert len(rows) == len(offloaded)
    assert all("offloaded to meet memory budget 30%" in row.reason for row in rows)
    assert len(_ops(cap.bw, "reload")) == len(offloaded)  # they come back for the backward


def test_with_offload_of_unmarked_values_off_the_budget_recomputes_instead():
    cap = _split(prefer_save_matmuls, memory_budget=0.3,
                 cost_model=CostModel(offload_unmarked=False))
    assert _offloaded_ops(cap) == []
    assert cap.report.offloaded_bytes == 0
    assert cap.report.activation_bytes <= cap.report.budget_bytes
    assert cap.report.recompute_flops >= 2 * 16 * 8192 * 8192  # a matmul is recomputed


def test_a_slow_host_link_makes_recomputing_cheaper_than_offloading():
    cap = _split(prefer_save_matmuls, memory_budget=0.3,
                 cost_model=CostModel(host_device_bandwidth=1e8))
    assert _offloaded_ops(cap) == []
    assert cap.report.recompute_flops >= 2 * 16 * 8192 * 8192


@needs_offload_ops
def test_prefer_cpu_offload_is_a_cost_must_cpu_offload_is_not():
    """PREFER_CPU_OFFLOAD on a cheap pointwise op: the cut recomputes it (cheaper than a
    transfer); MUST_CPU_OFFLOAD on it: offloaded whatever it costs."""
    def offload_sin(kind):
        def policy(ctx, op, *args, **kwargs):
            if op is aten.sin.default:
                return kind
            return prefer_save_matmuls(ctx, op, *args, **kwargs)
        return policy

    prefer = _split(offload_sin(CP.PREFER_CPU_OFFLOAD))
    assert "aten.sin.default" not in _offloaded_ops(prefer)
    assert "aten.sin.default" in prefer.report.recomputed
    must = _split(offload_sin(CP.MUST_CPU_OFFLOAD))
    assert "aten.sin.default" in _offloaded_ops(must)
    assert "aten.sin.default" not in must.report.recomputed


@needs_offload_ops
def test_must_save_never_leaves_the_device_nor_is_recomputed_under_a_budget():
    def must_save_matmuls(ctx, op, *args, **kwargs):
        return CP.MUST_SAVE if op is aten.mm.default else CP.PREFER_RECOMPUTE

    cap = _split(must_save_matmuls, memory_budget=0.9)
    r = cap.report
    assert r.activation_bytes <= r.budget_bytes
    assert "aten.mm.default" not in _offloaded_ops(cap)
    assert "aten.mm.default" not in r.recomputed
    assert all(s.op != "aten.mm.default" for s in r.saved if s.on_host)


def test_cost_model_for_a_device_takes_its_rates():
    """``CostModel.for_device``: a preset's roofline ratio and link (opt-in; the default
    CostModel keeps its ratios). The wide block at 4,096 rows: on an H100 (295 FLOPs per
    byte) recomputing a matmul takes less time than moving its 128 MiB output over PCIe
    and back, so a budget recomputes the matmuls; at the default rates (8 FLOPs per byte)
    it offloads them."""
    from sac_compile.cut.device_rates import PRESETS, rates_for
    h100 = CostModel.for_device("h100")
    assert h100.flops_per_byte == PRESETS["h100"].flops / PRESETS["h100"].memory_bandwidth
    assert (h100.device_memory_bandwidth, h100.host_device_bandwidth) == (3.35e12, 50e9)
    assert CostModel.for_device("h100", recompute_weight=0.5).recompute_weight == 0.5
    assert rates_for("cpu") is PRESETS["cpu"] and rates_for(torch.device("meta")) is None
    with pytest.raises(ValueError, match="no rates for this device"):
        CostModel.for_device(torch.device("meta"))

    def split(cost_model):
        @sac_region(prefer_save_matmuls, name="Wide")
        def block(x, w1, w2):
            return (torch.relu(x @ w1).sin() @ w2).cos().sum()

        args = (torch.randn(4096, 8192, device="meta", requires_grad=True),
                torch.randn(8192, 8192, device="meta", requires_grad=True),
                torch.randn(8192, 8192, device="meta", requires_grad=True))
        backend, cap = capturing_backend(memory_budget=0.3, cost_model=cost_model)
        _compile_and_run_on_meta(block, backend, *args)
        return cap

    on_h100, default = split(h100), split(CostModel())
    assert "aten.mm.default" not in _offloaded_ops(on_h100)
    assert on_h100.report.recompute_flops >= 2 * 4096 * 8192 * 8192
    if importlib.util.find_spec("torch._functorch._activation_offloading.offload_ops"):
        assert "aten.mm.default" in _offloaded_ops(default)
        assert default.report.recompute_flops < 2 * 4096 * 8192 * 8192
