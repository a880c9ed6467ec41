"""What crosses a compiled region's boundary (issue 9): non-tensor graph inputs
(compiled autograd's BackwardState, SymInts), backends other than ours, and mutation
around and inside a region. Every test compares gradients with running the same program
without checkpointing (eager, or compiled without regions where eager autograd refuses the
program), or expects an error where running without checkpointing errors too."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sac_compile import CheckpointError
from sac_compile import CheckpointPolicy as CP
from sac_compile import policies, sac_region, tag
from sac_compile.compiler import SACPartitioner, make_backend
from sac_compile.compiler import tagging
from sac_compile.runtime import collect_stats

POLICIES = {"recompute_all": "recompute_all", "save_matmuls": policies.save_matmuls,
            "must_recompute": lambda ctx, op, *a, **k: CP.MUST_RECOMPUTE}


def _xw(n=4, m=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, m, generator=g, requires_grad=True),
            torch.randn(m, m, generator=g, requires_grad=True))


def _grads(fn, *inputs, seed=5, loss=lambda y: y.pow(2).sum()):
    """Gradients of ``loss(fn(*inputs))`` w.r.t. the inputs that require grad, or the
    exception it raised."""
    for t in inputs:
        t.grad = None
    torch.manual_seed(seed)
    try:
        loss(fn(*inputs)).backward()
    except Exception as e:  # noqa: BLE001 - the outcome is compared, not hidden
        return e
    return [t.grad.clone() if t.grad is not None else None for t in inputs if t.requires_grad]


def _same(a, b, atol=1e-5):
    assert not isinstance(a, Exception), repr(a)
    assert not isinstance(b, Exception), repr(b)
    assert len(a) == len(b)
    for u, v in zip(a, b):
        assert (u is None) == (v is None)
        if u is not None:
            assert torch.allclose(u, v, atol=atol), (u - v).abs().max()


def _aot_eager():
    return make_backend(compiler="aot_eager")


# -- 1. non-tensor graph inputs ----------------------------------------------------------------

def _hooked(region):
    def f(x, w):
        y = region(x, w)
        y.register_hook(lambda g: g * 2)  # compiled autograd: a BackwardState graph input
        return (y * 3).sum()
    return f


def _mm_sin(x, w):
    return (x @ w).sin() @ w


@pytest.mark.parametrize("policy", ["recompute_all", "save_matmuls"])
def test_tensor_hook_on_region_output_under_compiled_autograd(policy, capture):
    """A hook on a region's output makes compiled autograd pass a BackwardState into the
    joint graph. It used to leave no valid split ("no valid forward/backward split");
    it is passed to the backward as torch's partitioner passes it."""
    region = sac_region(POLICIES[policy], name=f"Hooked_{policy}")(_mm_sin)
    x, w = _xw()
    ref = _grads(_hooked(_mm_sin), x, w, loss=lambda y: y)
    fn = torch.compile(_hooked(region), backend=capture.backend())
    with torch._dynamo.compiled_autograd._enable(torch.compile(backend="aot_eager")):
        got = _grads(fn, x, w, loss=lambda y: y)
    _same(ref, got)
    assert capture.reports, "the joint graph went through our partitioner"
    assert all(r.op != "input" or r.nbytes > 0 for r in capture.reports[0].saved)


def test_tensor_hook_with_compiled_autograd_config_and_backward_inside_compile(capture):
    region = sac_region("recompute_all", name="HookedConfig")(_mm_sin)

    def step(f):
        def run(x, w):
            loss = f(x, w)
            loss.backward()
            return loss.detach()
        return run

    x, w = _xw()
    ref = _grads(_hooked(_mm_sin), x, w, loss=lambda y: y)
    x.grad = w.grad = None
    with torch._dynamo.config.patch(compiled_autograd=True):
        torch.compile(step(_hooked(region)), backend=capture.backend())(x, w)
    _same(ref, [x.grad, w.grad])
    assert capture.reports


