"""What differs between the supported torch versions (2.11 and 2.13 are verified): features a
torch lacks fail with a message naming the version they need, and torch's own differences
do not leak into the library's behaviour."""
from __future__ import annotations

import importlib.util
import sys
import warnings

import pytest
import torch

import sac_compile as sc
from sac_compile import CheckpointError, CheckpointPolicy as CP
from sac_compile.compiler import offload

aten = torch.ops.aten

HAS_OFFLOAD_OPS = importlib.util.find_spec(
    "torch._functorch._activation_offloading.offload_ops") is not None


def test_save_hooks_need_none_of_the_offload_apis(monkeypatch):
    """A torch without the offload pass still traces SaveWithHooks into compiled graphs."""
    monkeypatch.setattr(offload, "_API", [])
    monkeypatch.setattr(offload, "_HOOKS_API", [])
    monkeypatch.setitem(sys.modules,
                        "torch._functorch._activation_offloading.activation_offloading", None)
    assert offload.hooks_api().fwd_only is not None
    with pytest.raises(offload.TorchAPIMissing, match=r"needs torch >= 2\.12"):
        offload.torch_api()


@pytest.mark.skipif(HAS_OFFLOAD_OPS, reason="this torch has the offload ops (torch.ops.ao)")
def test_offload_under_compile_names_the_torch_it_needs():

    @sc.sac_region(lambda ctx, op, *a, **k: CP.MUST_CPU_OFFLOAD if op is aten.mm.default
                   else None, name="V")
    def block(x, w):
        return (x @ w).sin()

    x = torch.randn(4, 8, device="meta", requires_grad=True)
    w = torch.randn(8, 8, device="meta", requires_grad=True)
    with pytest.raises(CheckpointError) as info:
        torch.compile(block, backend=sc.make_backend(compiler="aot_eager"))(x, w)
    msg = str(info.value)
    assert "MUST_CPU_OFFLOAD of aten.mm.default" in msg and "torch >= 2.12" in msg, msg
    assert torch.__version__ in msg, msg


def _clean() -> None:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from sac_compile import runtime
    assert _get_current_dispatch_mode_stack() == []
    assert runtime.active_recorder() is None
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


@pytest.mark.parametrize("where", ["traced", "graph-break"])
def test_an_error_in_a_compiled_region_leaves_no_context_entered(where):
    """torch < 2.13's checkpoint leaves the context_fn's forward context entered when the
    region's forward raises; while the error is alive (pytest.raises keeps it), the next
    compile must not find our tagging mode, recorder or saved-tensor hooks still active."""

    @sc.sac_region("save_matmuls", name="R")
    def region(x):
        y = x.sin()
        if where == "graph-break":
            torch._dynamo.graph_break()
        sc.name(x, "a")  # x is an input: a CheckpointError
        return y

    x = torch.randn(4, 8, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the graph break's eager-fallback warning
        with pytest.raises(CheckpointError, match="no op of the region produced") as info:
            torch.compile(lambda x: region(x).cos(),
                          backend=sc.make_backend(compiler="aot_eager"))(x)
    assert info.value is not None  # the error (and its traceback) are still alive here
    _clean()
    torch._dynamo.reset()

    @sc.sac_region("save_matmuls", name="S")
    def fine(x, w):
        return (x @ w).sin()

    w = torch.randn(8, 8, requires_grad=True)
    torch.compile(fine, backend=sc.make_backend(compiler="aot_eager"))(x, w).sum().backward()
    _clean()
