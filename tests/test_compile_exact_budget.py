"""Exact memory budgets (issue 12): the cut under a budget is the optimum of the exact
program, checked against two oracles - brute force on tiny networks (the formulation), and
scipy's MILP on the fixtures' real flow networks (the search)."""
from __future__ import annotations

import math
import random

import pytest
import torch

from fixtures.models import grads_of, loss_fn, make_model, max_grad_diff, reference_grads
from sac_compile import CheckpointPolicy as CP
from sac_compile import policies, sac_region
from sac_compile.budgets import split as budget_mod
from sac_compile.compiler import choose_cut, make_backend
from sac_compile.cut.exact import ExactProblem, brute_force, solve_exact

pytest.importorskip("scipy.optimize", reason="the exact program needs scipy's milp")
INF = math.inf
aten = torch.ops.aten


def _random_problem(rng: random.Random, n: int) -> ExactProblem:
    """A random DAG: the first nodes are inputs, each later node reads one or two earlier
    ones, some are needed by the backward; costs drawn so that every kind of edge occurs
    (free, banned, must-keep, offload-only)."""
    k = rng.randint(1, 2)
    structure = []
    for i in range(n):
        if i >= k:
            for j in rng.sample(range(i), min(i, rng.randint(1, 2))):
                structure.append((2 * j + 1, 2 * i))
        if rng.random() < 0.5 or i == n - 1:
            structure.append((2 * i + 1, 2 * n + 1))
    save = [rng.choice([0, 4, 8, 16, 32]) if i < k else rng.choice([4, 8, 16, 32, INF])
            for i in range(n)]
    offload = [INF if i < k else rng.choice([INF, 10, 30, 80]) for i in range(n)]
    rec = [INF if i < k else rng.choice([0, 1, 5, 20, 60, INF]) for i in range(n)]
    return ExactProblem(structure, save, offload, rec, [i < k for i in range(n)])


def test_the_exact_program_finds_the_brute_force_optimum_on_tiny_networks():
    rng = random.Random(0)
    checked = infeasible = 0
    for _ in range(150):
        p = _random_problem(rng, rng.randint(2, 6))
        cap = rng.choice([0, 8, 16, 32, 64])
        best = brute_force(p, cap)
        sol = solve_exact(p, cap)
        if best is None:
            assert sol is None
            infeasible += 1
            continue
        assert sol is not None and sol.optimal
        assert sol.cost == pytest.approx(best[0], abs=1e-9)
        assert sol.device_bytes <= cap
        checked += 1
    assert checked > 60 and infeasible >= 3  # both kinds of case were exercised


def prefer_policy(ctx, op, *args, **kwargs):
    return CP.PREFER_SAVE if op in policies.MATMUL_OPS else CP.PREFER_RECOMPUTE


def _networks(monkeypatch, model_name, policy, budget, seed=0):
    """Compile ``model_name`` with ``budget``; the flow networks and budget results of its
    splits, and the gradients."""
    seen = []
    real = choose_cut.solve_with_budget

    def recording(net, b, solver=None, **kw):
        res = real(net, b, solver, **kw)
        seen.append((net, res))
        return res

    monkeypatch.setattr(choose_cut, "solve_with_budget", recording)
    torch._dynamo.reset()
    model, inputs = make_model(model_name, size="test", seed=seed)
    for block in model.blocks:
        sac_region(policy)(block)
    compiled = torch.compile(model, backend=make_backend(compiler="aot_eager",
                                                         memory_budget=budget))
    torch.manual_seed(seed)
    loss_fn(compiled(*inputs)).backward()
    return seen, grads_of(model, inputs)


@pytest.mark.parametrize("model_name,policy", [("mlp", policies.save_all),
                                               ("gpt", prefer_policy)])
