"""The region API (issue 9): wrapped modules survive copies, pickling, fully_shard and
torch.compile; what cannot be a region is a TypeError; a sac_region object is a re-entrant,
thread-safe context manager; ``checkpoint`` takes torch's keywords; region names and the
rule for policy return values are the same in eager mode and under compile."""
from __future__ import annotations

import asyncio
import copy
import functools
import io
import pickle
import re
import re
import threading

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import create_selective_checkpoint_contexts, noop_context_fn

import sac_compile as sc
from sac_compile import CheckpointError
from sac_compile import CheckpointPolicy as CP
from sac_compile.compiler import make_backend

aten = torch.ops.aten

# Module-level (hence picklable) policies. _SEEN records (region, region_path, op) per ask.
_SEEN: list[tuple[str, tuple[str, ...], str]] = []


def _save_mm(ctx, op, *args, **kwargs):
    _SEEN.append((ctx.region, ctx.region_path, str(op)))
    return CP.MUST_SAVE if op in (aten.mm.default, aten.addmm.default) else None


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        return self.lin(x).tanh().sin()


def _block(seed=0):
    torch.manual_seed(seed)
    return Block()


def _x(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, 6, generator=g)


def _grads(module, x):
    """Parameter and input gradients of one forward/backward of ``module``."""
    x = x.detach().clone().requires_grad_()
    for p in module.parameters():
        p.grad = None
    module(x).sum().backward()
    return [p.grad.clone() for p in module.parameters()] + [x.grad]


def _unwrapped_like(module):
    """A plain Block with ``module``'s weights: the program without checkpointing."""
    ref = Block()
    ref.load_state_dict(module.state_dict())
    return ref


def _assert_same_grads(got, expected):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend=make_backend(compiler="aot_eager"))


# --------------------------------------------------------------------------------------
# 1. Module wrapping survives copies
# --------------------------------------------------------------------------------------

def test_wrapped_module_is_the_same_object_an_instance_of_its_class_with_the_same_state_keys():
    plain = _block()
    module = _block()
    wrapped = sc.sac_region(_save_mm)(module)
    assert wrapped is module
    assert isinstance(wrapped, Block) and type(wrapped) is not Block
    assert type(wrapped).__name__ == "SACRegionBlock"
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    wrapped.load_state_dict(plain.state_dict())       # unwrapped -> wrapped
    plain.load_state_dict(wrapped.state_dict())       # wrapped -> unwrapped
    _SEEN.clear()
    _assert_same_grads(_grads(wrapped, _x()), _grads(plain, _x()))
    assert {s[0] for s in _SEEN} == {"Block"}


def test_an_unwrapped_module_of_the_same_class_is_unchanged():
    sc.sac_region(_save_mm)(_block())
    other = _block()
    assert type(other) is Block and Block.forward is Block.__dict__["forward"]
    _SEEN.clear()
    other(_x().requires_grad_()).sum().backward()
    assert _SEEN == []


def test_deepcopy_of_a_wrapped_module_computes_with_its_own_parameters_and_region():
    original = sc.sac_region(_save_mm, name="Blk")(_block())
    clone = copy.deepcopy(original)
    with torch.no_grad():
        for p in clone.parameters():
            p.add_(0.5)
    _SEEN.clear()
    got = _grads(clone, _x())
    assert {s[0] for s in _SEEN} == {"Blk"}                   # the copy is still a region
    assert all(p.grad is None for p in original.parameters())  # no gradient leaks back
    _assert_same_grads(got, _grads(_unwrapped_like(clone), _x()))
    assert clone._sac_regions == original._sac_regions


@pytest.mark.parametrize("policy", [_save_mm, "save_matmuls", sc.policies.save_matmuls,
                                    [aten.addmm, aten.mm.default],
                                    functools.partial(_save_mm)],
                         ids=["function", "preset-name", "preset", "op-list", "partial"])
