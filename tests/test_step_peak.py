"""``apply_regions(model, policy, where=Block, memory_budget=PeakBudget(n))``
(``budgets/step_peak.py``): the step's peak is measured (the CPU allocator's events,
gradients included) and the regions' kept-byte cap is set from it, so after a few
calibration steps every step measures within ``n``: issue 17's stack (6 blocks, relaxed
save_matmuls) in eager mode, traversed once and twice, a block skipped on some steps, two
batch sizes; a GPT of 8 blocks compiled one by one (torchtitan's order). Figures are bytes
and counts.
"""
from __future__ import annotations

import pytest
import torch

import sac_compile as sc
from fixtures.stack import Block, Stack, stack_inputs
from sac_compile import BudgetUnreachableError, PeakBudget, policies
from sac_compile.budgets import step_peak
from sac_compile.errors import CompiledCheckpointError
from sac_compile.measured_peak import measured_peak
from sac_compile.regions import step_peak_of

RELAXED = policies.relaxed(policies.save_matmuls)


def _controller(model):
    found = step_peak_of(model)
    assert found is not None
    return found


def _stack(budget=None, traversals=1, policy=RELAXED):
    model = Stack(6, checkpoint="none", traversals=traversals)
    return sc.apply_regions(model, policy, where=Block, memory_budget=budget)


def _measured_step(model, x):
    for p in [*model.parameters(), x]:
        p.grad = None
    with measured_peak() as m:
        model(x).backward()
    return m.bytes


def _bounds(traversals=1):
    """(least, no budget): the step's measured peak recomputing all the policy lets be
    recomputed, and keeping all it keeps."""
    x = stack_inputs(traversals)
    out = []
    for policy in ("recompute_all", RELAXED):
        model = _stack(traversals=traversals, policy=policy)
        model(x).backward()
        out.append(_measured_step(model, x))
    return out


def _calibrated(model, x, steps=2 * step_peak.MAX_STEPS + 2):
    """Steps until the controller measures no more (at most ``steps``; steps that compile
    are not measured): how many."""
    ctrl = _controller(model)
    for i in range(steps):
        for p in [*model.parameters(), x]:
            p.grad = None
        model(x).backward()
        if ctrl.fits and all(f.done for f in ctrl.fits.values()):
            model(x)  # (the last calibration step is read at the next call)
            return i + 1
    raise AssertionError(f"still calibrating after {steps} steps: {ctrl.notes}")


@pytest.fixture(scope="module")
def bounds():
    return _bounds()


@pytest.mark.parametrize("where", [0.1, 0.5, 0.9])
def test_measured_step_peak_within_the_budget_and_gradients_exact(bounds, where):
    """Three budgets between the least measured peak and no budget's: after calibration
    every step measures at most ``n`` and at least 85% of it, with no checkpointing's
    gradients."""
    least, free = bounds
    n = least + int(where * (free - least))
    x = stack_inputs()
    model = _stack(PeakBudget(n))
    assert _calibrated(model, x) <= step_peak.MAX_STEPS + 1
    peaks = [_measured_step(model, x) for _ in range(2)]
    assert all(0.85 * n <= p <= n for p in peaks), (n, peaks, _controller(model).notes)
    grads = [p.grad.clone() for p in model.parameters()]
    plain = Stack(6, checkpoint="none")
    plain(x).backward()
    for g, p in zip(grads, plain.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6)


def test_the_first_step_keeps_the_least_and_later_steps_what_the_budget_allows(bounds):
    """Step 1 recomputes all it may (its peak the least); the cap rises by what a step
    left unused; the notes list every measured step."""
    least, free = bounds
    n = (least + free) // 2
    x = stack_inputs()
    model = _stack(PeakBudget(n))
    _calibrated(model, x)
    (fit,) = _controller(model).fits.values()
    assert fit.tries[0][:2] == (0, 0) and abs(fit.tries[0][2] - least) <= 16
    # each within the budget, so each cap at least the last (placed in time, the last
    # step may confirm the caps found: nothing left to grow): the kept bytes never fall
    assert all(p <= n for _, _, p in fit.tries)
    assert all(c2 >= c1 and k2 >= k1 for (c1, k1, _), (c2, k2, _)
               in zip(fit.tries, fit.tries[1:])), fit.tries
    assert fit.tries[1][0] > 0
    assert fit.tries[-1][1] > 0
    assert _controller(model).notes[-1].startswith(f"peak {sc.budgets.budget_label(n)}")


