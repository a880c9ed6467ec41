"""CPU offload under compile (issue 12): torch's activation-offloading pass on the split graphs.

Graph-level tests trace on the "meta" device (a non-CPU device without hardware): the
partitioner's graphs are captured and only the forward runs (ao.reload needs an
accelerator). On the CPU an offload is a plain save, and gradients are checked end to end.
"""
from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from fixtures.capture import capturing_backend
from fixtures.models import grads_of, loss_fn, make_model, max_grad_diff, reference_grads
from sac_compile import CheckpointError, CheckpointPolicy as CP, policies, sac_region
from sac_compile.compiler import SACPartitioner

aten = torch.ops.aten

# torch's async offload ops (torch.ops.ao.offload/reload/wait_tensor) first shipped in 2.12;
# an older torch refuses CPU offload under compile (test_missing_offload_pass_under_compile).
needs_offload_ops = pytest.mark.skipif(
    importlib.util.find_spec("torch._functorch._activation_offloading.offload_ops") is None,
    reason=f"CPU offload under compile needs torch >= 2.12 (torch.ops.ao); this is torch "
           f"{torch.__version__}")


def _meta_mlp(policy):
    model, (x,) = make_model("mlp", size="test", device="meta")
    for block in model.blocks:
        sac_region(policy)(block)
    return model, x


def _ops(gm, name):
    packet = getattr(torch.ops.ao, name, None)  # none before torch 2.12, nor such a node
    if packet is None:
        return []
    target = packet.default
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


@pytest.fixture(autouse=True)
def fresh_offload_runtime_state():
    """torch's offload ops keep process-wide state (transfer streams, pending waits, a
    pinned-buffer pool); a run on the meta device leaves entries a later test would reuse."""
    try:
        from torch._functorch._activation_offloading import offload_ops as ops
    except ImportError:  # torch < 2.12: no offload ops, no state to clear
        yield
        return
    for clear in (ops._transfer_streams.clear, ops._clear_wait_registry, ops._pool_clear):
        clear()
    yield


def _compile_and_run_on_meta(fn, backend, *args):
    """Compile ``fn`` (the backend captures the split graphs) and run it on the meta device.
    torch's offload op copies into a pinned CPU buffer, which a meta tensor cannot do once
    torch's transfer state exists (the second such run in a process): the graphs are
    captured by then, and they are what these tests check."""
    try:
        return torch.compile(fn, backend=backend)(*args)
    except NotImplementedError as e:
        if "meta tensor" not in str(e):
            raise
        return None


@needs_offload_ops
def test_offload_and_reload_placement_on_a_device():
    pytest.importorskip("torch._functorch._activation_offloading.activation_offloading")
    model, x = _meta_mlp(policies.offload_ops(aten.addmm))
    backend, cap = capturing_backend()
    _compile_and_run_on_meta(model, backend, x)  # forward only: reload needs an accelerator
    fw, bw, report = cap.fw, cap.bw, cap.report
    offloads = _ops(fw, "offload")
    reloads = _ops(bw, "reload")
    rows = {r.name: r for r in report.saved}
    offloaded = [r for r in report.saved if "offloaded to the CPU" in r.reason]
    # Per block: fc1's addmm (gelu's backward reads it) and, standing in for fc2's addmm,
    # the residual add that the cut keeps instead (LayerNorm's backward reads it).
    assert len(offloads) == len(reloads) == len(offloaded) == 4, report
    assert rows["addmm"].reason.startswith("MUST_CPU_OFFLOAD by policy in region 'MLPBlock'")
    assert rows["add"].reason.startswith("stands in for addmm_1 (aten.addmm.default: "
                                         "MUST_CPU_OFFLOAD by policy in region 'MLPBlock'")
    assert any("CPU offload: 4 values" in n for n in report.notes), report.notes

    order = {n: i for i, n in enumerate(fw.graph.nodes)}
    out = fw.graph.find_nodes(op="output")[0]
    for off in offloads:
        value = off.args[0]
        assert off.meta["val"].device.type == "cpu"
        # after the value's last forward use (the wait that keeps it alive aside)
        uses = [u for u in value.users if u is not off and u is not out
                and u.target is not torch.ops.ao.wait_tensor.default]
        assert uses and all(order[u] < order[off] for u in uses), (off, uses)
        # the forward hands the CPU copy (after its wait) to the backward, not the value
        assert value not in out.args[0][1:] or value in out.args[0][:1]
    border = {n: i for i, n in enumerate(bw.graph.nodes)}
    for rel in reloads:
        placeholder = rel.args[0]
        assert placeholder.op == "placeholder" and placeholder.meta["val"].device.type == "cpu"
        assert rel.args[1] == torch.device("meta")
        (wait,) = [u for u in rel.users if u.target is torch.ops.ao.wait_tensor.default]
        # before the value's first backward use
        assert wait.users and all(border[wait] < border[u] for u in wait.users)
        assert set(placeholder.users) == {rel, wait}


