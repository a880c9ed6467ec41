"""Our regions under torch.compile: nesting, tag/name, conflicts, graph breaks, and
eager/compile parity of MUST decisions."""
from __future__ import annotations

import logging
import re

import pytest
import torch

from fixtures.models import grads_of, loss_fn, make_model, max_grad_diff, reference_grads
from sac_compile import CheckpointError
from sac_compile import CheckpointPolicy as CP
from sac_compile import checkpoint, name, policies, sac_region, tag
from sac_compile.compiler import make_backend
from sac_compile.explaining import explain

aten = torch.ops.aten


def _xw(n=8):
    torch.manual_seed(0)
    return torch.randn(n, n, requires_grad=True), torch.randn(n, n, requires_grad=True)


def _save_mm(ctx, op, *args, **kwargs):
    return CP.MUST_SAVE if op is aten.mm.default else None


def _recompute_mm(ctx, op, *args, **kwargs):
    return CP.MUST_RECOMPUTE if op is aten.mm.default else None


def _prefer_recompute(ctx, op, *args, **kwargs):
    return CP.PREFER_RECOMPUTE


@sac_region(_prefer_recompute, name="Inner")
def _inner(x, w):
    return torch.relu(x @ w).sin()


@sac_region(_save_mm, name="Outer")
def _outer(x, w):
    return _inner(x, w).cos() @ w


def test_nested_outer_must_beats_inner_prefer(capture):
    x, w = _xw()
    fn = torch.compile(lambda x, w: _outer(x, w).sum(), fullgraph=True,
                       backend=capture.backend())
    fn(x, w).backward()
    got = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    (((x @ w).relu().sin().cos()) @ w).sum().backward()
    assert torch.allclose(got[0], x.grad) and torch.allclose(got[1], w.grad)
    # Both mm's are MUST_SAVE by the outer region although the inner policy prefers recompute:
    # none is recomputed.
    assert "aten.mm.default" not in capture.reports[0].recomputed


@sac_region(_recompute_mm, name="Inner2")
def _inner_conflict(x, w):
    return torch.relu(x @ w)


@sac_region(_save_mm, name="Outer2")
def _outer_conflict(x, w):
    return _inner_conflict(x, w) @ w


def test_conflicting_nested_musts_raise_the_same_error():
    x, w = _xw()
    with pytest.raises(CheckpointError) as eager_err:
        _outer_conflict(x, w).sum().backward()
    msg = str(eager_err.value)
    assert "Outer2" in msg and "Inner2" in msg
    fn = torch.compile(lambda x, w: _outer_conflict(x, w).sum(),
                       backend=make_backend(compiler="aot_eager"))
    with pytest.raises(CheckpointError, match=re.escape(msg)):
        fn(x, w)


@sac_region("recompute_all", name="T")
def _tagged(x, w):
    y = tag(torch.relu(x @ w), CP.MUST_SAVE)
    z = name(y.sin(), "z")
    return z @ w


def test_tag_and_name_compile_without_graph_breaks(capture):
    x, w = _xw()
    fn = torch.compile(lambda x, w: _tagged(x, w).sum(), fullgraph=True,
                       backend=capture.backend())
    fn(x, w).backward()
    reasons = {r.op: r.reason for r in capture.reports[0].saved}
    assert reasons["aten.relu.default"] == \
        "MUST_SAVE in region 'T' (beats PREFER_RECOMPUTE of policy in 'T')"
    assert capture.reports[0].recomputed == ["aten.sin.default"]


@sac_region(policies.save_only_these_names("keep"), name="Named")
def _named(x, w):
    y = name((x @ w).sin(), "keep")
    return y.cos() @ w


def test_name_reaches_name_based_policies():
    x, w = _xw()
    report = explain(lambda x, w: _named(x, w).sum(), x, w, mode="compile")
    assert {r.op: r.reason for r in report.saved}["aten.sin.default"] == \
        "MUST_SAVE by name in region 'Named'"


def test_checkpoint_call_with_op_list_policy_under_compile(capture):
    x, w = _xw()

    def f(x, w):
        return checkpoint(lambda a, b: torch.relu(a @ b).sin() @ b, x, w,
                          policy=[aten.mm.default]).sum()

    torch.compile(f, fullgraph=True, backend=capture.backend())(x, w).backward()
    assert "aten.mm.default" not in capture.reports[0].recomputed


def test_graph_break_in_region_falls_back_to_eager_runtime(caplog):
    calls = []

    @sac_region("save_matmuls", name="Breaks")
    def block(x, w):
        y = torch.relu(x @ w)
        calls.append(1)
        torch._dynamo.graph_break()
        return y.sin() @ w

    x, w = _xw()
    block(x, w).sum().backward()
    ref = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    calls.clear()
    fn = torch.compile(lambda x, w: block(x, w).sum(), backend=make_backend(compiler="aot_eager"))
    with caplog.at_level(logging.WARNING, logger="sac_compile"), \
            pytest.warns(UserWarning, match=r"region 'Breaks' graph-broke under "
                         r"torch\.compile.*use_cache=False") as warned:
        fn(x, w).backward()
        fn(x, w)
    # reported by default too (a UserWarning), once
    assert sum("'Breaks' graph-broke" in str(w_.message) for w_ in warned) == 1
    assert torch.allclose(x.grad, ref[0]) and torch.allclose(w.grad, ref[1])
    assert len(calls) == 2  # the user's Python ran once per call, never in backward
    # Logged once (two calls, each running the region through the eager runtime), saying
    # what happened and that the result is still right.
    warnings = [r.getMessage() for r in caplog.records if "Breaks" in r.getMessage()]
    assert warnings == ["sac_compile: region 'Breaks' graph-broke under torch.compile; it runs "
                        "through the eager runtime (correct, but not compiled)"], warnings