@pytest.mark.parametrize("policy", ["recompute_all", "save_matmuls"])
def test_dynamic_shapes_symint_inputs_and_no_extra_recompiles(policy):
    """SymInt graph inputs go through; computing costs adds no shape guard (FLOPs of a
    symbolic matmul used to be int()-ed, specialising the batch size: one recompile per
    new size)."""
    def body(x, w):
        return ((x @ w).sin() * x.shape[0]).reshape(-1, 2 * x.shape[1]).relu()

    region = sac_region(POLICIES[policy], name=f"Dyn_{policy}")(body)
    compiles = {"plain": 0, "sac": 0}

    def counting(label, backend):
        def count(gm, example_inputs):
            compiles[label] += 1
            return backend(gm, example_inputs)
        return count

    fns = {"plain": torch.compile(lambda x, w: body(x, w).sum() * x.shape[0], dynamic=True,
                                  backend=counting("plain",
                                                   torch._dynamo.lookup_backend("aot_eager"))),
           "sac": torch.compile(lambda x, w: region(x, w).sum() * x.shape[0], dynamic=True,
                                backend=counting("sac", _aot_eager()))}
    for n in (2, 4, 6):
        x, w = _xw(n=n, m=3, seed=n)
        ref = _grads(lambda x, w: body(x, w).sum() * n, x, w, loss=lambda y: y)
        for label, fn in fns.items():
            _same(ref, _grads(fn, x, w, loss=lambda y: y))
    assert compiles["sac"] == compiles["plain"], compiles


# -- 2. backends other than ours ---------------------------------------------------------------

class _DropoutModel(nn.Module):
    def __init__(self, policy=None, name="Drop"):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)
        self.policy, self.name = policy, name

    def body(self, x):
        return F.dropout(self.lin(x).sin(), p=0.5, training=True).cos()

    def forward(self, x):
        if self.policy is None:
            return self.body(x)
        return sac_region(self.policy, name=self.name)(self.body)(x)