def _noncontiguous_block(policy):
    @sac_region(policy, name="T")
    def block(x):
        y = x.t() * 2          # a pointwise op on a transpose: a non-contiguous output
        return y.sin()         # sin's backward reads y
    return block


def _noncontiguous_split(decision):
    """A thunk compiling the non-contiguous block with ``decision`` on its ``mul`` (on the
    meta device), and what the split captures."""
    pytest.importorskip("torch._functorch._activation_offloading.activation_offloading")
    torch._dynamo.reset()
    block = _noncontiguous_block(
        lambda ctx, op, *a, **k: decision if op is aten.mul.Tensor else None)
    backend, cap = capturing_backend()
    x = torch.randn(4, 8, device="meta", requires_grad=True)
    return (lambda: torch.compile(block, backend=backend)(x)), cap


@needs_offload_ops
def test_must_offload_of_a_value_torch_refuses_is_an_error():
    run, _ = _noncontiguous_split(CP.MUST_CPU_OFFLOAD)
    with pytest.raises(CheckpointError) as info:
        run()
    msg = str(info.value)
    assert "MUST_CPU_OFFLOAD of aten.mul.Tensor" in msg and "in region 'T'" in msg, msg
    assert "not contiguous" in msg and "PREFER_CPU_OFFLOAD" in msg, msg


@needs_offload_ops
def test_prefer_offload_of_a_value_torch_refuses_stays_on_the_device():
    run, cap = _noncontiguous_split(CP.PREFER_CPU_OFFLOAD)
    run()
    (row,) = [r for r in cap.report.saved if r.op == "aten.mul.Tensor"]
    assert row.reason == ("PREFER_CPU_OFFLOAD by policy in region 'T' (kept on the device "
                          "under compile: it is not contiguous (torch's offload pass refuses "
                          "non-contiguous values))"), row.reason
    assert not _ops(cap.fw, "offload")
    assert any("1 values decided for CPU offload kept on the device" in n
               for n in cap.report.notes), cap.report.notes


def test_offload_on_the_cpu_is_a_plain_save_with_exact_gradients(capture):
    ref_model, ref_inputs = make_model("mlp", size="test", seed=0)
    ref = reference_grads(ref_model, ref_inputs, seed=0)
    model, inputs = make_model("mlp", size="test", seed=0)
    for block in model.blocks:
        sac_region(policies.offload_ops(aten.addmm))(block)
    compiled = torch.compile(model, backend=capture.backend())
    loss_fn(compiled(*inputs)).backward()
    assert max_grad_diff(ref, grads_of(model, inputs)) <= 1e-6
    (report,) = capture.reports
    rows = {r.name: r.reason for r in report.saved}
    assert rows["addmm"] == ("MUST_CPU_OFFLOAD by policy in region 'MLPBlock' (the value is on "
                             "the CPU: CPU offload is a plain save)"), rows
    assert "stands in for addmm_1" in rows["add"] and "plain save" in rows["add"]


def test_a_torch_without_the_offload_pass_is_named(monkeypatch):
    from sac_compile.compiler import offload
    monkeypatch.setattr(offload, "_API", [])
    monkeypatch.setitem(sys.modules,
                        "torch._functorch._activation_offloading.activation_offloading", None)
    with pytest.raises(offload.TorchAPIMissing) as info:
        offload.torch_api()
    msg = str(info.value)
    assert "torch._functorch._activation_offloading.activation_offloading" in msg
    assert "MUST_SAVE" in msg and "upgrade torch" in msg


def test_missing_offload_pass_under_compile(monkeypatch):
    """MUST_CPU_OFFLOAD on a device value with no torch offload pass: a CheckpointError
    saying so; the same with PREFER: kept on the device, the reason in the report."""
    from sac_compile.compiler import offload
    monkeypatch.setattr(offload, "_API", [])
    monkeypatch.setitem(sys.modules,
                        "torch._functorch._activation_offloading.activation_offloading", None)
    model, x = _meta_mlp(policies.offload_ops(aten.addmm))
    backend, _ = capturing_backend()
    with pytest.raises(CheckpointError, match="lacks torch._functorch._activation_offloading"):
        torch.compile(model, backend=backend)(x)
    torch._dynamo.reset()
    model, x = _meta_mlp(policies.relaxed(policies.offload_ops(aten.addmm)))
    backend, cap = capturing_backend()
    torch.compile(model, backend=backend)(x)
    row = next(r for r in cap.report.saved if r.name == "addmm")
    assert row.reason.startswith("PREFER_CPU_OFFLOAD") and "lacks" in row.reason, row.reason


