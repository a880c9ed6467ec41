"""The shared fixture models and measurement helpers (no sac_compile involved)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fixtures import MODEL_NAMES, make_model, max_grad_diff, reference_grads
from fixtures.measure import (SavedBytes, TorchSAC, count_aten_ops, interleaved_medians,
                              param_storages, torch_sac_blocks)
from fixtures.models import grads_of

aten = torch.ops.aten


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_builds_and_trains(name):
    model, inputs = make_model(name)
    assert isinstance(model.blocks, nn.ModuleList) and len(model.blocks) >= 2
    assert model.training
    out = model(*inputs)
    assert isinstance(out, torch.Tensor) and out.requires_grad
    assert torch.isfinite(out).all()
    out.sum().backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, pname
        assert torch.isfinite(p.grad).all(), pname
    assert inputs[0].grad is not None and inputs[0].grad.abs().sum() > 0


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_deterministic_for_a_seed(name):
    m1, x1 = make_model(name, seed=3)
    m2, x2 = make_model(name, seed=3)
    m3, _ = make_model(name, seed=4)
    for (n, p1), p2, p3 in zip(m1.named_parameters(), m2.parameters(), m3.parameters()):
        assert torch.equal(p1, p2), n
    assert not all(torch.equal(p1, p3) for p1, p3 in zip(m1.parameters(), m3.parameters()))
    assert torch.equal(x1[0], x2[0])

    g1 = reference_grads(m1, x1, seed=7)
    g2 = reference_grads(m1, x1, seed=7)   # same model again: grads do not accumulate
    g3 = reference_grads(m2, x2, seed=7)   # an identical model
    assert g1.keys() == g3.keys() and "input:0" in g1
    assert max_grad_diff(g1, g2) == 0.0
    assert max_grad_diff(g1, g3) == 0.0
    assert m1.blocks[0].parameters().__next__().grad is None  # cleared afterwards


def test_make_model_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    make_model("gpt")
    assert torch.equal(torch.rand(4), expected)


def test_gpt_dropout_depends_on_the_seed():
    model, inputs = make_model("gpt")
    ops = count_aten_ops(model, *inputs)
    assert ops[aten.bernoulli_.float] > 0  # random ops appear in training
    assert ops[aten._scaled_dot_product_flash_attention_for_cpu.default] == len(model.blocks)
    a = reference_grads(model, inputs, seed=0)
    b = reference_grads(model, inputs, seed=1)
    assert max_grad_diff(a, b) > 0
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(*inputs), model(*inputs))


def test_conv_updates_batchnorm_running_stats():
    model, inputs = make_model("conv")
    bn = model.blocks[0].bn
    mean0, var0 = bn.running_mean.clone(), bn.running_var.clone()
    buffer, ptr = bn.running_mean, bn.running_mean.data_ptr()
    model(*inputs).sum().backward()
    assert bn.num_batches_tracked.item() == 1
    assert not torch.equal(bn.running_mean, mean0)
    assert not torch.equal(bn.running_var, var0)
    # Updated in place (the kernel writes the buffer; no new tensor is assigned).
    assert bn.running_mean is buffer and buffer.data_ptr() == ptr


def test_moe_routes_with_topk_and_index_ops():
    model, inputs = make_model("moe")
    ops = count_aten_ops(model, *inputs)
    for op in (aten.topk.default, aten.index_select.default, aten.index_add_.default,
               aten.scatter.src, aten._softmax.default):
        assert ops[op] > 0, op


def test_sizes_and_errors():
    model, (x,) = make_model("mlp", size="bench")
    assert len(model.blocks) == 8 and tuple(x.shape) == (64, 1024)
    assert model.blocks[0].fc1.weight.shape == (4096, 1024)
    del model
    stack, _ = make_model("gpt", size="stack32")
    assert len(stack.blocks) == 32
    with pytest.raises(ValueError, match="unknown fixture model 'nope'"):
        make_model("nope")
    with pytest.raises(ValueError, match="unknown size 'stack32' for fixture 'mlp'"):
        make_model("mlp", size="stack32")


def test_saved_bytes_hand_computed():
    # y = sin(x) saves x; z = y * w saves y and w (w excluded as a parameter).
    x = torch.randn(4, 8, requires_grad=True)
    w = nn.Parameter(torch.randn(8))
    with SavedBytes(exclude={*param_storages(nn.ParameterList([w]))}) as sb:
        (x.sin() * w).sum()
    assert sb.nbytes == 2 * 4 * 8 * 4
    assert sb.packed == 3


def test_torch_sac_instrumentation_on_mlp():
    # One MLP block d=16, hidden=64, batch 4, saving mm/addmm: the cache holds the two addmm
    # outputs (4x64 and 4x16 floats); the checkpoint's saved input (4x16) is seen outside.
    model, inputs = make_model("mlp")
    ref = reference_grads(model, inputs, seed=0)
    sac = TorchSAC()
    exclude = param_storages(model)
    with torch_sac_blocks(model, sac), SavedBytes(exclude) as outside:
        loss = model(*inputs).sum()
    assert sac.cached_bytes(exclude) == len(model.blocks) * (4 * 64 + 4 * 16) * 4
    # Inputs of both blocks plus the head's input.
    assert outside.nbytes == 3 * 4 * 16 * 4
    loss.backward()
    # Per block the recompute runs t (x2), gelu, add, native_layer_norm.
    assert sac.recomputed[aten.gelu.default] == len(model.blocks)
    assert sac.recomputed_ops == 5 * len(model.blocks)
    assert max_grad_diff(ref, grads_of(model, inputs)) == 0.0
    assert "forward" not in vars(model.blocks[0])  # unwrapped again


def test_interleaved_medians_runs_each():
    calls = []
    t = interleaved_medians({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                            reps=3, warmup=1)
    assert calls.count("a") == calls.count("b") == 4
    assert len(t["a"].samples) == 3 and t["b"].median >= 0


def test_demo_measurements_on_the_test_mlp():
    # The demo's three strategies on the tiny MLP: hand-computed bytes (batch 4, d=16,
    # hidden 64, fp32, 2 blocks) and identical gradients.
    from fixtures.measure import (TORCH_SAVE_MATMUL_OPS, measure_noac, measure_ours,
                                  measure_torch_sac)

    model, inputs = make_model("mlp", size="test", seed=0)
    noac = measure_noac(model, inputs, seed=0)
    tsac = measure_torch_sac(model, inputs, TORCH_SAVE_MATMUL_OPS, seed=0)
    ours = measure_ours(model, inputs, "save_matmuls", seed=0)
    d0, d1, d2 = (max_grad_diff(noac.grads, r.grads) for r in (noac, tsac, ours))
    assert d0 == d1 == d2 == 0.0
    per_block_cache = (4 * 64 + 4 * 16) * 4   # the two addmm outputs
    block_input = head_input = 4 * 16 * 4
    assert tsac.policy_bytes == ours.policy_bytes == 2 * per_block_cache
    assert tsac.saved_bytes == 2 * per_block_cache + 2 * block_input + head_input
    assert ours.saved_bytes <= tsac.saved_bytes
    assert tsac.recomputed_ops == 2 * 5 and noac.recomputed_ops == 0
    assert 0 < ours.recomputed_ops <= tsac.recomputed_ops