# -- eager/compile parity for MUST decisions ------------------------------------------------

def _all_must(ctx, op, *args, **kwargs):
    if op in policies.MATMUL_OPS:
        return CP.MUST_SAVE
    return CP.MUST_RECOMPUTE


def _view_like(op: str) -> bool:
    return (op.split(".") + [""])[1] in {"t", "view", "transpose", "detach", "expand", "permute",
                                "unsqueeze", "squeeze", "_unsafe_view", "alias", "slice",
                                "select", "reshape", "split", "as_strided"}


@pytest.mark.parametrize("model_name", ["mlp", "gpt"])
def test_eager_and_compile_agree_on_must_decisions(model_name):
    reports = {}
    for mode in ("eager", "compile"):
        model, inputs = make_model(model_name, size="test", seed=0)
        for block in model.blocks:
            sac_region(_all_must)(block)
        torch.manual_seed(0)
        reports[mode] = explain(lambda *a: loss_fn(model(*a)), *inputs, mode=mode)
    # The eager runtime keeps a region's output (here the block's final LayerNorm) alive
    # with its side outputs instead of recomputing them (reported to the lead), so the
    # region-final native_layer_norm is left out of the comparison.
    skip = {"aten.native_layer_norm.default"}
    def ops(pairs):
        return {op.split("[")[0] for op, region in pairs if region} - skip

    saved = {m: {op for op in ops((s.op, s.region) for s in r.saved if not s.is_input)
                 if not _view_like(op)} for m, r in reports.items()}
    recomputed = {m: {op for op in ops(zip(r.recomputed, r.recomputed_regions))
                      if not _view_like(op)} for m, r in reports.items()}
    assert saved["eager"] == saved["compile"]
    if model_name == "mlp":
        # (GPT's dropout is decomposed differently: bernoulli_/div_ in eager, native_dropout
        # under AOTAutograd; the decisions agree, the op names do not.)
        assert recomputed["eager"] == recomputed["compile"]
    assert saved["compile"] <= {str(op) for op in policies.MATMUL_OPS}


def test_compiled_regions_gradients_with_nesting_and_tags():
    model, inputs = make_model("gpt", size="test", seed=0)
    ref = reference_grads(make_model("gpt", size="test", seed=0)[0], inputs, seed=0)
    model.zero_grad()
    for block in model.blocks:
        sac_region("recompute_all")(block)
    sac_region(policies.save_matmuls, name="GPT")(model)
    compiled = torch.compile(model, backend=make_backend(compiler="aot_eager"))
    torch.manual_seed(0)
    loss_fn(compiled(*inputs)).backward()
    assert max_grad_diff(ref, grads_of(model, inputs)) <= 1e-5


def test_markers_are_removed_from_inference_graphs_aot_eager(monkeypatch):
    # Under no_grad nothing is partitioned; tag()/name() must not stay behind as copies.
    from sac_compile.compiler import backend as backend_module
    x, w = _xw()
    removed = []

    def recording_remove_markers(graph):
        n = real(graph)
        removed.append(n)
        assert not any("sac_compile" in str(node.target) for node in graph.nodes)
        return n

    real = backend_module.remove_markers
    monkeypatch.setattr(backend_module, "remove_markers", recording_remove_markers)
    with torch.no_grad():
        got = torch.compile(lambda x, w: _tagged(x, w),
                            backend=make_backend(compiler="aot_eager"))(x, w)
    torch.testing.assert_close(got, (torch.relu(x @ w).sin()) @ w)
    assert removed == [2]  # the tag() and the name() of _tagged


class _RecordingPass:
    """A user's own post-grad pass: must still run, after ours."""

    def __init__(self):
        self.targets = []

    def __call__(self, graph):
        self.targets.append([str(n.target) for n in graph.nodes])

    def uuid(self):
        return "recording-pass"


def test_markers_are_removed_from_inference_graphs_inductor():
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class Recording(_RecordingPass, CustomGraphPass):
        pass

    x, w = _xw()
    user_pass = Recording()
    with torch.no_grad(), torch._inductor.config.patch(post_grad_custom_pre_pass=user_pass,
                                                       force_disable_caches=True):
        got = torch.compile(lambda x, w: _tagged(x, w), backend=make_backend())(x, w)
    torch.testing.assert_close(got, (torch.relu(x @ w).sin()) @ w)
    assert user_pass.targets, "the user's post-grad pass did not run"
    flat = [t for graph in user_pass.targets for t in graph]
    assert "aten.mm.default" in flat
    assert not any("sac_compile" in t for t in flat), flat


@sac_region("recompute_all", name="Chained")
def _chained(x, w):
    y = (x @ w).sin()
    y = tag(name(y, "label"), CP.MUST_SAVE)  # a marker on a marker: still sin's output
    return y.cos() @ w


def test_tag_of_a_named_tensor_reaches_the_producer_under_compile():
    x, w = _xw()
    report = explain(lambda x, w: _chained(x, w).sum(), x, w, mode="compile")
    assert [r.op for r in report.saved if r.op == "aten.sin.default"] == ["aten.sin.default"]
    assert "aten.sin.default" not in report.recomputed
