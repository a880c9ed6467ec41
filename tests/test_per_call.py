"""Per-call policy state, as torch's SAC has it: torchtitan's "save every other matmul"
policy, written as torchtitan writes it (a counter in a closure that ``context_fn`` builds
afresh for each checkpoint call), through ``sac_compile.checkpoint(..., context_fn=...)``
and through the native factory ``per_call(make_policy)``, gives torch SAC's decisions on
every block and every step, in eager mode and compiled (whole model, and per block as
torchtitan's ``apply_compile`` does).

What is compared: the decision each runtime applied to each ``aten.mm`` of each block
(torch: its SAC cache, entry by entry; ours: the eager runtime's recorded decisions, or the
tags on the joint graph), the bytes the compiled split keeps and the matmuls it recomputes.
"""
from __future__ import annotations

import functools
import pickle
from collections import defaultdict

import pytest
import torch
import torch.utils.checkpoint as tuc
from functorch.compile import make_boxed_func
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy

import sac_compile as sc
from fixtures.titan import (TransformerBlock, make_policy, make_titan_model,
                            selective_checkpointing_context_fn)
from sac_compile import CheckpointError, per_call, policies
from sac_compile.compiler import SACPartitioner
from sac_compile.compiler.backend import _SACAotAutograd
from sac_compile.runtime import collect_stats

aten = torch.ops.aten
MM = aten.mm.default
PER_BLOCK = "SRSRSRS"  # 7 matmuls per block (wq wk wv wo w1 w3 w2): odd ones saved
STEPS = 2

# -- the ways of checkpointing each block -----------------------------------------------

def _wrap_forward(model, call):
    for block in model.layers.values():
        block.forward = functools.partial(call, block.forward)


FORMS = {
    "torch": lambda m: _wrap_forward(m, lambda f, h: tuc.checkpoint(
        f, h, use_reentrant=False, context_fn=selective_checkpointing_context_fn)),
    "checkpoint(context_fn)": lambda m: _wrap_forward(m, lambda f, h: sc.checkpoint(
        f, h, use_reentrant=False, context_fn=selective_checkpointing_context_fn)),
    "checkpoint(per_call)": lambda m: _wrap_forward(m, lambda f, h: sc.checkpoint(
        f, h, policy=per_call(make_policy))),
    "apply_regions(per_call)": lambda m: sc.apply_regions(m, per_call(make_policy),
                                                          where=TransformerBlock),
}
OURS = [f for f in FORMS if f != "torch"]


def _letters(decisions):
    return "".join("S" if d is True or d in (CheckpointPolicy.MUST_SAVE,
                                             CheckpointPolicy.PREFER_SAVE) else "R"
                   for d in decisions)


