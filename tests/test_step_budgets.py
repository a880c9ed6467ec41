"""Whole-model budgets where models do real things (issue 27): a block called twice per
step, a block skipped on the first step, shapes that change under ``dynamic=True``. The
rule: the bytes the regions keep at the end of forward, summed over every region *call* of
the step, stay within ``apply_regions(..., memory_budget=...)``, or a note (or an error)
says they cannot - never a silent overrun. Gradients equal the model's without regions."""
from __future__ import annotations

import logging

import pytest
import torch

from fixtures.budget_model import per_region
from fixtures.step_models import Reused, Skipping, compiled_kept, grads, models
from sac_compile.compiler import make_backend
from sac_compile.runtime import collect_stats

X = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))


def _check(got, want):
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def _eager_step(model, reference):
    with collect_stats() as stats:
        got = grads(model, X)
    _check(got, grads(reference, X))
    return per_region(stats.saved), stats.budget_notes


# -- eager ------------------------------------------------------------------------------

def test_eager_block_called_twice_is_counted_twice():
    """blocks.0 runs twice per step, blocks.1 once, budget 8,192 B. Before: 10,240 B kept
    in step 1 and 24,576 B every later step (blocks.0's plan, 8,192 B, applied to both its
    calls; the price was found after blocks.0's first call alone, 'by 1 regions'). Now every
    step keeps at most 8,192 B, the price found over the 3 calls of 2 regions."""
    reference, model = models(Reused, 8192)
    for step in range(3):
        per, notes = _eager_step(model, reference)
        assert sum(per.values()) <= 8192, (step, per)
        assert len(notes) == 3, notes
        if step:
            assert all("3 calls of 2 regions" in n for n in notes), notes
    budget = model.blocks[0]._sac_regions[0].frame.budget.model
    assert budget.shares == per and sum(budget.shares.values()) <= 8192


def test_eager_block_skipped_in_the_recording_step_is_not_given_budget_silently():
    """blocks.1 skipped in step 1, budget 8,192 B. Before: the price over blocks.0 alone
    gave it the whole budget, then blocks.1 its own plan on top: 16,384 B every step from
    step 3. Now blocks.1's first call keeps what the step has left (its note says it was
    not in the step the price was found for), and from the next step the price covers both."""
    reference, model = models(Skipping, 8192)
    seen = []
    for step in range(4):
        model.step = reference.step = step
        per, notes = _eager_step(model, reference)
        seen.append(per)
        assert sum(per.values()) <= 8192, (step, per)
        if step == 1:
            assert any("not in the step the price was found for" in n for n in notes), notes
    assert set(seen[-1]) == {"blocks.0", "blocks.1"}
    assert all("2 calls of 2 regions" in n for n in notes), notes


def test_eager_steps_alternating_batch_sizes_keep_each_sizes_price():
    """Eager plans per shape: batch 2 then 4 then 2 again, budget 8,192 B. Each size's
    first step records (within the budget), and later steps reuse that size's price: no
    step keeps more than the budget, and the third and fourth steps solve nothing."""
    from fixtures.step_models import TwoBlocks
    reference, model = models(TwoBlocks, 8192)
    steps = model.blocks[0]._sac_regions[0].frame.budget.model
    for i, batch in enumerate((2, 4, 2, 4)):
        x = torch.randn(batch, 8, 32)
        with collect_stats() as stats:
            got = grads(model, x)
        _check(got, grads(reference, x))
        assert sum(per_region(stats.saved).values()) <= 8192, (batch, stats.saved)
        if i >= 2:
            assert all("kept by 2 calls of 2 regions" in n for n in stats.budget_notes)
    model(X)  # (the fourth step ends)
    assert len(steps.eager.prices) == 2


# -- blocks compiled one by one ----------------------------------------------------------

def _per_block(model):
    reports = []
    backend = make_backend(compiler="aot_eager", on_partition=reports.append)
    for block in model.blocks:
        block.compile(backend=backend, fullgraph=True)
    return reports


