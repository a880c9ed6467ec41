"""Leaks and lifetime: many training steps keep live tensors, storages and runtime objects
flat; the runtime makes no reference cycles; a saved value is freed as soon as the last
backward node that uses it has run.

The 1,000-step runs are ``slow``; the always-on variants run fewer steps.
"""
from __future__ import annotations

import gc
import weakref
from collections import Counter

import pytest
import torch

import sac_compile as sc
from fixtures.models import loss_fn, make_model
from sac_compile import CheckpointPolicy as CP
from sac_compile.compiler import make_backend

aten = torch.ops.aten
RUNTIME_TYPES = ("OpNode", "NodeOutput", "LeafRef", "RegionRecorder", "ReplayContext")


def _census() -> Counter:
    """Live tensors, distinct storages and runtime objects, after a full collection."""
    gc.collect()
    counts: Counter = Counter()
    storages = set()
    for obj in gc.get_objects():
        name = type(obj).__name__
        if name in RUNTIME_TYPES:
            counts[name] += 1
        elif isinstance(obj, torch.Tensor):
            counts["tensors"] += 1
            try:
                storages.add(obj.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):
                pass
    counts["storages"] = len(storages)
    return counts


def _training(mode: str):
    """A step function for the GPT fixture ('test' size) with regions, and its model."""
    torch.manual_seed(0)
    model, (x,) = make_model("gpt", size="test", seed=0)
    for block in model.blocks:
        sc.sac_region(sc.policies.save_matmuls, name="Block")(block)
    forward = model if mode == "eager" else torch.compile(
        model, backend=make_backend(compiler="aot_eager"))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        opt.zero_grad(set_to_none=True)
        x.grad = None
        loss_fn(forward(x)).backward()
        opt.step()

    return step


def _flat_after_warmup(mode: str, steps: int, warmup: int) -> None:
    step = _training(mode)
    for _ in range(warmup):
        step()
    before = _census()
    for _ in range(steps - warmup):
        step()
    after = _census()
    # Growth is a leak; shrinking is fine (objects left by earlier tests may go meanwhile).
    assert not after - before, f"{mode}: live objects grew by {after - before}"


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_live_objects_flat_over_training_steps(mode):
    _flat_after_warmup(mode, steps=60, warmup=10)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_live_objects_flat_over_1000_training_steps(mode):
    _flat_after_warmup(mode, steps=1000, warmup=20)


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_no_reference_cycles_in_steady_state(mode):
    step = _training(mode)
    for _ in range(5):
        step()
    gc.collect()
    gc.disable()
    try:
        for _ in range(20):
            step()
        unreachable = gc.collect()
    finally:
        gc.enable()
    assert unreachable == 0


def test_no_reference_cycles_with_retain_graph_and_recompute_from_middle():
    w1 = torch.randn(16, 16, requires_grad=True)
    w2 = torch.randn(16, 16, requires_grad=True)

    @sc.sac_region(lambda ctx, op, *a, **k: CP.MUST_SAVE if op is aten.mm.default else None,
                   name="Chain")
    def chain(x):
        for _ in range(4):
            x = (x @ w1).sin() @ w2
        return x.relu()

    x = torch.randn(8, 16, requires_grad=True)
    chain(x).sum().backward()
    gc.collect()
    gc.disable()
    try:
        for _ in range(10):
            out = chain(x).sum()
            out.backward(retain_graph=True)
            out.backward()
            del out
        unreachable = gc.collect()
    finally:
        gc.enable()
    assert unreachable == 0


