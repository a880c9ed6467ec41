"""Inductor (C++ on CPU) end to end: a small set, since each compile costs seconds."""
from __future__ import annotations

import pytest
import torch

from fixtures.models import grads_of, loss_fn, make_model, max_grad_diff, reference_grads
from sac_compile import policies, sac_region
from sac_compile.compiler import SACPartitioner, sac_backend


def _no_dropout(model):
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model


def test_sac_backend_mlp_gradients():
    ref_model, inputs = make_model("mlp", size="test", seed=0)
    ref = reference_grads(ref_model, inputs, seed=0)
    model, inputs = make_model("mlp", size="test", seed=0)
    for block in model.blocks:
        sac_region(policies.save_matmuls)(block)
    compiled = torch.compile(model, backend=sac_backend)
    loss_fn(compiled(*inputs)).backward()
    assert max_grad_diff(ref, grads_of(model, inputs)) <= 1e-5
    assert sac_backend  # the module-level backend is reusable


@pytest.mark.slow
def test_custom_partitioner_fn_with_dropout_matches_inductor_without_checkpointing():
    """Recomputed dropout reproduces the forward's mask: Inductor seeds its random ops
    before our partitioner runs, so gradients equal Inductor without checkpointing."""
    reports = []
    grads = {}
    for label in ("plain", "sac"):
        model, inputs = make_model("gpt", size="test", seed=0)
        if label == "sac":
            for block in model.blocks:
                sac_region("recompute_all")(block)
            ctx = torch._inductor.config.patch(
                custom_partitioner_fn=SACPartitioner(on_partition=reports.append))
        else:
            ctx = torch._inductor.config.patch({})
        with ctx:
            compiled = torch.compile(model, backend="inductor")
            torch.manual_seed(0)
            loss_fn(compiled(*inputs)).backward()
        grads[label] = grads_of(model, inputs)
    assert reports and any("inductor_random" in op for op in reports[0].recomputed)
    assert max_grad_diff(grads["plain"], grads["sac"]) <= 1e-5


def test_no_dropout_gpt_matches_eager():
    ref_model, inputs = make_model("gpt", size="test", seed=0)
    ref = reference_grads(_no_dropout(ref_model), inputs, seed=0)
    model, inputs = make_model("gpt", size="test", seed=0)
    _no_dropout(model)
    for block in model.blocks:
        sac_region(policies.save_matmuls)(block)
    compiled = torch.compile(model, backend=sac_backend)
    loss_fn(compiled(*inputs)).backward()
    assert max_grad_diff(ref, grads_of(model, inputs)) <= 1e-5