def test_per_block_compile_block_called_twice(caplog):
    """Per-block compiles (one graph for the identical blocks), blocks.0 twice per step,
    budget 8,192 B. Before: the graph cut at 8,192 / 2 blocks = 4,096 B per call, run 3
    times: 12,288 B every step, said nowhere. Now the step that learns the 3 calls says it
    kept more than the budget, and the kind is compiled once more at 8,192 / 3 per call."""
    reference, model = models(Reused, 8192)
    _per_block(model)
    want = grads(reference, X)
    with caplog.at_level(logging.WARNING, logger="sac_compile"):
        kept, got = compiled_kept(model, model, X)
    _check(got, want)
    assert kept == 12288
    for _ in range(2):
        with caplog.at_level(logging.WARNING, logger="sac_compile"):
            kept, got = compiled_kept(model, model, X)
        _check(got, want)
        assert kept <= 8192
    assert "3 calls" in caplog.text and "above the budget" in caplog.text, caplog.text


def test_per_block_compile_block_skipped_keeps_its_share():
    """blocks.1 skipped in step 1 under per-block compiles: its share stays reserved (the
    even split over the 2 members), so no step keeps more than the budget."""
    reference, model = models(Skipping, 8192)
    _per_block(model)
    for step in range(3):
        model.step = reference.step = step
        kept, got = compiled_kept(model, model, X)
        _check(got, grads(reference, X))
        assert kept <= 8192, (step, kept)


# -- compiled whole ------------------------------------------------------------------------

def test_whole_compile_counts_each_call_of_a_reused_block(capture):
    reference, model = models(Reused, 8192)
    compiled = torch.compile(model, backend=capture.backend())
    _, got = compiled_kept(model, compiled, X)
    _check(got, grads(reference, X))
    report = capture.report
    assert sum(s.nbytes for s in report.saved if not s.is_input and s.region) <= 8192


# -- dynamic shapes ----------------------------------------------------------------------

def _blocks_only(budget):
    """The two GPT blocks alone: every value a compiled step keeps is in a region, so the
    count where autograd packs them is what the budget caps."""
    from fixtures.step_models import TwoBlocks
    return models(TwoBlocks, budget)


@pytest.mark.parametrize("per_block", [False, True], ids=["whole", "per_block"])
def test_dynamic_shapes_keep_the_budget_at_every_size(per_block):
    """torch.compile(dynamic=True): the cut is chosen at the size hint (batch 2). Before:
    batch 4 ran the same cut, keeping twice the bytes (16,384 B of an 8,192 B budget).
    Now a cut under a byte budget holds only for sizes up to the ones it was chosen at
    (guarded): a larger batch compiles again, and every size keeps at most the budget."""
    reference, model = _blocks_only(8192)
    reports = []
    backend = make_backend(compiler="aot_eager", on_partition=reports.append)
    if per_block:
        for block in model.blocks:
            block.compile(backend=backend, dynamic=True)
        run = model
    else:
        run = torch.compile(model, backend=backend, dynamic=True)
    for batch in (2, 4, 3, 1):
        x = torch.randn(batch, 8, 32)
        kept, got = compiled_kept(model, run, x)
        _check(got, grads(reference, x))
        assert kept <= 8192, (batch, kept)


def test_peak_budget_under_dynamic_shapes():
    """make_backend(memory_budget=PeakBudget(140000)) with dynamic=True: the split's
    modelled step peak fits at batch 2 (the size hint); batch 4 ran the same split, whose
    peak grows with the batch (141,517 B without a budget), with no new partition and no
    word. Now the sizes are guarded at most their hints (compiler/size_guards.py): batch 4
    is partitioned again, within the cap."""
    from sac_compile.budgets import PeakBudget
    reference, model = _blocks_only(None)
    import sac_compile as sc
    from fixtures.step_models import POLICY
    from sac_compile._bench.models import GPTBlock
    sc.apply_regions(model, POLICY, where=GPTBlock)
    reports = []
    backend = make_backend(compiler="aot_eager", memory_budget=PeakBudget(140000),
                           on_partition=reports.append)
    run = torch.compile(model, backend=backend, dynamic=True)
    for batch in (2, 4):
        x = torch.randn(batch, 8, 32)
        _, got = compiled_kept(model, run, x)
        _check(got, grads(reference, x))
    assert reports and all(r.budget_peak <= 140000 for r in reports)
    assert len(reports) == 2, "batch 4 ran the split chosen for batch 2"
