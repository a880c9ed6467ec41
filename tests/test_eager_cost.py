"""What the eager runtime costs per op, counted rather than timed (timings are benchmarks:
``benchmarks/eager_overhead.py``): policy calls per op, objects kept per recorded op for
Python's cyclic collector, pytree walks per op, and ops replayed in backward.

The objects count is why: a full collection walks every live tracked object, and on a chain
of cheap ops the collections that recorded nodes set off cost more than the recording."""
from __future__ import annotations

import dataclasses
import gc
import sys
from collections import Counter

import pytest
import torch
import torch.utils._pytree as pytree

import sac_compile as sc
from sac_compile import policies
from sac_compile.policy import PolicyValue, RegionFrame, answers_by_op, decide
from sac_compile.runtime import graph, replay
from sac_compile.runtime.decider import by_op_calls, fixed_decision, make_decider

aten = torch.ops.aten
N = 200


def chain_a(x):  # nothing recomputed: autograd saves no tensor of the region
    for _ in range(N):
        x = x * 1.0001 + 0.0001
    return x


def chain_b(x):  # every sin's input recomputed
    for _ in range(N):
        x = (x * 1.0001).sin()
    return x


def _kept_per_op(fn, x, policy="recompute_all"):
    """GC-tracked objects alive after the region's forward (output held), per ATen op."""
    sc.checkpoint(fn, x, policy=policy).sum().backward()  # torch's first-call caches
    gc.collect()
    gc.disable()
    try:
        before = Counter(map(type, gc.get_objects()))
        y = sc.checkpoint(fn, x, policy=policy)
        after = Counter(map(type, gc.get_objects()))
    finally:
        gc.enable()
    kept = after - before
    kept.pop(torch.Tensor, None)  # autograd's own (the saved scalars), also without regions
    y.sum().backward()
    return sum(kept.values()) / (2 * N), kept


def test_a_region_whose_backward_needs_nothing_keeps_nothing_per_op():
    x = torch.randn(16, requires_grad=True)

    def longer(x):  # twice chain_a: what is kept per op shows as the difference
        return chain_a(chain_a(x))
    _, short = _kept_per_op(chain_a, x)
    _, long = _kept_per_op(longer, x)
    assert sum(long.values()) - sum(short.values()) < 0.05 * 2 * N, (short, long)


def test_a_recorded_op_keeps_under_seven_collector_tracked_objects():
    # The node (no __dict__: the fields few nodes set are class defaults; it is also the
    # reference to its output 0 in the arguments that read it: no object of its own), its
    # argument tuple, the output's facts (a tuple holding one tuple and a weakref), a
    # handle for every second op (sin's input), and the shape tuple (which the collector
    # stops tracking at its next pass). Was 10 per op, then 7.7, then 6.7.
    per_op, kept = _kept_per_op(chain_b, torch.randn(16, requires_grad=True))
    assert per_op <= 6.75, kept
    assert kept[graph.NodeOutput] <= N + 5, kept  # the handles only
    assert dict not in kept or kept[dict] < 10, kept  # no node made its __dict__


def _calls_into_runtime(fn):
    """Python frames of sac_compile's code that ``fn()`` enters (profile 'call' events)."""
    calls = Counter()

    def prof(frame, event, arg):
        if event == "call" and "sac_compile" in frame.f_code.co_filename:
            calls[frame.f_code.co_name] += 1
    sys.setprofile(prof)
    try:
        out = fn()
    finally:
        sys.setprofile(None)
    return out, calls


@pytest.mark.parametrize("fn, per_op", [(chain_a, 2), (chain_b, 3)])
def test_python_calls_per_recorded_op(fn, per_op):
    # Forward, per op: the mode's __torch_dispatch__ and the node's constructor (the node
    # is the reference to its output: was a NodeOutput constructor per op, 3 on A); on
    # chain B also, per sin (every second op), the pack hook and its handle's constructor.
    # The walk at region exit over what backward needs reads the nodes' arguments inline
    # (was a ``deps`` call per op: 5 on B). No policy call
    # (recompute_all is decided once), no lookup call in the pack hook (was one per saved
    # tensor), no pytree walk.
    x = torch.randn(16, requires_grad=True)
    sc.checkpoint(fn, x, policy="recompute_all").sum().backward()  # first-call caches
    y, calls = _calls_into_runtime(lambda: sc.checkpoint(fn, x, policy="recompute_all"))
    total = sum(calls.values())
    assert total <= per_op * 2 * N + 60, calls  # + the region's entry and exit, once
    y.sum().backward()


def test_python_calls_per_replayed_op_and_unpack():
    # Backward of chain B: 2N - 1 ops replayed, N unpacks. Per replayed op: _replay alone
    # (its argument resolution and the walk over the node's inputs inlined); per unpack:
    # the hook alone (no torch._dynamo.disable wrapper frame, even with Dynamo loaded; the
    # saved-value read inlined). Was 8.5 calls per forward op (a helper per argument, the
    # live-output test per node, the wrapper per unpack), then 3 per replayed op and 2 per
    # unpack.
    import torch._dynamo  # noqa: F401  (loaded: the hook must still be the plain function)
    x = torch.randn(16, requires_grad=True)
    sc.checkpoint(chain_b, x, policy="recompute_all").sum().backward()
    y = sc.checkpoint(chain_b, x, policy="recompute_all").sum()
    _, calls = _calls_into_runtime(y.backward)
    replayed = 2 * N - 1
    assert calls["unpack"] == N and calls["_replay"] == replayed, calls
    assert sum(calls.values()) <= replayed + N + 10, calls
    assert "_fn" not in calls and "_live_forward_outputs" not in calls, calls
    assert "deps" not in calls and "_unpack_value" not in calls, calls