def test_a_stack_traversed_twice_holds_the_budget():
    """Every block runs twice per step (two inputs): the kept-byte cap counts each call,
    the measured step holds ``n``."""
    least, free = _bounds(traversals=2)
    n = (least + free) // 2
    x = stack_inputs(2)
    model = _stack(PeakBudget(n), traversals=2)
    _calibrated(model, x)
    peak = _measured_step(model, x)
    assert 0.85 * n <= peak <= n, (n, peak)


class _Skipping(torch.nn.Module):
    """Issue 17's stack whose last block runs only when ``self.all_blocks``."""

    def __init__(self) -> None:
        super().__init__()
        self.stack = Stack(6, checkpoint="none")
        self.all_blocks = False

    def forward(self, x):
        blocks = self.stack.blocks if self.all_blocks else self.stack.blocks[:-1]
        for block in blocks:
            x = block(x)
        return x.sum()


def test_a_block_skipped_on_the_first_steps_then_run_holds_the_budget(bounds):
    """Calibrated with a block skipped, then the block runs: that step is another pattern
    of calls, priced again when it ends; the steps after it are measured again, and hold
    ``n``."""
    least, free = bounds
    n = (least + free) // 2
    x = stack_inputs()
    model = sc.apply_regions(_Skipping(), RELAXED, where=Block, memory_budget=PeakBudget(n))
    _calibrated(model, x)
    model.all_blocks = True
    ctrl = _controller(model)
    model(x).backward()  # the new pattern: priced again when it ends
    model(x).backward()
    assert not all(f.done for f in ctrl.fits.values()), ctrl.notes  # measured again
    _calibrated(model, x)
    peak = _measured_step(model, x)
    assert peak <= n, (n, peak, ctrl.notes)


def test_two_batch_sizes_each_fitted_on_its_own(bounds):
    """Batch 4 and batch 2 alternate: each signature has its own cap from its own measured
    steps; both hold ``n``."""
    least, free = bounds
    n = (least + free) // 2
    model = _stack(PeakBudget(n))
    big, small = stack_inputs(), stack_inputs()[:2].detach().requires_grad_(True)
    for _ in range(step_peak.MAX_STEPS + 1):
        for x in (big, small):
            for p in [*model.parameters(), x]:
                p.grad = None
            model(x).backward()
    model(big)
    ctrl = _controller(model)
    assert len(ctrl.fits) == 2 and all(f.done for f in ctrl.fits.values()), ctrl.notes
    assert _measured_step(model, big) <= n
    assert _measured_step(model, small) <= n


