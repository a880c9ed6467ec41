"""Policy forms and the one resolution function shared by eager and compile."""
import re

import pytest
import torch
import torch.utils.checkpoint as tuc

from fixtures.capture import Captured
import sac_compile as sc
from sac_compile import CheckpointError, CheckpointPolicy as P, SaveWithHooks, policies
from sac_compile.runtime import collect_stats
from sac_compile.runtime.decider import make_decider
from sac_compile.policy import (RegionFrame, Vote, decide, normalize_policy,
                                resolve_decision)

aten = torch.ops.aten
MM = aten.mm.default


def test_public_names_are_torchs_objects():
    assert sc.CheckpointPolicy is tuc.CheckpointPolicy
    assert issubclass(sc.CheckpointError, tuc.CheckpointError)


def decisions_of(fn, *args, policy):
    """Run ``fn`` as a region and return {op name: decision label} for its ops."""
    with collect_stats() as stats:
        out = sc.checkpoint(fn, *args, policy=policy)
    out.sum().backward()
    return {op: d.label for op, d in stats.decisions}


def mm_sin(x, w):
    return (x @ w).sin()


X = torch.randn(4, 4, requires_grad=True)
W = torch.randn(4, 4, requires_grad=True)


@pytest.mark.parametrize("returned,expected", [
    (P.MUST_SAVE, "MUST_SAVE"), (P.PREFER_SAVE, "PREFER_SAVE"),
    (P.MUST_RECOMPUTE, "MUST_RECOMPUTE"), (P.PREFER_RECOMPUTE, "PREFER_RECOMPUTE"),
    (P.MUST_CPU_OFFLOAD, "MUST_CPU_OFFLOAD"), (P.PREFER_CPU_OFFLOAD, "PREFER_CPU_OFFLOAD"),
    (True, "MUST_SAVE"), (False, "PREFER_RECOMPUTE"), (None, "PREFER_RECOMPUTE"),
])
def test_callable_policy_results(returned, expected):
    def policy(ctx, op, *args, **kwargs):
        return returned if op == MM else None
    assert decisions_of(mm_sin, X, W, policy=policy)["aten.mm.default"] == expected


def test_save_with_hooks_is_a_decision():
    hooks = SaveWithHooks(lambda t: t, lambda t: t)
    d = decisions_of(mm_sin, X, W, policy=lambda ctx, op, *a, **k: hooks if op == MM else None)
    assert d["aten.mm.default"] == "SaveWithHooks"


@pytest.mark.parametrize("form", [[MM], (MM,), {MM}, [aten.mm]])
def test_op_collections_save_listed_ops_and_recompute_the_rest(form):
    d = decisions_of(mm_sin, X, W, policy=form)
    assert d == {"aten.mm.default": "MUST_SAVE", "aten.sin.default": "PREFER_RECOMPUTE"}


def test_packet_matches_every_overload():
    fn = normalize_policy([aten.add])
    ctx = sc.PolicyContext()
    assert fn(ctx, aten.add.Tensor) is P.MUST_SAVE
    assert fn(ctx, aten.add.Scalar) is P.MUST_SAVE
    assert fn(ctx, aten.mul.Tensor) is P.PREFER_RECOMPUTE


@pytest.mark.parametrize("name,mm,sin", [
    ("recompute_all", "PREFER_RECOMPUTE", "PREFER_RECOMPUTE"),
    ("save_all", "PREFER_SAVE", "PREFER_SAVE"),
    ("save_matmuls", "MUST_SAVE", "PREFER_RECOMPUTE"),
])
def test_string_presets(name, mm, sin):
    assert decisions_of(mm_sin, X, W, policy=name) == {"aten.mm.default": mm,
                                                        "aten.sin.default": sin}


@pytest.mark.parametrize("bad,named", [
    (42, "42"), ("save_everything", "'save_everything'"), (P.MUST_SAVE, "MUST_SAVE"),
    ([42], "got 42 of type int"), (object(), "<object object"),
])
def test_bad_policy_is_a_type_error_naming_the_value(bad, named):
    with pytest.raises(TypeError, match=re.escape(named)):
        sc.sac_region(bad)


def test_policy_returning_garbage_names_op_region_and_value():
    @sc.sac_region(lambda ctx, op, *a, **k: "yes", name="Block")
    def f(x):
        return x.sin()
    with pytest.raises(CheckpointError, match=r"region 'Block' returned 'yes'.*aten\.sin"):
        f(X)


def test_policy_that_raises_is_reported_with_op_and_region():
    def policy(ctx, op, *args, **kwargs):
        raise KeyError("boom")
    with pytest.raises(CheckpointError, match=r"region 'Block' raised KeyError.*aten\.sin"):
        sc.sac_region(policy, name="Block")(torch.sin)(X)


