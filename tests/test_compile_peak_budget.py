"""``memory_budget=PeakBudget(N)``: a cap on the step's peak - the most bytes the step
allocates at once above what was allocated when it began, the gradients it makes included
(issues 17, 27) - not on the split's kept bytes.

Bytes are the peak model's (``PartitionReport.budget_peak``, the final graphs' step walk)
and the measured step peak (``sac_compile.measured_peak``: the CPU allocator's events
replayed); costs are recompute FLOPs; never a clock.
"""
from __future__ import annotations

import itertools
import pickle

import pytest
import torch

import sac_compile as sc
from fixtures.measure import step_peak
from sac_compile.measured_peak import measured_peak
from fixtures.stack import BrokenPair, Stack, stack_inputs
from sac_compile import BudgetUnreachableError, PeakBudget, policies
from sac_compile.compiler import PartitionerConfig, SACPartitioner, make_backend
from sac_compile.report import PartitionReport

RELAXED = policies.relaxed(policies.save_matmuls)


def _run(budget, *, n=6, checkpoint="ours", compiler="aot_eager"):
    """(report, measured step, grads) of one step of issue 17's stack with relaxed
    save_matmuls regions under ``budget`` (checkpoint="none": no regions), the step
    after the one that compiles."""
    torch._dynamo.reset()
    model, x = Stack(n, policy=RELAXED, checkpoint=checkpoint), stack_inputs()
    reports: list[PartitionReport] = []
    fn = model
    if checkpoint != "none":
        fn = torch.compile(model, backend=make_backend(
            compiler=compiler, memory_budget=budget, on_partition=reports.append))
        step_peak(fn, list(model.parameters()), [x])
    leaves = [*model.parameters(), x]
    for t in leaves:
        t.grad = None
    with measured_peak() as m:
        fn(x).backward()
    grads = [t.grad for t in leaves]
    return (reports[-1] if reports else None), m, grads


@pytest.fixture(scope="module")
def reference():
    """Gradients of no checkpointing, and the split without a budget."""
    _, _, ref = _run(None, checkpoint="none")
    report, _, _ = _run(None)
    return ref, report


def _exact(grads, ref):
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r, rtol=0, atol=0)


# -- the value -------------------------------------------------------------------------------

def test_peak_budget_value_forms():
    assert PeakBudget("2MiB").value == 2 * 2**20
    assert PeakBudget("2MiB") == PeakBudget(2 * 2**20)
    assert PeakBudget(0.5).value == 0.5
    assert PeakBudget(0.5).cap(1000) == 500 and PeakBudget(4096).cap(1000) == 4096
    assert PeakBudget("1.5k").value == 1500 and PeakBudget(0.5).label() == "peak 50%"
    b = PeakBudget("64MiB")
    assert pickle.loads(pickle.dumps(b)) == b
    assert hash(b) == hash(PeakBudget(64 * 2**20)) and {b: 1}[PeakBudget("64MiB")] == 1
    with pytest.raises(Exception):
        b.value = 3  # frozen
    for bad in (1, 2.0, 0.0, -5, "lots", None, True):
        with pytest.raises(ValueError, match="PeakBudget"):
            PeakBudget(bad)


def test_peak_budget_in_the_config_and_the_cache_key():
    config = PartitionerConfig(memory_budget=PeakBudget("1MiB"))
    assert config.memory_budget == PeakBudget(2**20)
    assert pickle.loads(pickle.dumps(config)) == config and hash(config) == hash(
        PartitionerConfig(memory_budget=PeakBudget(2**20)))
    keys = {SACPartitioner(memory_budget=b).uuid()
            for b in (None, 2**20, PeakBudget(2**20), PeakBudget(2**21), PeakBudget(0.5))}
    assert len(keys) == 5


def test_peak_budget_is_a_step_budget_not_a_regions_own():
    """A region's own budget caps what it keeps: a PeakBudget there is refused, naming
    where it goes (apply_regions over the model, or the backend)."""
    with pytest.raises(ValueError, match="PeakBudget caps the peak of a whole step"):
        sc.sac_region("recompute_all", memory_budget=PeakBudget("1MiB"))


# -- the fast rule on issue 17's stack --------------------------------------------------------

FREE_STEP = 2_555_908  # the modelled step peak without a budget (measured: +4, the loss)
LEAST_STEP = 1_649_664  # the least the search finds


