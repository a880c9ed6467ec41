"""One whole-model memory budget over blocks compiled one by one (issue 19): torchtitan's
order, ``block.compile(fullgraph=True)`` per layer, after ``apply_regions(...,
memory_budget=<bytes>)``. Identical blocks: one compile, one partition, each block cut at
the budget over their number. Two kinds of block: each kind first at the even split, then,
once every kind was compiled, once more at its share of one price per byte."""
from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch._dynamo.utils import counters

import sac_compile as sc
from sac_compile import CheckpointError, policies
from sac_compile._bench.models import GPT, GPTBlock, MLPBlock
from sac_compile.compiler import make_backend

POLICY = policies.relaxed(policies.save_matmuls)
BUDGET = 100_000
N = 12


def _models(kinds: int = 1):
    torch.manual_seed(0)
    reference = GPT(32, 4, N, 8, dropout=0.0)
    if kinds == 2:
        for i in range(1, N, 2):
            reference.blocks[i] = MLPBlock(32, 64)
    model = copy.deepcopy(reference)
    sc.apply_regions(model, POLICY, where=(GPTBlock, MLPBlock), memory_budget=BUDGET)
    return reference, model


def _compile_per_block(model, reports):
    backend = make_backend(compiler="aot_eager", on_partition=reports.append)
    for block in model.blocks:
        block.compile(backend=backend, fullgraph=True)


def _grads(model, x):
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    model(x).pow(2).sum().backward()
    return [x.grad] + [p.grad for p in model.parameters()]


def _kept(report) -> int:
    """Bytes of the blocks' values the split keeps (the graph's inputs excluded)."""
    return sum(s.nbytes for s in report.saved if not s.is_input and s.region)


def _check_grads(got, want):
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_identical_blocks_compiled_per_block_share_one_whole_model_budget():
    """12 identical GPT blocks: one Dynamo compile and one partition serve all of them,
    cut at 100,000 B / 12 each: 8,192 B kept per block, 98,304 B in total (before: a
    CheckpointError, 'holds 1 of them'). Gradients equal no checkpointing's."""
    torch._dynamo.reset()
    reference, model = _models()
    reports = []
    _compile_per_block(model, reports)
    x = torch.randn(2, 8, 32)
    want = _grads(reference, x)
    counters.clear()
    for _ in range(2):
        _check_grads(_grads(model, x), want)
    assert counters["stats"]["unique_graphs"] == 1      # one Dynamo compile for 12 blocks
    assert len(reports) == 1                            # one partition
    assert _kept(reports[0]) == 8192
    assert N * _kept(reports[0]) == 98_304 <= BUDGET
    assert any("over 12 blocks; this graph's 1 at 8.1 KiB each" in n
               for n in reports[0].notes), reports[0].notes
    budget = model.blocks[0]._sac_regions[0].frame.budget.model
    assert budget.recompiles == 0 and budget.kind_share is None
    assert budget.shares == {f"blocks.{i}": 8192 for i in range(N)}   # every block's share