def test_ctx_carries_torch_fields_and_region_path():
    seen = []

    def policy(ctx, op, *args, **kwargs):
        seen.append((ctx.is_recompute, type(ctx.op_output), ctx.region_path, ctx.region))
        return None

    @sc.sac_region(policy, name="Outer")
    def outer(x):
        return sc.sac_region(policy, name="Inner")(torch.sin)(x)

    outer(X).sum().backward()
    assert (False, torch.Tensor, ("Outer", "Inner"), "Outer") in seen
    assert (False, torch.Tensor, ("Outer", "Inner"), "Inner") in seen
    assert isinstance(sc.PolicyContext(), tuc.SelectiveCheckpointContext)


# --- resolution ---------------------------------------------------------------------------

def vote(p, region, source="policy"):
    return Vote(p, region, source)


def test_no_opinion_is_prefer_recompute():
    d = resolve_decision(MM, [])
    assert (d.policy, d.source) == (P.PREFER_RECOMPUTE, "default")


def test_must_beats_prefer_wherever_it_is():
    d = resolve_decision(MM, [vote(P.MUST_SAVE, "Outer"), vote(P.PREFER_RECOMPUTE, "Inner")])
    assert (d.policy, d.region, d.source) == (P.MUST_SAVE, "Outer", "resolution")
    assert "beats PREFER_RECOMPUTE of policy in 'Inner'" in d.reason()


def test_innermost_prefer_wins():
    d = resolve_decision(MM, [vote(P.PREFER_SAVE, "Outer"), vote(P.PREFER_RECOMPUTE, "Inner")])
    assert (d.policy, d.region) == (P.PREFER_RECOMPUTE, "Inner")


def test_same_must_twice_agrees():
    d = resolve_decision(MM, [vote(P.MUST_SAVE, "Outer"), vote(P.MUST_SAVE, "Inner")])
    assert d.policy is P.MUST_SAVE


def test_different_musts_name_op_both_regions_and_both_decisions():
    with pytest.raises(CheckpointError) as err:
        resolve_decision(MM, [vote(P.MUST_SAVE, "Outer"), vote(P.MUST_RECOMPUTE, "Inner")])
    msg = str(err.value)
    for part in ("aten.mm.default", "MUST_SAVE", "'Outer'", "MUST_RECOMPUTE", "'Inner'"):
        assert part in msg


def test_hooks_agree_with_must_save_but_not_with_must_recompute():
    hooks = SaveWithHooks(lambda t: t, lambda t: t)
    d = resolve_decision(MM, [vote(P.MUST_SAVE, "Outer"), vote(hooks, "Inner")])
    assert d.hooks is hooks and d.policy is P.MUST_SAVE
    with pytest.raises(CheckpointError, match="SaveWithHooks"):
        resolve_decision(MM, [vote(P.MUST_RECOMPUTE, "Outer"), vote(hooks, "Inner")])


def test_tag_is_the_innermost_opinion():
    frames = [RegionFrame("Outer", policies.save_all), RegionFrame("Inner", policies.save_all)]
    d = decide(frames, MM, (X, W), {}, None, tag=P.PREFER_RECOMPUTE)
    assert (d.policy, d.source) == (P.PREFER_RECOMPUTE, "resolution")
    with pytest.raises(CheckpointError, match="tag"):
        decide([RegionFrame("B", policies.save_matmuls)], MM, (X, W), {}, None,
               tag=P.MUST_RECOMPUTE)


@pytest.mark.parametrize("frames", [
    [RegionFrame("A", policies.recompute_all)],
    [RegionFrame("A", policies.save_matmuls)],
    [RegionFrame("A", policies.save_all), RegionFrame("B", policies.save_matmuls)],
])
def test_fast_decider_agrees_with_decide(frames):
    fast = make_decider(frames)
    for op in (MM, aten.sin.default, aten.addmm.default):
        assert fast(op, (X, W), {}, None) == decide(frames, op, (X, W), {}, None)


# --- presets ----------------------------------------------------------------------------

def test_presets_are_named_and_silent_on_ops_they_do_not_know():
    ctx = sc.PolicyContext()
    assert repr(policies.save_matmuls) == "save_matmuls"
    assert policies.save_matmuls(ctx, MM) is P.MUST_SAVE
    assert policies.save_matmuls(ctx, aten.bmm.default) is P.MUST_SAVE
    assert policies.save_matmuls(ctx, aten.sin.default) is None
    assert policies.save_ops(aten.sin)(ctx, aten.sin.default) is P.MUST_SAVE
    assert policies.offload_ops(MM)(ctx, MM) is P.MUST_CPU_OFFLOAD
    named = sc.PolicyContext(names=frozenset({"q"}))
    assert policies.save_only_these_names("q")(named, MM) is P.MUST_SAVE
    assert policies.save_only_these_names("q")(ctx, MM) is None


def test_compose_takes_the_first_opinion():
    p = policies.compose(policies.save_ops(aten.sin), [MM], policies.save_all)
    ctx = sc.PolicyContext()
    assert p(ctx, aten.sin.default) is P.MUST_SAVE
    assert p(ctx, MM) is P.MUST_SAVE
    # The op list says PREFER_RECOMPUTE for the rest, so save_all is never asked.
    assert p(ctx, aten.cos.default) is P.PREFER_RECOMPUTE
    assert policies.compose(policies.save_matmuls)(ctx, aten.cos.default) is None


