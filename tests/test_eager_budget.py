"""Memory budgets in eager mode (issue 19): ``sac_region(policy, memory_budget=...)`` and
``apply_regions(..., memory_budget=...)`` solve the same flow network as a compiled split,
with the same code; a plan is made once per recorded ops and shapes, and reused."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fixtures.budget_model import POLICY, budget_model, budget_step, compile_blocks, per_region
from fixtures.models import max_grad_diff, reference_grads
from sac_compile import CheckpointError, CheckpointPolicy as CP, apply_regions, policies, sac_region
from sac_compile.runtime import collect_stats

BUDGETS = (1.0, 0.7, 0.5, 0.3)


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_eager_keeps_what_the_compiled_split_keeps(name):
    """Each block its own region with the same budget: eager keeps per region what the
    same block compiled on its own keeps (aot_eager, our partitioner), at every budget,
    and both give no-checkpointing's gradients exactly."""
    free = None
    for budget in BUDGETS:
        model, inputs = budget_model(name)
        ref = reference_grads(model, inputs, 0)
        apply_regions(model, POLICY, where=type(model.blocks[0]), memory_budget=budget)
        stats, grads = budget_step(model, inputs)
        eager = per_region(stats.saved)
        assert max_grad_diff(ref, grads) == 0.0
        assert stats.budget_notes and all("memory budget" in n for n in stats.budget_notes)
        caps = compile_blocks(model)
        _, grads = budget_step(model, inputs)
        assert max_grad_diff(ref, grads) <= 1e-6
        compiled = {f"blocks.{i}": sum(s.nbytes for s in cap.report.saved if not s.is_input)
                    for i, cap in enumerate(caps)}
        assert eager == compiled, (budget, eager, compiled)
        line = [n for n in caps[0].report.notes if n.startswith("memory_budget=")]
        # (identical blocks share one graph, named after one of the group's members)
        assert line and "of region 'blocks." in line[0], caps[0].report.notes
        free = free if budget != 1.0 else eager
        assert all(eager[r] <= budget * free[r] for r in eager), (budget, eager, free)


def _block(budget, policy=policies.save_all, name="B"):
    torch.manual_seed(0)
    w1 = torch.randn(64, 256, requires_grad=True)
    w2 = torch.randn(256, 64, requires_grad=True)

    def body(x):
        return F.gelu(F.layer_norm(x, (64,)) @ w1).sin() @ w2

    return sac_region(policy, name=name, memory_budget=budget)(body), body, (w1, w2)


def test_a_plan_is_made_once_per_shape_and_reused():
    from sac_compile.runtime import budget_plan
    calls = []
    solve = budget_plan.solve_region

    def counting(*args, **kwargs):
        calls.append(1)
        return solve(*args, **kwargs)

    f, body, _ = _block(0.5)
    budget_plan.solve_region = counting
    try:
        kept = []
        for batch in (32, 32, 32, 16, 32, 16):
            x = torch.randn(batch, 64, requires_grad=True)
            with collect_stats() as stats:
                y = f(x)
            y.sum().backward()
            kept.append(stats.saved_bytes)
    finally:
        budget_plan.solve_region = solve
    assert len(calls) == 2  # one solve per shape, none per step
    assert kept[0] == kept[1] == kept[2] == kept[4] and kept[3] == kept[5] < kept[0]


def test_the_report_says_what_was_dropped_and_gradients_are_exact():
    for budget in (None, 1.0, 0.5, 0.1):
        f, body, (w1, w2) = _block(budget)
        x = torch.randn(32, 64, requires_grad=True)
        with collect_stats() as stats:
            y = f(x)
        y.sum().backward()
        got = (x.grad, w1.grad, w2.grad)
        x2 = x.detach().clone().requires_grad_()
        w1.grad = w2.grad = None
        body(x2).sum().backward()
        assert all(torch.equal(a, b) for a, b in zip(got[:1], (x2.grad,)))
        if budget is None:
            assert not stats.budget_notes and stats.saved_bytes == 106752
            continue
        (note,) = stats.budget_notes
        assert note.startswith("region 'B': memory budget")
        cap = 41216 * budget
        assert stats.saved_bytes <= cap, (budget, stats.saved_bytes)
        if budget < 1.0:
            assert stats.evicted and all("overridden by memory budget" in r.reason
                                         for r in stats.evicted)
            assert "dropped to meet it" in note


def test_an_unreachable_budget_is_the_compilers_error_naming_the_region():
    f, _, _ = _block(0.1, policy=policies.save_matmuls)
    with pytest.raises(CheckpointError) as info:
        f(torch.randn(32, 64, requires_grad=True))
    msg = str(info.value)
    assert msg.startswith("region 'B' (eager mode): sac_compile: memory budget 10%")
    assert "cannot be met" in msg and "MUST_SAVE" in msg and "policies.relaxed(policy)" in msg


def test_recomputing_a_random_op_counts_its_rng_state():
    """As under compile: on the CPU a recomputed dropout keeps the generator's state
    (5,056 B); a budget below it is out of reach and the error says why. (Eager dropout
    runs as bernoulli_ + div_ + mul, not native_dropout: its unconstrained bytes differ.)"""
    @sac_region(lambda ctx, op, *a, **k: CP.PREFER_RECOMPUTE if op is not None else None,
                name="D", memory_budget="4KiB")
    def block(x, w):
        return F.dropout(x @ w, 0.5, training=True).sin()

    x = torch.randn(64, 64, requires_grad=True)
    w = torch.randn(64, 64, requires_grad=True)
    with pytest.raises(CheckpointError, match="the RNG states of the random ops it recomputes"):
        block(x, w)
    fits = sac_region(lambda ctx, op, *a, **k: CP.PREFER_RECOMPUTE, name="D8",
                      memory_budget="8KiB")(lambda x, w: F.dropout(x @ w, 0.5, True).sin())
    with collect_stats() as stats:
        torch.manual_seed(1)
        y = fits(x, w)
    y.sum().backward()
    assert "5,056 B of activations kept" in stats.budget_notes[0]  # the state alone
    x2, w2 = (t.detach().clone().requires_grad_() for t in (x, w))
    torch.manual_seed(1)
    F.dropout(x2 @ w2, 0.5, True).sin().sum().backward()
    assert torch.equal(x.grad, x2.grad) and torch.equal(w.grad, w2.grad)


def test_different_budgets_never_share_a_compiled_split():
    a = sac_region(POLICY, memory_budget=0.5)(torch.nn.Linear(4, 4))
    b = sac_region(POLICY, memory_budget=0.5)(torch.nn.Linear(4, 4))
    c = sac_region(POLICY, memory_budget=0.3)(torch.nn.Linear(4, 4))
    d = sac_region(POLICY)(torch.nn.Linear(4, 4))
    token = [m._sac_regions[0].frame.slot.token for m in (a, b, c, d)]
    assert token[0] == token[1] and len(set(token[1:])) == 3


def test_a_budget_on_a_nested_region_is_refused_in_eager_mode():
    inner = sac_region(POLICY, name="inner", memory_budget=0.5)(lambda x: x.sin())
    outer = sac_region(POLICY, name="outer")(lambda x: inner(x).cos())
    with pytest.raises(CheckpointError, match="applies to an outermost region only"):
        outer(torch.randn(4, requires_grad=True))


def test_budget_values_have_make_backends_meaning():
    for bad in (1, 0, -2, 1.5, "abc", True):
        with pytest.raises(ValueError):
            sac_region(POLICY, memory_budget=bad)
    assert sac_region(POLICY, memory_budget="64KiB").budget.value == 65536