def test_two_kinds_of_block_compiled_per_block_find_one_price(caplog):
    """GPT blocks and MLP blocks, alternating, 6 of each. Step 1: each kind compiled once
    at the even split (at most 100,000 / 12 B per block: the step is within the budget);
    the price is found at the second kind's partition. Step 2: the model's call gives both
    kinds new tokens (one recompile each, logged and counted), and each kind is cut at its
    share: the GPT blocks keep more (10,496 B, recomputing less), the total still within
    the budget. Step 3 compiles nothing. Gradients equal no checkpointing's every step."""
    torch._dynamo.reset()
    reference, model = _models(kinds=2)
    reports = []
    _compile_per_block(model, reports)
    x = torch.randn(2, 8, 32)
    want = _grads(reference, x)
    budget = model.blocks[0]._sac_regions[0].frame.budget.model
    assert len(set(budget.kinds)) == 2
    counters.clear()
    _check_grads(_grads(model, x), want)
    step1 = reports[:]
    assert len(step1) == 2 and counters["stats"]["unique_graphs"] == 2
    assert all(_kept(r) <= BUDGET / N for r in step1)
    assert 6 * sum(_kept(r) for r in step1) == 86_016 <= BUDGET
    assert budget.kind_share is not None and budget.rekey
    with caplog.at_level(logging.INFO, logger="sac_compile"):
        _check_grads(_grads(model, x), want)
    step2 = reports[2:]
    assert len(step2) == 2 and budget.recompiles == 2
    assert "compiled once more, at their shares" in caplog.text
    kept = {r.saved[0].region if r.saved else "": _kept(r) for r in step2}
    assert sorted(_kept(r) for r in step2) == [6144, 10496]
    assert 6 * sum(_kept(r) for r in step2) == 99_840 <= BUDGET, kept
    assert all("at their shares at the price per byte" in " ".join(r.notes) for r in step2)
    assert sum(r.recompute_flops for r in step2) < sum(r.recompute_flops for r in step1)
    _check_grads(_grads(model, x), want)
    assert len(reports) == 4


