"""Compiled regions at model scale: identical blocks share one graph and one split (the name
is data, not a guard), policies are values, and policies that differ - by a closure value,
or by reading the region's name - get splits of their own."""
from __future__ import annotations

import copy
import gc
import dataclasses
import io
import pickle

import pytest
import torch
from torch._dynamo.utils import counters

from fixtures.capture import Captured
from fixtures.tiny_stack import Block, Stack
import sac_compile as sc
from sac_compile import CheckpointPolicy as P, policies
from sac_compile.region_groups import members_of

aten = torch.ops.aten


def _grads(model, x):
    x = x.detach().requires_grad_()
    model(x).pow(2).sum().backward()
    return [x.grad] + [p.grad for p in model.parameters()]


def _compile_per_block(model, capture):
    """torchtitan's apply_compile: each block compiled on its own, fullgraph=True."""
    backend = capture.backend()
    for layer in model.layers:
        layer.compile(backend=backend, fullgraph=True)


def test_identical_blocks_compiled_per_block_share_one_graph_and_one_split(capture):
    reference = Stack(32)
    model = copy.deepcopy(reference)
    sc.apply_regions(model, policies.save_matmuls, where=Block)
    _compile_per_block(model, capture)
    counters.clear()
    x = torch.randn(4, 16)
    got = _grads(model, x)
    assert counters["stats"]["unique_graphs"] == 1      # one Dynamo compile for 32 blocks
    assert len(capture.reports) == 1                    # one partition
    for a, b in zip(got, _grads(reference, x)):
        torch.testing.assert_close(a, b)
    # the per-layer names stay known: the graph's group lists every block
    gc.collect()  # models of earlier tests, with blocks of the same names
    assert members_of("layers.0") == [f"layers.{i}" for i in range(32)]


def _factory(save_mm: bool):
    def policy(ctx, op, *args, **kwargs):
        if op is aten.mm.default or op is aten.addmm.default:
            return P.MUST_SAVE if save_mm else P.MUST_RECOMPUTE
        return None
    return policy


def _split_of(policy, per_block=True):
    model = Stack(2)
    sc.apply_regions(model, policy, where=Block)
    cap = Captured()
    _compile_per_block(model, cap)
    _grads(model, torch.randn(4, 16))
    return cap.reports


def _signature(report):
    return (report.saved_bytes, report.recompute_flops)


def test_policies_differing_by_a_closure_value_get_splits_of_their_own(capture):
    model = Stack(2)
    sc.sac_region(_factory(True))(model.layers[0])      # both named "Block": only the
    sc.sac_region(_factory(False))(model.layers[1])     # closure value tells them apart
    _compile_per_block(model, capture)
    _grads(model, torch.randn(4, 16))
    assert len(capture.reports) == 2                       # two splits, not one shared
    torch._dynamo.reset()
    (saving,), (recomputing,) = _split_of(_factory(True))[:1], _split_of(_factory(False))[:1]
    assert {_signature(r) for r in capture.reports} == {_signature(saving),
                                                        _signature(recomputing)}
    assert _signature(saving) != _signature(recomputing)
    assert recomputing.recompute_flops > 0 and saving.recompute_flops == 0


def _even_layers_save_matmuls(ctx, op, *args, **kwargs):
    if op is aten.addmm.default and int(ctx.region.rsplit(".", 1)[1]) % 2 == 0:
        return P.MUST_SAVE
    return None


def test_a_policy_reading_the_region_name_decides_per_layer_without_a_recompile_failure(capture):
    reference = Stack(10)
    model = copy.deepcopy(reference)
    sc.apply_regions(model, _even_layers_save_matmuls, where=Block)
    _compile_per_block(model, capture)     # fullgraph=True: a recompile failure would raise
    x = torch.randn(4, 16)
    got = _grads(model, x)
    for a, b in zip(got, _grads(reference, x)):
        torch.testing.assert_close(a, b)
    # one split per distinct set of decisions (even and odd layers), not one per name
    assert len(capture.reports) == 2
    even = [r for r in capture.reports if r.recompute_flops == 0]
    odd = [r for r in capture.reports if r.recompute_flops > 0]
    assert len(even) == len(odd) == 1


def test_a_whole_model_compile_reports_each_block_by_its_own_name(capture):
    model = Stack(3)
    sc.apply_regions(model, policies.save_matmuls, where=Block)
    compiled = torch.compile(model, backend=capture.backend())
    _grads(compiled, torch.randn(4, 16))
    (report,) = capture.reports
    regions = {rec.region for rec in report.saved if rec.region}
    assert regions == {"layers.0", "layers.1", "layers.2"}


# -- policies are values --------------------------------------------------------------------

PRESETS_AND_COMBINATORS = [
    policies.recompute_all, policies.save_all, policies.save_matmuls,
    policies.save_ops(aten.mm, aten.addmm.default), policies.offload_ops(aten.mm.default),
    policies.save_only_these_names("a", "b"), policies.relaxed(policies.save_matmuls),
    policies.compose(policies.relaxed(policies.save_ops(aten.addmm)), policies.save_all),
    sc.policy.normalize_policy([aten.addmm.default]),
]


@pytest.mark.parametrize("policy", PRESETS_AND_COMBINATORS, ids=repr)
def test_a_policy_is_a_value(policy):
    assert dataclasses.is_dataclass(policy)
    copied = pickle.loads(pickle.dumps(policy))
    assert copied == policy and hash(copied) == hash(policy) and repr(copied) == repr(policy)
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.x = 1  # type: ignore[attr-defined]


def test_equal_policy_values_made_apart_are_equal():
    assert policies.save_ops(aten.mm) == policies.save_ops(aten.mm.default, aten.mm.out,
                                                           aten.mm.dtype, aten.mm.dtype_out)
    assert policies.save_only_these_names("a", "b") == policies.save_only_these_names(["b", "a"])
    assert policies.relaxed("save_matmuls") == policies.relaxed(policies.save_matmuls)
    assert policies.save_ops(aten.mm) != policies.save_ops(aten.bmm)


@pytest.mark.parametrize("policy", PRESETS_AND_COMBINATORS, ids=repr)
def test_a_wrapped_model_saves_loads_and_trains_the_same(policy):
    model = Stack(2)
    sc.apply_regions(model, policy, where=Block)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded.layers[0]._sac_regions[0].frame.policy == policy
    x = torch.randn(4, 16)
    for a, b in zip(_grads(loaded, x), _grads(model, x)):
        torch.testing.assert_close(a, b)


def test_a_region_made_inside_compiled_code_compiles_and_is_exact(capture):
    """sac_region applied while Dynamo traces: the identity rule does not run in traced
    code; the region passes its name and policy as constants instead of a group token."""
    def saves_mm(ctx, op, *args, **kwargs):
        return P.MUST_SAVE if op is aten.mm.default else None

    def body(x, w):
        return (x @ w).sin() @ w

    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    body(x, w).sum().backward()
    expected = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    compiled = torch.compile(lambda x, w: sc.sac_region(saves_mm, name="Made")(body)(x, w).sum(),
                             backend=capture.backend())
    compiled(x, w).backward()
    torch.testing.assert_close((x.grad, w.grad), expected)
    assert len(capture.reports) == 1
    assert {r.region for r in capture.reports[0].saved if r.op == "aten.mm.default"} == {"Made"}