def test_torch_save_and_load_of_a_wrapped_module(policy):
    wrapped = sc.sac_region(policy, name="Saved", allow_cache_entry_mutation=True)(_block())
    buffer = io.BytesIO()
    torch.save(wrapped, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert type(loaded) is type(wrapped) and isinstance(loaded, Block)
    (config,) = loaded._sac_regions
    assert config.frame.name == "Saved" and config.allow_cache_entry_mutation
    assert repr(config.frame.policy) == repr(wrapped._sac_regions[0].frame.policy)
    _assert_same_grads(_grads(loaded, _x()), _grads(_unwrapped_like(wrapped), _x()))
    assert pickle.loads(pickle.dumps(wrapped))._sac_regions[0].frame.name == "Saved"


def test_pickling_a_wrapped_module_with_a_lambda_policy_names_region_and_fix():
    wrapped = sc.sac_region(lambda ctx, op, *a, **k: None, name="Blk")(_block())
    with pytest.raises(CheckpointError, match=r"cannot pickle the policy <function "
                                              r".*<lambda> at .* of region 'Blk'.*make it "
                                              r"picklable: a module-level function \(not a "
                                              r"lambda"):
        torch.save(wrapped, io.BytesIO())
    copy.deepcopy(wrapped)  # a copy needs no pickling


def test_wrapping_a_module_twice_nests_the_new_region_outside():
    wrapped = sc.sac_region(_save_mm, name="Outer")(sc.sac_region(_save_mm, name="Inner")(_block()))
    assert [c.frame.name for c in wrapped._sac_regions] == ["Outer", "Inner"]
    _SEEN.clear()
    got = _grads(wrapped, _x())
    assert {s[1] for s in _SEEN} == {("Outer", "Inner")}
    _assert_same_grads(got, _grads(_unwrapped_like(wrapped), _x()))


def test_a_forward_assigned_on_the_instance_before_wrapping_runs_inside_the_region():
    module = _block()
    calls = []

    def patched(x):
        calls.append(1)
        return Block.forward(module, x) * 2

    module.forward = patched
    sc.sac_region(_save_mm, name="Patched")(module)
    _SEEN.clear()
    got = _grads(module, _x())
    assert calls == [1] and {s[0] for s in _SEEN} == {"Patched"}
    ref = _unwrapped_like(module)
    ref.forward = lambda x: Block.forward(ref, x) * 2
    _assert_same_grads(got, _grads(ref, _x()))


def test_a_new_instance_of_the_swapped_class_is_a_plain_module():
    seq = sc.sac_region(_save_mm)(nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6)))
    assert type(seq[1:]) is nn.Sequential     # Sequential slicing builds type(self)(...)


def test_compiled_wrapped_modules_and_their_copies_match_the_unwrapped_program():
    wrapped = sc.sac_region(_save_mm, name="Blk")(_block())
    buffer = io.BytesIO()
    torch.save(wrapped, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    clone = copy.deepcopy(wrapped)
    with torch.no_grad():
        clone.lin.weight.mul_(-1)
    for module in (wrapped, loaded, clone):
        _SEEN.clear()
        got = _grads(_compiled(module), _x())
        assert {s[0] for s in _SEEN} == {"Blk"}
        _assert_same_grads(got, _grads(_unwrapped_like(module), _x()))


@pytest.mark.parametrize("order", ["sac_region_then_fully_shard", "fully_shard_then_sac_region"])
def test_fully_shard_in_either_order(order, tmp_path):
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    from torch.distributed.fsdp import FSDPModule, fully_shard

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)
    try:
        module = _block()
        ref = _unwrapped_like(module)
        if order == "sac_region_then_fully_shard":
            fully_shard(sc.sac_region(_save_mm)(module))
        else:
            sc.sac_region(_save_mm)(fully_shard(module))
        assert isinstance(module, Block) and isinstance(module, FSDPModule)
        assert list(module.state_dict()) == list(ref.state_dict())
        expected = _grads(ref, _x())
        for run in (module, _compiled(module)):
            _SEEN.clear()
            x = _x().requires_grad_()
            for p in module.parameters():
                p.grad = None
            run(x).sum().backward()
            assert {s[0] for s in _SEEN} == {"Block"}
            got = [p.grad.full_tensor() for p in module.parameters()] + [x.grad]
            _assert_same_grads(got, expected)
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------
# 2. What cannot be a region is a TypeError with the fix
# --------------------------------------------------------------------------------------

def test_decorating_a_module_class_is_a_type_error_saying_apply_it_to_an_instance():
    with pytest.raises(TypeError, match=re.escape(
            "sac_region(...) was applied to the class Model, which would checkpoint nothing; "
            "apply it to an instance, sac_region(policy)(Model(...))")):
        @sc.sac_region("save_matmuls")
        class Model(nn.Module):
            def forward(self, x):
                return x.sin()