def test_a_budget_below_the_least_raises_with_the_measured_least(bounds):
    """Below what a step recomputing all it may measures, twice (a first step also
    allocates what the program makes once): BudgetUnreachableError at the next call,
    proposing the least measured peak."""
    least, _ = bounds
    x = stack_inputs()
    model = _stack(PeakBudget(least // 2))
    for _ in range(2):
        for p in [*model.parameters(), x]:
            p.grad = None
        model(x).backward()
    with pytest.raises(BudgetUnreachableError) as e:
        model(x)
    assert abs(e.value.least_bytes - least) <= 16
    assert isinstance(e.value.proposed_budget, PeakBudget)
    assert e.value.proposed_budget.value >= e.value.least_bytes
    assert f"{e.value.least_bytes:,} B" in str(e.value) and "measured" in str(e.value)


def test_a_fraction_is_refused_in_eager_mode():
    with pytest.raises(ValueError, match="PeakBudget.*bytes"):
        _stack(PeakBudget(0.5))


def test_blocks_compiled_one_by_one_hold_one_budget_for_the_step():
    """8 identical GPT blocks, each ``block.compile(fullgraph=True)`` (torchtitan's order),
    one PeakBudget over the step: each cap the measured steps set compiles the blocks once
    more (steps that compile are not measured); then every step measures within ``n`` and
    uses at least 85% of it, with no checkpointing's gradients."""
    import copy

    from sac_compile._bench.models import GPT, GPTBlock
    from sac_compile.compiler import make_backend

    def step_peak_of(model, x):
        for p in model.parameters():
            p.grad = None
        with measured_peak() as m:
            model(x).pow(2).sum().backward()
        return m.bytes

    def built(policy, budget=None):
        torch.manual_seed(0)
        model = GPT(64, 4, 8, 64, dropout=0.0)
        reference = copy.deepcopy(model)
        sc.apply_regions(model, policy, where=GPTBlock, memory_budget=budget)
        backend = make_backend(compiler="aot_eager")
        for block in model.blocks:
            block.compile(backend=backend, fullgraph=True)
        return reference, model

    x = torch.randn(4, 64, 64)
    bounds = []
    for policy in ("recompute_all", RELAXED):
        torch._dynamo.reset()
        _, model = built(policy)
        model(x).pow(2).sum().backward()
        bounds.append(step_peak_of(model, x))
    least, free = bounds
    n = (least + free) // 2
    torch._dynamo.reset()
    reference, model = built(RELAXED, PeakBudget(n))
    ctrl = _controller(model)
    for steps in range(1, 2 * step_peak.MAX_STEPS + 3):
        for p in model.parameters():
            p.grad = None
        model(x).pow(2).sum().backward()
        if all(f.done for f in ctrl.fits.values()):
            break
    model(x)
    peaks = [step_peak_of(model, x) for _ in range(2)]
    assert all(0.85 * n <= p <= n for p in peaks), (n, peaks, ctrl.notes)
    assert sum(1 for note in ctrl.notes if "compiled blocks" in note) >= 1
    budget = model.blocks[0]._sac_regions[0].frame.budget.model
    assert 1 <= budget.recompiles <= 2 * step_peak.MAX_STEPS
    grads = [p.grad.clone() for p in model.parameters()]
    reference(x).pow(2).sum().backward()
    for g, p in zip(grads, reference.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6)


CACHE_SCRIPT = """
import json, sys, torch
import sac_compile as sc
from sac_compile import PeakBudget, policies
from sac_compile.budgets.step_peak import MAX_STEPS
from sac_compile.compiler import SACPartitioner, make_backend
from sac_compile.measured_peak import measured_peak
from torch._dynamo.utils import counters

least_kept = [0]  # which cut keeping the least each split made here was (0: none)
_partition = SACPartitioner._partition


def _counted(self, *args, **kwargs):
    least_kept.append(self.least_kept)
    return _partition(self, *args, **kwargs)


SACPartitioner._partition = _counted
mode, n = sys.argv[1].split(":")
n = float(n) if "." in n else int(n)
relaxed = policies.relaxed(policies.save_matmuls)
if mode == "whole":  # the backend's PeakBudget, Inductor, the model compiled whole
    from fixtures.stack import Block, Stack, stack_inputs
    model, x = Stack(6, checkpoint="none"), stack_inputs()
    sc.apply_regions(model, relaxed, where=Block)  # (its regions keyed for the caches)
    fn = torch.compile(model, backend=make_backend(memory_budget=PeakBudget(n)))
    loss, steps = (lambda: fn(x)), 1
elif mode == "apply_whole":  # apply_regions' PeakBudget, the model compiled whole by Inductor
    from fixtures.stack import Block, Stack, stack_inputs
    model, x = Stack(6, checkpoint="none"), stack_inputs()
    sc.apply_regions(model, relaxed, where=Block, memory_budget=PeakBudget(n))
    fn = torch.compile(model, backend=sc.sac_backend)
    loss, steps = (lambda: fn(x)), 2 * MAX_STEPS + 2
else:  # apply_regions' PeakBudget, blocks compiled one by one by Inductor
    from sac_compile._bench.models import GPT, GPTBlock
    torch.manual_seed(0)
    model = GPT(64, 4, 4, 64, dropout=0.0)
    sc.apply_regions(model, relaxed, where=GPTBlock, memory_budget=PeakBudget(n))
    for block in model.blocks:
        block.compile(backend=sc.sac_backend, fullgraph=True)
    x = torch.randn(4, 64, 64)
    loss, steps = (lambda: model(x).pow(2).sum()), 2 * MAX_STEPS + 2
for _ in range(steps):
    for p in model.parameters():
        p.grad = None
    loss().backward()
loss()  # (the last calibration step is read at the next call)
for p in model.parameters():
    p.grad = None
with measured_peak() as m:
    loss().backward()
print(json.dumps({"measured": m.bytes, "least_kept": max(least_kept),
                  "fx_hit": counters["inductor"].get("fxgraph_cache_hit", 0),
                  "aot_hit": counters["aot_autograd"].get("autograd_cache_hit", 0)}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode,loose,tight", [("whole", 2_300_000, 1_900_000),
                                              ("whole", 1_460_000, 1_458_000),
                                              ("blocks", 4_500_000, 3_600_000),
                                              ("apply_whole", 2_300_000, 1_900_000)],
                         ids=["whole", "whole, at the model's least", "blocks",
                              "apply_whole"])
def test_processes_sharing_a_compile_cache_each_hold_their_own_peak_budget(
        tmp_path, mode, loose, tight):
    """Around the region: processes sharing Inductor's caches. The same PeakBudget again
    measures what the first process measured (its compiled code served from the FX graph
    cache); a tighter one measures within its own cap (a split served for the looser cap
    would not). ``whole``: the backend's PeakBudget on issue 17's stack compiled whole;
    ``blocks``: apply_regions' PeakBudget over GPT blocks compiled one by one;
    ``apply_whole``: apply_regions' PeakBudget on the stack compiled whole (its graph split
    under the step's peak budget, its cache key carrying the lowered peak). At 2,300,000 B
    the stack compiled whole measures 2,304,776 B at its first split, 2,299,656 B lowered
    by the excess: both are in AOTAutograd's cache, the first under the key a process
    looks up first. (Before: served without a measurement, a warm process's step measured
    2,304,776 B, above the cap; now what the cache serves is measured, as a fresh split.)
    At the least the model finds (1,457,664 B modelled; 1,460,000 and 1,458,000 B), each
    process keeps the model's own split, measured 1,457,928 B. (Before the model walked
    Inductor's reordering for peak memory its least was 1,649,664 B, and a cap of 1,600,000
    was met only by the last tries, the cuts keeping the least.)"""
    from fixtures.cache_process import run_with_cache
    cold = run_with_cache(CACHE_SCRIPT, f"{mode}:{loose}", tmp_path)
    warm = run_with_cache(CACHE_SCRIPT, f"{mode}:{loose}", tmp_path)
    tighter = run_with_cache(CACHE_SCRIPT, f"{mode}:{tight}", tmp_path)
    assert cold["measured"] <= loose and warm["measured"] <= loose, (cold, warm)
    assert abs(warm["measured"] - cold["measured"]) <= 16, (cold, warm)
    assert warm["fx_hit"] >= 1, warm
    if mode != "blocks":  # (blocks: kept-byte caps, split by the cap's key, not measured)
        assert warm["aot_hit"] >= 1, warm
    assert tighter["measured"] <= tight, tighter
    assert (cold["least_kept"], warm["least_kept"]) == (0, 0)  # (the model's splits)


PROFILED_SCRIPT = """
import json, sys, torch
import sac_compile as sc
from fixtures.cache_process import caught_warnings
from fixtures.stack import Block, Stack, stack_inputs
from sac_compile import PeakBudget, policies
from sac_compile.compiler import make_backend

warned = caught_warnings("was not measured")
model, x = Stack(6, checkpoint="none"), stack_inputs()
sc.apply_regions(model, policies.relaxed(policies.save_matmuls), where=Block)
fn = torch.compile(model, backend=make_backend(memory_budget=PeakBudget(2_300_000)))
if sys.argv[1] == "profiled":  # a profiler of the user's: the CPU trial cannot measure
    with torch.profiler.profile():
        fn(x).backward()
else:
    fn(x).backward()
print(json.dumps({"warned": len(warned)}))
"""


@pytest.mark.slow
def test_a_served_split_that_cannot_be_measured_is_not_silent(tmp_path):
    """The stack at PeakBudget(2,300,000): the cold process's first split measured above
    the cap, the second within, both cached. A warm process compiling under a profiler of
    its own (the CPU trial is a profiler: it cannot measure) is served the first key's
    split unmeasured: a warning says so (a compile that partitions notes it in the
    report)."""
    from fixtures.cache_process import run_with_cache
    cold = run_with_cache(PROFILED_SCRIPT, "plain", tmp_path)
    warm = run_with_cache(PROFILED_SCRIPT, "profiled", tmp_path)
    assert cold["warned"] == 0 and warm["warned"] == 1, (cold, warm)


@pytest.mark.slow
def test_a_fractional_peak_budget_is_split_again_in_each_process(tmp_path):
    """A PeakBudget fraction's cap is the unconstrained split's modelled peak, which only
    a partition gives: its graphs bypass AOTAutograd's cache (a served split could not be
    measured against its cap), Inductor's still serves the code; each process measures
    the same step."""
    from fixtures.cache_process import run_with_cache
    cold = run_with_cache(CACHE_SCRIPT, "whole:0.8", tmp_path)
    warm = run_with_cache(CACHE_SCRIPT, "whole:0.8", tmp_path)
    assert warm["aot_hit"] == 0 and warm["fx_hit"] >= 1, warm
    assert abs(warm["measured"] - cold["measured"]) <= 16, (cold, warm)


class _Broken(torch.nn.Module):
    """Issue 17's stack with a graph break between its third and fourth block (written
    out: a break inside a loop has Dynamo compile the blocks one by one instead)."""

    def __init__(self, graph_break: bool = True) -> None:
        super().__init__()
        self.stack = Stack(6, checkpoint="none")
        self.graph_break = graph_break

    def forward(self, x):
        b = self.stack.blocks
        x = b[2](b[1](b[0](x)))
        if self.graph_break:
            torch._dynamo.graph_break()
        return b[5](b[4](b[3](x))).sum()


def _compiled(graph_break, policy, budget=None):
    from sac_compile.compiler import make_backend
    torch._dynamo.reset()
    model = sc.apply_regions(_Broken(graph_break), policy, where=Block, memory_budget=budget)
    reports = []
    fn = torch.compile(model, backend=make_backend(compiler="aot_eager",
                                                   on_partition=reports.append))
    return model, fn, reports


def _compiled_step(model, fn, x):
    for p in [*model.parameters(), x]:
        p.grad = None
    with measured_peak() as m:
        fn(x).backward()
    return m.bytes


@pytest.mark.parametrize("graph_break", [False, True], ids=["one graph", "a graph break"])
def test_a_model_compiled_whole_holds_the_budget(graph_break):
    """``torch.compile(model)`` of the whole model, one graph or two around a graph break:
    the model's step hooks run eagerly (a graph break at them, outside the graphs), so its
    steps are measured as in eager mode. One graph of every block is split under the
    step's PeakBudget itself (one compile; measured within ``n``: done); two graphs each
    hold some blocks, cut at the kept-byte cap the measured steps set (each cap compiles
    them once more, those steps not measured). Then every step measures within ``n`` and
    uses at least 85% of it, with no checkpointing's gradients. (Before: a
    CheckpointError for one graph, a CompiledCheckpointError at the first run for two.)"""
    x = stack_inputs()
    bounds = []
    for policy in ("recompute_all", RELAXED):
        model, fn, _ = _compiled(graph_break, policy)
        fn(x).backward()
        bounds.append(_compiled_step(model, fn, x))
    least, free = bounds
    n = (least + free) // 2
    model, fn, reports = _compiled(graph_break, RELAXED, PeakBudget(n))
    reference = _Broken(graph_break)
    ctrl = _controller(model)
    for _ in range(3 * step_peak.MAX_STEPS):
        for p in model.parameters():
            p.grad = None
        fn(x).backward()
        if ctrl.fits and all(f.done for f in ctrl.fits.values()):
            break
    fn(x)
    compiled = len(reports)
    peaks = [_compiled_step(model, fn, x) for _ in range(2)]
    assert all(0.85 * n <= p <= n for p in peaks), (least, free, n, peaks, ctrl.notes)
    assert len(reports) == compiled  # (the steps after calibration compile nothing)
    if graph_break:
        assert compiled % 2 == 0 and 2 <= compiled // 2 <= step_peak.MAX_STEPS + 1
        assert sum("compiled blocks" in note for note in ctrl.notes) == compiled // 2
    else:
        assert compiled == 1 and reports[0].budget_peak <= n, ctrl.notes
        assert any("split under the step's peak budget" in note for note in ctrl.notes)
    grads = [p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    reference(x).backward()
    for g, p in zip(grads, reference.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6)


def test_a_block_skipped_then_run_compiled_whole_is_measured_again(bounds):
    """Compiled whole, calibrated with the last block skipped; then it runs: Dynamo
    compiles a graph of all six blocks at the calibrated cap, which measures above ``n``
    (2,166,792 B against 2,102,792). A step that compiled a graph of the regions after
    calibration reopens it (as a pattern of calls eager plans lacked does): the steps
    after it are measured again and hold ``n``, with exact gradients (before: done, every
    step above the budget, silently)."""
    from sac_compile.compiler import make_backend
    least, free = bounds
    n = (least + free) // 2
    x = stack_inputs()
    torch._dynamo.reset()
    model = sc.apply_regions(_Skipping(), RELAXED, where=Block, memory_budget=PeakBudget(n))
    reference = _Skipping()
    fn = torch.compile(model, backend=make_backend(compiler="aot_eager"))
    ctrl = _controller(model)

    def calibrate():
        for _ in range(3 * step_peak.MAX_STEPS):
            for p in model.parameters():
                p.grad = None
            fn(x).backward()
            if all(f.done for f in ctrl.fits.values()):
                break
        fn(x)
    calibrate()
    model.all_blocks = reference.all_blocks = True
    fn(x).backward()  # compiles the graph of six blocks
    fn(x).backward()
    assert not all(f.done for f in ctrl.fits.values()), ctrl.notes  # measured again
    assert sum("compiled a graph of the regions after" in note for note in ctrl.notes) == 1
    calibrate()
    peaks = [_compiled_step(model, fn, x) for _ in range(2)]
    assert all(p <= n for p in peaks), (n, peaks, ctrl.notes)
    grads = [p.grad.clone() for p in model.parameters()]
    reference(x).backward()
    for g, p in zip(grads, reference.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6)


def test_below_the_least_compiled_whole_is_unreachable_at_compile(bounds):
    """Compiled whole, a budget below the least the graph's peak model finds: the
    graph's compile raises (as the backend's PeakBudget does), proposing that least."""
    from sac_compile.torch_internals import profiler_enabled
    model, fn, _ = _compiled(False, RELAXED, PeakBudget(1_000_000))
    with pytest.raises(BudgetUnreachableError) as e:
        fn(stack_inputs()).backward()
    assert e.value.proposed_budget.value > 1_000_000
    assert "least modelled step peak" in str(e.value)
    assert not profiler_enabled()  # (the failed step's measurement stopped with it)


def test_a_graph_at_its_least_measured_above_the_budget_raises_without_compiling_again():
    """Code around the model holds 1 MB across the backward (outside every graph): the
    graph of every block, split under ``n`` (50 KB above the step's peak with every block
    recomputed, so within the least its model finds), measures above it; its cap lowered
    below that least, it is split at the least once and measured twice above ``n``:
    BudgetUnreachableError proposing the least measured peak, after two compiles. (Before:
    each measured step lowered the cap again, the same least split compiled 5 times, the
    error at the 13th step.)"""
    x = stack_inputs()

    def step(fn, extra_bytes=1_000_000):
        for p in [*model.parameters(), x]:
            p.grad = None
        out = fn(x)
        extra = torch.ones(extra_bytes // 4)  # (held across the backward)
        out.backward()
        del extra

    model, fn, _ = _compiled(False, "recompute_all")
    step(fn, 0)
    with measured_peak() as m:
        step(fn, 0)
    n = m.bytes + 50_000
    model, fn, reports = _compiled(False, RELAXED, PeakBudget(n))
    with pytest.raises(BudgetUnreachableError) as e:
        for _ in range(3 * step_peak.MAX_STEPS):
            step(fn)
    # (was intermittent in the full suite, the first compile raising: the reference step
    # measured 64 KiB low where an earlier test's measurement had seen the address of a
    # block it frees; measured_peak now drops such frees)
    assert len(reports) == 2, (n, str(e.value)[:400], _controller(model).notes)
    assert len(_controller(model).notes) == 4  # (2 compiling steps, 2 measured)
    assert e.value.proposed_budget.value > n
    assert "down to the least its model finds" in str(e.value)


def test_a_model_compiled_whole_by_inductor_is_measured_before_its_first_step():
    """Inductor, the model compiled whole: its one graph is split under the step's
    PeakBudget and, as the backend's PeakBudget is, run once on stand-ins before the first
    step (``compiler/measured_fit.py``); the step being measured by the controller gives
    the CPU profiler up to that trial (a step that compiles is never decided on). The
    next step measures within ``n``: done, one compile."""
    torch._dynamo.reset()
    x = stack_inputs()
    free_model = sc.apply_regions(_Broken(False), RELAXED, where=Block)
    fn = torch.compile(free_model, backend=sc.make_backend())
    fn(x).backward()
    free = _compiled_step(free_model, fn, x)
    n = int(0.93 * free)
    torch._dynamo.reset()
    model = sc.apply_regions(_Broken(False), RELAXED, where=Block, memory_budget=PeakBudget(n))
    reports = []
    fn = torch.compile(model, backend=sc.make_backend(on_partition=reports.append))
    ctrl = _controller(model)
    for _ in range(2):
        for p in model.parameters():
            p.grad = None
        fn(x).backward()
    fn(x)
    assert all(f.done for f in ctrl.fits.values()), ctrl.notes
    assert any("measured on its own before its first run" in note for note in ctrl.notes)
    assert len(reports) == 1 and any("run once on stand-ins" in note
                                     for note in reports[0].notes), reports[0].notes
    assert _compiled_step(model, fn, x) <= n


def test_two_batch_sizes_compiled_whole_each_reuse_their_graph():
    """Batch 4 and batch 2 alternate under a model compiled whole: each signature's cap
    is its own, and a cap seen before finds its graph in Dynamo's cache (the token is made
    from the budget's state, not chained), so calibration ends and the steps after it
    compile nothing (chained, every step compiled and none was measured)."""
    n = 2_100_000
    model, fn, reports = _compiled(False, RELAXED, PeakBudget(n))
    ctrl = _controller(model)
    big, small = stack_inputs(), stack_inputs()[:2].detach().requires_grad_(True)
    for _ in range(2 * step_peak.MAX_STEPS):
        for x in (big, small):
            for p in [*model.parameters(), x]:
                p.grad = None
            fn(x).backward()
        if len(ctrl.fits) == 2 and all(f.done for f in ctrl.fits.values()):
            break
    assert len(ctrl.fits) == 2 and all(f.done for f in ctrl.fits.values()), ctrl.notes
    fn(big)
    compiled = len(reports)
    peaks = [_compiled_step(model, fn, x) for x in (big, small, big, small)]
    assert len(reports) == compiled, ctrl.notes
    assert all(p <= n for p in peaks) and peaks[0] >= 0.85 * n, (peaks, ctrl.notes)


def test_the_models_forward_compiled_without_its_hooks_is_a_clear_error():
    """``torch.compile(model.forward)`` skips the model's hooks, which begin and measure
    the steps: the graph's compile says so, naming the fix (compile the model itself),
    never a step at a cap nothing measures."""
    from sac_compile.compiler import make_backend
    torch._dynamo.reset()
    model = _stack(PeakBudget(2_000_000))
    fn = torch.compile(model.forward, backend=make_backend(compiler="aot_eager"))
    with pytest.raises(Exception) as e:
        fn(stack_inputs()).backward()
    err = e.value
    while err is not None and not isinstance(err, CompiledCheckpointError):
        err = err.__cause__
    assert err is not None, e.value
    assert "blocks.0" in str(err) and "torch.compile(model)" in str(err)
    assert "make_backend(memory_budget=PeakBudget" in str(err)


def test_a_fullgraph_function_calling_the_model_names_the_fix():
    """``torch.compile(step, fullgraph=True)`` of a function that calls the model: the
    model's step hooks must run eagerly, which fullgraph forbids; Dynamo's error carries
    our reason, naming the fix (compile the model itself)."""
    from sac_compile.compiler import make_backend
    torch._dynamo.reset()
    model = _stack(PeakBudget(2_000_000))

    @torch.compile(backend=make_backend(compiler="aot_eager"), fullgraph=True)
    def step(x):
        return model(x)
    with pytest.raises(Exception) as e:
        step(stack_inputs()).backward()
    assert "apply_regions(memory_budget=PeakBudget(n))" in str(e.value)
    assert "torch.compile(model)" in str(e.value)


def test_a_users_profiler_started_during_a_calibration_step_is_not_a_measurement():
    """The calibration's CPU profiler runs from a step's start to the next call of the
    model; a profiler the user starts in between loses its events: that step is measured
    again, never read as a 0-byte step (which would raise the cap to the budget)."""
    model = _stack(PeakBudget(2_000_000))
    x = stack_inputs()
    model(x).backward()
    with torch.profiler.profile():
        model(x).backward()
    ctrl = _controller(model)
    assert all(p > 0 for fit in ctrl.fits.values() for _, _, p in fit.tries), ctrl.notes
    assert any("disturbed" in note for note in ctrl.notes), ctrl.notes
    assert all(f.cap < 2_000_000 for f in ctrl.fits.values())


def test_a_saved_model_and_a_second_model_each_calibrate(bounds):
    """``torch.save`` of a model mid-calibration loads and calibrates afresh (a running
    measurement is not pickled); called in turn, each model's step start ends the other's
    measurement left running (its backward over: decided on then), so both reach their
    caps."""
    import io
    least, free = bounds
    n = (least + free) // 2
    x = stack_inputs()
    model = _stack(PeakBudget(n))
    model(x).backward()  # measuring, until its next call
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert step_peak_of(loaded) is not step_peak_of(model)
    for _ in range(2 * step_peak.MAX_STEPS):
        for m in (loaded, model):
            for p in [*m.parameters(), x]:
                p.grad = None
            m(x).backward()
    for m in (loaded, model):
        m(x)
        ctrl = step_peak_of(m)
        assert all(f.done for f in ctrl.fits.values()), ctrl.notes
        assert _measured_step(m, x) <= n


class _EmbeddedStack(torch.nn.Module):
    """Issue 17's stack behind a large embedding: its gradient is made last, after every
    block's backward, so the step peaks at the end of the backward (as HF GPT-2's does),
    when no block holds its values any more."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(16384, 64)
        self.stack = Stack(6, checkpoint="none")

    def forward(self, ids):
        return self.stack(self.embed(ids))


