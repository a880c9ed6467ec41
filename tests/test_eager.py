"""The eager runtime: what it keeps, what it replays, and that gradients stay right."""
import gc
import sys
import weakref

import pytest
import torch
import torch.nn.functional as F

import sac_compile as sc
from sac_compile import CheckpointError, CheckpointPolicy as P, SaveWithHooks, policies
from sac_compile.runtime import collect_stats

aten = torch.ops.aten
MM = aten.mm.default


def grads(fn, *inputs, seed=0):
    """Output and input gradients of ``fn(*inputs).sum()`` from ``seed``."""
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    torch.manual_seed(seed)
    out = fn(*leaves)
    out.sum().backward()
    return out.detach(), [t.grad for t in leaves]


def assert_same_as_no_checkpointing(fn, *inputs, policy, seed=0):
    ref_out, ref_grads = grads(fn, *inputs, seed=seed)
    out, got = grads(lambda *a: sc.checkpoint(fn, *a, policy=policy), *inputs, seed=seed)
    torch.testing.assert_close(out, ref_out)
    for a, b in zip(got, ref_grads):
        torch.testing.assert_close(a, b)


def two_matmuls(x, w):
    a = x @ w
    b = a.sin()
    c = b @ w
    return c.relu().sum()


X = torch.randn(8, 8)
W = torch.randn(8, 8)


# --- counts, hand-computed -----------------------------------------------------------------

def run_counted(fn, *inputs, policy):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    with collect_stats() as stats:
        out = sc.checkpoint(fn, *leaves, policy=policy)
    out.sum().backward()
    return stats


def test_recompute_all_replays_each_needed_op_once():
    # relu's saved output needs mm2 <- sin <- mm1; later unpacks of sin and mm1 hit the cache.
    stats = run_counted(two_matmuls, X, W, policy="recompute_all")
    assert stats.recomputed_ops == ["aten.mm.default", "aten.sin.default", "aten.mm.default",
                                    "aten.relu.default"]
    assert stats.saved_bytes == 0


def test_save_matmuls_keeps_two_8x8_floats_and_replays_the_cheap_ops():
    stats = run_counted(two_matmuls, X, W, policy="save_matmuls")
    assert stats.saved_bytes == 2 * 8 * 8 * 4
    assert sorted(stats.recomputed_ops) == ["aten.relu.default", "aten.sin.default"]
    assert [r.op for r in stats.saved] == ["aten.mm.default", "aten.mm.default"]
    assert stats.saved[0].reason.startswith("MUST_SAVE by policy in region")


def test_nothing_is_kept_that_no_backward_needs():
    # sin saves its input x (a region input), and sum saves nothing: save_all keeps nothing.
    stats = run_counted(lambda x: x.sin().sum(), X, policy="save_all")
    assert stats.saved_bytes == 0 and stats.saved == []


def test_recompute_starts_from_the_nearest_saved_value():
    def chain(x):
        a = x.sin()
        b = sc.tag(a.cos(), P.MUST_SAVE)
        c = b.sin()
        return c.cos().exp()

    stats = run_counted(chain, X, policy="recompute_all")
    # Saved for backward: x (input), a, b (saved by the tag), c, and exp's output (the
    # region's output, still alive). a = sin(x) and c = sin(b) are replayed, each from the
    # nearest value that exists; the saved cos is never replayed.
    assert stats.recomputed_ops == ["aten.sin.default", "aten.sin.default"]
    assert stats.saved_bytes == 8 * 8 * 4


def test_users_python_runs_once():
    calls = []

    def f(x):
        calls.append(1)
        return x.sin().sin()

    assert_same_as_no_checkpointing(f, X, policy="recompute_all")
    assert len(calls) == 2  # once for the reference run, once for ours


@pytest.mark.parametrize("policy", ["recompute_all", "save_matmuls", "save_all",
                                    policies.compose(policies.save_ops(aten.sin), [MM])])
def test_gradients_match_no_checkpointing(policy):
    assert_same_as_no_checkpointing(two_matmuls, X, W, policy=policy)


# --- lifetime ------------------------------------------------------------------------------

