"""Regions under compiled autograd: exact gradients, recompute that stays progressive, and
an unpack hook Dynamo does not trace into.

Compiled autograd keeps every saved-tensor handle as an input of its graph until the graph
returns, so a value the runtime cached on its node would stay alive to the end of backward.
The runtime counts each node's reads and drops a recomputed value at its last one; its own
accounting (``EagerStats.replayed_peak``: storages replay allocated that are still alive,
by weak references) shows one region's worth at a time, as with the plain engine.

Under a compiled-autograd graph that Dynamo compiles, the hook is ``torch._dynamo.disable``d:
one graph break per unpack, as for torch's own checkpoint hooks, none inside our code.
"""
import copy
import functools
import weakref

import pytest
import torch
from torch._dynamo import compiled_autograd
from torch._dynamo.utils import counters
from torch.utils.checkpoint import (CheckpointPolicy as P, checkpoint,
                                    create_selective_checkpoint_contexts)

import sac_compile as sc
from sac_compile import policies
from sac_compile.compiler import make_backend
from sac_compile.runtime import collect_stats

aten = torch.ops.aten
N_BLOCKS = 3
REPLAYED_PER_BLOCK = 2  # save_matmuls: tanh and sin are recomputed (t() views are free)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(16, 16)
        self.l2 = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x)).sin())


def make_models(n_blocks=N_BLOCKS):
    torch.manual_seed(0)
    ref = torch.nn.Sequential(*[Block() for _ in range(n_blocks)])
    model = copy.deepcopy(ref)
    for block in model:
        sc.sac_region(policies.save_matmuls, name="Block")(block)
    x = torch.randn(4, 16, requires_grad=True)
    return ref, model, x


def grads_of(model, x):
    return [p.grad for p in model.parameters()] + [x.grad]


def reference_grads(ref, x, times=1):
    """Gradients without checkpointing, accumulated over ``times`` backward passes."""
    x = x.detach().clone().requires_grad_()
    loss = ref(x).sum()
    for i in range(times):
        loss.backward(retain_graph=i < times - 1)
    return grads_of(ref, x)


