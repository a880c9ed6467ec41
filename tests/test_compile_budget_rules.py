"""What a memory budget may change and what it may not (issue 12): upstream's heuristic bans
on untagged ops are lifted under a budget (and named when they are not), the error blames
the value that cannot be recomputed, and attention without dropout is not a random op."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fixtures.capture import Captured, capturing_backend as _capture
from fixtures.models import grads_of, loss_fn, make_model, max_grad_diff, reference_grads
from sac_compile import CheckpointError, CheckpointPolicy as CP, policies, sac_region
from sac_compile.compiler import CostModel, make_backend

aten = torch.ops.aten


def _gpt(policy, budget, **options):
    torch._dynamo.reset()
    model, inputs = _gpt_without_dropout()
    for block in model.blocks:
        sac_region(policy)(block)
    cap = Captured()
    compiled = torch.compile(model, backend=cap.backend(memory_budget=budget, **options))
    torch.manual_seed(0)
    loss_fn(compiled(*inputs)).backward()
    return cap.reports[0], grads_of(model, inputs)


def _gpt_without_dropout():
    """The GPT fixture with dropout 0: recomputing a random op on the CPU keeps the CPU
    generator's whole state (5 KiB), which would set the floor of these small budgets."""
    model, inputs = make_model("gpt", size="test", seed=0)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model, inputs


def test_untagged_ops_outside_regions_no_longer_set_a_floor_under_a_budget():
    """GPT fixture, recompute_all in each block: the final LayerNorm and the loss head lie
    outside every region. Without lifting upstream's bans (compute intensive, reductions)
    a budget of 30% is out of reach; with them lifted it is met, gradients exact."""
    with pytest.raises(CheckpointError) as info:
        _gpt(policies.recompute_all, 0.3,
             cost_model=CostModel(budget_lifts_upstream_bans=False))
    msg = str(info.value)
    assert "(outside every region)" in msg
    assert "upstream's recomputable allowlist" in msg or "compute intensive" in msg or \
        "reduction" in msg, msg
    assert "put those ops in a region whose policy returns PREFER_RECOMPUTE" in msg
    report, grads = _gpt(policies.recompute_all, 0.3)
    assert report.activation_bytes <= report.budget_bytes
    assert any("untagged ops recomputed that torch's partitioner would keep" in n
               for n in report.notes), report.notes
    model, inputs = _gpt_without_dropout()
    assert max_grad_diff(reference_grads(model, inputs, seed=0), grads) <= 1e-5


def test_budget_one_keeps_upstream_bans():
    unconstrained, _ = _gpt(policies.recompute_all, None)
    at_one, _ = _gpt(policies.recompute_all, 1.0)
    assert at_one.activation_bytes == unconstrained.activation_bytes
    assert sorted(at_one.recomputed) == sorted(unconstrained.recomputed)


def test_the_error_blames_the_value_that_cannot_be_recomputed():
    """A value kept only because its producer's input cannot be recomputed: the message
    names that producer and its MUST_SAVE, not 'kept so that others can be recomputed'."""
    def policy(ctx, op, *args, **kwargs):
        return CP.MUST_SAVE if op is aten.mm.default else CP.PREFER_RECOMPUTE

    @sac_region(policy, name="Blame")
    def block(x, w):
        return (x @ w).sin().cos()

    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(16, 16, requires_grad=True)
    f = torch.compile(lambda x, w: block(x, w).sum(),
                      backend=make_backend(compiler="aot_eager", memory_budget=64))
    with pytest.raises(CheckpointError) as info:
        f(x, w).backward()
    msg = str(info.value)
    assert "kept so that others can be recomputed" not in msg
    assert "mm (aten.mm.default, 512 B in region 'Blame': MUST_SAVE by policy)" in msg
    assert "policies.relaxed(policy)" in msg


def test_attention_without_dropout_is_not_a_random_op():
    """SDPA kernels carry torch's nondeterministic_seeded tag whatever their dropout_p. With
    p=0 a recomputed attention needs no RNG state (no run_with_rng_state in the backward)."""
    def policy(ctx, op, *args, **kwargs):
        return CP.PREFER_RECOMPUTE

    @sac_region(policy, name="Attn")
    def attn(q, k, v):  # the kernel F.scaled_dot_product_attention picks on a CPU
        out, _ = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0)
        return out.sin()

    q, k, v = (torch.randn(2, 2, 8, 4, requires_grad=True) for _ in range(3))
    backend, cap = _capture()
    attn_c = torch.compile(attn, backend=backend)
    attn_c(q, k, v).sum().backward()
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in cap["report"].recomputed
    assert not [n for n in cap["bw"].graph.nodes if "rng_state" in str(n.target)]
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    F.scaled_dot_product_attention(q2, k2, v2).sin().sum().backward()
    for a, b in ((q, q2), (k, k2), (v, v2)):
        assert torch.allclose(a.grad, b.grad, atol=1e-6)