def test_saved_value_is_freed_after_its_last_use_in_backward():
    refs = []

    def pack(t):
        refs.append(weakref.ref(t))
        return t

    hooks = SaveWithHooks(pack, lambda t: t)
    x = torch.randn(4, 4, requires_grad=True)
    w = torch.randn(4, 4, requires_grad=True)
    alive_when_x_grad_ready = []
    x.register_hook(lambda g: alive_when_x_grad_ready.append(refs[0]() is not None))
    out = sc.checkpoint(lambda x, w: (x @ w).sin().cos(), x, w,
                        policy=lambda ctx, op, *a, **k: hooks if op == MM else None)
    assert refs and refs[0]() is not None
    out.sum().backward()
    # mm's output is used only by sin's backward, which runs before mm's backward.
    assert alive_when_x_grad_ready == [False]


def test_hooks_are_called_once_per_saved_tensor():
    packs, unpacks = [], []
    hooks = SaveWithHooks(lambda t: packs.append(1) or t.clone(),
                          lambda p: unpacks.append(1) or p)
    policy = lambda ctx, op, *a, **k: hooks if op == MM else None  # noqa: E731
    # The mm output is unpacked by two backward nodes (sin and cos both save it).
    fn = lambda x, w: (x @ w).sin() + (x @ w).cos()  # noqa: E731
    assert_same_as_no_checkpointing(fn, X, W, policy=policy)
    assert len(packs) == 2 and len(unpacks) == 2


def test_unpack_of_wrong_shape_names_the_op():
    hooks = SaveWithHooks(lambda t: t, lambda p: p[:1])
    x = torch.randn(4, 4, requires_grad=True)
    out = sc.sac_region(lambda ctx, op, *a, **k: hooks if op == MM else None, name="Blk")(
        lambda x: (x @ x).sin())(x)
    with pytest.raises(CheckpointError, match=r"unpack for aten\.mm\.default .*'Blk'.*\(1, 4\)"):
        out.sum().backward()


def test_retain_graph_keeps_values_and_second_backward_without_it_fails():
    x = torch.randn(5, requires_grad=True)
    out = sc.checkpoint(lambda t: t.sin().exp().cos(), x)
    out.sum().backward(retain_graph=True)
    first = x.grad.clone()
    out.sum().backward()
    torch.testing.assert_close(x.grad, 2 * first)
    x.grad = None
    out = sc.checkpoint(lambda t: t.sin().exp().cos(), x)
    out.sum().backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        out.sum().backward()


def _chain(n):
    def f(t):
        for _ in range(n):
            t = (t * 1.0001).sin()
        return t
    return f


def test_long_chain_needs_no_recursion():
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(200)  # far below the chain length: recursion would fail loudly
    try:
        x = torch.randn(16, requires_grad=True)
        sc.checkpoint(_chain(20_000), x).sum().backward()
        assert torch.isfinite(x.grad).all()
    finally:
        sys.setrecursionlimit(limit)