def assert_exact(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def count_packs(model, x):
    """How many tensors autograd saves for ``model(x)`` (the unpacks backward makes)."""
    n = [0]

    def pack(t):
        n[0] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return n[0]


@pytest.fixture(autouse=True)
def fresh_counters():
    counters.clear()


def _identity_compiler(gm):
    return gm


def test_eager_regions_compiled_autograd_recompute_progressively():
    """Compiled autograd (its graph run as is): one region's replayed values alive at a
    time, as with the plain engine, and fewer or as many as torch's SAC."""
    ref, model, x = make_models()
    want = reference_grads(ref, x)

    with collect_stats() as plain:
        model(x).sum().backward()
    assert_exact(grads_of(model, x), want)
    model.zero_grad(set_to_none=True)
    x.grad = None

    with collect_stats() as st:
        loss = model(x).sum()
    with compiled_autograd._enable(_identity_compiler):
        loss.backward()
    assert counters["compiled_autograd"]["captures"] == 1
    assert_exact(grads_of(model, x), want)
    assert st.ops_replayed == plain.ops_replayed
    assert plain.replayed_peak == REPLAYED_PER_BLOCK
    assert st.replayed_peak == REPLAYED_PER_BLOCK  # before: every region's at once (6)
    assert st.replayed_alive == 0
    assert st.replayed_peak <= _torch_sac_peak(ref, x, compiler=_identity_compiler)


def test_retain_graph_under_compiled_autograd_recomputes_again():
    ref, model, x = make_models()
    want = reference_grads(ref, x, times=2)
    with collect_stats() as st:
        loss = model(x).sum()
    with compiled_autograd._enable(_identity_compiler):
        loss.backward(retain_graph=True)
        first = st.ops_replayed
        assert st.replayed_peak == REPLAYED_PER_BLOCK
        st.reset_peak()
        loss.backward()
    assert_exact(grads_of(model, x), want)
    assert st.ops_replayed == 2 * first  # released values are recomputed, not kept
    assert st.replayed_peak == REPLAYED_PER_BLOCK
    assert st.replayed_alive == 0


def test_plain_retain_graph_then_compiled_autograd():
    """A value the plain engine cached (its node dropped its inputs) is not released by
    compiled autograd's counting: it could not be recomputed."""
    ref, model, x = make_models()
    want = reference_grads(ref, x, times=3)
    loss = model(x).sum()
    loss.backward(retain_graph=True)
    with compiled_autograd._enable(_identity_compiler):
        loss.backward(retain_graph=True)
        loss.backward()
    assert_exact(grads_of(model, x), want)


def test_dynamo_compiled_backward_breaks_only_at_the_opaque_hook():
    """Dynamo compiles the compiled-autograd graph: the unpack hook is an opaque call (one
    graph break per unpack, as torch's checkpoint hooks), never traced into. (Two blocks:
    Dynamo compiles one graph per break.)"""
    ref, model, x = make_models(n_blocks=2)
    want = reference_grads(ref, x)
    packs = count_packs(ref, x)
    with collect_stats() as st:
        loss = model(x).sum()
    with compiled_autograd._enable(torch.compile(backend="eager")):
        loss.backward()
    assert_exact(grads_of(model, x), want)
    breaks = counters["graph_break"]
    assert sum(breaks.values()) == packs == 2 * 6, dict(breaks)
    assert all("torch.compiler.disable" in reason for reason in breaks), list(breaks)
    # Dynamo's resume functions keep each hook's result until the graph returns: all
    # replayed values at once, and torch's SAC measured the same way keeps as many.
    assert st.replayed_peak == 2 * REPLAYED_PER_BLOCK
    assert st.replayed_alive == 0
    torch._dynamo.reset()
    assert _torch_sac_peak(ref, x, compiler=torch.compile(backend="eager")) == st.replayed_peak


def test_compiled_regions_under_compiled_autograd_config():
    """``compiled_autograd = True`` with a compiled step: regions compiled by our backend,
    backward by compiled autograd."""
    ref, model, x = make_models()
    want = reference_grads(ref, x)

    def step(x):
        model(x).sum().backward()

    # torch.compile reads compiled_autograd when it wraps the function
    with torch._dynamo.config.patch(compiled_autograd=True):
        torch.compile(step, backend=make_backend(compiler="aot_eager"))(x)
    assert counters["compiled_autograd"]["captures"] == 1
    for g, w in zip(grads_of(model, x), want):
        torch.testing.assert_close(g, w)


def _double(grad):
    return grad * 2


def test_tensor_hook_on_a_region_output_eager_regions():
    ref, model, x = make_models()
    x2 = x.detach().clone().requires_grad_()
    y = ref(x2)
    y.register_hook(_double)
    y.sum().backward()
    want = grads_of(ref, x2)
    y = model(x)
    y.register_hook(_double)
    with compiled_autograd._enable(_identity_compiler):
        y.sum().backward()
    assert_exact(grads_of(model, x), want)


def test_tensor_hook_on_a_region_output_compiled_regions():
    ref, model, x = make_models()
    x2 = x.detach().clone().requires_grad_()
    y = ref(x2)
    y.register_hook(_double)
    y.sum().backward()
    want = grads_of(ref, x2)

    def step(x):
        y = model(x)
        y.register_hook(_double)
        y.sum().backward()

    with torch._dynamo.config.patch(compiled_autograd=True):
        torch.compile(step, backend=make_backend(compiler="aot_eager"))(x)
    assert counters["compiled_autograd"]["captures"] == 1
    for g, w in zip(grads_of(model, x), want):
        torch.testing.assert_close(g, w)


# -- torch's SAC under the same setting, measured the same way -------------------------------

def _torch_sac_peak(ref, x, compiler):
    """Peak of torch SAC's recomputed values alive during a compiled-autograd backward:
    weak references to the storages of the values its recompute produces."""
    alive, peak, recomputing = [0], [0], [False]

    def dead():
        alive[0] -= 1

    def track(t):
        if recomputing[0]:
            alive[0] += 1
            peak[0] = max(peak[0], alive[0])
            weakref.finalize(t.untyped_storage(), dead)
        return t

    def block_fn(block, h):
        return block.l2(track(track(torch.tanh(block.l1(h))).sin()))

    def policy(ctx, op, *args, **kwargs):
        return P.MUST_SAVE if op in (aten.mm.default, aten.addmm.default) else \
            P.PREFER_RECOMPUTE

    model = copy.deepcopy(ref)
    h = x.detach().clone().requires_grad_()
    for block in model:
        h = checkpoint(functools.partial(block_fn, block), h, use_reentrant=False,
                       context_fn=functools.partial(create_selective_checkpoint_contexts,
                                                    policy))
    recomputing[0] = True
    with compiled_autograd._enable(compiler):
        h.sum().backward()
    assert alive[0] == 0
    return peak[0]