@pytest.mark.parametrize("cap", [2_400_000, 2_000_000, LEAST_STEP])
def test_stack_peak_fits_and_gradients_are_exact(cap, reference):
    """6 blocks, relaxed save_matmuls: without a budget the step peaks at 2,555,908 B
    (modelled: activations, the gradients the backward makes, the copy a matmul makes of
    the expanded gradient of ``sum``; measured +4, the loss). Under PeakBudget(cap) both
    the modelled and the measured step peak fit (the measured one within the loss's
    bytes), and the gradients are those of no checkpointing."""
    ref, free = reference
    report, m, grads = _run(PeakBudget(cap))
    _exact(grads, ref)
    assert report.budget_peak <= cap < free.peak.with_gradients == FREE_STEP
    assert report.budget_peak == report.peak.with_gradients
    assert report.budget_peak <= m.bytes <= report.budget_peak + 16 and m.bytes <= cap + 16
    assert report.memory_budget == PeakBudget(cap) and report.budget_bytes == cap
    # (it may keep more than the cut without a budget, which pays for each byte it keeps:
    # at 2,400,000 it keeps 1,968,128 B against 1,900,544, recomputing 8.4 MFLOPs, and
    # peaks 195 KB lower; the budget caps the peak, not the bytes kept)
    assert report.recompute_flops > free.recompute_flops
    note = next(n for n in report.notes if n.startswith(f"peak {sc.report.fmt_bytes(cap)}"))
    assert "modelled step peak" in note and "the cheapest to recompute" in note
    assert all("so that the step's modelled peak fits" in r.reason for r in report.evicted)
    line = report.snapshot().splitlines()[1]
    assert line.startswith(f"  peak {sc.report.fmt_bytes(cap)} = {sc.report.fmt_bytes(cap)}: "
                           f"modelled step peak {sc.report.fmt_bytes(report.budget_peak)}, "), \
        line


def test_stack_recompute_falls_as_the_cap_rises():
    flops = [_run(PeakBudget(cap))[0].recompute_flops
             for cap in (LEAST_STEP, 2_000_000, 2_400_000, FREE_STEP)]
    assert flops == sorted(flops, reverse=True) and flops[-1] == 0
    assert flops[0] > flops[2] > 0


def test_the_kept_bytes_are_stepped_to_the_cap(monkeypatch):
    """At PeakBudget(2,400,000) the grid and bisection over kept-byte budgets stop at a
    cut keeping 1,841,152 B (peak 2,234,372 B, 16.8 MFLOPs recomputed); stepping its
    kept-byte budget up by what the peak leaves of the cap (``_to_the_cap``) finds one
    keeping 1,968,128 B that peaks at 2,361,348 B and recomputes half as much: exact
    gradients, the measured peak within the cap."""
    import sac_compile.compiler.peak_budget as peak_budget
    stepped, m, _ = _run(PeakBudget(2_400_000))
    monkeypatch.setattr(peak_budget, "TO_THE_CAP_STEPS", 0)
    bisected, _, _ = _run(PeakBudget(2_400_000))
    assert (bisected.activation_bytes, bisected.budget_peak, bisected.recompute_flops) == \
        (1_841_152, 2_234_372, 16_777_216)
    assert (stepped.activation_bytes, stepped.budget_peak, stepped.recompute_flops) == \
        (1_968_128, 2_361_348, 8_388_608)
    assert m.bytes <= 2_400_000


def test_stack_unreachable_peak_proposes_a_peak_budget_that_is_met(reference):
    ref, free = reference
    with pytest.raises(BudgetUnreachableError) as info:
        _run(PeakBudget(1_000_000))
    e = info.value
    assert e.budget == PeakBudget(1_000_000)
    assert e.least_bytes == LEAST_STEP and e.unconstrained_bytes == FREE_STEP
    assert e.proposed_budget == PeakBudget(LEAST_STEP)
    assert f"memory_budget=PeakBudget(value={LEAST_STEP})" in str(e)
    again = pickle.loads(pickle.dumps(e))
    assert (again.budget, again.least_bytes, again.proposed_budget) == \
        (e.budget, e.least_bytes, e.proposed_budget)
    report, _, grads = _run(e.proposed_budget)
    assert report.budget_peak <= LEAST_STEP
    _exact(grads, ref)
    # a fraction is a fraction of the split's peak without a budget, and so is its proposal
    with pytest.raises(BudgetUnreachableError) as info:
        _run(PeakBudget(0.3))
    proposed = info.value.proposed_budget
    assert isinstance(proposed.value, float) and proposed.value * FREE_STEP >= LEAST_STEP
    assert _run(proposed)[0].budget_peak <= proposed.value * FREE_STEP


