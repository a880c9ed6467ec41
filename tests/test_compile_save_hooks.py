"""SaveWithHooks under compile (issue 12): pack/unpack traced into the split graphs."""
from __future__ import annotations

import pytest
import torch

from fixtures.capture import capturing_backend as _capturing
from fixtures.models import grads_of, loss_fn, make_model, reference_grads
from sac_compile import CheckpointError, SaveWithHooks, sac_region
from sac_compile.compiler import make_backend

aten = torch.ops.aten

# Before torch 2.12 Dynamo cannot hand a policy object to an assume_constant_result
# function: untraceable hooks are not found before tracing, the partitioner raises instead.
needs_hooks_fallback = pytest.mark.skipif(
    torch.torch_version.TorchVersion(torch.__version__) < (2, 12),
    reason=f"the eager fallback for untraceable hooks needs torch >= 2.12; this is torch "
           f"{torch.__version__}")

MATMULS = {aten.mm.default, aten.addmm.default}


def to_bf16(t):
    return t.to(torch.bfloat16)


def from_bf16(t):
    return t.to(torch.float32)


def quantize_int8(t):
    scale = t.abs().amax().clamp(min=1e-12) / 127
    return torch.round(t / scale).to(torch.int8), scale


def dequantize_int8(packed):
    q, scale = packed
    return q.to(torch.float32) * scale


class Counting:
    """Hooks that record what they pack (shape, dtype): once per saved tensor in eager mode,
    once per traced pack under compile."""

    def __init__(self, pack, unpack):
        self.packed = []
        self.hooks = SaveWithHooks(self._pack, unpack)
        self._inner = pack

    def _pack(self, t):
        self.packed.append((tuple(t.shape), t.dtype))
        return self._inner(t)


def _policy(hooks):
    return lambda ctx, op, *args, **kwargs: hooks if op in MATMULS else None


def _mlp(hooks, seed=0):
    model, inputs = make_model("mlp", size="test", seed=seed)
    for block in model.blocks:
        sac_region(_policy(hooks), name="MLPBlock")(block)
    return model, inputs


def _eager_grads(hooks):
    model, inputs = _mlp(hooks)
    loss_fn(model(*inputs)).backward()
    return grads_of(model, inputs)


def _rel_diff(a, b):
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-6)).item() for k in b)


def test_the_same_values_are_packed_in_both_modes():
    eager = Counting(to_bf16, from_bf16)
    _eager_grads(eager.hooks)
    compiled = Counting(to_bf16, from_bf16)
    model, inputs = _mlp(compiled.hooks)
    backend, cap = _capturing()
    loss_fn(torch.compile(model, backend=backend)(*inputs)).backward()
    fw, bw = cap["fw"], cap["bw"]
    # the forward returns packed values: one pack (a bf16 cast) per value eager packed
    out = fw.graph.find_nodes(op="output")[0].args[0]
    packs = [n for n in out if isinstance(n, torch.fx.Node) and n.name.startswith("sac_pack_")]
    unpacks = [n for n in bw.graph.nodes if n.name.startswith("sac_unpack_")]
    assert len(eager.packed) == len(packs) == len(unpacks) == 4
    # pack is traced once per value layout (its Python runs once per layout, per split)
    from sac_compile.compiler.save_hooks import PROBE_SHAPE  # traceability tried on it first
    traced = [p for p in compiled.packed if p != (PROBE_SHAPE, torch.float32)]
    assert sorted(set(eager.packed), key=str) == sorted(traced, key=str)
    assert all(n.meta["val"].dtype == torch.bfloat16 for n in packs)
    # pack after the value's last forward use; unpack before its first backward use
    order = {n: i for i, n in enumerate(fw.graph.nodes)}
    for p in packs:
        value = p.args[0]
        assert all(order[u] <= order[p] for u in value.users if u.op != "output")
    border = {n: i for i, n in enumerate(bw.graph.nodes)}
    for u in unpacks:
        assert u.args[0].op == "placeholder" and u.args[0].meta["val"].dtype == torch.bfloat16
        assert all(border[u] < border[user] for user in u.users)