def test_budgeted_cuts_are_optimal_on_the_fixtures(monkeypatch, model_name, policy):
    """Gap 0 to scipy's MILP at every budget, on networks under 2,000 nodes; the Lagrangian
    search alone is never better, and was worse somewhere (what the exact step is for)."""
    model, inputs = make_model(model_name, size="test", seed=0)
    ref = reference_grads(model, inputs, seed=0)
    gaps = []
    # (0.22: just above the GPT fixture's floor, its dropouts' CPU RNG states)
    for b in (0.9, 0.7, 0.5, 0.3, 0.22):
        seen, grads = _networks(monkeypatch, model_name, policy, b)
        assert seen
        for net, res in seen:
            assert len(net.cls.nodes) <= budget_mod.EXACT_MAX_NODES
            oracle = solve_exact(ExactProblem.from_network(net), res.budget_bytes)
            assert oracle is not None and oracle.optimal
            assert res.activation_bytes <= res.budget_bytes
            assert res.cost == pytest.approx(oracle.cost, rel=1e-9, abs=1e-6), (b, res.method)
            assert res.lagrangian_cost >= res.cost * (1 - 1e-9)
            gaps.append(res.lagrangian_cost / max(res.cost, 1e-9) - 1)
        assert max_grad_diff(ref, grads) <= 1e-5, b
    assert max(gaps) > 0, gaps


def test_large_splits_fill_the_slack_instead(monkeypatch):
    """Above EXACT_MAX_NODES the exact program is not run; values go back into the
    budget's slack while they fit, and the result is never worse than the search's."""
    monkeypatch.setattr(budget_mod, "EXACT_MAX_NODES", 0)
    seen, _ = _networks(monkeypatch, "gpt", prefer_policy, 0.5)
    for net, res in seen:
        assert res.method.startswith("Lagrangian search")
        assert res.cost <= res.lagrangian_cost
        assert res.activation_bytes <= res.budget_bytes


@pytest.mark.parametrize("budget", [None, 0.5, 0.1])
def test_a_budgeted_region_whose_input_is_changed_before_backward_is_never_silently_wrong(
        budget):
    """Around the region: the caller updates the region's input in place between forward
    and backward (a residual). Whatever the budget makes the cut keep, the gradients are
    those of plain autograd, or autograd's in-place error - never silently different."""
    @sac_region(policies.relaxed(policies.save_matmuls), name=f"Res_{budget}")
    def block(h, w):
        return ((h * 2.0) @ w).sin() @ w

    def caller(run, x, w):
        h = x * 1
        out = run(h, w)
        h += out
        return h.sum()

    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(16, 16, requires_grad=True)
    ref_x, ref_w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    caller(lambda h, w: ((h * 2.0) @ w).sin() @ w, ref_x, ref_w).backward()
    f = torch.compile(block, backend=make_backend(compiler="aot_eager", memory_budget=budget))
    try:
        caller(f, x, w).backward()
    except RuntimeError as e:
        assert "modified by an inplace operation" in str(e)
        return
    assert torch.allclose(x.grad, ref_x.grad, atol=1e-5)
    assert torch.allclose(w.grad, ref_w.grad, atol=1e-5)


def test_placed_in_time_options_include_cuts_between_the_prices(monkeypatch):
    """``budgets/nested.py``'s options per network (what the caps placed in time choose
    from): the price search reaches only the cuts on the lower convex hull of cost against
    kept bytes; the exact program's cuts at caps between them fill the gaps (a choice of
    one cut per call is discrete: a cut between two hull cuts lets a prefix use its cap).
    The options grow in bytes and fall in cost, some lie between hull neighbours, and the
    nested choice over them is never costlier than over the price search's cuts alone,
    and cheaper at some caps."""
    from sac_compile.budgets import nested
    seen, _ = _networks(monkeypatch, "gpt", prefer_policy, 0.5)
    nets = [net for net, _ in seen]
    between = 0
    for net in nets:
        options = nested.cut_options(net)
        assert all(a.nbytes < b.nbytes and a.cost > b.cost
                   for a, b in zip(options, options[1:]))
        with monkeypatch.context() as m:
            m.setattr(nested, "EXACT_OPTIONS", 0)
            hull = {c.nbytes for c in nested.cut_options(net)}
        between += sum(c.nbytes not in hull for c in options)
    assert between > 0
    least = sum(nested.cut_options(net)[0].nbytes for net in nets)
    most = sum(nested.cut_options(net)[-1].nbytes for net in nets)
    cheaper = 0
    for frac in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9):
        caps = [least + frac * (most - least)] * len(nets)
        with_exact = nested.solve_nested(nets, caps)
        with monkeypatch.context() as m:
            m.setattr(nested, "EXACT_OPTIONS", 0)
            prices_only = nested.solve_nested(nets, caps)
        cost = sum(c.cost for c in with_exact.cuts)
        before = sum(c.cost for c in prices_only.cuts)
        assert with_exact.fits and cost <= before * (1 + 1e-9)
        cheaper += cost < before * (1 - 1e-9)
    assert cheaper > 0