@needs_offload_ops
def test_a_saved_view_of_an_offloaded_value_offloads_the_value():
    pytest.importorskip("torch._functorch._activation_offloading.activation_offloading")

    @sac_region(policies.offload_ops(aten.mm), name="V")
    def block(x, w):
        return (x @ w).view(-1).sin()  # sin's backward reads the view

    backend, cap = capturing_backend()
    x = torch.randn(4, 8, device="meta", requires_grad=True)
    w = torch.randn(8, 8, device="meta", requires_grad=True)
    _compile_and_run_on_meta(block, backend, x, w)  # no CheckpointError: mm is offloaded
    (offload,) = _ops(cap.fw, "offload")
    assert offload.args[0].target is aten.mm.default
    (row,) = [r for r in cap.report.saved if not r.is_input]
    assert row.op == "aten.mm.default" and "offloaded to the CPU" in row.reason, row


@needs_offload_ops
def test_offload_options_are_the_same_for_every_compile():
    """torch's config.patch leaves a flag marked overridden after restoring it; the second
    compile in a process must still take the asynchronous path (it took the synchronous
    one, prims.device_put)."""
    from sac_compile.compiler import offload
    first = offload.offload_options()
    with offload.torch_api().functorch_config.patch(first):
        pass
    assert offload.offload_options() == first
    assert first["activation_offload_separate_stream"] is True


# -- a storage decision on a view op applies to its base --------------------------------

VIEWS = {"view": (aten.view.default, lambda h: h.view(-1)),
         "transpose": (aten.transpose.int, lambda h: h.transpose(0, 1)),
         "t": (aten.t.default, lambda h: h.t())}


def _deciding(op, opinion):
    return lambda ctx, o, *a, **k: opinion if o is op else None


@pytest.mark.parametrize("kind", sorted(VIEWS))
@needs_offload_ops
def test_must_offload_of_a_view_offloads_its_base(kind):
    """MUST_CPU_OFFLOAD for a view op: the view shares its base's storage, so the base (a
    matmul the policy says nothing about) is what leaves the device."""
    pytest.importorskip("torch._functorch._activation_offloading.activation_offloading")
    op, view = VIEWS[kind]

    @sac_region(_deciding(op, CP.MUST_CPU_OFFLOAD), name="V")
    def block(x, w):
        return view(x @ w).sin()  # sin's backward reads the view

    backend, cap = capturing_backend()
    x = torch.randn(4, 8, device="meta", requires_grad=True)
    w = torch.randn(8, 8, device="meta", requires_grad=True)
    _compile_and_run_on_meta(block, backend, x, w)
    (offload,) = _ops(cap.fw, "offload")
    assert offload.args[0].target is aten.mm.default
    assert len(_ops(cap.bw, "reload")) == 1
    (row,) = [r for r in cap.report.saved if not r.is_input]
    assert row.op == "aten.mm.default", row
    assert row.reason.startswith(f"MUST_CPU_OFFLOAD by policy on its view {op} ") and \
        "in region 'V'" in row.reason and "offloaded to the CPU" in row.reason, row.reason


def test_prefer_offload_of_a_view_offloads_its_base_when_kept():
    pytest.importorskip("torch._functorch._activation_offloading.activation_offloading")

    @sac_region(lambda ctx, op, *a, **k: CP.PREFER_CPU_OFFLOAD if op is aten.t.default else
                (CP.MUST_SAVE if op is aten.mm.default else None), name="V")
    def block(x, w):
        return (x @ w).t().sin()

    backend, cap = capturing_backend()
    x = torch.randn(4, 8, device="meta", requires_grad=True)
    w = torch.randn(8, 8, device="meta", requires_grad=True)
    # mm is MUST_SAVE: the view's PREFER does not beat it, mm stays on the device
    _compile_and_run_on_meta(block, backend, x, w)
    assert not _ops(cap.fw, "offload")
    (row,) = [r for r in cap.report.saved if not r.is_input]
    assert row.op == "aten.mm.default" and row.reason.startswith("MUST_SAVE by policy"), row


