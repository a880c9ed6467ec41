"""Storage decisions that reach the compiled graphs through ``tag()`` and through views:
``tag(t, SaveWithHooks(...))`` packs ``t`` as a policy's hooks do (the hooks survive the
marker op), and MUST_CPU_OFFLOAD / SaveWithHooks decided on a view op apply to its base."""
from __future__ import annotations

import functools

import pytest
import torch
from torch._functorch._aot_autograd.autograd_cache import (BypassAOTAutogradCache,
                                                           _collect_context_fn_hashes)

from fixtures.capture import capturing_backend as _capturing
from sac_compile import CheckpointPolicy as CP, SaveWithHooks, sac_region, tag
from sac_compile.compiler import make_backend
from sac_compile.compiler.cache_keys import hooks_key, policy_key
from sac_compile.markers import decode_opinion, encode_opinion

aten = torch.ops.aten


def to_bf16(t):
    return t.to(torch.bfloat16)


def from_bf16(t):
    return t.to(torch.float32)


def to_f16(t):
    return t.to(torch.float16)


def from_f16(t):
    return t.to(torch.float32)


# Hooks name their identity (a cache_hash each): what lets a graph holding them be cached.
to_bf16.cache_hash, from_bf16.cache_hash = "to_bf16-v1", "from_bf16-v1"
to_f16.cache_hash, from_f16.cache_hash = "to_f16-v1", "from_f16-v1"
BF16 = SaveWithHooks(to_bf16, from_bf16)


def _saves_nothing_special(ctx, op, *args, **kwargs):
    return None


def _tagged_block(hooks):
    @sac_region(_saves_nothing_special, name="T")
    def block(x, w1, w2):
        h = tag(x @ w1, hooks)   # sin's backward reads h
        return h.sin() @ w2
    return block


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, requires_grad=True) for s in ((16, 32), (32, 32),
                                                                     (32, 16))]


def _grads(fn, inputs):
    fn(*inputs).square().sum().backward()
    out = [t.grad.clone() for t in inputs]
    for t in inputs:
        t.grad = None
    return out


def _rel(a, b):
    return max(((x - y).abs().max() / y.abs().max()).item() for x, y in zip(a, b))


def test_tag_with_hooks_packs_the_value_and_agrees_with_eager():
    inputs = _inputs()
    plain = _grads(_tagged_block(CP.MUST_SAVE), inputs)  # no hooks, nothing rounded
    eager = _grads(_tagged_block(BF16), inputs)          # the eager runtime's hooks
    backend, cap = _capturing()
    got = _grads(torch.compile(_tagged_block(BF16), backend=backend), inputs)
    fw, bw, report = cap["fw"], cap["bw"], cap["report"]
    # the forward packs the tagged value (a bf16 cast) and returns the packed tensor
    outs = fw.graph.find_nodes(op="output")[0].args[0]
    packs = [n for n in outs if isinstance(n, torch.fx.Node) and n.name.startswith("sac_pack_")]
    assert len(packs) == 1 and packs[0].meta["val"].dtype == torch.bfloat16, fw.graph
    assert packs[0].target is torch.ops.prims.convert_element_type.default or \
        packs[0].target is aten._to_copy.default, packs[0].target
    assert [n for n in bw.graph.nodes if n.name.startswith("sac_unpack_")], bw.graph
    # the report: the tagged value (mm) at half its bytes, with the tag as the reason
    (row,) = [r for r in report.saved if r.name == "mm"]
    assert row.nbytes == 16 * 32 * 2, row
    assert row.reason.startswith("SaveWithHooks by tag in region 'T': packed by "
                                 "SaveWithHooks(to_bf16, from_bf16)"), row.reason
    assert "(2 KiB -> 1 KiB)" in row.reason, row.reason
    # gradients: those of eager tag(...) with the same hooks, to the hooks' rounding
    assert _rel(got, eager) <= 1e-2
    assert 0 < _rel(got, plain) <= 2e-2  # the hooks ran: the saved value was rounded