# --- relaxed() and the matmul set ---------------------------------------------------------

@pytest.mark.parametrize("answer, relaxed_answer", [
    (P.MUST_SAVE, P.PREFER_SAVE), (P.MUST_RECOMPUTE, P.PREFER_RECOMPUTE),
    (P.MUST_CPU_OFFLOAD, P.PREFER_CPU_OFFLOAD), (True, P.PREFER_SAVE),
    (P.PREFER_SAVE, P.PREFER_SAVE), (P.PREFER_RECOMPUTE, P.PREFER_RECOMPUTE),
    (P.PREFER_CPU_OFFLOAD, P.PREFER_CPU_OFFLOAD), (False, P.PREFER_RECOMPUTE), (None, None),
])
def test_relaxed_turns_musts_into_the_matching_prefers(answer, relaxed_answer):
    relaxed = policies.relaxed(lambda ctx, op, *a, **k: answer)
    assert relaxed(sc.PolicyContext(), MM, X, W) is relaxed_answer


def test_relaxed_keeps_hooks_and_presets_names():
    hooks = SaveWithHooks(lambda t: t, lambda t: t)
    assert policies.relaxed(lambda ctx, op, *a, **k: hooks)(sc.PolicyContext(), MM) is hooks
    ctx = sc.PolicyContext()
    relaxed = policies.relaxed(policies.save_matmuls)
    assert repr(relaxed) == "relaxed(save_matmuls)"
    assert relaxed(ctx, MM) is P.PREFER_SAVE and relaxed(ctx, aten.sin.default) is None
    assert policies.relaxed([MM])(ctx, MM) is P.PREFER_SAVE       # the list forms too
    assert policies.relaxed([MM])(ctx, aten.sin.default) is P.PREFER_RECOMPUTE
    assert policies.relaxed("save_matmuls")(ctx, MM) is P.PREFER_SAVE
    assert policies.relaxed(policies.recompute_all).constant is P.PREFER_RECOMPUTE


def test_relaxed_saves_the_same_in_eager_mode_and_lets_a_budget_evict():
    """Eager mode honours PREFER_SAVE: the relaxed preset saves the same matmuls. Compiled
    with a memory budget, MUST_SAVE matmuls cannot be evicted; relaxed ones can."""
    def fn(x, w1, w2):
        return (x @ w1).sin() @ w2

    x, w1, w2 = (torch.randn(64, 64, requires_grad=True) for _ in range(3))
    assert decisions_of(fn, x, w1, w2, policy=policies.relaxed(policies.save_matmuls)) == \
        {"aten.mm.default": "PREFER_SAVE", "aten.sin.default": "PREFER_RECOMPUTE"}

    def saved_mms(policy, budget):
        cap = Captured()
        torch._dynamo.reset()
        region = sc.sac_region(policy, name="R")(fn)
        torch.compile(region, backend=cap.backend(memory_budget=budget))(x, w1, w2).sum().backward()
        return sum(r.op == "aten.mm.default" for r in cap.reports[0].saved)

    assert saved_mms(policies.relaxed(policies.save_matmuls), None) == 1
    assert saved_mms(policies.relaxed(policies.save_matmuls), 2) == 0  # 2 bytes: evict all
    with pytest.raises(CheckpointError):
        saved_mms(policies.save_matmuls, 2)


def test_matmul_ops_cover_grouped_batched_and_quantized_matmuls():
    wanted = ["mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "_grouped_mm",
              "_scaled_grouped_mm", "_scaled_mm", "_int_mm", "_weight_int8pack_mm",
              "_weight_int4pack_mm"]
    for name in wanted:
        if hasattr(aten, name):  # newer matmuls are optional: older torch lacks them
            assert getattr(aten, name).default in policies.MATMUL_OPS, name


@pytest.mark.skipif(not hasattr(aten, "_grouped_mm"), reason="torch without aten._grouped_mm")
def test_save_matmuls_saves_grouped_mm_in_eager_mode():
    """Mixture-of-experts layers run their experts as one grouped matmul."""
    x = torch.randn(12, 16, requires_grad=True)
    w = torch.randn(3, 16, 8, requires_grad=True)
    offs = torch.tensor([4, 8, 12], dtype=torch.int32)

    def experts(x, w):
        return torch._grouped_mm(x, w, offs=offs).relu() * 2

    assert decisions_of(experts, x, w, policy=policies.save_matmuls)["aten._grouped_mm.default"] \
        == "MUST_SAVE"
    report = sc.explain(sc.sac_region(policies.save_matmuls)(experts), x, w, mode="eager")
    assert "aten._grouped_mm.default" in report.saved_ops
    assert "aten._grouped_mm.default" not in report.recomputed
