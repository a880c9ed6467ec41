"""Gradients of the reference models equal a run without checkpointing (same seed), with a
region on every block, under several policies and nestings."""
import copy

import pytest
import torch

import sac_compile as sc
from sac_compile import CheckpointPolicy as P, policies
from sac_compile.runtime import collect_stats
from fixtures.measure import wrapped_blocks
from fixtures.models import MODEL_NAMES, make_model, max_grad_diff, reference_grads

aten = torch.ops.aten

POLICIES = {
    "recompute_all": "recompute_all",
    "save_matmuls": "save_matmuls",
    "save_all": "save_all",
    "prefer_save_pointwise": lambda ctx, op, *a, **k: P.PREFER_SAVE
    if op in (aten.gelu.default, aten.relu.default) else None,
    "composed": policies.compose(policies.save_ops(aten.native_layer_norm, aten.topk),
                                 policies.save_matmuls),
}


def region_per_block(policy, outer=None):
    def wrap(i, forward):
        inner = sc.sac_region(policy, name=f"block{i}")(forward)
        return sc.sac_region(outer, name="outer")(inner) if outer is not None else inner
    return wrap


def check_parity(name, wrap, seed=0):
    model, inputs = make_model(name, size="test", seed=seed)
    expected = reference_grads(copy.deepcopy(model), inputs, seed)
    with wrapped_blocks(model, wrap), collect_stats() as stats:
        got = reference_grads(model, inputs, seed)
    assert max_grad_diff(expected, got) < 1e-5
    return stats


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_gradients_equal_no_checkpointing(name, policy):
    stats = check_parity(name, region_per_block(POLICIES[policy]))
    assert stats.ops_recorded > 0


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_nested_regions_keep_gradients(name):
    check_parity(name, region_per_block("recompute_all", outer="save_matmuls"))


def test_save_matmuls_keeps_fewer_bytes_than_save_all_and_replays_more():
    kept = {}
    for policy in ("save_all", "save_matmuls", "recompute_all"):
        stats = check_parity("gpt", region_per_block(policy))
        kept[policy] = (stats.saved_bytes, stats.ops_replayed)
    assert kept["save_all"][0] > kept["save_matmuls"][0] > kept["recompute_all"][0] == 0
    assert kept["save_all"][1] < kept["save_matmuls"][1] < kept["recompute_all"][1]


def test_conv_batchnorm_running_stats_match():
    model, inputs = make_model("conv", size="test")
    plain = copy.deepcopy(model)
    reference_grads(plain, inputs, 0)
    with wrapped_blocks(model, region_per_block("recompute_all")):
        reference_grads(model, inputs, 0)
    for (n, a), (_, b) in zip(plain.named_buffers(), model.named_buffers()):
        torch.testing.assert_close(a, b, msg=n)
