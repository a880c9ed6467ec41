"""On a CUDA device (issue 21): regions in eager mode and compiled with Inductor against no
checkpointing, CPU offload under compile, bf16 SaveWithHooks and a memory budget, with the
device's own allocator figures. Marked ``cuda`` (``pytest -m cuda``; what
``benchmarks/gpu_check.py`` runs) and skipped without a CUDA device.

Only torch, pytest and the fixtures are imported, so these run on a bare CUDA image.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from fixtures.models import MLP, grads_of, loss_fn, make_model, max_grad_diff, reference_grads
from sac_compile import SaveWithHooks, policies, sac_region
from sac_compile.compiler import make_backend

aten = torch.ops.aten

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

needs_offload_ops = pytest.mark.skipif(
    importlib.util.find_spec("torch._functorch._activation_offloading.offload_ops") is None,
    reason=f"CPU offload under compile needs torch >= 2.12 (torch.ops.ao); this is torch "
           f"{torch.__version__}")

DEVICE = "cuda"
POLICIES = {"save_matmuls": policies.save_matmuls, "recompute_all": policies.recompute_all}


def _rel(a: dict, b: dict) -> float:
    """Largest gradient difference over the largest reference gradient."""
    return max_grad_diff(a, b) / max(g.abs().max().item() for g in b.values())


def _model(name: str, size: dict | None = None):
    """Fixture ``name`` at its test size, or an MLP of ``size``, on the device."""
    if size is None:
        return make_model(name, size="test", seed=0, device=DEVICE)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = MLP(**size["model"])
        x = torch.randn(size["input"])
    return model.to(DEVICE).train(), (x.to(DEVICE).requires_grad_(True),)


def _wrapped(name: str, policy, size: dict | None = None):
    model, inputs = _model(name, size)
    for block in model.blocks:
        sac_region(policy)(block)
    return model, inputs


def _ref(name: str, size: dict | None = None) -> dict:
    return reference_grads(*_model(name, size), seed=0)


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("name", ["gpt", "mlp"])
def test_eager_regions_give_no_checkpointing_gradients(name, policy):
    ref = _ref(name)
    model, inputs = _wrapped(name, POLICIES[policy])
    torch.manual_seed(0)  # gpt: dropout, replayed in backward with the forward's CUDA state
    loss_fn(model(*inputs)).backward()
    assert _rel(grads_of(model, inputs), ref) <= 1e-5


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("name", ["gpt", "mlp"])
def test_compiled_regions_give_no_checkpointing_gradients(name, policy):
    ref = _ref(name)
    model, inputs = _wrapped(name, POLICIES[policy])
    reports = []
    compiled = torch.compile(model, backend=make_backend(on_partition=reports.append))
    # fallback_random: Inductor draws dropout masks from the eager generator, as the reference
    with torch._inductor.config.patch(fallback_random=True):
        torch.manual_seed(0)
        loss_fn(compiled(*inputs)).backward()
    assert reports, "our partitioner did not run"
    assert _rel(grads_of(model, inputs), ref) <= 1e-3
    if policy == "save_matmuls":
        assert any("mm" in r.op for r in reports[0].saved if not r.is_input), reports[0]


# Large enough that the saved activations dominate what a step allocates.
BIG_MLP = dict(model=dict(d=512, hidden=2048, n_layers=8, d_out=16), input=(1024, 512))


def _step_peak(model, inputs, backend):
    """Compile, one step (the compile), then the measured step: device bytes allocated at
    the step's peak above what it began with, and the gradients."""
    compiled = torch.compile(model, backend=backend)
    loss_fn(compiled(*inputs)).backward()
    for t in (*model.parameters(), *inputs):
        t.grad.zero_()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss_fn(compiled(*inputs)).backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before, grads_of(model, inputs)


@needs_offload_ops
def test_offload_under_compile_lowers_device_memory_with_exact_gradients():
    ref = _ref("mlp", BIG_MLP)
    saved_reports, offload_reports = [], []
    model, inputs = _wrapped("mlp", policies.save_ops(aten.addmm), BIG_MLP)
    saved_peak, saved_grads = _step_peak(model, inputs,
                                         make_backend(on_partition=saved_reports.append))
    torch._dynamo.reset()
    model, inputs = _wrapped("mlp", policies.offload_ops(aten.addmm), BIG_MLP)
    offload_peak, offload_grads = _step_peak(model, inputs,
                                             make_backend(on_partition=offload_reports.append))
    report = offload_reports[0]
    assert report.offloaded_bytes > 0, report
    assert report.activation_bytes < saved_reports[0].activation_bytes
    assert offload_peak < saved_peak, (offload_peak, saved_peak)
    # the values come back as they left: the same arithmetic as keeping them on the device
    assert _rel(offload_grads, saved_grads) <= 1e-6
    assert _rel(offload_grads, ref) <= 1e-3


def _to_bf16(t):
    return t.to(torch.bfloat16)