def test_tag_with_hooks_built_in_the_compiled_code_and_a_closure():
    """``tag(h, SaveWithHooks(pack, unpack))`` written in the traced code, and hooks that
    close over a dtype: another closure recompiles and packs to its own dtype."""
    def hooks_for(dtype):
        return SaveWithHooks(lambda t: t.to(dtype), lambda p: p.to(torch.float32))

    current = {"hooks": hooks_for(torch.bfloat16)}

    @sac_region(_saves_nothing_special, name="T")
    def inline(x, w1, w2):
        return tag(x @ w1, SaveWithHooks(to_bf16, from_bf16)).sin() @ w2

    @sac_region(_saves_nothing_special, name="T")
    def closure(x, w1, w2):
        return tag(x @ w1, current["hooks"]).sin() @ w2

    inputs = _inputs()
    for block, dtype in ((inline, torch.bfloat16), (closure, torch.bfloat16)):
        backend, cap = _capturing()
        _grads(torch.compile(block, backend=backend), inputs)
        (pack,) = [n for n in cap["fw"].graph.nodes if n.name.startswith("sac_pack_")]
        assert pack.meta["val"].dtype == dtype
    current["hooks"] = hooks_for(torch.float16)  # same code, another dtype: recompiles
    compiled = torch.compile(closure, backend=backend)
    _grads(compiled, inputs)
    (pack,) = [n for n in cap["fw"].graph.nodes if n.name.startswith("sac_pack_")]
    assert pack.meta["val"].dtype == torch.float16


def test_tag_with_hooks_under_a_backend_without_aot_autograd():
    """backend="eager": the region runs through the eager runtime and the marker applies the
    same hooks as eager tag()."""
    packed = []

    def counting_pack(t):
        packed.append(t.shape)
        return t.to(torch.bfloat16)

    hooks = SaveWithHooks(counting_pack, from_bf16)
    inputs = _inputs()
    eager = _grads(_tagged_block(hooks), inputs)
    assert packed == [torch.Size([16, 32])]
    got = _grads(torch.compile(_tagged_block(hooks), backend="eager"), inputs)
    assert packed == [torch.Size([16, 32])] * 2
    assert _rel(got, eager) <= 1e-6


def test_encoded_hooks_round_trip_and_are_named_stably():
    text = encode_opinion(BF16)
    assert text.startswith("SaveWithHooks:")
    assert encode_opinion(SaveWithHooks(to_bf16, from_bf16)) == text  # the same functions
    assert encode_opinion(SaveWithHooks(to_f16, from_f16)) != text
    back = decode_opinion(text)
    assert back.pack is to_bf16 and back.unpack is from_bf16
    assert decode_opinion("MUST_SAVE") is CP.MUST_SAVE
    assert encode_opinion(SaveWithHooks(lambda t: t.half(), lambda p: p.float())) \
        .startswith("SaveWithHooks@")                  # no declared identity: unstable
    unstable = encode_opinion(_STATEFUL_HOOKS)
    assert unstable.startswith("SaveWithHooks@")
    with pytest.raises(Exception, match="not registered in this process"):
        decode_opinion("SaveWithHooks:0000")


class _Caster:
    """Hooks whose behaviour lives in an object's attribute: nothing can name it stably."""

    def __init__(self, dtype):
        self.dtype = dtype

    def pack(self, t):
        return t.to(self.dtype)

    def unpack(self, packed):
        return packed.float()


_STATEFUL_HOOKS = SaveWithHooks(_Caster(torch.bfloat16).pack, _Caster(torch.bfloat16).unpack)


def test_hooks_key_forms():
    assert hooks_key(BF16) == "SaveWithHooks(cache_hash:to_bf16-v1; cache_hash:from_bf16-v1)"
    assert hooks_key(SaveWithHooks(to_f16, from_f16)) != hooks_key(BF16)
    assert hooks_key(SaveWithHooks(lambda t: t, from_bf16)) is None   # a user's code: no key
    assert hooks_key(SaveWithHooks(torch.clone, torch.clone)) is not None
    assert hooks_key(_STATEFUL_HOOKS) is None


def _policy_returning_global_hooks(ctx, op, *args, **kwargs):
    return BF16 if op is aten.mm.default else None


def test_a_function_returning_hooks_has_no_key_unless_it_declares_one():
    assert policy_key(_policy_returning_global_hooks) is None
    declared = functools.partial(_policy_returning_global_hooks)
    declared.cache_hash = "bf16-matmuls-v1"
    assert policy_key(declared) == "cache_hash:bf16-matmuls-v1"


