"""sac_compile.measured_peak: the allocator's peak of a step, in bytes (never time)."""
from __future__ import annotations

import contextlib
import gc

import pytest
import torch
import torch.utils.checkpoint as tuc

from fixtures.measure import LiveBytes, wrapped_blocks
from fixtures.models import make_model
from sac_compile import measured_peak as mp
from sac_compile.measured_peak import MeasuredPeak, measure_peak, measured_peak

MiB = 1 << 20


def _bytes(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8)


def test_alloc_free_alloc_peaks_at_the_larger():
    with measured_peak() as m:
        a = _bytes(MiB)
        del a
        b = _bytes(2 * MiB)
        del b
    assert (m.bytes, m.end, m.source) == (2 * MiB, 0, "profiler")


def test_values_alive_together_add_up_and_phases_split_the_step():
    with measured_peak() as m:
        a = _bytes(MiB)
        m.mark("second")
        b = _bytes(2 * MiB)
        del a, b
        c = _bytes(MiB // 2)
    assert m.bytes == 3 * MiB
    assert m.phases == {"step": MiB, "second": 3 * MiB}
    assert m.starts == {"step": 0, "second": MiB}
    assert m.end == MiB // 2 and m.peak("step") == MiB and m.at("second") == MiB
    del c


def test_measure_peak_counts_the_result_at_the_peak_only():
    m = measure_peak(lambda n: _bytes(n).clone(), MiB)  # the tensor and its clone at once
    assert (m.bytes, m.end) == (2 * MiB, 0)


def test_a_phase_is_marked_once():
    with measured_peak() as m:
        m.mark("backward")
        with pytest.raises(ValueError, match="already marked"):
            m.mark("backward")
    with pytest.raises(RuntimeError, match="inside"):
        m.mark("later")


def test_replay_orders_events_by_time_and_ignores_other_devices():
    result = MeasuredPeak("cpu", "profiler", starts={"step": 0})
    events = [(30, -100, "cpu", "[memory]", 1), (10, 100, "cpu", "[memory]", 1),
              (5, 0, "cpu", mp._MARK + "step", 0), (20, 50, "cpu", "[memory]", 2),
              (25, 0, "cpu", mp._MARK + "bw", 0), (26, 999, "cuda", "[memory]", 3),
              (40, 10, "cpu", "[memory]", 1), (27, 0, "cpu", "aten::mm", 0)]
    mp._replay(result, events)
    assert (result.bytes, result.end) == (150, 60)
    assert result.phases == {"step": 150, "bw": 150}
    assert result.starts == {"step": 0, "bw": 150}
    # only the block at 1 allocated first is freed in the step: the working set is it
    assert (result.working, result.working_phases) == (100, {"step": 100, "bw": 100})


def test_working_set_leaves_out_what_the_step_keeps():
    with measured_peak() as m:
        kept = _bytes(MiB)           # left allocated: like a gradient
        tmp = _bytes(2 * MiB)        # freed: like an activation
        del tmp
        tmp = _bytes(MiB // 2)       # the same address may come back: a new block
        del tmp
    assert (m.bytes, m.end, m.working) == (3 * MiB, MiB, 2 * MiB)
    del kept


def test_a_free_of_a_block_allocated_before_the_step_is_not_counted():
    """The profiler reports the free of a block an earlier measurement saw allocated (with
    that measurement's size, even where the address was reused since, unprofiled): counted,
    a step's figure depended on what was measured before it (64 KiB less, now and then, in
    the full suite). Dropped: the same step measures the same after any history."""
    with measured_peak() as first:
        left = _bytes(MiB)           # left allocated: last step's gradients, say
    with measured_peak() as second:
        del left                     # freed in the next measured step
        tmp = _bytes(MiB // 2)
        del tmp
    assert (first.bytes, first.end) == (MiB, MiB)
    assert (second.bytes, second.end, second.working) == (MiB // 2, 0, MiB // 2)
    result = MeasuredPeak("cpu", "profiler", starts={"step": 0})
    mp._replay(result, [(1, -4096, "cpu", "[memory]", 7), (2, 100, "cpu", "[memory]", 8),
                        (3, -100, "cpu", "[memory]", 8)])
    assert (result.bytes, result.end, result.working) == (100, 0, 100)


def _step(model, inputs, meter, wrap=None):
    model.zero_grad(set_to_none=True)
    gc.collect()
    ctx = wrapped_blocks(model, wrap) if wrap else contextlib.nullcontext()
    with ctx, meter() as m:
        loss = model(*inputs).sum()
        if m is not None:
            m.mark("backward")
        loss.backward()
        del loss
    model.zero_grad(set_to_none=True)
    return m


def _full_ac(i, fwd):
    return lambda *a: tuc.checkpoint(fwd, *a, use_reentrant=False, preserve_rng_state=False)


@pytest.mark.parametrize("name", ["mlp", "gpt"])
@pytest.mark.parametrize("ac", [False, True], ids=["no_ac", "full_ac"])
def test_eager_step_equals_the_run_time_count_of_every_storage(name, ac):
    """In eager mode every allocation is an op's output: the allocator's peak is the
    run-time count of live storages (``LiveBytes``, gradients included), to the byte."""
    model, inputs = make_model(name, size="test")
    model.eval()  # no dropout: both runs allocate the same
    wrap = _full_ac if ac else None
    _step(model, inputs, contextlib.nullcontext)  # warm-up: the first call caches 256 B
    measured = _step(model, inputs, measured_peak, wrap)
    live = _step(model, inputs, LiveBytes, wrap)
    assert measured.bytes == live.peak() > 0
    assert measured.peak("backward") == live.peak("backward")
    assert measured.at("backward") == live.at("backward")
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    assert measured.end == grads  # the step leaves its gradients allocated
    # what it frees peaks at least as high as the activations (gradients excluded) count
    assert live.peak() - grads <= measured.working <= live.peak()


def test_full_ac_lowers_the_measured_peak_where_activations_dominate():
    torch.manual_seed(0)
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(512, 64)

    def block(h):
        return torch.sigmoid(torch.tanh(h @ w))

    def run(wrap):
        def f():
            h = x
            for _ in range(6):
                h = wrap(h)
            h.sum().backward()
        w.grad = None
        return measure_peak(f).bytes

    noac = run(block)
    full = run(lambda h: tuc.checkpoint(block, h, use_reentrant=False, preserve_rng_state=False))
    act = 512 * 64 * 4  # one block's output
    # No AC keeps each block's input (the matmul's) and its tanh (both save outputs): 12
    # values; full AC its 6 inputs, and re-makes one block's 2 in the backward.
    assert noac - full >= 4 * act


def test_inductor_generated_code_allocations_are_counted():
    """Inductor's kernels write into buffers its generated code allocates itself (no ATen
    op a dispatch mode sees); the profiler sees them: the forward's phase holds what it
    saves, the step ends with the gradients, and the compiled step peaks no higher than
    the eager one (it fuses and frees early)."""
    import sac_compile as sc
    from sac_compile.torch_internals import dynamo_reset

    n = 64
    torch.manual_seed(0)
    x = torch.randn(n, n)
    w1 = torch.randn(n, 2 * n, requires_grad=True)
    w2 = torch.randn(2 * n, n, requires_grad=True)

    def f(x, w1, w2):
        return torch.nn.functional.gelu(torch.tanh(x @ w1) @ w2).sum()

    dynamo_reset()
    compiled = torch.compile(f, backend=sc.sac_backend)
    compiled(x, w1, w2).backward()  # compile

    def step(fn):
        w1.grad = w2.grad = None
        with measured_peak() as m:
            loss = fn(x, w1, w2)
            m.mark("backward")
            loss.backward()
            del loss
        return m

    eager, comp = step(f), step(compiled)
    grads = 2 * (n * 2 * n * 4)
    assert comp.end == eager.end == grads
    # the forward allocated at least the matmul it cannot fuse away (n x 2n floats)
    assert comp.peak("step") >= n * 2 * n * 4
    assert comp.at("backward") > 0  # it kept something for the backward
    assert grads < comp.bytes <= eager.bytes
    dynamo_reset()


def test_allocator_statistics_path_on_a_fake_device(monkeypatch):
    """The CUDA path (no GPU here): phases from max_memory_allocated between resets."""
    state = {"now": 1000, "max": 1000}

    def alloc(n):
        state["now"] += n
        state["max"] = max(state["max"], state["now"])

    fake = {"synchronize": lambda *a: None, "current_device": lambda: 0,
            "memory_allocated": lambda *a: state["now"],
            "max_memory_allocated": lambda *a: state["max"],
            "reset_peak_memory_stats": lambda *a: state.update(max=state["now"])}
    for name, fn in fake.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    with measured_peak("cuda") as m:
        alloc(300)
        alloc(-300)
        alloc(100)
        m.mark("backward")
        alloc(50)
        alloc(-150)
    assert (m.source, m.bytes, m.end) == ("allocator", 300, 0)
    assert m.phases == {"step": 300, "backward": 150}
    assert m.starts == {"step": 0, "backward": 100}


def test_an_accelerator_without_statistics_is_refused(monkeypatch):
    monkeypatch.setattr(torch, "accelerator", None, raising=False)
    with pytest.raises(ValueError, match="no allocator statistics"):
        with measured_peak("meta"):
            pass


# -- the peak model against the measurement ----------------------------------------------

def _compiled_step_peaks(name: str, compiler: str):
    """(the split's MemoryPeak, the measured step) for fixture ``name`` (test size) with
    every block a relaxed(save_matmuls) region, compiled whole with ``compiler``."""
    from sac_compile import policies
    from sac_compile._bench.measure import wrap_blocks
    from sac_compile._bench.strategies import loss_of, ours
    from sac_compile.compiler import make_backend
    from sac_compile.torch_internals import dynamo_reset, functorch_config

    model, inputs = make_model(name, size="test")
    wrap_blocks(model, ours(policies.relaxed(policies.save_matmuls)))
    reports = []
    dynamo_reset()
    fn = torch.compile(model, backend=make_backend(compiler=compiler,
                                                   on_partition=reports.append))

    def step(m=None):
        torch.manual_seed(0)
        loss = loss_of(fn(*inputs))
        if m is not None:
            m.mark("backward")
        loss.backward()

    with functorch_config.patch(enable_autograd_cache=False):
        step()  # compiles
    model.zero_grad(set_to_none=True)
    gc.collect()
    with measured_peak() as m:
        step(m)
    dynamo_reset()
    assert len(reports) == 1
    return reports[0].peak, m


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_aot_eager_step_model_is_the_measured_step_peak(name):
    """``aot_eager`` runs the graphs in the order the model walks them: its step figure
    (activations, and the gradients from when the backward makes them) is the allocator's
    peak but for the loss and its tangent (4 B each, made outside the graphs)."""
    peak, m = _compiled_step_peaks(name, "aot_eager")
    assert 0 <= m.bytes - peak.with_gradients <= 16
    assert m.working - 16 <= peak.bytes <= m.working  # activations alone: the working set


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_inductor_step_model_tracks_the_measured_step_peak(name):
    """Inductor fuses, reuses buffers and reorders. The model as Inductor allocates
    (``peak.fused``: ``compiler/inductor_alloc.py``'s rules, walked in the graph's order
    under our fusion veto) is within 3% of the measured step peak on the
    MLP and GPT fixtures, and its forward within 1%. At bench size (issue 27, the slow test
    below and benchmarks/peak_measured.py): MLP +0.1%, GPT, GPT-2 and Llama -0.0% (before
    the fusion veto at any distance: GPT -2.1%, GPT-2 -1.3%, Llama -2.9%)."""
    peak, m = _compiled_step_peaks(name, "inductor")
    assert peak.fused is not None
    fused_err = abs(peak.fused.with_gradients / m.bytes - 1)
    assert fused_err <= 0.03, (peak.fused, m)
    assert fused_err <= abs(peak.with_gradients / m.bytes - 1)
    # the forward alone, as Inductor allocates it
    assert abs(peak.fused.forward / m.peak("step") - 1) <= 0.01, (peak.fused, m)


def _reused_step(policy, monkeypatch, distance=None):
    """(the split's MemoryPeak, the measured step) of a GPT block run twice per step (then
    another), its blocks ``policy`` regions, compiled whole with Inductor; ``distance``:
    the fusion veto's (compiler/near_fusion.py)."""
    import sac_compile as sc
    from fixtures.step_models import Reused
    from sac_compile._bench.models import GPTBlock
    from sac_compile.compiler import make_backend, near_fusion
    from sac_compile.torch_internals import dynamo_reset, functorch_config, inductor_config

    if distance is not None:
        monkeypatch.setattr(near_fusion, "DISTANCE", distance)
    torch.manual_seed(0)
    model = Reused()
    sc.apply_regions(model, policy, where=GPTBlock)
    x = torch.randn(8, 64, 32, requires_grad=True)
    reports = []
    dynamo_reset()
    fn = torch.compile(model, backend=make_backend(on_partition=reports.append))
    with functorch_config.patch(enable_autograd_cache=False), \
            inductor_config.patch(force_disable_caches=True):
        (fn(x) ** 2).sum().backward()
        model.zero_grad(set_to_none=True)
        x.grad = None
        gc.collect()
        with measured_peak() as m:
            (fn(x) ** 2).sum().backward()
    dynamo_reset()
    monkeypatch.undo()
    return reports[-1].peak, m


@pytest.mark.parametrize("policy", ["recompute_all", "save_matmuls"])
def test_inductor_step_model_is_the_measured_peak_of_a_block_run_twice(policy, monkeypatch):
    """A block run twice per step (issue 27's case), compiled whole with Inductor: under
    our fusion veto the graph runs in its own order, and the fused step model is the
    allocator's peak (torch 2.13: 8 B apart, the loss)."""
    from sac_compile import policies
    chosen = policies.recompute_all if policy == "recompute_all" else \
        policies.relaxed(policies.save_matmuls)
    peak, m = _reused_step(chosen, monkeypatch)
    assert abs(peak.fused.with_gradients / m.bytes - 1) <= 0.01, (peak.fused, m)


def test_no_fusion_with_anything_between_keeps_more_bytes_alive(monkeypatch):
    """The veto at torch's distance (64 nodes) let fusions within the small graph keep a
    recomputed block's values alive across the other call's backward: 2,365,192 B
    measured; refused wherever something runs between the kernels: 1,474,568 B."""
    from sac_compile import policies
    _, at_64 = _reused_step(policies.recompute_all, monkeypatch, distance=64)
    _, now = _reused_step(policies.recompute_all, monkeypatch)
    assert at_64.bytes - now.bytes >= 500_000, (at_64.bytes, now.bytes)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_inductor_step_model_within_3_percent_at_bench_size(name):
    """Issue 27 at bench size, Hugging Face GPT-2 and Llama compiled whole with Inductor
    (each decoder layer a relaxed(save_matmuls) region): the fused step model within 3% of
    the allocator's step peak (torch 2.13: -0.0% both, under the fusion veto at any
    distance; -1.3% and -2.9% before it; before the in-place, reuse, addmm and
    horizontal-fusion rules -4.0% and +7.2%), its forward within 0.1%."""
    pytest.importorskip("transformers")
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from peak_measured import case

    row = case(name, "bench", "inductor")
    assert abs(row["error_step"]) <= 0.03, row
    assert abs(row["model_fw"] / row["measured_fw"] - 1) <= 0.001, row
