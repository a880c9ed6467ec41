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
    before our partitioner runs, so gradients equal Inductor without checkpointing. Plain
    recompute_all recomputes the masks from their seeds (no MUST_RECOMPUTE needed)."""
    reports = []
    grads = {}
    for label in ("plain", "sac"):
        model, inputs = make_model("gpt", size="test", seed=0)
        if label == "sac":
            for block in model.blocks:
                sac_region(policies.recompute_all)(block)
            ctx = torch._inductor.config.patch(
                custom_partitioner_fn=SACPartitioner(on_partition=reports.append))
        else:
            ctx = torch._inductor.config.patch({})
        with ctx:
            compiled = torch.compile(model, backend="inductor")
            torch.manual_seed(0)
            loss_fn(compiled(*inputs)).backward()
        grads[label] = grads_of(model, inputs)
    assert reports and [op for op in reports[0].recomputed if "inductor_random" in op] == \
        ["prims.inductor_random.default"] * 4
    assert not [r for r in reports[0].saved if r.op == "aten.gt.Scalar"]
    assert max_grad_diff(grads["plain"], grads["sac"]) <= 1e-5


def _inductor_joint_passes_then_ours(on_partition):
    """Inductor's joint-graph passes (replace_random, ...) and decompositions, then our
    partitioner, as compile_fx runs them, without Inductor's code generation."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._guards import detect_fake_mode
    from torch._inductor.compile_fx import partition_fn
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.virtualized import V

    def partition(gm, joint_inputs, **kwargs):
        with V.set_fake_mode(detect_fake_mode(joint_inputs)):
            return partition_fn(gm, joint_inputs, **kwargs)

    def nop(gm, _):
        return make_boxed_func(gm.forward)

    return (torch._inductor.config.patch(custom_partitioner_fn=SACPartitioner(
                on_partition=on_partition)),
            aot_autograd(fw_compiler=nop, bw_compiler=nop, partition_fn=partition,
                         decompositions=select_decomp_table()))


def test_recompute_all_recomputes_inductor_seeded_dropout_from_its_seeds():
    """Inductor's replace_random rewrites a region's dropout draw into inductor_lookup_seed
    + inductor_random, which carried only torch's keys: taken for a region call of their
    own, the region-boundary floor kept every 512 B mask. They now join their region:
    each mask is recomputed from its 8 B seed (kept 4,256 B, was 6,272; modelled peak
    62,480 B, was 63,488)."""
    torch._dynamo.reset()
    reports = []
    model, inputs = make_model("gpt", size="test", seed=0)
    for block in model.blocks:
        sac_region(policies.recompute_all)(block)
    patch, backend = _inductor_joint_passes_then_ours(reports.append)
    with patch:
        torch.manual_seed(0)
        loss_fn(torch.compile(model, backend=backend)(*inputs)).backward()
    (report,) = reports
    random = [(op, region) for op, region in zip(report.recomputed, report.recomputed_regions)
              if "inductor_random" in op]
    assert random == [("prims.inductor_random.default", "GPTBlock")] * 4
    kept = sorted((r.op, r.nbytes) for r in report.saved if not r.is_input)
    assert [k for k in kept if k[0] == "aten.gt.Scalar"] == []
    assert kept.count(("prims.inductor_lookup_seed.default", 8)) == 4
    assert report.activation_bytes == 4256
    assert report.peak.backward == 62480
    torch._dynamo.reset()


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