def test_per_block_budget_out_of_reach_names_the_budget():
    """MUST_SAVE matmuls and a 64 B budget: the even split cannot be met by a block, and
    the error says which budget."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(32, 4, 2, 8, dropout=0.0)
    sc.apply_regions(model, policies.save_matmuls, where=GPTBlock, memory_budget=64)
    _compile_per_block(model, [])
    with pytest.raises(CheckpointError, match="for the whole model"):
        model(torch.randn(2, 8, 32))


def test_the_budget_is_part_of_a_regions_cache_key():
    """A split made under one budget is never served from the compile caches for another:
    the budget is in the region's cache hash; blocks of a model of several kinds bypass
    the caches until the price is found (their partitions record the kinds' networks),
    unless one graph holds all of them."""
    from sac_compile.budgets import ModelBudget, RegionBudget, budget_cache_text
    from sac_compile.compiler.cache_keys import region_cache_hash
    texts = [budget_cache_text(RegionBudget(b)) for b in (0.5, 0.3, 4096)]
    assert len({region_cache_hash("region", "b", POLICY, False, t) for t in texts}) == 3
    assert region_cache_hash("region", "b", POLICY, False, "none") == \
        region_cache_hash("region", "b", POLICY, False)          # no budget: as before
    two = ModelBudget(BUDGET, ("a", "b"), ("k1", "k2"))
    assert budget_cache_text(RegionBudget(BUDGET, two, "k1")) is None
    assert "whole graph" in budget_cache_text(RegionBudget(BUDGET, two, "k1"), whole=True)
    two.kind_share = {"k1": 4096.0, "k2": 2048.0}
    assert "share=4096.0" in budget_cache_text(RegionBudget(BUDGET, two, "k1"))
    one = ModelBudget(BUDGET, ("a", "b"), ("k", "k"))
    assert "share=even" in budget_cache_text(RegionBudget(BUDGET, one, "k"))
    # a step-peak budget's graph of every block (a model compiled whole) is split under
    # the step's PeakBudget, lowered by what measured steps found above it; a graph of
    # some blocks at the kept-byte cap its steps set. Each key carries both, so a graph
    # classified either way never shares an entry across either (a block whose ops are
    # all pruned from the joint graph would be "whole" to Dynamo's graph, "some" to the
    # split): each cap and each lowered peak its own entry, in both kinds of key
    from sac_compile import PeakBudget
    peak = ModelBudget(0, ("a", "b"), ("k", "k"))
    peak.step_peak = PeakBudget(2_000_000)

    def texts():
        budget = RegionBudget(PeakBudget(2_000_000), peak, "k")
        return budget_cache_text(budget, whole=True), budget_cache_text(budget)
    first = texts()
    peak.set_cap(4096)
    capped = texts()
    peak.lower_graph_peak(1000)
    lowered = texts()
    for before, after in zip(first, capped):
        assert before != after and "cap=4096" in after
    for before, after in zip(capped, lowered):
        assert before != after and "peak=1999000" in after


def test_a_kind_compiled_again_before_its_new_token_stays_at_the_even_split():
    """A backend per block (Dynamo compiles each block on its own): blocks 2.. of a kind
    are compiled after the price was found at block 1, within step 1. They keep the even
    split until the next call of the model gives their kind a new token, so step 1 never
    mixes the two splits of a kind and stays within the budget."""
    torch._dynamo.reset()
    config = torch._dynamo.config
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    with config.patch(**{limit: 4 * N}):
        _backend_per_block()


def _backend_per_block():
    reference, model = _models(kinds=2)
    reports = []
    for block in model.blocks:
        block.compile(backend=make_backend(compiler="aot_eager", on_partition=reports.append),
                      fullgraph=True)
    x = torch.randn(2, 8, 32)
    want = _grads(reference, x)
    _check_grads(_grads(model, x), want)
    assert len(reports) == N
    assert all(_kept(r) <= BUDGET / N for r in reports)
    assert sum(_kept(r) for r in reports) <= BUDGET
    _check_grads(_grads(model, x), want)
    assert sorted({_kept(r) for r in reports[N:]}) == [6144, 10496]
    assert sum(_kept(r) for r in reports[N:]) == 99_840


CACHE_SCRIPT = """
import copy, json, sys, torch
import sac_compile as sc
from sac_compile import policies
from sac_compile._bench.models import GPT, GPTBlock
from torch._dynamo.utils import counters

torch.manual_seed(0)
reference = GPT(32, 4, 12, 8, dropout=0.0)
model = copy.deepcopy(reference)
sc.apply_regions(model, policies.relaxed(policies.save_matmuls), where=GPTBlock,
                 memory_budget=int(sys.argv[1]))
for block in model.blocks:
    block.compile(backend=sc.sac_backend, fullgraph=True)
x = torch.randn(2, 8, 32)
params = {id(p) for p in model.parameters()}
kept = []

def pack(t):
    if id(t) not in params and t.requires_grad is False and t.dim() > 0:
        kept.append(t.untyped_storage().nbytes())
    return t

def grads(m, hooks):
    m.zero_grad(set_to_none=True)
    if hooks:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = m(x).pow(2).sum()
    else:
        loss = m(x).pow(2).sum()
    loss.backward()
    return [p.grad for p in m.parameters()]

want = grads(reference, False)
got = grads(model, True)
error = max((a - b).abs().max().item() for a, b in zip(got, want))
aot = counters["aot_autograd"]
print(json.dumps({k: aot.get("autograd_cache_" + k, 0) for k in ("hit", "miss", "bypass")}
                 | {"kept": sum(kept), "error": error}))
"""


@pytest.mark.slow
def test_a_second_process_sharing_the_cache_gets_its_own_budgets_split(tmp_path):
    """Around the region: processes sharing a compile cache, 12 identical GPT blocks
    compiled one by one under one whole-model budget. The same budget again is a cache hit
    keeping the same bytes; another budget misses and keeps what that budget allows (a
    served stale split would keep the first budget's bytes). Gradients equal no
    checkpointing's in every process."""
    from fixtures.cache_process import run_with_cache

    cold = run_with_cache(CACHE_SCRIPT, "100000", tmp_path)
    warm = run_with_cache(CACHE_SCRIPT, "100000", tmp_path)
    tighter = run_with_cache(CACHE_SCRIPT, "50000", tmp_path)
    assert cold["miss"] >= 1 and cold["hit"] == 0, cold
    assert warm["hit"] >= 1 and warm["miss"] == 0 and warm["kept"] == cold["kept"], warm
    assert tighter["miss"] >= 1 and tighter["hit"] == 0, tighter
    assert tighter["kept"] < cold["kept"], (tighter, cold)
    for run in (cold, warm, tighter):
        assert run["error"] < 1e-5, run