def test_peak_budget_under_region_budgets():
    """Regions with their own (kept-byte) budgets: each kept-byte budget the search tries
    is solved under them too; the peak fits and each region keeps within its budget."""
    torch._dynamo.reset()
    model, x = Stack(policy=RELAXED, checkpoint="none"), stack_inputs()
    for i, block in enumerate(model.blocks):
        sc.sac_region(RELAXED, name=f"blocks.{i}", memory_budget=0.5)(block)
    reports: list[PartitionReport] = []
    fn = torch.compile(model, backend=make_backend(
        compiler="aot_eager", memory_budget=PeakBudget(2_000_000),
        on_partition=reports.append))
    meter, _ = step_peak(fn, list(model.parameters()), [x])
    report = reports[-1]
    assert report.budget_peak <= 2_000_000
    assert any(n.startswith("peak 1.9 MiB: modelled step peak") for n in report.notes)
    assert any("keeps" in n and "cap" in n for n in report.notes)  # the regions' groups


def test_full_peak_budget_is_the_split_without_a_budget(reference):
    _, free = reference
    report, _, _ = _run(PeakBudget(1.0))
    assert (report.activation_bytes, report.recompute_flops, report.budget_peak) == \
        (free.activation_bytes, free.recompute_flops, free.peak.with_gradients)
    assert any("the cut without a budget fits" in n for n in report.notes)


@pytest.mark.parametrize("cap", [3_000_000, 1_500_000])
def test_a_graph_break_under_one_peak_budget_is_not_silent(cap, caplog):
    """Two graphs split under one PeakBudget each get the whole cap (a known limit): the
    second graph's report says so with the sum of their modelled step peaks; above the
    cap, a warning too."""
    torch._dynamo.reset()
    reports: list[PartitionReport] = []
    x = torch.randn(4, 64, 64, requires_grad=True)
    with caplog.at_level("WARNING", logger="sac_compile"):
        torch.compile(BrokenPair(RELAXED), backend=make_backend(
            compiler="aot_eager", memory_budget=PeakBudget(cap),
            on_partition=reports.append))(x).backward()
    assert len(reports) == 2 and all(r.budget_peak <= cap for r in reports)
    total = sum(r.budget_peak for r in reports)
    note = [n for n in reports[1].notes if "held by each compiled graph" in n]
    assert len(note) == 1 and sc.report.fmt_bytes(total) in note[0]
    warned = [r for r in caplog.records if "held by each compiled graph" in r.getMessage()]
    assert (total > cap) == ("above the cap" in note[0]) == (len(warned) == 1), \
        (total, cap, note)


BROKEN_SCRIPT = """
import json, sys, torch
from fixtures.cache_process import caught_warnings
from fixtures.stack import BrokenPair
from sac_compile import PeakBudget, policies
from sac_compile.compiler import make_backend
from torch._dynamo.utils import counters

warned = caught_warnings("held by each compiled graph")
x = torch.randn(4, 64, 64, requires_grad=True)
model = BrokenPair(policies.relaxed(policies.save_matmuls))
fn = torch.compile(model, backend=make_backend(memory_budget=PeakBudget(int(sys.argv[1]))))
fn(x).backward()
print(json.dumps({"warned": len(warned),
                  "aot_hit": counters["aot_autograd"].get("autograd_cache_hit", 0)}))
"""


@pytest.mark.slow
def test_a_graph_break_under_one_peak_budget_warns_when_the_cache_serves_its_graphs(
        tmp_path):
    """Inductor, a second process sharing the compile caches: the two graphs of a graph
    break, split under one PeakBudget, are served by AOTAutograd's cache (no partition
    runs), measured on stand-ins, and still counted as two graphs: the warning of the cold
    process, again. (A per-compile key in the partitioner's pickled state, this
    counting's first version, made every warm process miss both caches: the hits are
    asserted.)"""
    from fixtures.cache_process import run_with_cache
    cold = run_with_cache(BROKEN_SCRIPT, "1200000", tmp_path)
    warm = run_with_cache(BROKEN_SCRIPT, "1200000", tmp_path)
    assert cold["warned"] == 1, cold
    assert warm["aot_hit"] >= 2 and warm["warned"] == 1, warm