def _python_lines_run(fn):
    """Lines of Python executed by ``fn()``: deterministic, unlike a clock."""
    count = 0

    def tracer(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return tracer

    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
    return count


def test_runtime_work_grows_linearly_with_the_number_of_ops():
    """Forward and backward of a chain 10x longer runs 10x the runtime's Python, not 100x:
    no per-op scan of everything recorded so far (counted, not timed)."""
    def step(n):
        x = torch.randn(16, requires_grad=True)
        return lambda: sc.checkpoint(_chain(n), x).sum().backward()

    small = _python_lines_run(step(300))
    big = _python_lines_run(step(3_000))
    assert 9.0 < big / small < 10.5, (small, big)


@pytest.mark.slow
def test_hundred_thousand_op_chain():
    x = torch.randn(16, requires_grad=True)

    def f(t):
        for _ in range(100_000):
            t = (t * 1.0001).sin()
        return t

    ref = grads(f, x)[1][0]
    got = grads(lambda t: sc.checkpoint(f, t), x)[1][0]
    torch.testing.assert_close(got, ref)


# --- semantics ------------------------------------------------------------------------------

def test_dropout_replays_forward_randomness_and_leaves_the_rng_stream_alone():
    def f(x, w):
        return F.dropout((x @ w).relu(), p=0.5).sin()

    assert_same_as_no_checkpointing(f, X, W, policy="recompute_all", seed=3)
    torch.manual_seed(3)
    f(X, W)
    after_plain = torch.rand(3)
    torch.manual_seed(3)
    out = sc.checkpoint(f, X.requires_grad_(), W)
    out.sum().backward()
    assert torch.equal(torch.rand(3), after_plain)
    X.requires_grad_(False)


def test_mutated_cached_tensor_raises_unless_allowed():
    # y is saved by the policy only to recompute z; autograd itself never saved y, so
    # only the runtime can notice that y changed before backward.
    def f(x):
        y = x @ x
        z = y * 2
        w = z.sin()
        y.mul_(3)
        return w.sum() + y.sum()

    x = torch.randn(4, 4, requires_grad=True)
    out = sc.sac_region([MM], name="Blk")(f)(x)
    with pytest.raises(CheckpointError, match=r"aten\.mm\.default.*'Blk'.*mutated.*aten\.mul_"):
        out.backward()
    ref_out, ref_grads = grads(f, x)
    out, got = grads(sc.sac_region([MM], allow_cache_entry_mutation=True)(f), x)
    torch.testing.assert_close(got[0], ref_grads[0])


def test_in_place_ops_and_views_are_replayed_correctly():
    def f(x):
        y = x * 2
        y[0].add_(1)          # through a view: y's base changes
        z = y.t().contiguous()
        z.relu_()
        a, b = z.split(4, dim=0)
        return (a.sin() * b.cos() * y[:4]).exp()

    for policy in ("recompute_all", "save_all", "save_matmuls"):
        assert_same_as_no_checkpointing(f, X, policy=policy)


def test_input_mutated_after_use_is_snapshotted():
    def f(x, buf):
        y = (x + buf).sin()   # sin saves x + buf: replaying it needs buf as it was
        buf.add_(1)           # a region input changes after an op used it
        return y * 3

    ref_buf, our_buf = torch.ones(8), torch.ones(8)
    x = torch.randn(8, requires_grad=True)
    torch.manual_seed(0)
    f(x, ref_buf).sum().backward()
    ref = x.grad.clone()
    x.grad = None
    sc.checkpoint(f, x, our_buf).sum().backward()
    torch.testing.assert_close(x.grad, ref)
    assert torch.equal(our_buf, ref_buf)


def test_multi_output_ops():
    def f(x):
        v, i = x.topk(3, dim=1)
        mean_var = torch.var_mean(x, dim=0)
        ln = F.layer_norm(x, (8,))
        parts = torch.split(ln, 2, dim=1)
        return (v.sin() * parts[0][:, :1]).sum() + mean_var[0].sum() + i.float().sum()

    for policy in ("recompute_all", "save_all"):
        assert_same_as_no_checkpointing(lambda x: f(x).reshape(1), X, policy=policy)


def test_integer_saved_tensor_comes_back_as_the_same_object():
    x = torch.randn(6, 6, requires_grad=True)
    kept = {}

    def f(x):
        idx = x.detach().argsort(dim=0)
        kept["idx"] = idx
        return torch.gather(x, 0, idx)

    out = sc.checkpoint(f, x, policy=policies.save_ops(aten.sort))
    assert out.grad_fn._saved_index is kept["idx"]


def test_cpu_offload_of_a_cpu_tensor_is_a_plain_save():
    stats = run_counted(two_matmuls, X, W, policy=policies.offload_ops(MM))
    assert stats.saved_bytes == 2 * 8 * 8 * 4
    assert_same_as_no_checkpointing(two_matmuls, X, W, policy=policies.offload_ops(MM))


def test_autocast():
    w = torch.randn(8, 8, requires_grad=True)

    def f(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return ((x @ w).sin() @ w).float()

    assert_same_as_no_checkpointing(f, X, policy="recompute_all")


def test_batchnorm_buffers_update_once():
    bn = torch.nn.BatchNorm1d(8)

    def f(x):
        return bn(x).relu().sin()

    torch.manual_seed(0)
    f(X).sum()
    expected_mean = bn.running_mean.clone()
    bn.reset_running_stats()
    x = X.clone().requires_grad_()
    sc.checkpoint(f, x).sum().backward()
    torch.testing.assert_close(bn.running_mean, expected_mean)
    assert bn.num_batches_tracked.item() == 1


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_no_grad_and_inference_mode_run_a_plain_forward(mode):
    region = sc.sac_region("save_matmuls")(lambda x: sc.tag(x.sin(), P.MUST_SAVE) @ x)
    with collect_stats() as stats, mode():
        out = region(X)
    assert torch.equal(out, X.detach().sin() @ X.detach())
    assert not out.requires_grad
    assert stats.ops_recorded == 0 and stats.saved == [] and stats.decisions == []


# --- regions, tag, name --------------------------------------------------------------------

def test_nested_regions_resolve_and_conflicts_name_both_regions():
    inner_recompute = sc.sac_region(lambda ctx, op, *a, **k: P.MUST_RECOMPUTE
                                    if op == MM else None, name="Inner")(lambda x: x @ x)

    @sc.sac_region("save_matmuls", name="Outer")
    def outer(x):
        return inner_recompute(x).sin()

    x = torch.randn(4, 4, requires_grad=True)
    with pytest.raises(CheckpointError, match=r"aten\.mm\.default.*'Outer'.*'Inner'"):
        outer(x)

    @sc.sac_region(policies.save_all, name="Outer2")
    def outer2(x):
        return sc.sac_region("recompute_all", name="Inner2")(lambda t: (t @ t).sin())(x)

    with collect_stats() as stats:
        outer2(x).sum().backward()
    assert {d.label for _, d in stats.decisions} == {"PREFER_RECOMPUTE"}  # innermost PREFER


def test_tag_and_name_change_the_producers_decision():
    def f(x):
        a = sc.tag(x.sin(), P.MUST_SAVE)
        b = sc.name(a.cos(), "b")
        return b.exp().sin()

    with collect_stats() as stats:
        sc.checkpoint(f, X.clone().requires_grad_(),
                      policy=policies.save_only_these_names("b")).sum().backward()
    decided = {}
    for op, decision in stats.decisions:
        decided.setdefault(op, decision)  # the first sin is the tagged one
    assert decided["aten.sin.default"].source == "tag"  # the only opinion on that op
    assert decided["aten.cos.default"].policy is P.MUST_SAVE
    assert decided["aten.cos.default"].source == "name"
    assert_same_as_no_checkpointing(f, X, policy=policies.save_only_these_names("b"))


def test_tag_misuse():
    with pytest.raises(TypeError, match="takes a tensor"):
        sc.tag(3.0, P.MUST_SAVE)
    y = X.sin()
    assert sc.tag(y, P.MUST_SAVE) is y  # outside any region: no-op, like jax's checkpoint_name
    with pytest.raises(CheckpointError, match="no op of the region produced"):
        sc.checkpoint(lambda x: sc.tag(x, P.MUST_SAVE), X.clone().requires_grad_())


def test_region_forms_and_default_names():
    class Block(torch.nn.Module):
        def forward(self, x):
            return x.sin().cos()

    seen = set()

    def policy(ctx, op, *args, **kwargs):
        seen.add(ctx.region)

    block = sc.sac_region(policy)(Block())
    assert isinstance(block, Block)

    @sc.sac_region(policy)
    def decorated(x):
        return x.exp()

    x = X.clone().requires_grad_()
    block(x).sum().backward()
    decorated(x).sum().backward()
    with sc.sac_region(policy, name="ctx"):
        y = x.tanh()
    y.sum().backward()
    assert seen == {"Block", decorated.__qualname__, "ctx"}
    with pytest.raises(TypeError, match="must decorate a function"):
        sc.sac_region()(42)


def test_no_reference_cycles_through_the_runtime():
    x = torch.randn(8, requires_grad=True)
    f = sc.sac_region("save_all")(lambda t: t.sin().exp().cos())
    for _ in range(3):
        f(x).sum().backward()
    gc.collect()
    gc.disable()
    try:
        for _ in range(5):
            f(x).sum().backward()
        assert gc.collect() == 0
    finally:
        gc.enable()


def test_runtime_keeps_no_forward_output_alive_that_it_did_not_save():
    # The region's last op is layer norm; backward needs its mean and rstd. They were not
    # saved, so they must be replayed, not found alive through the runtime's own references.
    def f(x):
        return F.layer_norm(x.sin(), (8,))

    stats = run_counted(f, X, policy=lambda ctx, op, *a, **k: None)
    assert "aten.native_layer_norm.default" in stats.recomputed_ops