class _CountMM(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func is MM
        return func(*args, **(kwargs or {}))


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


# -- eager --------------------------------------------------------------------------------

def _torch_sac_eager_step(model, tokens, monkeypatch):
    """One step under torch's SAC: per checkpoint call, the decision torch's forward mode
    applied to each matmul (its policy's answer, which torch stores or marks for recompute
    as is), and the mm ops run in backward."""
    calls = []
    original = tuc._CachingTorchDispatchMode.__init__

    def spy(self, policy_fn, *args, **kwargs):
        answers = []
        calls.append(answers)

        def recorded(ctx, func, *a, **k):
            out = policy_fn(ctx, func, *a, **k)
            if func is MM and not ctx.is_recompute:
                answers.append(out)
            return out

        original(self, recorded, *args, **kwargs)

    monkeypatch.setattr(tuc._CachingTorchDispatchMode, "__init__", spy)
    loss = model(tokens).sum()
    monkeypatch.undo()
    with _CountMM() as bw:
        loss.backward()
    return [_letters(answers) for answers in calls], bw.n


def _ours_eager_step(model, tokens):
    with collect_stats() as st:
        loss = model(tokens).sum()
    with _CountMM() as bw:
        loss.backward()
    mm = [d.policy for op, d in st.decisions if op == str(MM)]
    blocks = [_letters(mm[i:i + len(PER_BLOCK)]) for i in range(0, len(mm), len(PER_BLOCK))]
    saved_mm = [r for r in st.saved if r.op == str(MM)]
    return blocks, bw.n, st, saved_mm


@pytest.mark.parametrize("form", OURS)
def test_every_other_matmul_eager_matches_torch_sac_on_every_block_and_step(form, monkeypatch):
    ref, tokens = make_titan_model()
    FORMS["torch"](ref)
    model, _ = make_titan_model()
    FORMS[form](model)
    for step in range(STEPS):
        ref.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        torch_blocks, torch_bw_mm = _torch_sac_eager_step(ref, tokens, monkeypatch)
        blocks, bw_mm, st, saved_mm = _ours_eager_step(model, tokens)
        assert torch_blocks == [PER_BLOCK, PER_BLOCK], (step, torch_blocks)
        assert blocks == torch_blocks, (step, blocks)
        for g, w in zip(_grads(model), _grads(ref)):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
        # The unsaved matmuls wk, wo and w3 are recomputed, once each, by both: backward
        # needs k, w3's output and the residual h = x + wo(...) (RMSNorm's input).
        loss = make_titan_model()[0](tokens).sum()  # no checkpointing
        with _CountMM() as plain:
            loss.backward()
        assert torch_bw_mm - plain.n == 2 * 3
        assert bw_mm - plain.n == 2 * 3
        # Saved: wq, wv, w1 per block (w2's output, saved by the policy, feeds only the
        # residual add: no backward needs it, so the runtime drops it at the region's end).
        assert len(saved_mm) == 2 * 3


def test_a_plain_stateful_policy_lives_for_the_region_not_the_call():
    """Without per_call, a policy object's state lives as long as the region: the counter
    runs on across blocks and steps (the behaviour issue 18 reported)."""
    model, tokens = make_titan_model()
    sc.apply_regions(model, make_policy(), where=TransformerBlock)
    seen = []
    for _ in range(STEPS):
        blocks, *_ = _ours_eager_step(model, tokens)
        seen.append(blocks)
    assert seen == [["SRSRSRS", "RSRSRSR"], ["SRSRSRS", "RSRSRSR"]]


# -- compiled -----------------------------------------------------------------------------

class _Capture:
    """aot_eager with our partitioner; per joint graph, the tag of each matmul per region
    (``ac_graph_id``), and the split's report."""

    def __init__(self):
        self.tags, self.reports = [], []
        partitioner = SACPartitioner(on_partition=self.reports.append)

        def partition(gm, inputs, **kwargs):
            regions = defaultdict(list)
            for n in gm.graph.find_nodes(op="call_function", target=MM):
                if "recompute" in n.meta:
                    regions[n.meta.get("ac_graph_id")].append(n.meta["recompute"])
            self.tags.append(sorted(_letters(v) for v in regions.values()))
            return partitioner(gm, inputs, **kwargs)

        boxed = lambda gm, example_inputs: make_boxed_func(gm.forward)  # noqa: E731
        self.backend = _SACAotAutograd(fw_compiler=boxed, bw_compiler=boxed,
                                       partition_fn=partition)

    def summary(self):
        return (self.tags, [sum(r.nbytes for r in rep.saved) for rep in self.reports],
                [sum("aten.mm" in op for op in rep.recomputed) for rep in self.reports])


def _compiled_run(form, per_block):
    torch._dynamo.reset()
    model, tokens = make_titan_model()
    FORMS[form](model)
    cap = _Capture()
    if per_block:  # torchtitan's apply_compile: each block on its own, fullgraph
        for block in model.layers.values():
            block.compile(backend=cap.backend, fullgraph=True)
        run = model
    else:
        run = torch.compile(model, backend=cap.backend, fullgraph=True)
    grads = []
    # every split is made here: a warm AOTAutograd cache would skip the partitioner
    with torch._functorch.config.patch(enable_autograd_cache=False):
        for _ in range(STEPS):
            model.zero_grad(set_to_none=True)
            run(tokens).sum().backward()
            grads.append(_grads(model))
    return cap, grads


@pytest.mark.parametrize("per_block", [False, True], ids=["whole-model", "per-block"])
@pytest.mark.parametrize("form", OURS)
def test_every_other_matmul_compiled_matches_torch_sac(form, per_block):
    ref, ref_grads = _compiled_run("torch", per_block)
    cap, grads = _compiled_run(form, per_block)
    tags, nbytes, recomputed_mm = cap.summary()
    ref_tags, ref_nbytes, ref_recomputed_mm = ref.summary()
    # torch builds the policy per checkpoint call while AOTAutograd traces: every region
    # of every graph starts counting at 1.
    assert all(t == [PER_BLOCK] * len(t) for t in ref_tags), ref_tags
    # One region per graph per block compiled on its own, both in one graph otherwise.
    assert {tuple(t) for t in tags} == {tuple(t) for t in ref_tags}
    assert set(nbytes) == set(ref_nbytes) and set(recomputed_mm) == set(ref_recomputed_mm)
    # One graph: the whole model, or the block graph every block shares (the per-call
    # policy value is one identity for all blocks); nothing new in step 2.
    assert len(cap.reports) == len(ref.reports) == 1
    for step in range(STEPS):
        for g, w in zip(grads[step], ref_grads[step]):
            torch.testing.assert_close(g, w)


# -- the factory itself --------------------------------------------------------------------

def test_per_call_builds_one_policy_per_region_call_in_both_modes():
    built = []

    def factory():
        built.append(1)
        return policies.save_matmuls

    @sc.sac_region(per_call(factory), name="B")
    def block(x, w):
        return torch.tanh(x @ w) @ w

    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    for _ in range(3):
        block(x, w).sum().backward()
    assert len(built) == 3
    compiled = torch.compile(block, backend=sc.make_backend(compiler="aot_eager"))
    with torch._functorch.config.patch(enable_autograd_cache=False):  # trace, not a hit
        compiled(x, w).sum().backward()
        traced = len(built) - 3
        assert traced >= 1  # while AOTAutograd traces the region (as torch calls context_fn)
        for _ in range(2):
            compiled(x, w).sum().backward()
    assert len(built) == 3 + traced  # the compiled split serves every later call


def _factory_raises():
    raise ValueError("no config")


def _factory_not_a_policy():
    return 3


@pytest.mark.parametrize("factory,message", [
    (_factory_raises, "raised ValueError: no config when called to build the region's policy"),
    (_factory_not_a_policy, "returned 3, which is not a policy"),
])
def test_a_factory_that_fails_is_a_checkpoint_error_naming_the_region(factory, message):
    block = sc.sac_region(per_call(factory), name="Blk")(lambda x: x.sin())
    with pytest.raises(CheckpointError, match=f"region 'Blk'.*{message}"):
        block(torch.randn(3, requires_grad=True))


def test_per_call_inside_compose_says_where_to_compose():
    policy = policies.compose(per_call(make_policy), policies.save_all)
    block = sc.sac_region(policy, name="Blk")(lambda x: x.sin())
    with pytest.raises(CheckpointError, match=r"compose in the factory instead"):
        block(torch.randn(3, requires_grad=True))


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_a_context_fn_returning_other_contexts_is_a_checkpoint_error(mode):
    def f(x):
        return sc.checkpoint(torch.sin, x, context_fn=_not_sac_contexts)

    run = f if mode == "eager" else torch.compile(
        f, backend=sc.make_backend(compiler="aot_eager"))
    torch._dynamo.reset()
    with pytest.raises(CheckpointError, match="only torch's create_selective_checkpoint_"
                                              "contexts.*policy=per_call"):
        run(torch.randn(3, requires_grad=True))


def _not_sac_contexts():
    return None, None


def test_per_call_is_a_value_that_pickles_with_a_module_level_factory():
    assert per_call(make_policy) == per_call(make_policy)
    assert per_call(per_call(make_policy)) == per_call(make_policy)
    assert repr(per_call(make_policy)) == "per_call(make_policy)"
    assert pickle.loads(pickle.dumps(per_call(make_policy))) == per_call(make_policy)
    with pytest.raises(TypeError, match="takes a function of no arguments"):
        per_call("save_matmuls")