def test_a_byte_budget_holds_at_every_size_under_dynamic_shapes():
    """``dynamic=True``: the split solved at batch 4 served every batch, and PeakBudget
    (3,000,000) measured 5,046,280 B at batch 8 and 7,536,648 B at batch 12. Now a byte
    budget's split is guarded to sizes up to its hints: batch 8 compiles its own split
    (within the cap, measured), batch 2 reuses the first, and batch 12, which no split of
    this stack fits in 3,000,000 B, raises BudgetUnreachableError instead of running over."""
    torch._dynamo.reset()
    model = Stack(6, policy=RELAXED)
    reports: list[PartitionReport] = []
    fn = torch.compile(model, dynamic=True, backend=make_backend(
        compiler="aot_eager", memory_budget=PeakBudget(3_000_000),
        on_partition=reports.append))
    measured = {}
    for batch in (4, 8, 2):
        x = torch.randn(batch, 64, 64, requires_grad=True)
        step_peak(fn, list(model.parameters()), [x])  # compiles where the guard fails
        for p in [*model.parameters(), x]:
            p.grad = None
        with measured_peak() as m:
            fn(x).backward()
        measured[batch] = m.bytes
    assert len(reports) == 2 and all(r.budget_peak <= 3_000_000 for r in reports)
    assert all(n <= 3_000_000 + 16 for n in measured.values()), measured
    assert measured[8] > measured[4] > measured[2]
    with pytest.raises(BudgetUnreachableError):
        fn(torch.randn(12, 64, 64, requires_grad=True)).backward()


def test_a_fractional_budget_adds_no_size_guard():
    """A fraction scales with the sizes: one split serves every batch."""
    torch._dynamo.reset()
    model = Stack(2, policy=RELAXED)
    reports: list[PartitionReport] = []
    fn = torch.compile(model, dynamic=True, backend=make_backend(
        compiler="aot_eager", memory_budget=PeakBudget(0.95), on_partition=reports.append))
    for batch in (4, 8, 12):
        fn(torch.randn(batch, 64, 64, requires_grad=True)).backward()
    assert len(reports) == 1


# -- the fast rule against the true cheapest split, small graphs -------------------------------

