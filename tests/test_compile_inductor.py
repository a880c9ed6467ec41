"""Inductor (C++ on CPU) end to end: a small set, since each compile costs seconds."""
from __future__ import annotations

import pytest
import torch

from fixtures.models import grads_of, loss_fn, make_model, max_grad_diff, reference_grads
from sac_compile import CheckpointPolicy, policies, sac_region
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


def _recompute_dropout(ctx, op, *args, **kwargs):
    # MUST: the cut would otherwise keep the 512 B masks, costing a recomputed random op
    # its generator state (5,056 B on the CPU) where Inductor needs only its 8 B seed.
    return CheckpointPolicy.MUST_RECOMPUTE if "dropout" in str(op) else None


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
                sac_region(_recompute_dropout)(block)
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


# -- torch.compile(mode=..., options=...) reach Inductor through our backends -------------

def test_inductor_patches_follow_torch_compile_mode_and_options():
    from sac_compile.compiler.backend import RemoveMarkers, inductor_patches
    partitioner = SACPartitioner()
    patches = inductor_patches(partitioner, "max-autotune-no-cudagraphs", None)
    assert patches["max_autotune"] is True and patches["coordinate_descent_tuning"] is True
    assert patches["custom_partitioner_fn"] is partitioner
    assert isinstance(patches["post_grad_custom_pre_pass"], RemoveMarkers)
    assert inductor_patches(partitioner, None, {"max_autotune": False})["max_autotune"] is False
    assert "max_autotune" not in inductor_patches(partitioner, "default", None)
    with pytest.raises(RuntimeError, match="Unexpected optimization option"):
        inductor_patches(partitioner, None, {"no_such_option": 1})      # torch's own check
    with pytest.raises(ValueError, match="replaces sac_compile's partitioner"):
        inductor_patches(partitioner, None, {"custom_partitioner_fn": SACPartitioner()})
    seen = []
    user_pass = RemoveMarkers(seen.append)     # any CustomGraphPass: runs after our removal
    chained = inductor_patches(partitioner, None, {"post_grad_custom_pre_pass": user_pass})
    assert chained["post_grad_custom_pre_pass"].then is user_pass


@pytest.mark.parametrize("how", [{"mode": "max-autotune-no-cudagraphs"},
                                 {"options": {"max_autotune": False}}])
def test_torch_compile_mode_and_options_reach_compile_fx(monkeypatch, how):
    """sac_backend used to fail at the first call with "unexpected keyword argument 'mode'".
    compile_fx is replaced by a recorder (no code generation): what it gets is checked."""
    import torch._inductor.compile_fx as compile_fx_module
    calls = []

    def recording_compile_fx(gm, example_inputs, config_patches=None, **kwargs):
        calls.append(config_patches)
        return gm.forward

    monkeypatch.setattr(compile_fx_module, "compile_fx", recording_compile_fx)
    x = torch.randn(4, 8, requires_grad=True)
    out = torch.compile(lambda x: (x @ x.T).sin().sum(), backend=sac_backend, **how)(x)
    assert torch.allclose(out, (x @ x.T).sin().sum())
    (patches,) = calls
    assert patches["max_autotune"] is ("mode" in how)
    assert isinstance(patches["custom_partitioner_fn"], SACPartitioner)


def test_aot_eager_backend_accepts_mode_like_torchs_aot_eager(capture):
    ref_model, inputs = make_model("mlp", size="test", seed=0)
    ref = reference_grads(ref_model, inputs, seed=0)
    model, inputs = make_model("mlp", size="test", seed=0)
    for block in model.blocks:
        sac_region(policies.save_matmuls)(block)
    compiled = torch.compile(model, backend=capture.backend(),
                             mode="max-autotune-no-cudagraphs")
    torch.manual_seed(0)
    loss_fn(compiled(*inputs)).backward()
    assert len(capture.reports) == 1  # one split, by our partitioner, mode ignored
    assert dict(capture.report.saved_ops) == {"aten.addmm.default": 2, "aten.add.Tensor": 2}
    assert max_grad_diff(ref, grads_of(model, inputs)) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("how", [{"mode": "max-autotune-no-cudagraphs"},
                                 {"options": {"max_autotune": False}}])
def test_sac_backend_with_inductor_mode_and_options(how):
    ref_model, inputs = make_model("mlp", size="test", seed=0)
    ref = reference_grads(ref_model, inputs, seed=0)
    model, inputs = make_model("mlp", size="test", seed=0)
    for block in model.blocks:
        sac_region(policies.save_matmuls)(block)
    compiled = torch.compile(model, backend=sac_backend, **how)
    loss_fn(compiled(*inputs)).backward()
    assert max_grad_diff(ref, grads_of(model, inputs)) <= 1e-5
