"""One memory budget for the whole model (issue 19): ``apply_regions(model, policy,
where=..., memory_budget=<bytes>)`` is one byte budget for all the regions together, met
at a single price per byte found over all of them; each region's share is reported."""
from __future__ import annotations

import pytest
import torch

from fixtures.budget_model import POLICY, budget_model, budget_step, per_region
from fixtures.models import grads_of, loss_fn, max_grad_diff, reference_grads
from sac_compile import CheckpointError, apply_regions, policies


def _step(model, inputs):
    stats, grads = budget_step(model, inputs)
    return stats, per_region(stats.saved), grads


def _alive_when_backward_starts(model, inputs, steps=2):
    """Bytes alive (LiveBytes: storages, no allocator) when each step's backward starts."""
    from sac_compile.live_bytes import LiveBytes
    alive = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        with LiveBytes() as meter:
            torch.manual_seed(0)
            loss = loss_fn(model(*inputs))
            meter.mark("backward")
            loss.backward()
        alive.append(meter.at("backward"))
    return alive


def test_one_budget_for_all_regions_in_eager_mode():
    """GPT fixture (dropout on): step 1 records and already keeps at most the budget (each
    region cut at its part of what the step has left, measured by the runtime's saved-value
    accounting at the end of forward, before backward); from step 2 the regions together
    keep at most the budget at one price, with their shares reported; gradients equal no
    checkpointing's every step."""
    model, inputs = budget_model(dropout=True)
    ref = reference_grads(model, inputs, 0)
    apply_regions(model, POLICY, where=type(model.blocks[0]), memory_budget=20000)
    stats, per, grads = _step(model, inputs)
    assert max_grad_diff(ref, grads) == 0.0
    assert all("recording step" in n for n in stats.budget_notes)
    assert per == {"blocks.0": 6144, "blocks.1": 12288}   # was 22,784 B each before
    assert sum(per.values()) <= 20000
    assert "10,000 B: 20,000 B over 2 regions not yet run" in stats.budget_notes[0]
    for _ in range(2):
        stats, per, grads = _step(model, inputs)
        assert max_grad_diff(ref, grads) == 0.0
        assert sum(per.values()) <= 20000
        assert len(stats.budget_notes) == 2
        assert all("one price per byte" in n and "share" in n for n in stats.budget_notes)
        assert all("without the budget 45,568 B" in n for n in stats.budget_notes)
    budget = model.blocks[0]._sac_regions[0].frame.budget.model
    assert budget.shares == per and budget.weight < 1.0


def test_step_one_is_within_budget_when_backward_starts():
    """What is alive when step 1's backward starts (LiveBytes: storages, no allocator) is
    what later steps have alive: step 1's regions drop their held forward outputs at their
    exits, down to plans that together keep 18,432 B, as the price's plans do (before:
    27,136 B more alive at step 1, each region keeping its 22,784 B without a budget)."""
    model, inputs = budget_model(dropout=True)
    apply_regions(model, POLICY, where=type(model.blocks[0]), memory_budget=20000)
    assert _alive_when_backward_starts(model, inputs) == [24708, 24708]


def test_an_unreachable_whole_model_budget_names_the_fix():
    model, inputs = budget_model(dropout=True)
    apply_regions(model, policies.save_matmuls, where=type(model.blocks[0]), memory_budget=64)
    _step(model, inputs)
    with pytest.raises(CheckpointError, match="whole-model memory budget 64 B of apply_regions "
                                              "cannot be met"):
        _step(model, inputs)


def test_a_fraction_on_apply_regions_is_each_regions_own():
    model, _ = budget_model(dropout=True)
    apply_regions(model, POLICY, where=type(model.blocks[0]), memory_budget=0.5)
    budgets = [b._sac_regions[0].frame.budget for b in model.blocks]
    assert all(b.model is None and b.value == 0.5 for b in budgets)
    model, _ = budget_model(dropout=True)
    apply_regions(model, POLICY, where=type(model.blocks[0]), memory_budget="64KiB")
    models = {id(b._sac_regions[0].frame.budget.model) for b in model.blocks}
    assert len(models) == 1 and model.blocks[0]._sac_regions[0].frame.budget.model.members == (
        "blocks.0", "blocks.1")


def test_whole_model_budget_under_compile_is_one_cap_over_the_regions(capture):
    """The whole model compiled as one graph: one cap over all its regions' values, with
    each region's share in the report. A graph holding only some of the regions (a block
    compiled on its own) is cut at its blocks' part of the budget
    (tests/test_model_budget_blocks.py)."""
    model, inputs = budget_model()
    ref = reference_grads(model, inputs, 0)
    apply_regions(model, POLICY, where=type(model.blocks[0]), memory_budget=20000)
    compiled = torch.compile(model, backend=capture.backend())
    loss_fn(compiled(*inputs)).backward()
    assert max_grad_diff(ref, grads_of(model, inputs)) <= 1e-5
    report = capture.report
    in_regions = sum(s.nbytes for s in report.saved if not s.is_input and s.region)
    assert in_regions <= 20000
    shares = [n for n in report.notes if "for the whole model (2 regions): shares" in n]
    assert shares and "blocks.0" in shares[0] and "blocks.1" in shares[0], report.notes
    torch._dynamo.reset()
    model.blocks[0].compile(backend=capture.backend())
    model.zero_grad(set_to_none=True)
    inputs[0].grad = None
    loss_fn(model(*inputs)).backward()
    assert max_grad_diff(ref, grads_of(model, inputs)) <= 1e-5
    assert any("over 2 blocks; this graph's 1 at 9.8 KiB each" in n for n in capture.report.notes)
    assert sum(s.nbytes for s in capture.report.saved if not s.is_input and s.region) <= 10000


@pytest.mark.parametrize("fraction,alive", [(0.5, 26756), (0.3, 18564)])
def test_the_first_call_of_a_region_budget_is_within_it_when_backward_starts(fraction,
                                                                             alive):
    """A budget of each region's own (a fraction): its first call plans at the region's exit
    and drops what the plan does not keep there, so the bytes alive when backward starts
    (LiveBytes) are those of every later call."""
    model, inputs = budget_model(dropout=True)
    apply_regions(model, POLICY, where=type(model.blocks[0]), memory_budget=fraction)
    assert _alive_when_backward_starts(model, inputs) == [alive, alive]