def test_which_ops_are_random():
    from sac_compile.cut.costs import is_random

    g = torch.fx.Graph()
    x = g.placeholder("x")

    def node(target, *args, **kwargs):
        return g.call_function(target, args, kwargs)

    flash = aten._scaled_dot_product_flash_attention.default
    efficient = aten._scaled_dot_product_efficient_attention.default
    assert not is_random(node(flash, x, x, x, 0.0))
    assert is_random(node(flash, x, x, x, 0.1))
    assert not is_random(node(flash, x, x, x))                      # default dropout_p=0
    assert not is_random(node(efficient, x, x, x, None, True, 0.0))
    assert is_random(node(efficient, x, x, x, None, True, dropout_p=0.5))
    assert not is_random(node(aten.native_dropout.default, x, 0.5, False))  # eval mode
    assert is_random(node(aten.native_dropout.default, x, 0.5, True))
    assert is_random(node(aten.rand.default, [2, 2]))
    assert not is_random(node(aten.sin.default, x))


def _region_budget_run(budgets):
    """Two SAC regions, each under torch's region_activation_memory_budget (None: none)."""
    torch._dynamo.reset()
    backend, cap = _capture()

    @sac_region(policies.save_all, name="A")
    def a(x, w):
        return (x @ w).sin().cos().sin()

    @sac_region(policies.save_all, name="B")
    def b(x, w):
        return (x @ w).cos().sin().cos()

    def f(x, w):
        for block, budget in zip((a, b), budgets):
            if budget is None:
                x = block(x, w)
            else:
                with torch.autograd.graph.region_activation_memory_budget(budget):
                    x = block(x, w)
        return x.sum()

    torch.manual_seed(0)
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(16, 16, requires_grad=True)
    torch.compile(f, backend=backend)(x, w).backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ((((x2 @ w2).sin().cos().sin()) @ w2).cos().sin().cos()).sum().backward()
    assert torch.allclose(x.grad, x2.grad, atol=1e-6)
    assert torch.allclose(w.grad, w2.grad, atol=1e-6)
    report = cap["report"]
    kept = {r: sum(s.nbytes for s in report.saved if not s.is_input and s.region == r)
            for r in ("A", "B")}
    return report, kept


@pytest.mark.skipif(not hasattr(torch.autograd.graph, "region_activation_memory_budget"),
                    reason="torch.autograd.graph.region_activation_memory_budget: torch >= 2.13")
def test_region_activation_memory_budget_is_honoured_per_region():
    """torch 2.13 ignores its per-region budget once a checkpoint is in the graph, and
    refuses two different budgets in one graph. Here each region gets its own: 0.0 = as
    little as the region can keep, 1.0 = what the cut keeps without a budget."""
    _, free = _region_budget_run((None, None))
    assert free["A"] > 0 and free["B"] > 0
    report, kept = _region_budget_run((0.0, 1.0))
    assert kept == {"A": 0, "B": free["B"]}
    assert any(n.startswith("region_activation_memory_budget(0):") for n in report.notes)
    _, kept = _region_budget_run((1.0, 0.0))
    assert kept == {"A": free["A"], "B": 0}


def test_recomputed_random_ops_count_their_rng_state():
    """On the CPU, replaying a dropout keeps the generator's state (5,056 bytes): the cut
    counts it (a small dropout is then saved, not recomputed), the report lists it, and an
    unreachable budget says so."""
    def recompute(ctx, op, *args, **kwargs):
        return CP.PREFER_RECOMPUTE

    @sac_region(recompute, name="D")
    def block(x, w):
        return F.dropout(x @ w, 0.5, training=True).sin()

    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(16, 16, requires_grad=True)
    backend, cap = _capture()
    torch.compile(block, backend=backend)(x, w).sum().backward()
    assert "aten.native_dropout.default" not in cap["report"].recomputed
    # a dropout over a value larger than the state is recomputed, and its state is listed
    torch._dynamo.reset()
    x = torch.randn(64, 64, requires_grad=True)
    w = torch.randn(64, 64, requires_grad=True)
    backend, cap = _capture()
    torch.compile(block, backend=backend)(x, w).sum().backward()
    report = cap["report"]
    assert "aten.native_dropout.default" in report.recomputed
    (state,) = [s for s in report.saved if s.op == "RNG state"]
    assert state.nbytes == torch.get_rng_state().numel() and not state.is_input
    assert report.activation_bytes == state.nbytes  # all the cut keeps besides the inputs
    # the state is the floor of a budget: the error says so
    torch._dynamo.reset()
    backend, cap = _capture(memory_budget=0.5)
    with pytest.raises(CheckpointError, match="the RNG states of the random ops it recomputes"):
        torch.compile(block, backend=backend)(x, w).sum().backward()


def test_dead_random_ops_are_not_reported_as_recomputed_under_fallback_random():
    """Inductor's fallback_random makes FX keep random-tagged ops alive in dead-code
    elimination (SDPA carries the tag): a dead copy in the backward counted as recomputed."""
    @sac_region(policies.save_matmuls, name="A")
    def attn(q):
        return F.scaled_dot_product_attention(q, q, q, is_causal=True)

    backend, cap = _capture()
    q = torch.randn(1, 2, 8, 4, requires_grad=True)
    with torch._inductor.config.patch(fallback_random=True):
        torch.compile(attn, backend=backend)(q).sum().backward()
    assert cap["report"].recomputed == [] and cap["report"].recompute_flops == 0
    assert not [n for n in cap["bw"].graph.nodes if "attention.default" in str(n.target)
                and "backward" not in str(n.target)]