def test_saved_values_are_freed_right_after_their_last_backward_use():
    """a = x @ w1 and c = b @ w2 are saved (MUST_SAVE); b = a.sin() is recomputed.

    Backward runs SinBackward(c) -> MmBackward(c) -> SinBackward(a) -> MmBackward(a). The
    saved c is last used by SinBackward(c), the saved a by SinBackward(a) (after replaying
    b from it): each must be gone when the next node starts, and not before its last use."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 16, generator=g, requires_grad=True)
    w1 = torch.randn(16, 16, generator=g, requires_grad=True)
    w2 = torch.randn(16, 16, generator=g, requires_grad=True)

    @sc.sac_region(lambda ctx, op, *a, **k: CP.MUST_SAVE if op is aten.mm.default else None,
                   name="Block")
    def block(x):
        a = x @ w1
        b = a.sin()
        c = b @ w2
        return c.sin()

    d = block(x)
    sin_c = d.grad_fn
    mm_c = sin_c.next_functions[0][0]
    sin_a = next(f for f, _ in mm_c.next_functions if f is not None and "Sin" in f.name())
    mm_a = sin_a.next_functions[0][0]
    assert (sin_c.name(), mm_c.name(), sin_a.name(), mm_a.name()) == \
        ("SinBackward0", "MmBackward0", "SinBackward0", "MmBackward0")
    # The saved values, as the runtime holds them (autograd's unpacked `_saved_self` is a
    # fresh Python wrapper, so look at the runtime's own references).
    nodes = [o for o in gc.get_objects() if type(o).__name__ == "OpNode"
             and o.op is aten.mm.default and o.value is not None]
    assert len(nodes) == 2
    a_node, c_node = sorted(nodes, key=lambda n: n.seq)
    a_saved, c_saved = weakref.ref(a_node.value[0]), weakref.ref(c_node.value[0])
    del nodes, a_node, c_node
    gc.collect()
    assert c_saved() is not None and a_saved() is not None

    seen = {}

    def at(label):
        def hook(grad_outputs):
            seen[label] = (c_saved() is None, a_saved() is None)
        return hook

    mm_c.register_prehook(at("mm_c starts"))
    sin_a.register_prehook(at("sin_a starts"))
    mm_a.register_prehook(at("mm_a starts"))
    d.sum().backward()
    assert seen == {
        "mm_c starts": (True, False),   # c freed right after SinBackward(c); a still held
        "sin_a starts": (True, False),  # a held until its last use ...
        "mm_a starts": (True, True),    # ... and freed right after it
    }


def test_values_are_kept_until_the_graph_is_freed_with_retain_graph():  # noqa: D103
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(16, 16, requires_grad=True)

    @sc.sac_region("save_matmuls", name="Block")
    def block(x):
        return (x @ w).sin()

    out = block(x)
    node = next(o for o in gc.get_objects() if type(o).__name__ == "OpNode"
                and o.op is aten.mm.default)
    saved = weakref.ref(node.value[0])
    del node
    loss = out.sum()
    loss.backward(retain_graph=True)
    gc.collect()
    assert saved() is not None  # kept for the next backward
    loss.backward()             # the last one frees the graph's saved values
    gc.collect()
    assert saved() is None

    out = block(x)
    node = next(o for o in gc.get_objects() if type(o).__name__ == "OpNode"
                and o.op is aten.mm.default)
    saved = weakref.ref(node.value[0])
    del node
    out.sum().backward(retain_graph=True)
    gc.collect()
    assert saved() is not None
    del out                     # or the graph goes away without another backward
    gc.collect()
    assert saved() is None


def test_a_budget_that_cannot_be_met_leaves_nothing_of_the_region_alive():
    """The budget's plan fails at region exit: the region's outputs never reach the caller,
    and what it recorded (kept alive for the plan) must not stay in a cycle through
    autograd's C++ nodes, which the collector cannot break."""
    from sac_compile import CheckpointError, policies, sac_region

    block = sac_region(policies.save_matmuls, name="Unmet", memory_budget=0.1)(
        lambda x, w: (x @ w).sin() @ w)
    with pytest.raises(CheckpointError, match="cannot be met"):
        block(torch.randn(32, 64, requires_grad=True), torch.randn(64, 64, requires_grad=True))
    gc.collect()
    alive = [type(o).__name__ for o in gc.get_objects()
             if type(o).__name__ in ("RegionRecorder", "OpNode")]
    assert alive == []