def _cache_view(hooks):
    """What AOTAutograd's cache key reads from a compile of the tagged block: the region
    hashes (or the bypass), and the marker's string in Dynamo's graph."""
    seen = []
    backend = make_backend(compiler="aot_eager")

    def recording(gm, example_inputs, **kwargs):
        compiled = backend(gm, example_inputs, **kwargs)
        texts = [n.args[1] for m in gm.modules() if isinstance(m, torch.fx.GraphModule)
                 for n in m.graph.nodes if "tag_marker" in str(n.target)]
        try:
            seen.append((_collect_context_fn_hashes(gm), texts))
        except BypassAOTAutogradCache as e:
            seen.append((e, texts))
        return compiled

    @sac_region("recompute_all", name="T")
    def block(x, w1, w2):
        return tag(x @ w1, hooks).sin() @ w2

    torch._dynamo.reset()
    _grads(torch.compile(block, backend=recording), _inputs())
    (result,) = seen
    return result


def test_the_cache_key_covers_tagged_hooks():
    hashes, texts = _cache_view(BF16)
    assert isinstance(hashes, list) and len(hashes) == 1, hashes
    assert texts == [encode_opinion(BF16)]
    again, texts_again = _cache_view(SaveWithHooks(to_bf16, from_bf16))
    assert (again, texts_again) == (hashes, texts)               # warm: the same key
    other, other_texts = _cache_view(SaveWithHooks(to_f16, from_f16))
    assert other_texts != texts                                  # other hooks: another graph
    bypass, _ = _cache_view(_STATEFUL_HOOKS)
    assert isinstance(bypass, BypassAOTAutogradCache)            # no stable identity


# -- SaveWithHooks decided on a view op packs its base ----------------------------------

def _hooks_on(op):
    return lambda ctx, o, *a, **k: BF16 if o is op else None


def _view_block(how):
    if how == "policy":
        @sac_region(_hooks_on(aten.t.default), name="V")
        def block(x, w1, w2):
            return (x @ w1).t().sin() @ w2.transpose(0, 1)  # sin's backward reads the view
    else:
        @sac_region(_saves_nothing_special, name="V")
        def block(x, w1, w2):
            return tag((x @ w1).t(), BF16).sin() @ w2.transpose(0, 1)
    return block


@pytest.mark.parametrize("how", ["policy", "tag"])
def test_hooks_on_a_view_pack_its_base_and_agree_with_eager(how):
    inputs = _inputs()
    eager = _grads(_view_block(how), inputs)
    backend, cap = _capturing()
    got = _grads(torch.compile(_view_block(how), backend=backend), inputs)
    packs = [n for n in cap["fw"].graph.nodes if n.name.startswith("sac_pack_")]
    assert len(packs) == 1 and packs[0].meta["val"].dtype == torch.bfloat16
    (row,) = [r for r in cap["report"].saved if "packed by" in r.reason]
    assert row.op == "aten.mm.default" and row.nbytes == 16 * 32 * 2, row
    source = "policy" if how == "policy" else "tag"
    assert row.reason.startswith(f"SaveWithHooks by {source} on its view aten.t.default (t) "
                                 f"in region 'V': packed by SaveWithHooks(to_bf16, "
                                 f"from_bf16)"), row.reason
    assert _rel(got, eager) <= 1e-2


def test_hooks_on_a_view_of_an_input_pack_the_view_itself():
    """The base is an input (the region cannot pack it): the view is saved and packed by
    itself, as the eager runtime packs the view op's output - never dropped."""

    @sac_region(_hooks_on(aten.t.default), name="V")
    def block(x, w1, w2):
        return (w1.t() @ x.transpose(0, 1)).sin() @ w2.transpose(0, 1)  # mm reads w1.t()

    inputs = _inputs()
    eager = _grads(block, inputs)
    backend, cap = _capturing()
    got = _grads(torch.compile(block, backend=backend), inputs)
    (pack,) = [n for n in cap["fw"].graph.nodes if n.name.startswith("sac_pack_")]
    assert pack.args[0].target is aten.t.default and pack.meta["val"].dtype == torch.bfloat16
    (row,) = [r for r in cap["report"].saved if "packed by" in r.reason]
    assert row.op == "aten.t.default" and row.reason.startswith(
        "SaveWithHooks by policy in region 'V': packed by"), row.reason
    assert _rel(got, eager) <= 1e-2