def _model_grads(model, backend=None):
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    fn = model if backend is None else torch.compile(model, backend=backend)
    out = _grads(fn, x)
    if isinstance(out, Exception):
        return out
    return out + [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("policy", ["recompute_all", "save_matmuls", "must_recompute"])
def test_eager_backend_region_recomputes_dropout_with_the_forwards_mask(policy):
    """backend="eager" runs torch's checkpoint op as Python (with preserve_rng_state=False):
    it recomputed dropout with a new mask, silently. The region now runs through the
    eager runtime there."""
    ref = _model_grads(_DropoutModel())
    got = _model_grads(_DropoutModel(POLICIES[policy], name=f"EagerDrop_{policy}"), "eager")
    _same(ref, got)


def test_eager_backend_checkpoint_function_form():
    from sac_compile import checkpoint

    def body(x, w):
        return F.dropout((x @ w).sin(), 0.5, training=True) @ w

    x, w = _xw()
    ref = _grads(body, x, w)
    fn = torch.compile(lambda x, w: checkpoint(body, x, w, policy="save_matmuls"),
                       backend="eager")
    _same(ref, _grads(fn, x, w))


def test_eager_backend_nested_regions_and_tags_apply_as_in_eager():
    @sac_region("recompute_all", name="EInner")
    def inner(x, w):
        return F.dropout((x @ w).sin(), p=0.5, training=True)

    @sac_region(policies.save_matmuls, name="EOuter")
    def outer(x, w):
        h = tag(inner(x, w).cos(), CP.MUST_SAVE)
        return F.dropout(h @ w, 0.5, training=True)

    def plain(x, w):
        h = F.dropout((x @ w).sin(), p=0.5, training=True).cos()
        return F.dropout(h @ w, 0.5, training=True)

    x, w = _xw(8, 8)
    ref = _grads(plain, x, w)
    with collect_stats() as stats:
        got = _grads(torch.compile(outer, backend="eager"), x, w)
    _same(ref, got)
    saved = {r.op: r.reason for r in stats.saved}
    assert "tag" in saved.get("aten.cos.default", ""), saved  # the tag() applied
    assert "aten.cos.default" not in stats.recomputed_ops


def test_eager_backend_tag_on_a_region_input_raises_as_in_eager():
    @sac_region("recompute_all", name="EForeign")
    def region(x, w):
        tag(x, CP.MUST_SAVE)
        return (x @ w).sin()

    x, w = _xw()
    with pytest.raises(CheckpointError, match="EForeign"):
        region(x, w)
    with pytest.raises(CheckpointError, match="EForeign"):
        torch.compile(region, backend="eager")(x, w)


def test_eager_backend_batch_norm_running_stats_update_once():
    def body(x, rm, rv):
        return F.batch_norm(x, rm, rv, training=True, momentum=0.1).sin()

    region = sac_region(POLICIES["must_recompute"], name="EBN")(body)
    x = torch.randn(8, 4, requires_grad=True)
    stats = {}
    for label, fn in (("plain", body), ("eager_backend", torch.compile(region, backend="eager"))):
        rm, rv = torch.zeros(4), torch.ones(4)
        x.grad = None
        fn(x, rm, rv).pow(2).sum().backward()
        stats[label] = (x.grad.clone(), rm, rv)
    for a, b in zip(stats["plain"], stats["eager_backend"]):
        assert torch.allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("allow", [False, True])
def test_eager_backend_keeps_allow_cache_entry_mutation(allow):
    def body(x, w):
        h = x @ w
        y = (h * 2).relu()
        h.mul_(3)
        return y + h

    region = sac_region(policies.save_matmuls, name=f"EAllow{allow}",
                        allow_cache_entry_mutation=allow)(body)
    x, w = _xw()
    ref = _grads(body, x, w)
    eager = _grads(region, x, w)
    got = _grads(torch.compile(region, backend="eager"), x, w)
    if allow:
        _same(ref, eager)
        _same(ref, got)
    else:  # as in eager: the saved matmul was mutated
        assert isinstance(eager, CheckpointError) and isinstance(got, CheckpointError)


def test_graph_break_region_is_one_region_not_two():
    """A graph break inside a region: torch's checkpoint runs as Python with our context,
    which opens the eager region; the body must not open a second one (every op would be
    decided twice)."""
    asked = []

    def policy(ctx, op, *args, **kwargs):
        asked.append(op)
        return CP.MUST_SAVE if op is torch.ops.aten.mm.default else None

    @sac_region(policy, name="BreaksOnce")
    def block(x, w):
        y = torch.relu(x @ w)
        torch._dynamo.graph_break()
        return y.sin() @ w

    x, w = _xw()
    block(x, w)
    eager_asked, asked[:] = list(asked), []
    ref = _grads(lambda x, w: torch.relu(x @ w).sin() @ w, x, w)
    got = _grads(torch.compile(block, backend=_aot_eager()), x, w)
    _same(ref, got)
    assert asked == eager_asked


def test_foreign_partitioner_warns_once_per_region_and_is_still_right():
    """aot_eager / inductor split with torch's partitioner: gradients are right (torch
    functionalises the recomputed dropout's RNG), but tag()/name() and our errors do not
    apply: one UserWarning per region."""
    ref = _model_grads(_DropoutModel())
    with pytest.warns(UserWarning, match=r"region 'ForeignDrop'.*sac_backend") as record:
        got = _model_grads(_DropoutModel("recompute_all", name="ForeignDrop"), "aot_eager")
        torch._dynamo.reset()
        _model_grads(_DropoutModel("recompute_all", name="ForeignDrop"), "aot_eager")
    _same(ref, got)
    assert sum("ForeignDrop" in str(w.message) for w in record) == 1


@pytest.mark.parametrize("backend", ["ours", "aot_eager"])
def test_inference_graph_with_dropout_in_a_region_compiles(backend):
    """Inputs that need no grad: AOTAutograd traces an inference graph and runs torch's
    forward-loss-backward remat pass on it, which refused random ops tagged for recompute
    ("does not support RNG ops in recompute regions"), for torch's own checkpoint too.
    Random ops are kept (tagged saved) in graphs that are never partitioned."""
    model = _DropoutModel("recompute_all", name=f"InfDrop_{backend}")
    for p in model.parameters():
        p.requires_grad_(False)
    x = torch.randn(4, 8)
    torch.manual_seed(3)
    ref = model.body(x)
    compiled = torch.compile(model, backend=_aot_eager() if backend == "ours" else backend)
    torch.manual_seed(3)
    assert torch.allclose(compiled(x), ref, atol=1e-6)


def test_our_backends_and_inference_graphs_do_not_warn():
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="sac_compile: region")
        _model_grads(_DropoutModel("recompute_all", name="OursDrop"), _aot_eager())
        torch._dynamo.reset()
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd
        users_own = aot_autograd(fw_compiler=make_boxed_func, bw_compiler=make_boxed_func,
                                 partition_fn=SACPartitioner())
        _model_grads(_DropoutModel("recompute_all", name="UsersOwnDrop"), users_own)
        torch._dynamo.reset()
        model = _DropoutModel("recompute_all", name="InferenceDrop")
        with torch.no_grad():
            torch.compile(model, backend="aot_eager")(torch.randn(4, 8))
        torch._dynamo.reset()
        for p in model.parameters():
            p.requires_grad_(False)
        torch.compile(model, backend="aot_eager")(torch.randn(4, 8))  # no tangents: no split
    assert not tagging.partitioned_by_us()
    with torch._inductor.config.patch(custom_partitioner_fn=SACPartitioner()):
        assert tagging.partitioned_by_us()
    with tagging.sac_partitioning():
        assert tagging.partitioned_by_us()