class _Block(torch.nn.Module):
    """``x + fc2(gelu(fc1(x)))`` (d=128, hidden 256): issue 17's block without its
    LayerNorm, so that a few blocks have few enough values to enumerate their splits."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(128, 256), torch.nn.Linear(256, 128)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def _enumerate(gm, net):
    """Every split of a small joint graph by what it keeps (subsets of the values that are
    not views: a view costs nothing to recompute and shares its base's storage), valid
    where all it recomputes may be recomputed: ``(modelled peak, recompute cost in the
    solver's units, recompute FLOPs)`` each."""
    from sac_compile.compiler.peak_budget import step_peak
    from sac_compile.cut import costs
    from sac_compile.cut.network import INF
    cls = net.cls
    pool = [v for i, v in enumerate(cls.nodes)
            if v.op == "call_function" and not costs.is_view(v) and net.save_cost[i] != INF
            and costs.nbytes(v) > 0]
    out = []
    for r in range(len(pool) + 1):
        for kept in itertools.combinations(pool, r):
            cost = _recompute_cost(net, kept)
            if cost is not None:
                out.append((step_peak(gm, net, set(kept), fused=False), *cost))
    return pool, out


def _recompute_cost(net, kept):
    """(cost in the solver's units, FLOPs) of what a split keeping ``kept`` recomputes;
    None where it would recompute what may not be."""
    from sac_compile.compiler.boundaries import recomputed_by
    from sac_compile.cut import costs
    from sac_compile.cut.network import INF
    cost = flops = 0
    for v in recomputed_by(net.cls, set(kept)):
        i = net.cls.index[v]
        c = net.lifted_under_budget.get(i, net.recompute_cost[i])
        if c == INF:
            return None
        cost, flops = cost + c, flops + costs.flops(v)
    return cost, flops


@pytest.mark.parametrize("n,exact_each", [(2, True), (2, False),
                                          pytest.param(3, True, marks=pytest.mark.slow),
                                          pytest.param(3, False, marks=pytest.mark.slow)])
def test_fast_rule_against_enumeration_on_small_graphs(n, exact_each, monkeypatch):
    """``n`` blocks, each a relaxed save_matmuls region (9 and 13 values a split may keep:
    512 and 8,192 splits, enumerated). For 9 caps from the least peak any split reaches
    up to the peak of the split without a budget: the fast rule's split fits the cap; where
    the cap binds, its recompute cost (the solver's objective, which the rule minimises)
    is within 1% of the cheapest split that fits and its FLOPs are the same (measured:
    equal at every binding cap of 2 and 3 blocks since step 4 steps the kept bytes to the
    cap, 2026-11-29; 0.09% more cost at 2 of the 3-block caps before); at the top cap it is the split
    without a budget (a budget that does not bind changes nothing; the enumeration's
    cheapest there keeps more, which that split weighs against its bytes). None raised.
    (Before step 5 of :mod:`sac_compile.compiler.peak_budget`, the put-back, the rule
    recomputed 2x the cheapest at most binding caps.) ``exact_each``: every kept-byte
    budget solved by the MILP (splits up to 500 nodes), or, as on larger splits, by the
    Lagrangian search with one MILP at the end: the same bounds hold for both here. The
    figures print with -s."""
    import sac_compile.compiler.partition as partition
    from sac_compile.compiler.choose_cut import choose_cut
    from sac_compile.compiler.peak_budget import step_peak

    seen = {}

    def spy(gm, net, stand_ins, budget, solver, **kwargs):
        pool, splits = _enumerate(gm, net)
        least = min(p for p, _, _ in splits)
        free = choose_cut(gm, net, stand_ins, None, solver)
        top = step_peak(gm, net, set(free.saved), fused=False)
        rows = []
        for k in range(9):
            cap = least + (top - least) * k // 8
            exact = min(((c, f) for p, c, f in splits if p <= cap), default=None)
            try:
                cut = choose_cut(gm, net, stand_ins, PeakBudget(cap), solver)
            except BudgetUnreachableError as e:
                rows.append((cap, exact, None, None, e.least_bytes))
                continue
            peak = step_peak(gm, net, set(cut.saved), fused=False)
            rows.append((cap, exact, _recompute_cost(net, cut.saved), peak, None))
        seen.update(pool=pool, rows=rows, least=least, splits=len(splits), top=top,
                    free=_recompute_cost(net, free.saved))
        return choose_cut(gm, net, stand_ins, budget, solver)

    monkeypatch.setattr(partition, "choose_cut", spy)
    if not exact_each:
        import sac_compile.compiler.peak_budget as peak_budget
        monkeypatch.setattr(peak_budget, "EXACT_EACH_MAX_NODES", 0)
    torch._dynamo.reset()
    model = torch.nn.Sequential(*[_Block() for _ in range(n)])
    for i, block in enumerate(model):
        sc.sac_region(RELAXED, name=f"blocks.{i}")(block)
    x = torch.randn(256, 128, requires_grad=True)  # activations above the gradients
    torch.compile(lambda x: model(x).sum(), backend=make_backend(compiler="aot_eager"))(
        x).backward()
    print(f"\n{n} blocks: {len(seen['pool'])} values, {seen['splits']} valid splits, least "
          f"peak {seen['least']}, without a budget {seen['top']}")
    for cap, exact, fast, peak, raised in seen["rows"]:
        print(f"  cap {cap}: cheapest (cost, FLOPs) {exact}; fast rule {fast}, peak {peak}"
              + (f"; raised, least found {raised}" if raised is not None else ""))
    assert len(seen["pool"]) == 4 * n + 1 and seen["least"] < seen["top"]
    for cap, exact, fast, peak, raised in seen["rows"]:
        assert raised is None and exact is not None and peak <= cap
        if cap >= seen["top"]:
            assert fast == seen["free"]
            continue
        assert exact[0] <= fast[0] <= 1.01 * exact[0], (cap, exact, fast)
        assert fast[1] == exact[1], (cap, exact, fast)


@pytest.mark.parametrize("fraction", [0.94, 0.96])
def test_the_split_does_not_depend_on_which_trace_of_the_program_it_is(fraction, monkeypatch):
    """The same joint graph traced again (here: deep copies, new node objects) gets the
    same cut under a PeakBudget as Inductor's peak model sees it. Identical blocks tie, and
    a tie broken by the order of a set of nodes (hashed by identity) made the cut - and
    the measured peak of the code Inductor made from it - differ from one compile of the
    same model to the next (HF GPT-2 under Inductor at one budget measured 30.2, 30.9 or
    31.8 MB, and was called out of reach one time in three)."""
    import copy

    from sac_compile._bench.models import GPT
    from sac_compile.compiler import partition

    captured = []
    real = SACPartitioner._partition

    def capture(self, gm, joint_inputs, **kwargs):
        if not captured:
            captured.append((self, copy.deepcopy(gm), kwargs))
        return real(self, gm, joint_inputs, **kwargs)

    monkeypatch.setattr(SACPartitioner, "_partition", capture)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = GPT(d=32, n_heads=4, n_layers=4, d_out=8), torch.randn(4, 64, 32)
    for i, block in enumerate(model.blocks):
        sc.sac_region(RELAXED, name=f"blocks.{i}")(block)
    torch.compile(lambda x: model(x).sum(), backend=make_backend(compiler="aot_eager"))(
        x).backward()
    partitioner, traced, kwargs = captured[0]
    cuts = []
    for _ in range(5):  # the decision of the split, as under Inductor, on a new trace each
        gm = copy.deepcopy(traced)
        partition._prune(gm, partitioner.cse)
        partition.normalize_tags(gm)
        static = partition.static_inputs(gm.graph, kwargs.get("static_lifetime_input_indices")
                                         or [])
        net, stand_ins = partition.flow_network(gm, kwargs["num_fwd_outputs"], static,
                                                partitioner.cost_model, partition.HookTraces())
        cut = partition.choose_cut(gm, net, stand_ins, PeakBudget(fraction),
                                   partitioner.solver, fusing=True)
        cuts.append((sorted(v.name for v in cut.saved), cut.peak_fit.peak))
    assert cut.peak_fit.peak < cut.peak_fit.unconstrained_peak
    assert all(c == cuts[0] for c in cuts), [(len(s), p) for s, p in cuts]


@pytest.mark.parametrize("fusing", [False, True], ids=["aot_eager", "inductor"])
def test_the_put_back_runs_for_either_peak_model(fusing, monkeypatch):
    """Step 5 (values put back under the peak) and the stepping to the cap (step 4) run
    whichever peak model the split is chosen by - the eager walk or Inductor's
    allocations (under Inductor the measured trial holds the cap where the model is off;
    the stepping was the eager walk's alone until 2026-11-30: HF Llama, bench, at
    30,632,968 B it recomputes 0.575 GFLOPs, 0.596 without). (A session's edit once put
    the put-back under the eager walk alone: no quick test saw it, and Inductor's split
    at full AC's peak on HF GPT-2 went out of reach.)"""
    import sac_compile.compiler.partition as partition
    import sac_compile.compiler.peak_budget as peak_budget
    from sac_compile.compiler.choose_cut import choose_cut

    calls = {"put_back": 0, "to_the_cap": 0}
    for name in calls:
        real = getattr(peak_budget, f"_{name}")

        def counting(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)
        monkeypatch.setattr(peak_budget, f"_{name}", counting)

    def spy(gm, net, stand_ins, budget, solver, **kwargs):
        free = choose_cut(gm, net, stand_ins, None, solver)
        top = peak_budget.step_peak(gm, net, set(free.saved), fused=fusing)
        with pytest.raises(BudgetUnreachableError) as low:
            choose_cut(gm, net, stand_ins, PeakBudget(2), solver, fusing=fusing)
        calls.update(put_back=0, to_the_cap=0)  # (the least's search puts back too)
        least = low.value.least_bytes
        choose_cut(gm, net, stand_ins, PeakBudget((least + top) // 2), solver, fusing=fusing)
        calls["cut"] = dict(calls)
        return choose_cut(gm, net, stand_ins, budget, solver, **kwargs)

    monkeypatch.setattr(partition, "choose_cut", spy)
    torch._dynamo.reset()
    model = torch.nn.Sequential(*[_Block() for _ in range(3)])
    for i, block in enumerate(model):
        sc.sac_region(RELAXED, name=f"blocks.{i}")(block)
    x = torch.randn(256, 128, requires_grad=True)
    torch.compile(lambda x: model(x).sum(), backend=make_backend(compiler="aot_eager"))(
        x).backward()
    assert calls["cut"]["put_back"] == 1
    assert calls["cut"]["to_the_cap"] == 1