def test_gradients_agree_with_eager_hooks_and_report_packed_bytes(capture):
    hooks = SaveWithHooks(to_bf16, from_bf16)
    eager = _eager_grads(hooks)
    model, inputs = _mlp(hooks)
    ref = reference_grads(*make_model("mlp", size="test", seed=0), seed=0)
    compiled = torch.compile(model, backend=capture.backend())
    loss_fn(compiled(*inputs)).backward()
    got = grads_of(model, inputs)
    # bf16 keeps 8 bits of mantissa: both modes round the saved values, a little differently
    assert _rel_diff(got, eager) <= 2e-2
    assert _rel_diff(got, ref) <= 2e-2
    assert _rel_diff(got, ref) > 0  # the hooks ran: the values were rounded
    (report,) = capture.reports
    packed = [r for r in report.saved if "packed by SaveWithHooks(to_bf16, from_bf16)" in r.reason]
    assert len(packed) == 4
    # The cut costs a hooked value at its packed bytes: it keeps the four decided matmul
    # outputs themselves (before that cost it kept a later value of addmm_1's size in its place)
    assert all(r.reason.startswith("SaveWithHooks by policy in region 'MLPBlock'")
               for r in packed)
    assert sorted(r.name for r in packed) == ["addmm", "addmm_1", "addmm_2", "addmm_3"]
    # the report's bytes are the packed bytes: half of fp32
    assert "(1 KiB -> 512 B)" in packed[0].reason and packed[0].nbytes == 512
    assert any("SaveWithHooks: 4 values packed in the compiled graphs, 2.5 KiB -> 1.2 KiB" in n
               for n in report.notes), report.notes


def test_int8_hooks_with_a_scale():
    hooks = SaveWithHooks(quantize_int8, dequantize_int8)
    eager = _eager_grads(hooks)
    model, inputs = _mlp(hooks)
    backend, cap = _capturing()
    loss_fn(torch.compile(model, backend=backend)(*inputs)).backward()
    got = grads_of(model, inputs)
    assert _rel_diff(got, eager) <= 5e-2
    (report,) = cap["reports"]
    rows = [r for r in report.saved if "packed by" in r.reason]
    # 1 KiB fp32 -> 256 B of int8 + a 4 B scale
    assert rows[0].nbytes == 260, rows[0]
    placeholders = [n.name for n in cap["bw"].graph.find_nodes(op="placeholder")]
    assert "addmm_packed" in placeholders and "addmm_packed_1" in placeholders


def _data_dependent(t):
    return t.to(torch.bfloat16) if t.abs().max() > 1 else t


UNTRACEABLE_CASES = {
    "data_dependent": (lambda: SaveWithHooks(_data_dependent, lambda p: p.float()),
                       "could not be traced"),
    "non_tensor": (lambda: SaveWithHooks(lambda t: (to_bf16(t), "bf16"),
                                         lambda p: from_bf16(p[0])), "non-tensor values (str)"),
    "in_place": (lambda: SaveWithHooks(lambda t: t.mul_(1), lambda p: p), "in place"),
    "wrong_unpack": (lambda: SaveWithHooks(to_bf16, lambda p: p), "expected the saved value's"),
}


def _hooked_block(policy, name="Blk"):
    torch._dynamo.reset()

    @sac_region(policy, name=name)
    def block(x, w):
        return (x @ w).sin()

    fn = torch.compile(lambda x, w: block(x, w).sum(), backend=make_backend(compiler="aot_eager"))
    fn.block = block
    return fn, torch.randn(4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)


@pytest.mark.parametrize("case", ["data_dependent", "non_tensor", "in_place"])
@needs_hooks_fallback
def test_untraceable_hooks_run_the_region_eagerly_with_a_warning(case):
    make, why = UNTRACEABLE_CASES[case]
    fn, x, w = _hooked_block(_policy(make()), name=f"Blk_{case}")  # warned once per name
    with pytest.warns(UserWarning, match="runs through the eager runtime") as record:
        fn(x, w).backward()
    assert any(why in str(r.message) and f"'Blk_{case}'" in str(r.message) for r in record)
    ref_x, ref_w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    fn.block(ref_x, ref_w).sum().backward()  # the region run eagerly, with the same hooks
    assert torch.equal(w.grad, ref_w.grad) and torch.equal(x.grad, ref_x.grad)