@pytest.mark.slow
def test_plain_inductor_region_with_dropout_warns_and_matches():
    with torch._inductor.config.patch(fallback_random=True):
        ref = _model_grads(_DropoutModel(), "inductor")
        torch._dynamo.reset()
        with pytest.warns(UserWarning, match="region 'InductorDrop'"):
            got = _model_grads(_DropoutModel("recompute_all", name="InductorDrop"), "inductor")
    _same(ref, got)


# -- 3. mutation around a compiled region --------------------------------------------------------

def _block_a(h, w):
    return (h * 2.0) @ w


def _caller_a(block):
    def f(x, w):
        h = x * 1
        h += block(h, w)
        return h
    return f


@pytest.mark.parametrize("where", ["whole", "region"])
def test_in_place_add_of_a_region_output_to_its_input(where):
    block = sac_region("recompute_all", name=f"BlockA_{where}")(_block_a)
    x, w = _xw()
    ref = _grads(_caller_a(_block_a), x, w)
    if where == "whole":
        fn = torch.compile(_caller_a(block), backend=_aot_eager())
    else:
        fn = _caller_a(torch.compile(block, backend=_aot_eager()))
    _same(ref, _grads(fn, x, w))


def _region_b(body, policy, name):
    return sac_region(policy, name=name)(body)


def _mutating_caller(region, mutate):
    def f(x, w):
        h, s = region(x, w)
        mutate(h)
        return h + s
    return f


_MUTATIONS = {"mul_": lambda h: h.mul_(2), "slice_mul_": lambda h: h[:, :3].mul_(2)}


def _b_sin(x, w):
    h = x @ w
    return h, h.sin()


def _b_relu(x, w):
    h = x @ w
    return h, (h * 3).relu()


@pytest.mark.filterwarnings("ignore:Error detected in SinBackward0")
@pytest.mark.parametrize("mutation", list(_MUTATIONS))
@pytest.mark.parametrize("where", ["whole", "region"])
def test_caller_mutates_a_saved_region_output_that_backward_needs(mutation, where):
    """h = x @ w, saved by save_matmuls, returned and read by sin inside the region; the
    caller mutates h. Autograd without checkpointing refuses (sin saved h): so does the
    compiled region (autograd's version check, at trace time when the whole model is
    compiled)."""
    mutate = _MUTATIONS[mutation]
    region = _region_b(_b_sin, policies.save_matmuls, f"BSin_{mutation}_{where}")
    x, w = _xw()
    assert isinstance(_grads(_mutating_caller(_b_sin, mutate), x, w), RuntimeError)
    if where == "whole":
        fn = torch.compile(_mutating_caller(region, mutate), backend=_aot_eager())
    else:
        fn = _mutating_caller(torch.compile(region, backend=_aot_eager()), mutate)
    err = _grads(fn, x, w)
    assert isinstance(err, RuntimeError) and "modified by an inplace operation" in str(err)


@pytest.mark.parametrize("mutation", list(_MUTATIONS))
@pytest.mark.parametrize("where", ["whole", "region"])
@pytest.mark.parametrize("policy", ["save_matmuls", "must_recompute"])
def test_caller_mutates_a_saved_region_output_backward_does_not_need(policy, mutation, where):
    """Same, but the region reads h through (h * 3).relu(), whose backward needs relu's
    output, not h: autograd without checkpointing is fine, and so is the compiled region
    (it never recomputes relu from the mutated h)."""
    mutate = _MUTATIONS[mutation]
    region = _region_b(_b_relu, POLICIES[policy], f"BRelu_{policy}_{mutation}_{where}")
    x, w = _xw()
    ref = _grads(_mutating_caller(_b_relu, mutate), x, w)
    if where == "whole":
        fn = torch.compile(_mutating_caller(region, mutate), backend=_aot_eager())
    else:
        fn = _mutating_caller(torch.compile(region, backend=_aot_eager()), mutate)
    _same(ref, _grads(fn, x, w))


