"""The misuse catalogue (docs/errors.md): one test per row, matched on the message.

Each row: what the user did, what they get (eager; and under compile where it differs),
and the message, which names the op and the region and says what to do.
"""
from __future__ import annotations

import re
import warnings

import pytest
import torch

import sac_compile as sc
from sac_compile import CheckpointError, CheckpointPolicy as CP
from sac_compile.compiler import make_backend

aten = torch.ops.aten


def _xw():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(4, 8, generator=g, requires_grad=True),
            torch.randn(8, 8, generator=g, requires_grad=True))


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend=make_backend(compiler="aot_eager"))


def _grads(fn, *inputs):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    fn(*leaves).sum().backward()
    return [t.grad for t in leaves]


# 1 -------------------------------------------------------------------------------------
def test_policy_comparing_a_packet_decides_nothing_and_warns_once():
    def policy(ctx, op, *args, **kwargs):  # op is aten.mm.default, never the packet
        return CP.MUST_SAVE if op == aten.mm else CP.PREFER_RECOMPUTE

    x, w = _xw()
    with pytest.warns(UserWarning, match=re.escape(
            "the policy 'policy' of region 'block' decided nothing for any of the region's "
            "2 ops (aten.mm.default, aten.sin.default)")) as record:
        @sc.sac_region(policy, name="block")
        def block(x, w):
            return (x @ w).sin()
        block(x, w).sum().backward()
    assert "op.overloadpacket" in str(record[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        block(x, w).sum().backward()  # once per policy


def test_policy_comparing_a_packet_warns_under_compile_too():
    def packet_policy(ctx, op, *args, **kwargs):
        return CP.MUST_SAVE if op == aten.mm else CP.PREFER_RECOMPUTE

    @sc.sac_region(packet_policy, name="cblock")
    def block(x, w):
        return (x @ w).sin()

    x, w = _xw()
    f = _compiled(lambda x, w: block(x, w))
    with pytest.warns(UserWarning, match=re.escape(
            "the policy 'packet_policy' of region 'cblock' decided nothing for any of the "
            "region's 2 ops (aten.mm.default, aten.sin.default)")):
        f(x, w).sum().backward()


def test_a_policy_that_decides_through_tags_only_is_not_inert_under_compile(capture):
    def tag_only(ctx, op, *args, **kwargs):
        return None

    @sc.sac_region(tag_only, name="tagged")
    def block(x, w):
        return sc.tag(x @ w, CP.MUST_SAVE).sin()

    x, w = _xw()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", module="torch")
        torch.compile(lambda x, w: block(x, w), backend=capture.backend())(x, w).sum().backward()
    (saved,) = [r for r in capture.report.saved if not r.is_input]
    assert (saved.op, saved.nbytes, saved.region) == ("aten.mm.default", 4 * 8 * 4, "tagged")


def test_packet_in_an_op_list_policy_matches_every_overload():
    # The supported way to name a packet: a list (or save_ops) expands it.
    from sac_compile.runtime import collect_stats
    x, w = _xw()
    with collect_stats() as stats:
        sc.checkpoint(lambda x, w: (x @ w).sin(), x, w, policy=[aten.mm]).sum().backward()
    assert dict(stats.decisions)["aten.mm.default"].policy is CP.MUST_SAVE


# 2 -------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_policy_returning_a_non_policy_value(mode):
    x, _ = _xw()

    def f(x):
        return sc.sac_region(lambda ctx, op, *a, **k: "yes", name="sin")(torch.sin)(x).sum()

    run = f if mode == "eager" else _compiled(f)
    with pytest.raises(CheckpointError, match=r"the policy of region 'sin' returned 'yes' "
                       r"\(type str\) for op aten\.sin\.default; a policy must return"):
        run(x)


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_policy_that_raises(mode):
    x, _ = _xw()

    def policy(ctx, op, *args, **kwargs):
        raise KeyError("boom")

    def f(x):
        return sc.sac_region(policy, name="sin")(torch.sin)(x).sum()

    run = f if mode == "eager" else _compiled(f)
    with pytest.raises(CheckpointError, match=r"the policy of region 'sin' raised KeyError: "
                       r"'boom' while deciding op aten\.sin\.default; fix the policy or return "
                       r"None"):
        run(x)


def test_policy_of_the_wrong_type_is_a_type_error_at_region_creation():
    with pytest.raises(TypeError, match=r"policy <CheckpointPolicy.MUST_SAVE: 0> is a "
                                        r"decision, not a policy; pass a function returning it"):
        sc.sac_region(CP.MUST_SAVE)
    with pytest.raises(TypeError, match=r"got 42 of type int"):
        sc.sac_region(42)


# 3 -------------------------------------------------------------------------------------
def _must(policy):
    return lambda ctx, op, *a, **k: policy if op is aten.mm.default else None


@sc.sac_region(_must(CP.MUST_RECOMPUTE), name="Inner")
def _inner(x, w):
    return (x @ w).relu()


@sc.sac_region(_must(CP.MUST_SAVE), name="Outer")
def _outer(x, w):
    return _inner(x, w).sin()


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_conflicting_musts(mode):
    x, w = _xw()
    f = (lambda x, w: _outer(x, w).sum())
    run = f if mode == "eager" else _compiled(f)
    with pytest.raises(CheckpointError, match=re.escape(
            "conflicting decisions for op aten.mm.default: MUST_SAVE by policy in region "
            "'Outer' and MUST_RECOMPUTE by policy in region 'Inner'. Two MUST decisions cannot "
            "both hold; make one of them PREFER_*")):
        run(x, w)


# 4 -------------------------------------------------------------------------------------
def _mutates(x):
    a = x.sin()
    b = a.exp()
    a.mul_(2)
    return b * a


def _SAVE_SIN(ctx, op, *args, **kwargs):  # noqa: N802
    return CP.MUST_SAVE if op is aten.sin.default else CP.PREFER_RECOMPUTE


def test_mutated_cached_tensor_raises_in_eager():
    x, _ = _xw()
    out = sc.sac_region(_SAVE_SIN, name="_mutates")(_mutates)(x)
    with pytest.raises(CheckpointError, match=re.escape(
            "the saved output of aten.sin.default (op #0 of region '_mutates') was mutated in "
            "place by aten.mul_.Tensor after it was saved")) as e:
        out.sum().backward()
    assert "allow_cache_entry_mutation=True" in str(e.value)


def test_mutated_cached_tensor_allowed_keeps_a_copy_and_compile_is_right():
    x, _ = _xw()
    ref = _grads(_mutates, x)
    allowed = sc.sac_region(_SAVE_SIN, allow_cache_entry_mutation=True)(_mutates)
    torch.testing.assert_close(_grads(allowed, x), ref)
    # Under compile the graph is functional: the mutation is a copy, nothing to report.
    compiled = _compiled(lambda x: sc.sac_region(_SAVE_SIN, name="M")(_mutates)(x))
    torch.testing.assert_close(_grads(compiled, x), ref)


# 5 -------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_second_backward(mode):
    x, w = _xw()

    def f(x, w):
        return sc.checkpoint(lambda x, w: (x @ w).sin(), x, w, policy="recompute_all").sum()

    run = f if mode == "eager" else _compiled(f)
    out = run(x, w)
    out.backward()
    with pytest.raises(RuntimeError, match="Trying to backward through the graph a second "
                                           "time.*retain_graph=True"):
        out.backward()
    x.grad = None
    out = run(x, w)
    out.backward(retain_graph=True)
    first = x.grad.clone()
    out.backward()
    torch.testing.assert_close(x.grad, 2 * first)


# 6 -------------------------------------------------------------------------------------
_calls = [0]


@torch.library.custom_op("sac_misuse::grows", mutates_args=())
def _grows(x: torch.Tensor) -> torch.Tensor:
    """Returns a different number of rows on every call: not deterministic in shape."""
    _calls[0] += 1
    return x[: 1 + _calls[0] % 3].clone()


@_grows.register_fake
def _(x):
    return x.new_empty(torch.library.get_ctx().new_dynamic_size(), *x.shape[1:])


def _grows_setup(ctx, inputs, output):
    ctx.shape = inputs[0].shape


def _grows_backward(ctx, grad):
    out = grad.new_zeros(ctx.shape)
    out[: grad.shape[0]] = grad
    return out


_grows.register_autograd(_grows_backward, setup_context=_grows_setup)


def test_recompute_that_diverges_in_shape():
    x, _ = _xw()

    def block(x):
        return torch.ops.sac_misuse.grows(x.sin()).sin()

    out = sc.sac_region("recompute_all", name="block")(block)(x)
    with pytest.raises(CheckpointError, match=r"recomputing sac_misuse\.grows\.default \(op #1 "
                       r"of region 'block'\) gave output 0 as \(\d, 8\) torch\.float32, but the "
                       r"forward produced \(\d, 8\) torch\.float32: .*Make the policy save this "
                       r"op \(MUST_SAVE\)"):
        out.sum().backward()


# 7 -------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_tag_on_a_non_tensor(mode):
    x, _ = _xw()

    def f(x):
        return sc.checkpoint(lambda x: sc.tag(x.sin().shape[0], CP.MUST_SAVE) * x, x)

    run = f if mode == "eager" else _compiled(f)
    with pytest.raises(TypeError, match=r"tag\(\) takes a tensor, got 4 of type int"):
        run(x)


def test_tag_on_a_tensor_from_outside_the_region_in_eager():
    x, _ = _xw()
    with pytest.raises(CheckpointError, match=re.escape(
            "tag() in region 'R' got a tensor that no op of the region produced (an "
            "input, a parameter, or a value from outside); apply it to the output of the op "
            "you mean, inside the region")):
        sc.sac_region("recompute_all", name="R")(lambda x: sc.tag(x, CP.MUST_SAVE).sin())(x)


def test_tag_outside_any_region_is_a_no_op():
    x, _ = _xw()
    y = x.sin()
    assert sc.tag(y, CP.MUST_SAVE) is y and sc.name(y, "a") is y


def test_tag_on_a_tensor_from_outside_the_region_under_compile():
    x, _ = _xw()
    f = _compiled(lambda x: sc.sac_region("recompute_all", name="R")(
        lambda x: sc.tag(x, CP.MUST_SAVE).sin())(x))
    with pytest.raises(CheckpointError, match=re.escape(
            "tag() in region 'R' got a tensor that no op of the region produced (an "
            "input, a parameter, or a value from outside); apply it to the output of the op "
            "you mean, inside the region")):
        f(x)


def test_tag_and_name_outside_any_region_are_no_ops_under_compile():
    from sac_compile.explaining import explain
    x, _ = _xw()

    @sc.sac_region("recompute_all", name="R")
    def r(x):
        return x.sin()

    def f(x):
        y = sc.tag(r(x), CP.MUST_SAVE)   # on a region's output, but outside the region
        z = sc.name(x.cos(), "a")         # on a value no region produced
        return (y.cos() * z).sum()

    report = explain(f, x, mode="compile")
    assert "aten.sin.default" not in [s.op for s in report.saved]
    assert report.recomputed.count("aten.sin.default") == 1


# 8 -------------------------------------------------------------------------------------
def test_offload_policy_without_accelerator_is_a_plain_save_and_warns_once(monkeypatch):
    from sac_compile.runtime import collect_stats
    from sac_compile.runtime import store
    monkeypatch.setattr(store, "_WARNED_OFFLOAD_ON_CPU", False)
    x, w = _xw()
    ref = _grads(lambda x, w: (x @ w).sin(), x, w)

    def f(x, w):
        return sc.sac_region(sc.policies.offload_ops(aten.mm), name="Off")(
            lambda x, w: (x @ w).sin())(x, w)

    with collect_stats() as stats, pytest.warns(UserWarning, match=re.escape(
            "MUST_CPU_OFFLOAD for aten.mm.default (op #0 of region 'Off'): ")) as rec:
        got = _grads(f, x, w)
    if not torch.accelerator.is_available():
        assert "no accelerator is available, so CPU offload is a plain save" in \
            str(rec[0].message)
    torch.testing.assert_close(got, ref)
    assert [r.op for r in stats.saved] == ["aten.mm.default"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _grads(f, x, w)


def test_offload_of_a_cpu_value_under_compile_is_reported_as_a_plain_save():
    from sac_compile.explaining import explain
    x, w = _xw()

    @sc.sac_region(sc.policies.offload_ops(aten.mm), name="Off")
    def f(x, w):
        return (x @ w).sin().sin()

    report = explain(lambda x, w: f(x, w).sum(), x, w, mode="compile")
    reasons = [r.reason for r in report.saved if r.op == "aten.mm.default"]
    assert reasons and "(the value is on the CPU: CPU offload is a plain save)" in reasons[0]


# 9 -------------------------------------------------------------------------------------
def test_save_with_hooks_whose_unpack_returns_the_wrong_shape():
    x, _ = _xw()
    hooks = sc.SaveWithHooks(lambda t: t, lambda t: t[:2])

    def block(x):
        return x.sin().sin()

    out = sc.sac_region(lambda ctx, op, *a, **k: hooks if op is aten.sin.default else None,
                        name="block")(block)(x)
    with pytest.raises(CheckpointError, match=re.escape(
            "SaveWithHooks unpack for aten.sin.default (op #0 of region 'block') returned "
            "(2, 8) torch.float32, expected (4, 8) torch.float32; unpack must return a tensor "
            "like the one pack got")):
        out.sum().backward()


def test_save_with_hooks_whose_unpack_returns_the_wrong_shape_under_compile():
    """Under compile the hooks are traced into the graphs; an unpack that does not give the
    saved value back is found before tracing, and the region runs through the eager
    runtime, which raises with the op and the region (on a torch without that check, the
    partitioner raises while compiling, with the fix)."""
    from sac_compile.explaining import explain
    x, _ = _xw()
    hooks = sc.SaveWithHooks(lambda t: t, lambda t: t[:2])

    @sc.sac_region(lambda ctx, op, *a, **k: hooks if op is aten.sin.default else None,
                   name="H")
    def block(x):
        return x.sin().sin()

    with pytest.raises(CheckpointError, match=r"aten\.sin\.default .*region 'H'.*"
                       r"expected .*\(4, 8\)"), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the region's eager fallback
        explain(lambda x: block(x).sum(), x, mode="compile")


# 10 ------------------------------------------------------------------------------------
def test_memory_budget_that_is_unreachable():
    from sac_compile.compiler.tagging import CompiledCheckpointError  # noqa: F401
    x, w = _xw()

    @sc.sac_region(lambda ctx, op, *a, **k: CP.MUST_SAVE, name="AllMust")
    def block(x, w):
        return (x @ w).sin().cos()

    f = torch.compile(lambda x, w: block(x, w).sum(),
                      backend=make_backend(compiler="aot_eager", memory_budget=0.5))
    with pytest.raises(CheckpointError, match=re.escape(
            "sac_compile: memory budget 50% of 256 B = 128 B cannot be met: even with "
            "everything recomputed or offloaded that may be, this forward/backward split "
            "keeps 256 B of activations on the device. Largest values it must still keep: "
            "mm (aten.mm.default, 128 B in region 'AllMust': MUST_SAVE by policy)")) as e:
        f(x, w)
    assert "To fix: raise the budget to at least 256 B" in str(e.value)
    assert "relax those MUST_SAVE decisions to PREFER_SAVE" in str(e.value)


# 11 ------------------------------------------------------------------------------------
def test_sac_region_applied_to_a_non_callable():
    with pytest.raises(TypeError, match=re.escape(
            "sac_region(...) must decorate a function or be applied to an nn.Module, got 42 "
            "of type int")):
        sc.sac_region("save_all")(42)


# 12 ------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["eager", "compile"])
@pytest.mark.parametrize("context", ["no_grad", "inference_mode"])
def test_no_grad_and_inference_mode_are_a_plain_forward(mode, context):
    x, w = _xw()
    ref = (x @ w).sin().detach()

    def f(x, w):
        return sc.checkpoint(lambda x, w: sc.tag(x @ w, CP.MUST_SAVE).sin(), x, w,
                             policy="save_all")

    run = f if mode == "eager" else _compiled(f)
    with getattr(torch, context)():
        out = run(x, w)
    assert not out.requires_grad
    torch.testing.assert_close(out, ref)


# 13 ------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_tensor_subclass_two_tensor(mode):
    from torch.testing._internal.two_tensor import TwoTensor
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
    w = torch.randn(8, 8, generator=g)

    def body(t, w):
        return (t @ w).sin().cos()

    def run(fn):
        t = TwoTensor(a.clone(), b.clone()).requires_grad_()
        ww = w.clone().requires_grad_()
        out = fn(t, ww)
        out.sum().backward()
        return out, t.grad, ww.grad

    ref = run(body)

    def f(t, w):
        return sc.checkpoint(body, t, w, policy="save_matmuls")

    got = run(f if mode == "eager" else _compiled(f))
    assert type(got[0]) is TwoTensor and type(got[1]) is TwoTensor
    for r, o in zip(ref, got):
        torch.testing.assert_close(o.a, r.a) if isinstance(r, TwoTensor) else None
        torch.testing.assert_close(o.b, r.b) if isinstance(r, TwoTensor) else None
        if not isinstance(r, TwoTensor):
            torch.testing.assert_close(o, r)


def test_save_only_these_names_takes_a_list_too():
    a = sc.policies.save_only_these_names(["attn", "mlp"])
    b = sc.policies.save_only_these_names("attn", "mlp")
    x = torch.randn(4, 8, requires_grad=True)

    def f(x):
        return sc.name(x.sin(), "attn").cos()

    for policy in (a, b):
        decisions = []
        with sc.runtime.collect_stats() as stats:
            sc.sac_region(policy, name="N")(f)(x)
        decisions = {op: d.label for op, d in stats.decisions}
        assert decisions["aten.sin.default"] == "MUST_SAVE", decisions
    with pytest.raises(TypeError, match="takes label strings"):
        sc.policies.save_only_these_names(1, 2)


def test_save_with_hooks_whose_pack_raises_names_the_op_and_region():
    x, _ = _xw()

    def pack(t):
        raise ValueError("boom")

    hooks = sc.SaveWithHooks(pack, lambda p: p)
    block = sc.sac_region(lambda ctx, op, *a, **k: hooks if op is aten.sin.default else None,
                          name="P")(lambda x: x.sin().sin())
    with pytest.raises(CheckpointError, match=r"aten\.sin\.default \(op #0 of region 'P'\): "
                       r"pack raised ValueError: boom"):
        block(x)