def _generator(x):
    yield x.sin()


async def _coroutine(x):
    return x.sin()


async def _async_generator(x):
    yield x.sin()


@pytest.mark.parametrize("fn,kind", [(_generator, "a generator function"),
                                     (_coroutine, "an async function"),
                                     (_async_generator, "an async generator function")])
def test_generator_and_async_functions_are_type_errors(fn, kind):
    message = f"got {kind} '{fn.__name__}': calling it returns before its body runs"
    with pytest.raises(TypeError, match=re.escape(message) + ".*a function that computes and "
                                                            "returns tensors"):
        sc.sac_region("recompute_all")(fn)
    with pytest.raises(TypeError, match=re.escape(message)):
        sc.checkpoint(fn, torch.ones(2))
    asyncio.run(_coroutine(torch.ones(1)))  # (no "never awaited" warning from the test)


# --------------------------------------------------------------------------------------
# 3. One sac_region object as a context manager: nested and from two threads
# --------------------------------------------------------------------------------------

def test_one_region_object_entered_in_nested_blocks():
    region = sc.sac_region(_save_mm, name="R")
    w = torch.randn(6, 6, requires_grad=True)
    x = _x().requires_grad_()
    _SEEN.clear()
    with region:
        a = (x @ w).sin()
        with region:
            b = (a @ w).exp()
        c = b.cos().sum()
    c.backward()
    assert ("R", ("R", "R"), "aten.mm.default") in _SEEN
    got = [x.grad, w.grad]
    x.grad = w.grad = None
    ((x @ w).sin() @ w).exp().cos().sum().backward()
    _assert_same_grads(got, [x.grad, w.grad])


def test_one_region_object_entered_from_two_threads_at_once():
    region = sc.sac_region("save_matmuls", name="Shared")
    both_inside = threading.Barrier(2, timeout=30)
    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def work(i):
        try:
            g = torch.Generator().manual_seed(i)
            x = torch.randn(4, 6, generator=g, requires_grad=True)
            w = torch.randn(6, 6, generator=g, requires_grad=True)
            with region:
                both_inside.wait()      # the other thread is inside the same object now
                y = (x @ w).sin().exp()
                both_inside.wait()
            y.sum().backward()
            got = [x.grad.clone(), w.grad.clone()]
            x.grad = w.grad = None
            (x @ w).sin().exp().sum().backward()
            results[i] = [got, [x.grad, w.grad]]
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for got, expected in results.values():
        _assert_same_grads(got, expected)
    assert len(results) == 2


def test_a_region_object_copies_and_pickles_without_its_entered_contexts():
    region = sc.sac_region([aten.mm], name="R", allow_cache_entry_mutation=True)
    with region:
        clone = copy.deepcopy(region)
        loaded = pickle.loads(pickle.dumps(region))
    for other in (clone, loaded):
        assert (other.name, other.allow_cache_entry_mutation) == ("R", True)
        assert repr(other.policy) == repr(region.policy)
        x = _x().requires_grad_()
        with other:
            y = x.sin().exp()
        y.sum().backward()
        torch.testing.assert_close(x.grad, (x.detach().sin().exp() * x.detach().cos()))
    with pytest.raises(CheckpointError, match="cannot pickle the policy"):
        pickle.dumps(sc.sac_region(lambda ctx, op, *a, **k: None))


# --------------------------------------------------------------------------------------
# 4. checkpoint() takes torch.utils.checkpoint's keywords
# --------------------------------------------------------------------------------------

def _scaled(x, w, *, scale):
    return (x @ w).sin() * scale


def _xw():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(4, 6, generator=g, requires_grad=True),
            torch.randn(6, 6, generator=g, requires_grad=True))