@pytest.mark.parametrize("fn", [chain_a, chain_b])
def test_no_pytree_walk_per_op(monkeypatch, fn):
    calls = Counter()
    for name in ("tree_flatten", "tree_map", "tree_leaves", "tree_map_only", "tree_unflatten"):
        original = getattr(pytree, name)

        def counted(*a, _name=name, _original=original, **k):
            calls[_name] += 1
            return _original(*a, **k)
        monkeypatch.setattr(pytree, name, counted)
    x = torch.randn(16, requires_grad=True)
    sc.checkpoint(fn, x, policy="save_matmuls").sum().backward()
    assert sum(calls.values()) == 0, calls


def _count_replays(monkeypatch):
    replayed = Counter()
    original = replay._replay

    def counted(node):
        replayed[str(node.op)] += 1
        return original(node)
    monkeypatch.setattr(replay, "_replay", counted)
    return replayed


def test_replay_runs_each_missing_op_once_and_nothing_else(monkeypatch):
    replayed = _count_replays(monkeypatch)
    x = torch.randn(16, requires_grad=True)
    sc.checkpoint(chain_a, x, policy="recompute_all").sum().backward()
    assert sum(replayed.values()) == 0  # autograd saved nothing of the region
    y = sc.checkpoint(chain_b, x, policy="recompute_all")
    y.sum().backward()
    # Every sin's input is unpacked; recomputing the first needs the whole chain before
    # it, once: N muls and N - 1 sins (the last sin's output is the region's output).
    assert replayed == {"aten.mul.Tensor": N, "aten.sin.default": N - 1}
    expected = chain_b(x.detach().requires_grad_())
    torch.testing.assert_close(y, expected, rtol=0, atol=0)


def test_save_matmuls_replays_only_what_is_not_saved(monkeypatch):
    replayed = _count_replays(monkeypatch)
    w = torch.randn(8, 8, requires_grad=True)

    def block(x):
        for _ in range(3):
            x = (x @ w).relu()
        return x
    sc.checkpoint(block, torch.randn(4, 8), policy="save_matmuls").sum().backward()
    assert "aten.mm.default" not in replayed and sum(replayed.values()) <= 3


# -- decisions: asked once per op for our presets, every time for anything else ----------

def test_presets_are_asked_once_per_op_overload_and_stack_of_regions():
    policy = policies.compose(policies.save_ops(aten.sin), policies.relaxed("save_matmuls"))
    x = torch.randn(16, requires_grad=True)
    sc.checkpoint(chain_b, x, policy=policy).sum().backward()  # fills the cache (or not)
    before = by_op_calls()
    for _ in range(3):
        sc.checkpoint(chain_b, x, policy=policy).sum().backward()
    assert by_op_calls() == before  # 3 x 400 ops, no policy asked


@pytest.mark.filterwarnings("ignore:the policy")
def test_user_policies_are_asked_for_every_op():
    calls = []

    def policy(ctx, op, *args, **kwargs):
        calls.append(op)
        return None

    @dataclasses.dataclass(frozen=True)
    class Counting(PolicyValue):  # a value, but its own __call__ may read anything
        def __call__(self, ctx, op, *args, **kwargs):
            calls.append(op)
            return None

    x = torch.randn(16, requires_grad=True)
    for p in (policy, Counting(), policies.compose(policy, "save_matmuls")):
        calls.clear()
        sc.checkpoint(chain_a, x, policy=p).sum().backward()
        assert len(calls) == 2 * N
    assert not answers_by_op(Counting())


@dataclasses.dataclass(frozen=True)
class _OverridesMatmuls(policies.SaveMatmuls):
    def __call__(self, ctx, op, *args, **kwargs):
        return None


@pytest.mark.parametrize("policy, by_op", [
    (policies.save_matmuls, True), (policies.recompute_all, True),
    (policies.save_ops(aten.sin), True), (policies.offload_ops(aten.mm), True),
    (policies.compose(policies.save_ops(aten.sin), "save_all"), True),
    (policies.relaxed(policies.save_matmuls), True),
    (policies.save_only_these_names("q"), False),
    (policies.compose(policies.save_matmuls, lambda ctx, op, *a, **k: None), False),
    (_OverridesMatmuls(), False),
])
def test_which_policies_answer_by_op(policy, by_op):
    assert answers_by_op(policy) is by_op


@pytest.mark.parametrize("frames", [
    (RegionFrame("A", policies.save_matmuls),),
    (RegionFrame("A", policies.save_all), RegionFrame("B", policies.save_ops(aten.sin))),
    (RegionFrame("A", policies.relaxed(policies.save_matmuls)),
     RegionFrame("B", policies.recompute_all)),
])
def test_the_by_op_decider_gives_what_decide_gives(frames):
    fast = make_decider(frames)
    x, w = torch.randn(2, 2), torch.randn(2, 2)
    for _ in range(2):  # the second round is answered from the cache
        for op in (aten.mm.default, aten.sin.default, aten.addmm.default, aten.cos.default):
            assert fast(op, (x, w), {}, None) == decide(frames, op, (x, w), {}, None)


def test_constant_policies_decide_without_a_call():
    frames = (RegionFrame("A", policies.save_all), RegionFrame("B", policies.recompute_all))
    assert fixed_decision(frames) == decide(frames, aten.sin.default, (), {}, None)
    assert fixed_decision((RegionFrame("A", policies.save_matmuls),)) is None
