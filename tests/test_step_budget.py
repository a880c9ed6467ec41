"""``PeakBudget(n)`` holds the *measured* step peak (issue 27): HF GPT-2 and Llama at bench
size, each decoder layer a ``relaxed(save_matmuls)`` region, compiled whole; one step to
compile, the next measured by ``sac_compile.measured_peak`` (the CPU allocator's events,
gradients included). Bytes and FLOPs, never a clock. Slow: each point compiles the model.
"""
from __future__ import annotations

import pytest

from sac_compile import PeakBudget

pytest.importorskip("transformers")

from sac_compile import policies  # noqa: E402
from sac_compile._bench.step_budget import reference_step, run_eager_step, run_step  # noqa: E402

pytestmark = pytest.mark.slow

GRAD_RTOL = 1e-5


@pytest.fixture(scope="module")
def references():
    return {}


def _reference(references, name, dropout=True):
    key = (name, dropout)
    if key not in references:
        references[key] = reference_step(name, "bench", dropout=dropout)
    return references[key]


def _ok(point):
    assert point.status == "ok", point.note
    assert point.grad_rel is not None and point.grad_rel <= GRAD_RTOL, point
    return point


@pytest.mark.parametrize("name,compiler", [
    ("gpt2", None), ("llama", None), ("gpt2", "aot_eager"), ("llama", "aot_eager"),
])
def test_apply_regions_measured_step_peak_within_the_budget(name, compiler, references):
    """``apply_regions(..., memory_budget=PeakBudget(n))`` on the decoder layers
    (``budgets/step_peak.py``), eager or (``compiler``) the model compiled whole, whose
    step hooks run eagerly around the graph (split under the step's PeakBudget, then
    measured: aot_eager 1 compile, GPT-2 1.81 / 0.87 / 0.07 GFLOPs, Llama 2.52 / 1.22 /
    0.18 at the three budgets; under a kept-byte cap they were 2.68 / 0.94 / 0.13 and
    2.70 / 1.30 / 0.27 after 2-3 compiles): three
    budgets from full AC's measured step peak (our ``recompute_all`` regions) to no
    budget's (relaxed save_matmuls); after its calibration steps the measured step is at
    most ``n`` and at least 85% of it, with no checkpointing's gradients (eager with
    dropout on: it replays the masks), and the FLOPs recomputed never rise with the
    budget. Eager at full AC's peak, GPT-2 (whose step peaks at the end of the backward:
    the embedding's gradient) recomputes at most half full AC's FLOPs, its last blocks
    keeping their values (caps placed in time, ``budgets/nested.py``); Llama's step peaks
    at the loss's backward, where every block holds its values, so there no plan of kept
    values recomputes less than full AC (nor does one cap over the step, compiled)."""
    dropout = compiler is None
    ref = _reference(references, name, dropout)
    relaxed = policies.relaxed(policies.save_matmuls)

    def run(policy, budget=None):
        return _ok(run_eager_step(name, "bench", policy, budget=budget, reference=ref,
                                  dropout=dropout, compiler=compiler))

    free, full = run(relaxed), run(policies.recompute_all)
    assert full.measured < free.measured
    flops = []
    for n in [full.measured, (full.measured + free.measured) // 2,
              full.measured + 9 * (free.measured - full.measured) // 10]:
        p = run(relaxed, PeakBudget(n))
        print(f"{name} {compiler or 'eager'} PeakBudget({n}): measured {p.measured} "
              f"({p.measured / n:.3f}), {p.replayed} ops replayed (full AC {full.replayed}), "
              f"{p.flops} FLOPs recomputed ({p.flops / full.flops:.3f}x full AC's), after "
              f"{p.steps} steps, {p.note}")
        assert 0.85 * n <= p.measured <= n, (n, p)
        flops.append(p.flops)
    assert flops == sorted(flops, reverse=True)
    if compiler is None:
        assert flops[0] <= (full.flops / 2 if name == "gpt2" else full.flops)


# (name, budget) -> (modelled, measured) step peaks of the Inductor points, for the model's test
INDUCTOR_POINTS: dict[tuple[str, int], tuple[int, int]] = {}


@pytest.mark.parametrize("name,compiler", [
    ("gpt2", "aot_eager"), ("llama", "aot_eager"),
    ("gpt2", "inductor"), ("llama", "inductor"),
])
def test_measured_step_peak_within_the_budget(name, compiler, references):
    """Three budgets from full AC's measured step peak (the lower of torch's
    ``torch.utils.checkpoint`` on every layer and our ``recompute_all`` regions; where our
    search cannot reach it, the least it finds, at most 5% above) to no budget's: the
    measured peak is at most the budget and at least 85% of it (the plan uses what it is
    given), the gradients are no checkpointing's, and the recompute falls as the budget
    rises; under aot_eager the model is within 3% of the measurement (under Inductor the
    budget holds by the measured trial, ``compiler/measured_fit.py``: the model's error
    there is the next test's). Under Inductor at full AC's peak, fewer FLOPs recomputed
    than full AC's: GPT-2 at most half (issue 27's target; 1.14 of 2.68 GFLOPs, 0.43x,
    the cut keeping the least with values put back), Llama 1.65 of 2.70 (0.61x: the
    cheapest cut the model finds under the cap, the model within 0.1% there). Inductor: dropout 0 (its
    gradients are checked against eager's only with eager's RNG, ``fallback_random``,
    which allocates the masks Inductor's own RNG computes inside its kernels)."""
    dropout = compiler != "inductor"
    ref = _reference(references, name, dropout)

    def run(strategy, **kw):
        return run_step(name, "bench", strategy, compiler=compiler, reference=ref,
                        dropout=dropout, **kw)

    free = _ok(run("ours"))
    full_ac = min((_ok(run(s)) for s in ("torch full AC", "ours recompute_all")),
                  key=lambda p: (p.measured, p.flops))
    full = full_ac.measured
    assert full < free.measured
    low = run("ours", budget=PeakBudget(full))
    if low.status == "ok":
        print(f"{name} {compiler}: at full AC's {full} B, {low.flops} FLOPs recomputed "
              f"against full AC's {full_ac.flops} ({low.flops / full_ac.flops:.2f}x)")
        if compiler == "inductor":  # (aot_eager: test_at_full_acs_peak_ours_recomputes_...)
            assert low.flops <= full_ac.flops / (2 if name == "gpt2" else 1)
    if low.status == "unreachable":
        print(f"{name} {compiler}: full AC's {full} B out of reach, least found "
              f"{low.proposed.value} B")
        assert low.proposed.value <= 1.05 * full
        full = low.proposed.value
    budgets = [full, (full + free.measured) // 2, full + 9 * (free.measured - full) // 10]
    flops = []
    for n in budgets:
        p = _ok(run("ours", budget=PeakBudget(n)))
        print(f"{name} {compiler} PeakBudget({n}): measured {p.measured}, modelled "
              f"{p.modelled}, {p.flops} FLOPs recomputed")
        assert 0.85 * n <= p.measured <= n, (n, p)
        if compiler == "inductor":
            INDUCTOR_POINTS[name, n] = (p.modelled, p.measured)
        else:
            assert abs(p.modelled / p.measured - 1) <= 0.03, p
        flops.append(p.flops)
    assert flops == sorted(flops, reverse=True)


def test_inductor_step_model_within_3_percent_at_the_budgets():
    """The Inductor points of the test above: the modelled step peak of each split is
    within 3% of its measured one (issue 27's target for the model). Measured 2026-11-30:
    GPT-2 +1.1% / -0.0% / -0.0% (at full AC's measured peak, 25,882,760 B, the split is
    the cut keeping the least with values put back, which the measured trial tries after
    the model's least measured above the cap: 26,073,096 B modelled, 25,795,624
    measured), Llama +0.1% / -0.0% / -0.0%."""
    if not INDUCTOR_POINTS:
        pytest.skip("runs after test_measured_step_peak_within_the_budget's Inductor points")
    errors = {k: m / p - 1 for k, (m, p) in INDUCTOR_POINTS.items()}
    print({k: f"{e:+.1%}" for k, e in errors.items()})
    assert all(abs(e) <= 0.03 for e in errors.values()), errors


def _misses(reason):
    return pytest.mark.xfail(strict=True, reason=reason)


@pytest.mark.parametrize("name", [
    # (no plan of kept values can: see the docstring)
    pytest.param("gpt2", marks=_misses("1.81 of 2.42 GFLOPs (0.75x) at 32,312,328 B: "
                                       "the loss head's backward binds")),
    pytest.param("llama", marks=_misses("2.42 of 2.43 GFLOPs (1.00x) at 28,088,072 B: "
                                        "full AC's own peak is the loss head's backward")),
])
def test_at_full_acs_peak_ours_recomputes_at_most_half(name, references):
    """``aot_eager``, dropout 0: at the measured step peak of full AC
    (``torch.utils.checkpoint`` on every layer, torch's partitioner), ``PeakBudget`` of that
    peak measures at most it and recomputes at most half of full AC's FLOPs (issue 27;
    its goal is a third). Missed, and no keep/recompute plan meets it here (measured
    2026-11-29, the model within 8 B of the allocator): the backward begins at the loss
    head, ``_log_softmax_backward_data``, with its input gradient and its output (8 MiB
    each, unfused under aot_eager) alive beside every value any block keeps - all of them
    alive then, whichever block they belong to. GPT-2: full AC peaks later (32.3 MB, the
    gradients near the backward's end), so the head leaves 15.5 MB for kept values
    (8.4 MB of them the head's log_softmax, whose recompute would hold the logits there
    instead); the exact program's cheapest cut within those bytes recomputes 1.81 GF,
    with FLOPs as the objective too. Llama: full AC's own peak is that moment (28.3 MB
    modelled), so nothing more can be kept. Under Inductor, which fuses the head's
    backward, both models meet it (0.39x, 0.37x: the test above); so does GPT-2 eager
    (0.375x, placed in time). Offload would move it (an accelerator)."""
    ref = _reference(references, name, dropout=False)
    full = _ok(run_step(name, "bench", "torch full AC", compiler="aot_eager",
                        reference=ref, dropout=False))
    ours = _ok(run_step(name, "bench", "ours", compiler="aot_eager",
                        budget=PeakBudget(full.measured), reference=ref, dropout=False))
    print(f"{name}: full AC {full.measured} B, {full.flops} FLOPs; ours {ours.measured} B, "
          f"{ours.flops} FLOPs ({ours.flops / full.flops:.2f}x)")
    assert ours.measured <= full.measured
    assert ours.flops <= full.flops / 2


@pytest.mark.parametrize("torch_budget", [
    pytest.param(0.7, marks=_misses("ours 1.01 against torch's 0.94 GFLOPs at 38,797,320 B: "
                                    "a 0.94 cut fits to 3 B by the model, 8 B short")),
    pytest.param(0.5, marks=_misses("ours 1.81 against torch's 1.74 GFLOPs at 32,505,864 B: "
                                    "a 1.74 cut fits to 3 B by the model, 8 B short")),
    0.3,  # ours 1.01 against 2.55 GFLOPs
])
def test_against_torchs_knapsack_at_its_measured_peaks(torch_budget, references):
    """HF GPT-2 (bench, aot_eager, dropout 0: torch's partitioner recomputes a dropout with
    a fresh mask here): torch's SAC regions (matmuls PREFER_SAVE) under torch's
    ``activation_memory_budget`` measure a step peak Pt with Ft FLOPs recomputed; ours
    under ``PeakBudget(Pt)`` measures at most Pt (met at every point) and recomputes at
    most Ft (missed at 0.7 and 0.5 by 4-7%). Why (measured 2026-11-29): torch's point is
    its own measured peak, its cut 8 B under it. At 0.7 the cheapest cut of our objective
    within the cap recomputes 0.94 GF too (cost 36.7 M in our model, against 37.3 M for
    the 1.01 GF cut) and is modelled 3 B under Pt: measured, 5 B over, the model leaving
    out 8 B the step holds beyond the graphs (scalars such as the loss). The search steps the kept
    bytes to 64 B short of the cap (``peak_budget.TO_THE_CAP_MARGIN``) and keeps the
    1.01 GF cut; at 0.5 likewise (1.74 GF 3 B under, 1.81 kept). The two steps' measured
    times are equal (ours / torch 1.01 at 0.7, 1.00 at 0.5; CPU, 25 interleaved rounds)."""
    ref = _reference(references, "gpt2", dropout=False)
    theirs = _ok(run_step("gpt2", "bench", "torch SAC", compiler="aot_eager",
                          torch_budget=torch_budget, reference=ref, dropout=False))
    ours = _ok(run_step("gpt2", "bench", "ours", compiler="aot_eager",
                        budget=PeakBudget(theirs.measured), reference=ref, dropout=False))
    print(f"torch budget {torch_budget}: torch {theirs.measured} B, {theirs.flops} FLOPs; "
          f"ours {ours.measured} B, {ours.flops} FLOPs")
    assert ours.measured <= theirs.measured
    assert ours.flops <= theirs.flops