@needs_hooks_fallback
def test_hooks_that_return_a_wrong_value_are_an_error_in_the_eager_fallback():
    make, _ = UNTRACEABLE_CASES["wrong_unpack"]
    fn, x, w = _hooked_block(_policy(make()), name="Blk_wrong")
    with pytest.raises(CheckpointError, match="unpack for aten.mm.default .*region 'Blk_wrong'"), \
            pytest.warns(UserWarning, match="expected the saved value's"):
        fn(x, w).backward()


@pytest.mark.parametrize("case", ["data_dependent", "non_tensor", "in_place", "wrong_unpack"])
def test_untraceable_hooks_the_policy_builds_per_call_are_an_error(case):
    """Hooks made inside the policy call cannot be seen before tracing: the partitioner
    finds them untraceable and raises, naming the op, the region and the fix."""
    make, why = UNTRACEABLE_CASES[case]

    def policy(ctx, op, *args, **kwargs):
        return make() if op in MATMULS else None

    fn, x, w = _hooked_block(policy)
    with pytest.raises(CheckpointError) as info:
        fn(x, w).backward()
    msg = str(info.value)
    assert "on aten.mm.default" in msg and "in region 'Blk'" in msg, msg
    assert "To fix: write pack/unpack as torch code" in msg, msg
    assert why in msg, msg


@pytest.mark.slow
def test_inductor_gradients_agree_with_eager_hooks():
    hooks = SaveWithHooks(to_bf16, from_bf16)
    eager = _eager_grads(hooks)
    model, inputs = _mlp(hooks)
    reports = []
    compiled = torch.compile(model, backend=make_backend(on_partition=reports.append))
    loss_fn(compiled(*inputs)).backward()
    assert _rel_diff(grads_of(model, inputs), eager) <= 2e-2
    assert any("4 values packed" in n for n in reports[0].notes)


def test_an_in_place_change_of_a_region_input_after_the_forward_raises_as_autograd_does():
    """Around the region: the input the packed matmul reads is changed before backward.
    The compiled split keeps that input (hooks pack only the matmul's output): autograd's
    version check raises, as without checkpointing - never a silently wrong gradient."""
    hooks = SaveWithHooks(to_bf16, from_bf16)

    @sac_region(lambda ctx, op, *a, **k: hooks if op is torch.ops.aten.mm.default else None,
                name="H")
    def block(x, w):
        return (x @ w).sin() @ w

    f = torch.compile(block, backend=make_backend(compiler="aot_eager"))
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(16, 16, requires_grad=True)
    h = x * 1
    out = f(h, w)
    h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def _scale_pack(t):
    s = t.abs().max().item()  # a Python number from the tensor's values: not traceable
    return (t / s).to(torch.bfloat16), torch.tensor(s)


def _scale_unpack(packed):
    q, s = packed
    return q.to(torch.float32) * s


UNTRACEABLE = SaveWithHooks(_scale_pack, _scale_unpack)


def _untraceable_policy(ctx, op, *args, **kwargs):
    return UNTRACEABLE if op in MATMULS else None


@needs_hooks_fallback
def test_hooks_that_cannot_be_traced_run_the_region_through_the_eager_runtime():
    """Never silently ignored, never a failed compile: the region falls back to the eager
    runtime (its hooks run as Python), with one warning naming the hooks and why."""

    def build():
        model, inputs = make_model("mlp", size="test", seed=0)
        for block in model.blocks:
            sac_region(_untraceable_policy, name="Untraceable")(block)
        return model, inputs

    model, inputs = build()
    loss_fn(model(*inputs)).backward()
    eager = grads_of(model, inputs)
    model, inputs = build()
    compiled = torch.compile(model, backend=make_backend(compiler="aot_eager"))
    with pytest.warns(UserWarning, match=r"_scale_pack could not be traced .* runs through "
                                         r"the eager runtime"):
        loss_fn(compiled(*inputs)).backward()
    got = grads_of(model, inputs)
    assert _rel_diff(got, eager) == 0