def _run(mode, fn, *inputs):
    run = fn if mode == "eager" else _compiled(fn)
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    run(*leaves).sum().backward()
    return [t.grad for t in leaves]


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_checkpoint_with_torchs_keywords_passes_only_the_others_to_fn(mode):
    asked = []

    def torch_policy(ctx, op, *args, **kwargs):   # torch's signature; a bool result
        asked.append(str(op))
        return op is aten.mm.default

    context_fn = functools.partial(create_selective_checkpoint_contexts, torch_policy)

    def f(x, w):
        return sc.checkpoint(_scaled, x, w, scale=3.0, use_reentrant=False,
                             context_fn=context_fn, preserve_rng_state=False,
                             determinism_check="none", debug=True, early_stop=False)

    x, w = _xw()
    _assert_same_grads(_run(mode, f, x, w), _run("eager", lambda x, w: _scaled(x, w, scale=3.0),
                                                 x, w))
    assert "aten.mm.default" in asked      # the context_fn's policy is the region's policy


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_checkpoint_context_fn_with_an_op_list_and_noop_context_fn(mode):
    x, w = _xw()
    expected = _run("eager", lambda x, w: _scaled(x, w, scale=2.0), x, w)
    listed = functools.partial(create_selective_checkpoint_contexts, [aten.mm.default])
    for context_fn in (listed, noop_context_fn):
        got = _run(mode, lambda x, w: sc.checkpoint(_scaled, x, w, scale=2.0,
                                                    use_reentrant=False,
                                                    context_fn=context_fn), x, w)
        _assert_same_grads(got, expected)


def _mutates(x):
    a = x.sin()
    b = a.exp()
    a.mul_(2)
    return b * a


def _save_sin(ctx, op, *args, **kwargs):
    return CP.MUST_SAVE if op is aten.sin.default else None


def test_checkpoint_context_fn_carries_allow_cache_entry_mutation():
    x, _ = _xw()
    expected = _run("eager", _mutates, x)
    allowed = functools.partial(create_selective_checkpoint_contexts, _save_sin, True)
    _assert_same_grads(_run("eager", lambda x: sc.checkpoint(_mutates, x, context_fn=allowed),
                            x), expected)
    strict = functools.partial(create_selective_checkpoint_contexts, _save_sin)
    with pytest.raises(CheckpointError, match="allow_cache_entry_mutation=True"):
        _run("eager", lambda x: sc.checkpoint(_mutates, x, context_fn=strict), x)


@pytest.mark.parametrize("mode", ["eager", "compile"])
@pytest.mark.parametrize("kwargs,message", [
    ({"use_reentrant": True}, "use_reentrant=True): the runtime is always non-reentrant"),
    ({"context_fn": "not callable"}, "context_fn='not callable' is not callable"),
    ({"context_fn": functools.partial(create_selective_checkpoint_contexts, [aten.mm.default]),
      "policy": "save_all"}, "got both policy= and context_fn=; pass one of them"),
    ({"determinism_check": "strict"}, "determinism_check='strict'): expected one of "
                                      "['default', 'none']"),
], ids=["use_reentrant", "other-context_fn", "policy-and-context_fn", "determinism_check"])
def test_checkpoint_keyword_misuse_is_a_type_error_with_the_fix(mode, kwargs, message):
    x, w = _xw()
    with pytest.raises(TypeError, match=re.escape(message)):
        _run(mode, lambda x, w: sc.checkpoint(_scaled, x, w, scale=1.0, **kwargs), x, w)


# --------------------------------------------------------------------------------------
# 5. Region names are the same in eager mode and under compile, for every form
# --------------------------------------------------------------------------------------

def _names_policy(ctx, op, *args, **kwargs):
    _SEEN.append((ctx.region, ctx.region_path, str(op)))
    return CP.MUST_SAVE if op is aten.sin.default else None


def _plain(x):
    return x.sin().cos()


class Sinner(nn.Module):
    def forward(self, x):
        return x.sin().cos()

    def method(self, x):
        return x.sin().exp()


_decorated = sc.sac_region(_names_policy)(_plain)
_named = sc.sac_region(_names_policy, name="Explicit")(_plain)
_module = sc.sac_region(_names_policy)(Sinner())
_plain_module = Sinner()
_outer_lambda = lambda x: x.sin().tanh()  # noqa: E731