def _embedded_step(model, ids, *, steps=2 * step_peak.MAX_STEPS + 2):
    """(measured peak, recompute FLOPs, gradients) of a step after calibration."""
    from sac_compile.runtime import collect_stats
    ctrl = step_peak_of(model)
    for _ in range(steps if ctrl is not None else 1):
        model.zero_grad(set_to_none=True)
        model(ids).backward()
        if ctrl is None or all(f.done for f in ctrl.fits.values()):
            break
    model.zero_grad(set_to_none=True)
    with measured_peak() as m, collect_stats() as stats:
        model(ids).backward()
    return m.bytes, stats.recomputed_flops, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("placed", [True, False])
def test_at_full_acs_peak_the_calls_backwarded_first_keep_their_values(placed, monkeypatch):
    """``PeakBudget(n)`` at full AC's measured peak, on a step that peaks at its end: placed
    in time (``budgets/nested.py``: per depth, what the measured step held beside the
    calls holding their values there), the last blocks, whose backward runs before the
    peak, keep their matmuls: the step measures within ``n`` recomputing at most half
    full AC's FLOPs, with no checkpointing's gradients. One cap over the step (the former
    rule) cannot: any byte kept raises the moment every call holds its values, and the
    cap stays at the least."""
    monkeypatch.setattr(step_peak, "PLACED", placed)
    ids = torch.randint(0, 16384, (4, 64))
    plain = _EmbeddedStack()
    _, _, reference = _embedded_step(plain, ids)
    full = sc.apply_regions(_EmbeddedStack(), "recompute_all", where=Block)
    n, full_flops, _ = _embedded_step(full, ids)
    model = sc.apply_regions(_EmbeddedStack(), RELAXED, where=Block,
                             memory_budget=PeakBudget(n))
    peak, flops, grads = _embedded_step(model, ids)
    print(f"\nplaced={placed}: PeakBudget({n}) measured {peak}, {flops} FLOPs recomputed "
          f"(full AC {full_flops})")
    assert peak <= n, _controller(model).notes
    if placed:
        assert flops <= full_flops / 2, (flops, full_flops, _controller(model).notes)
    else:
        assert flops == full_flops
    for g, r in zip(grads, reference):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def test_identical_blocks_share_one_options_search(monkeypatch):
    """Placed in time over 6 identical blocks: each plan searches the options of one
    block's network, not six (``budgets/nested.py``: the same problem node by node, the
    cuts translated), and the step is the one searching each gives: the same measured
    peak, FLOPs and gradients."""
    from sac_compile.budgets import nested
    ids = torch.randint(0, 16384, (4, 64))
    full = sc.apply_regions(_EmbeddedStack(), "recompute_all", where=Block)
    n, _, _ = _embedded_step(full, ids)
    searched, solves = [], []
    real_options, real_solve = nested.cut_options, nested.solve_nested

    def counting_options(net, problem=None):
        searched.append(net)
        return real_options(net, problem)

    def counting_solve(nets, caps):
        solves.append(len(nets))
        return real_solve(nets, caps)

    monkeypatch.setattr(nested, "cut_options", counting_options)
    monkeypatch.setattr(nested, "solve_nested", counting_solve)
    shared = _embedded_step(sc.apply_regions(_EmbeddedStack(), RELAXED, where=Block,
                                             memory_budget=PeakBudget(n)), ids)
    assert solves and all(k == 6 for k in solves) and len(searched) == len(solves)
    monkeypatch.setattr(nested, "_problem_key", id)  # every network its own search
    del searched[:], solves[:]
    each = _embedded_step(sc.apply_regions(_EmbeddedStack(), RELAXED, where=Block,
                                           memory_budget=PeakBudget(n)), ids)
    assert len(searched) == 6 * len(solves)
    assert shared[:2] == each[:2] and shared[0] <= n
    for a, b in zip(shared[2], each[2]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


class _TwoTowers(torch.nn.Module):
    """Two stacks of 3 blocks on two inputs, one loss (a contrastive model's shape): the
    calls' intervals of the first tower enclose the second's only through the engine's
    order (the later-made node's backward first)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = Stack(3, checkpoint="none", seed=0), Stack(3, checkpoint="none", seed=1)

    def forward(self, x):
        return self.a(x[0]) + self.b(x[1])


def test_two_towers_placed_in_time_hold_the_budget():
    """Placed in time over two towers: after calibration the step measures within ``n``
    (between the least and no budget's), keeps more than the least, and the gradients are
    no checkpointing's."""
    x = stack_inputs(2)
    peaks = []
    for policy in ("recompute_all", RELAXED):
        model = sc.apply_regions(_TwoTowers(), policy, where=Block)
        model(x).backward()
        peaks.append(_measured_step(model, x))
    least, free = peaks
    n = (least + free) // 2
    model = sc.apply_regions(_TwoTowers(), RELAXED, where=Block, memory_budget=PeakBudget(n))
    _calibrated(model, x)
    (fit,) = _controller(model).fits.values()
    assert fit.prefix_caps is not None and len(fit.prefix_caps) == 6, _controller(model).notes
    peak = _measured_step(model, x)
    assert peak <= n and fit.tries[-1][1] > 0, (n, peak, _controller(model).notes)
    plain = _TwoTowers()
    plain(x).backward()
    for g, p in zip([p.grad for p in model.parameters()], plain.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6)