@pytest.mark.parametrize("case", ["input", "conflict"])
def test_must_offload_of_a_view_its_base_cannot_take_is_an_error(case):
    """A view of an input (its base cannot be offloaded by the compiled graph), or of a
    value whose own MUST differs: a CheckpointError naming the view's op, region and fix,
    never a silent drop."""
    if case == "input":
        policy = _deciding(aten.t.default, CP.MUST_CPU_OFFLOAD)

        @sac_region(policy, name="V")
        def block(x, w):
            return (x.t() @ w).sin()  # mm's backward reads x.t()
    else:
        def policy(ctx, op, *a, **k):
            return {aten.t.default: CP.MUST_CPU_OFFLOAD, aten.mm.default: CP.MUST_SAVE}.get(op)

        @sac_region(policy, name="V")
        def block(x, w):
            return (w @ x).t().sin()  # mm is MUST_SAVE, its view MUST_CPU_OFFLOAD

    backend, _ = capturing_backend()
    x = torch.randn(8, 4, device="meta", requires_grad=True)
    w = torch.randn(8, 8, device="meta", requires_grad=True)
    with pytest.raises(CheckpointError) as info:
        torch.compile(block, backend=backend)(x, w)
    msg = str(info.value)
    assert "MUST_CPU_OFFLOAD of aten.t.default (t) in region 'V' cannot be honoured" in msg, msg
    assert "shares its base's storage" in msg and "To fix" in msg, msg
    if case == "input":
        assert "an input, a parameter or a value from outside every region" in msg, msg
    else:
        assert "aten.mm.default, MUST_SAVE by policy in region 'V'" in msg, msg
    # On the CPU an offload is a plain save: nothing to carry, nothing to refuse
    torch._dynamo.reset()
    cpu = [torch.randn(8, 4, requires_grad=True), torch.randn(8, 8, requires_grad=True)]
    backend, cap = capturing_backend()
    torch.compile(block, backend=backend)(*cpu).sum().backward()
    assert not _ops(cap.fw, "offload")


def test_must_offload_of_a_multi_output_view_on_the_cpu_is_a_plain_save(capture):
    """Found by the fuzzer (seed 0): MUST_CPU_OFFLOAD for split (a view with a list of
    outputs) of a region input, on the CPU. The check that an offload on the CPU is a plain
    save read only a single tensor: a split raised "cannot be honoured" (its base is an
    input) where eager saves it. Now both modes save it; gradients equal plain autograd's."""
    @sac_region(_deciding(aten.split.Tensor, CP.MUST_CPU_OFFLOAD), name="S")
    def block(x):
        return torch.cat(x.split(3, -1)[::-1], -1).sin()

    def grad(fn):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0), requires_grad=True)
        fn(x).sum().backward()
        return x.grad

    expected = grad(lambda x: torch.cat(x.split(3, -1)[::-1], -1).sin())
    assert torch.equal(grad(block), expected)
    got = grad(torch.compile(block, backend=capture.backend()))
    torch.testing.assert_close(got, expected)
    assert not _ops(capture.fw, "offload")


def _wait_positions(fw):
    """Each offload's wait: how many forward ops run after it (0: at the graph's end)."""
    nodes = [n for n in fw.graph.nodes if n.op == "call_function"]
    order = {n: i for i, n in enumerate(nodes)}
    waits = [u for off in _ops(fw, "offload") for u in off.users
             if u.target is torch.ops.ao.wait_tensor.default]
    return [len(nodes) - 1 - order[w] for w in waits]


@needs_offload_ops
def test_offloaded_values_leave_the_device_as_they_go_unless_asked_to_sink_the_waits():
    """By default a value's offload wait stays next to it, so the device copy is freed as
    the forward goes (sunk to the end, every offloaded value would stay on the device until
    the forward ends: no peak saved). SACPartitioner(offload_options=...) sets torch's flags
    per partitioner, either way."""
    pytest.importorskip("torch._functorch._activation_offloading.activation_offloading")
    positions = {}
    for sink in (None, True):
        torch._dynamo.reset()
        model, x = _meta_mlp(policies.offload_ops(aten.addmm))
        options = {} if sink is None else {"activation_offload_sink_wait": True}
        backend, cap = capturing_backend(offload_options=options)
        _compile_and_run_on_meta(model, backend, x)
        positions[sink] = _wait_positions(cap.fw)
    assert positions[None] and min(positions[None]) > 0      # waits inside the forward
    assert max(positions[True]) < len(positions[True]) + 2   # all gathered at the end
    with pytest.raises(ValueError, match="unknown flags"):
        SACPartitioner(offload_options={"sink_wait": True})