class _ParamModel(nn.Module):
    """``forward`` calls ``region(x, self.w)``: a region compiled alone, or anything."""

    def __init__(self, region):
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(4, 4))
        self.region = region

    def forward(self, x):
        return self.region(x, self.w)


def _update_then_backward(model, fn):
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
    out = fn(x)
    with torch.no_grad():
        model.w.add_(1.0)  # an optimizer step between forward and backward
    try:
        out.pow(2).sum().backward()
    except Exception as e:  # noqa: BLE001
        return e
    return [x.grad, model.w.grad]


def _uses_w_in_backward(x, w):
    return (x @ w).sin() @ w


def _reads_w_only_in_forward(x, w):
    return (x + w).sin() * 2


@pytest.mark.parametrize("policy", ["recompute_all", "save_matmuls"])
@pytest.mark.parametrize("where", ["whole", "region"])
@pytest.mark.parametrize("body", [_uses_w_in_backward, _reads_w_only_in_forward],
                         ids=lambda f: f.__name__.lstrip("_"))
def test_parameter_updated_in_place_between_forward_and_backward(body, where, policy):
    """Autograd without checkpointing refuses the first body (mm saved w): so does the
    compiled region. The second is fine without checkpointing (sin saved x + w), and
    compiled: the cut keeps x + w rather than recomputing it from the updated w."""
    plain = _ParamModel(body)
    ref = _update_then_backward(plain, plain)
    refuses = body is _uses_w_in_backward
    assert isinstance(ref, RuntimeError) == refuses
    region = sac_region(POLICIES[policy], name=f"Param_{body.__name__}_{policy}_{where}")(body)
    if where == "whole":
        model = _ParamModel(region)
        fn = torch.compile(model, backend=_aot_eager())
    else:
        model = fn = _ParamModel(torch.compile(region, backend=_aot_eager()))
    got = _update_then_backward(model, fn)
    if refuses:
        assert isinstance(got, RuntimeError) and "inplace" in str(got), repr(got)
    else:
        _same(ref, got)


# -- 4. list mutation and rrelu inside a region ------------------------------------------------

def _foreach_on_input(x, w):
    a = (x * 2).sin()           # reads x; its backward needs x * 2, not x
    torch._foreach_add_([x], 1.0)
    return a * x


def _foreach_on_input_mm(x, w):
    a = (x @ w).sin()           # mm saves x: eager autograd refuses the mutation
    torch._foreach_add_([x], 1.0)
    return a * x


def _foreach_on_saved(x, w):
    h = x @ w                   # saved by save_matmuls
    a = (h * 2).relu()
    torch._foreach_mul_([h], 3.0)
    return a + h


def _foreach_on_saved_sin(x, w):
    h = x @ w
    a = h.sin()                 # sin saves h: eager autograd refuses the mutation
    torch._foreach_add_([h], 1.0)
    return a * h


def _rrelu(x, w):
    return (F.rrelu(x @ w, training=True) * 2).sin()


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("body", [_foreach_on_input, _foreach_on_input_mm, _foreach_on_saved,
                                  _foreach_on_saved_sin, _rrelu],
                         ids=lambda f: f.__name__.lstrip("_"))
def test_list_mutation_and_rrelu_in_a_region(body, policy):
    def caller(fn):
        return lambda x, w: fn(x * 1, w)  # the region's input x is not a leaf

    x, w = _xw()
    ref = _grads(caller(body), x, w)
    if isinstance(ref, Exception):
        # Eager autograd refuses; compiled without regions it is a functional program:
        # the same program without checkpointing is the compiled one.
        ref = _grads(torch.compile(caller(body), backend="aot_eager"), x, w)
        torch._dynamo.reset()
    region = sac_region(POLICIES[policy], name=f"{body.__name__}_{policy}")(body)
    _same(ref, _grads(torch.compile(caller(region), backend=_aot_eager()), x, w))