def _from_bf16(t):
    return t.to(torch.float32)


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_bf16_save_with_hooks(mode):
    ref = _ref("mlp")
    hooks = SaveWithHooks(_to_bf16, _from_bf16)

    def pack_matmuls(ctx, op, *args, **kwargs):
        return hooks if op in (aten.mm.default, aten.addmm.default) else None

    model, inputs = _wrapped("mlp", pack_matmuls)
    reports = []
    fn = model if mode == "eager" else torch.compile(
        model, backend=make_backend(on_partition=reports.append))
    loss_fn(fn(*inputs)).backward()
    rel = _rel(grads_of(model, inputs), ref)
    assert 0 < rel <= 2e-2  # rounded to bf16's 8-bit mantissa, so not exact, but close
    if mode == "compiled":
        packed = [r for r in reports[0].saved if "packed by SaveWithHooks" in r.reason]
        assert len(packed) == 4, reports[0]
        # fc1's [4, 64] and fc2's [4, 16] fp32 outputs in each of the two blocks, halved
        assert sorted(r.nbytes for r in packed) == [128, 128, 512, 512], packed


def test_memory_budget_saves_less_and_lowers_the_peak():
    ref = _ref("mlp", BIG_MLP)
    full_reports, half_reports = [], []
    model, inputs = _wrapped("mlp", policies.relaxed(policies.save_matmuls), BIG_MLP)
    full_peak, _ = _step_peak(model, inputs, make_backend(on_partition=full_reports.append))
    torch._dynamo.reset()
    model, inputs = _wrapped("mlp", policies.relaxed(policies.save_matmuls), BIG_MLP)
    half_peak, grads = _step_peak(model, inputs, make_backend(
        memory_budget=0.5, on_partition=half_reports.append))
    full, half = full_reports[0], half_reports[0]
    assert half.activation_bytes <= half.budget_bytes, half
    assert half.activation_bytes < full.activation_bytes
    assert half_peak <= full_peak, (half_peak, full_peak)
    assert _rel(grads, ref) <= 1e-3


def _stack_step_peak(model, x, step_fn=None):
    from sac_compile.measured_peak import measured_peak
    for p in [*model.parameters(), x]:
        p.grad = None
    with measured_peak(DEVICE) as m:
        (step_fn or model)(x).backward()
    return m.bytes


def test_eager_peak_budget_holds_on_the_device_allocator():
    """Issue 27 on CUDA: ``apply_regions(..., memory_budget=PeakBudget(n))`` in eager mode,
    issue 17's stack on the device, ``n`` halfway between the least measured peak
    (``recompute_all``) and no budget's: after calibration the step's
    ``max_memory_allocated`` above its start is at most ``n`` and at least 85% of it."""
    import sac_compile as sc
    from fixtures.stack import Block, Stack, stack_inputs
    from sac_compile import PeakBudget
    from sac_compile.budgets.step_peak import MAX_STEPS
    from sac_compile.regions import step_peak_of

    relaxed = policies.relaxed(policies.save_matmuls)
    x = stack_inputs().detach().to(DEVICE).requires_grad_(True)
    bounds = []
    for policy in ("recompute_all", relaxed):
        model = sc.apply_regions(Stack(6, checkpoint="none").to(DEVICE), policy, where=Block)
        model(x).backward()
        bounds.append(_stack_step_peak(model, x))
    n = sum(bounds) // 2
    model = sc.apply_regions(Stack(6, checkpoint="none").to(DEVICE), relaxed, where=Block,
                             memory_budget=PeakBudget(n))
    ctrl = step_peak_of(model)
    for _ in range(2 * MAX_STEPS + 2):
        for p in [*model.parameters(), x]:
            p.grad = None
        model(x).backward()
        if all(f.done for f in ctrl.fits.values()):
            break
    model(x)
    peak = _stack_step_peak(model, x)
    print(f"eager PeakBudget on CUDA: least {bounds[0]:,} B, free {bounds[1]:,} B, "
          f"n {n:,} B, measured {peak:,} B; {ctrl.notes[-1]}")
    assert 0.85 * n <= peak <= n, (bounds, n, peak, ctrl.notes)


def test_inductor_peak_budget_trial_holds_on_the_device_allocator():
    """Issue 27 on CUDA: ``make_backend(memory_budget=PeakBudget(n))`` under Inductor, its
    split measured by a trial step before the first (parameters aliased, not copied):
    the user's step then measures within ``n``, as the report's ``budget_measured``."""
    from fixtures.stack import Stack, stack_inputs
    from sac_compile import PeakBudget

    relaxed = policies.relaxed(policies.save_matmuls)
    torch._dynamo.reset()
    x = stack_inputs().detach().to(DEVICE).requires_grad_(True)
    model = Stack(6, policy=relaxed).to(DEVICE)
    free_fn = torch.compile(model, backend=make_backend())
    free_fn(x).backward()
    free = _stack_step_peak(model, x, free_fn)
    n = int(0.8 * free)
    torch._dynamo.reset()
    reports = []
    fn = torch.compile(model, backend=make_backend(memory_budget=PeakBudget(n),
                                                   on_partition=reports.append))
    fn(x).backward()
    peak = _stack_step_peak(model, x, fn)
    print(f"Inductor PeakBudget on CUDA: free {free:,} B, n {n:,} B, measured {peak:,} B, "
          f"trial {reports[-1].budget_measured}")
    assert peak <= n and reports[-1].budget_measured is not None, (free, n, peak)