def _logged(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper


_wraps_decorated = _logged(_plain)

_FORMS = {
    "decorated function": (lambda x: _decorated(x), {"_plain"}),
    "explicit name": (lambda x: _named(x), {"Explicit"}),
    "module instance": (lambda x: _module(x), {"Sinner"}),
    "checkpoint(function)": (lambda x: sc.checkpoint(_plain, x, policy=_names_policy),
                             {"_plain"}),
    "checkpoint(lambda)": (lambda x: sc.checkpoint(_outer_lambda, x, policy=_names_policy),
                           {"<lambda>"}),
    "checkpoint(functools.wraps-decorated)": (
        lambda x: sc.checkpoint(_wraps_decorated, x, policy=_names_policy), {"_plain"}),
    "checkpoint(region-decorated)": (
        lambda x: sc.checkpoint(_decorated, x, policy=_names_policy), {"_plain"}),
    "checkpoint(partial)": (lambda x: sc.checkpoint(functools.partial(_plain), x,
                                                    policy=_names_policy), {"_plain"}),
    "checkpoint(bound method)": (lambda x: sc.checkpoint(_plain_module.method, x,
                                                         policy=_names_policy),
                                 {"Sinner.method"}),
    "checkpoint(module.forward)": (lambda x: sc.checkpoint(_plain_module.forward, x,
                                                           policy=_names_policy),
                                   {"Sinner.forward"}),
    "checkpoint(wrapped module.forward)": (lambda x: sc.checkpoint(_module.forward, x,
                                                                   policy=_names_policy),
                                           {"Sinner.forward", "Sinner"}),
    "checkpoint(module)": (lambda x: sc.checkpoint(_plain_module, x, policy=_names_policy),
                           {"Sinner"}),
}


@pytest.mark.parametrize("form", list(_FORMS))
def test_region_names_are_the_same_in_eager_and_compiled_mode(form):
    fn, expected = _FORMS[form]
    names = {}
    for mode in ("eager", "compile"):
        _SEEN.clear()
        _run(mode, fn, _x())
        names[mode] = {s[0] for s in _SEEN}
    assert names["eager"] == names["compile"] == expected


def test_checkpoint_of_a_lambda_created_in_compiled_code_has_the_eager_name():
    def f(x):
        return sc.checkpoint(lambda t: t.sin().exp(), x, policy=_names_policy)

    names = {}
    for mode in ("eager", "compile"):
        _SEEN.clear()
        _run(mode, f, _x())
        names[mode] = {s[0] for s in _SEEN}
    assert names["eager"] == names["compile"] == {f.__qualname__ + ".<locals>.<lambda>"}


# --------------------------------------------------------------------------------------
# 6. Policy return values: one rule in both modes, whatever was returned before
# --------------------------------------------------------------------------------------

def _values():
    np = pytest.importorskip("numpy")
    return {"True": True, "numpy.True_": np.True_, "numpy.False_": np.False_, "1": 1,
            "1.0": 1.0, "0": 0}


@pytest.mark.parametrize("mode", ["eager", "compile"])
@pytest.mark.parametrize("order", ["value first", "True first"])
@pytest.mark.parametrize("value", ["True", "numpy.True_", "numpy.False_", "1", "1.0", "0"])
def test_policy_return_values_follow_one_rule(value, order, mode):
    returned = _values()[value]
    answers = [returned, True] if order == "value first" else [True, returned]
    calls = []

    def policy(ctx, op, *args, **kwargs):
        calls.append(op)
        return answers[0] if len(calls) == 1 else answers[1]

    region = sc.sac_region(policy, name="Vals")(lambda x: x.sin().exp().cos())
    x = _x()
    if value in ("True", "numpy.True_", "numpy.False_"):   # bool and numpy.bool_: as bool
        _assert_same_grads(_run(mode, region, x), _run("eager", lambda t: t.sin().exp().cos(), x))
    else:                                                   # ints and floats: rejected
        with pytest.raises(CheckpointError, match=re.escape(
                f"the policy of region 'Vals' returned {returned!r} (type "
                f"{type(returned).__name__}) for op aten.") + r".*a policy must return a "
                r"CheckpointPolicy, a bool, None or SaveWithHooks"):
            _run(mode, region, x)


# -- API edges: compile, tag types, TorchScript -----------------------------------------------

def test_with_block_under_compile_runs_through_the_eager_runtime_quietly(recwarn):
    """A `with sac_region(...)` block in compiled code is a clean graph break: its ops go
    through the eager runtime (recorded, recomputed), and Dynamo does not trace into the
    runtime (no warnings about torch internals)."""
    from sac_compile.runtime import collect_stats

    x = torch.randn(4, 4, requires_grad=True)

    def f(x):
        x = x * 2
        with sc.sac_region("recompute_all", name="W"):
            y = x.sin().cos()
        return y * 3

    ref = torch.autograd.grad(f(x).sum(), x)[0]
    compiled = torch.compile(f, backend=sc.make_backend(compiler="aot_eager"))
    with collect_stats() as stats:
        got = torch.autograd.grad(compiled(x).sum(), x)[0]
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert stats.ops_recorded == 2 and stats.recomputed_ops == ["aten.sin.default"]
    assert not [w for w in recwarn if "Dynamo" in str(w.message)], [str(w.message) for w in recwarn]


@pytest.mark.parametrize("value, hint", [("MUST_SAVE", "use CheckpointPolicy.MUST_SAVE"),
                                         ("save_all", "a preset is a region's policy"),
                                         (1, "got 1 of type int")])
def test_tag_with_something_that_is_not_a_decision_is_a_type_error_naming_it(value, hint):
    @sc.sac_region("recompute_all")
    def f(x):
        return sc.tag(x.sin(), value)

    with pytest.raises(TypeError, match=r"tag\(\) takes a decision .*" + re.escape(hint)):
        f(torch.randn(3, requires_grad=True))


def test_tag_accepts_numpy_bool_like_a_bool():
    np = pytest.importorskip("numpy")

    @sc.sac_region("recompute_all")
    def f(x):
        return sc.tag(x.sin(), np.True_).cos()

    x = torch.randn(3, requires_grad=True)
    f(x).sum().backward()
    torch.testing.assert_close(x.grad, -x.detach().sin().sin() * x.detach().cos())


def test_torch_jit_script_of_a_wrapped_module_is_a_type_error_with_the_fix():
    m = sc.sac_region("recompute_all")(torch.nn.Linear(4, 4))
    with pytest.raises(TypeError, match=r"torch\.jit\.script cannot compile the sac_region "
                       r"'Linear'.*backend=sac_compile\.sac_backend"):
        torch.jit.script(m)


def test_torch_jit_trace_of_a_wrapped_module_warns_once_that_the_region_is_dropped():
    m = sc.sac_region("recompute_all", name="Traced")(torch.nn.Linear(4, 4))
    x = torch.randn(2, 4)
    with pytest.warns(UserWarning, match=r"torch\.jit\.trace records the ops of sac_region "
                      r"'Traced' without its checkpointing"):
        traced = torch.jit.trace(m, (x,))
    torch.testing.assert_close(traced(x), m(x))


# -- apply_regions --------------------------------------------------------------------------

class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.inner(x).relu()


class _Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([_Block(), _Block()])

    def forward(self, x):
        for block in self.layers:
            x = block(x)
        return x


def _regions_seen(model, compile_it):
    seen = set()

    def policy(ctx, op, *a, **k):
        seen.add(ctx.region)
        return sc.CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.addmm.default else None

    sc.apply_regions(model, policy, where=_Block)
    run = torch.compile(model, backend=sc.make_backend(compiler="aot_eager")) if compile_it \
        else model
    torch._dynamo.reset()
    run(torch.randn(2, 4, requires_grad=True)).sum().backward()
    return seen


@pytest.mark.parametrize("compile_it", [False, True], ids=["eager", "compile"])
def test_apply_regions_names_each_block_by_its_path_in_both_modes(compile_it):
    assert _regions_seen(_Stack(), compile_it) == {"layers.0", "layers.1"}


def test_apply_regions_wraps_only_the_outermost_matches_and_keeps_gradients():
    torch.manual_seed(0)
    ref = _Stack()
    model = copy.deepcopy(ref)
    sc.apply_regions(model, "save_matmuls",
                     where=lambda path, m: isinstance(m, (_Block, torch.nn.Linear)))
    assert type(model.layers[0]).__name__ == "SACRegion_Block"
    assert type(model.layers[0].inner) is torch.nn.Linear  # inside a wrapped block
    x = torch.randn(2, 4)
    ref(x).sum().backward()
    model(x).sum().backward()
    for (n, p), q in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=n)


def test_apply_regions_with_no_match_is_an_error_with_the_fix():
    with pytest.raises(ValueError, match=r"no submodule of _Stack matches.*type\(model\.layers"):
        sc.apply_regions(_Stack(), "save_matmuls", where=torch.nn.Conv2d)
