"""What one FX node costs: bytes to keep its output, FLOPs and memory traffic to recompute it.

FLOPs come from ``torch.utils.flop_counter``'s registry (matmuls, convolutions, attention);
other ATen ops are memory-bound, and cost the bytes they read and write. Custom ops and the
ATen matmuls the registry has no formula for are estimated from their shapes
(:func:`op_flops`), and reports flag them as "cost estimated".
"""
from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import py_sym_types
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import flop_registry

__all__ = ["nbytes", "flops", "traffic", "is_view", "is_random", "is_sym", "is_opaque",
           "op_label"]


def _tensor_bytes(t: Any) -> int:
    if not isinstance(t, torch.Tensor):
        return 0
    return _hint(t.numel(), fallback=4096) * t.dtype.itemsize


def nbytes(node: fx.Node) -> int:
    """Bytes of the node's output (a SymInt counts as 1 byte; tuples sum their tensors)."""
    val = node.meta.get("val")
    if isinstance(val, py_sym_types):
        return 1
    if isinstance(val, torch.Tensor):
        return _tensor_bytes(val)
    if isinstance(val, (list, tuple)):
        return sum(_tensor_bytes(v) for v in val)
    return 0


def _val(a: Any) -> Any:
    return a.meta.get("val") if isinstance(a, fx.Node) else a


def flops(node: fx.Node) -> int:
    """FLOPs to recompute ``node``: :func:`op_flops` of its target on its ``meta["val"]``s."""
    if node.op != "call_function":
        return 0
    args, kwargs = pytree.tree_map(_val, (node.args, node.kwargs))
    count, _ = op_flops(node.target, args, kwargs, node.meta.get("val"))
    return _hint(count, fallback=0)


#: Namespaces whose ops have known costs: ATen/prims ops without a FLOP formula are
#: memory-bound (they cost their traffic), collectives move bytes, our markers are folded.
_KNOWN_NAMESPACES = frozenset({
    "aten", "prims", "rngprims", "debugprims", "profiler", "_c10d_functional",
    "c10d_functional", "_c10d_functional_autograd", "_dtensor", "sac_compile"})

#: Ops computed exactly like one with a formula (same leading arguments).
_SAME_FORMULA = {
    "_scaled_dot_product_flash_attention_for_cpu": "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu_backward":
        "_scaled_dot_product_flash_attention_backward",
}


def _formula(target: Any) -> Any:
    """The ``flop_registry`` formula for ``target`` (an OpOverload, a packet or a
    higher-order op), or None."""
    key = getattr(target, "overloadpacket", target)
    formula = flop_registry.get(key)
    if formula is None and getattr(target, "namespace", None) == "aten":
        alias = _SAME_FORMULA.get(getattr(key, "__name__", ""))
        if alias is not None and hasattr(torch.ops.aten, alias):
            formula = flop_registry.get(getattr(torch.ops.aten, alias))
    return formula


def is_cost_estimated(target: Any) -> bool:
    """True where :func:`op_flops` estimates from shapes instead of a known formula: a
    custom op (any namespace but ATen's and torch's own) and an ATen matmul that
    ``torch.utils.flop_counter`` has no formula for (``aten._grouped_mm``, the quantized
    ones: see :data:`sac_compile.policies.MATMUL_OPS`)."""
    if not isinstance(target, torch._ops.OpOverload) or _formula(target) is not None:
        return False
    if target.namespace not in _KNOWN_NAMESPACES:
        return True
    if target.namespace != "aten":
        return False
    from ..policies import MATMUL_OPS
    return target in MATMUL_OPS


_MATMUL_DTYPES = frozenset({torch.int8, torch.uint8})


def _matmul_like(tensors: list[torch.Tensor]) -> int | None:
    """2 x numel(a) x N for the first pair of inputs (a, b) that multiply as a matmul:
    ``a[..., K]`` with ``b[..., K, N]`` (or ``b[..., N, K]``, a transposed weight; or a vector
    ``b[K]``). Dims are compared by their size hints (no guard on a symbolic shape)."""
    ops = [t for t in tensors if t.dim() >= 1
           and (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype in _MATMUL_DTYPES)]
    dims = [[_hint(d, fallback=64) for d in t.shape] for t in ops]

    def first(match: Callable[[list[int], list[int]], int | None]) -> int | None:
        for i, a in enumerate(dims):
            for b in dims[i + 1:]:
                n = match(a, b)
                if n is not None:
                    return 2 * _hint(ops[i].numel(), fallback=4096) * n
        return None

    return (first(lambda a, b: b[-1] if len(b) >= 2 and a[-1] == b[-2] else None)
            or first(lambda a, b: b[-2] if len(b) >= 2 and a[-1] == b[-1] else None)
            or first(lambda a, b: 1 if len(b) == 1 and a[-1] == b[0] else None))


def op_flops(target: Any, args: Any, kwargs: Any, out: Any) -> tuple[int, bool]:
    """``(FLOPs, estimated)`` of one call of ``target`` on ``args``/``kwargs`` (tensors, fake
    tensors or FX ``meta["val"]``s) producing ``out``. Used by the partitioner's cost model
    and by ``explain(mode="eager")``, so both modes count alike.

    * An op ``torch.utils.flop_counter`` has a formula for (mm, addmm, bmm, baddbmm,
      convolutions, attention; the CPU flash-attention kernel by the flash formula): that
      formula, not estimated.
    * Other ATen/prims ops: 0, not estimated: they are memory-bound and the cost model
      charges their traffic (:func:`traffic`) instead.
    * Ops whose cost is estimated (:func:`is_cost_estimated`: custom ops such as Hugging
      Face's ``transformers::grouped_mm_fallback``, ATen matmuls without a formula such as
      ``aten._grouped_mm``): 2 x numel(a) x N when two inputs multiply as a matmul
      (``a[..., K] @ b[..., K, N]``: exact for mm, bmm and grouped matmuls, half of
      attention's count); otherwise the bytes the op reads and writes, one FLOP per byte.
      A custom op may hide any amount of work: the estimate only keeps it from counting as
      free, and the report says "cost estimated".
    """
    formula = _formula(target)
    if formula is not None:
        try:
            return formula(*args, **(kwargs or {}), out_val=out), False
        except Exception:  # a formula that cannot handle symbolic or unusual arguments
            return 0, False
    if not is_cost_estimated(target):
        return 0, False
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    estimate = _matmul_like(tensors)
    if estimate is None:
        estimate = sum(_tensor_bytes(t) for t in tensors) + sum(
            _tensor_bytes(t) for t in pytree.tree_leaves(out))
    return estimate, True


def _hint(value: Any, *, fallback: int) -> int:
    """An int for a cost that may be symbolic (dynamic shapes), without ``int()``: that
    would specialise the shape and add a guard, recompiling for every new size."""
    if isinstance(value, int):
        return value
    try:
        return int(torch.fx.experimental.symbolic_shapes.optimization_hint(
            value, fallback=fallback))
    except Exception:
        return fallback


def traffic(node: fx.Node) -> int:
    """Bytes read and written when the node runs (its tensor inputs and its output)."""
    if node.op != "call_function" or node.target is operator.getitem or is_view(node):
        return 0
    read = 0
    for a in pytree.tree_leaves((node.args, node.kwargs)):
        if isinstance(a, fx.Node):
            read += nbytes(a)
    return read + nbytes(node)


def is_view(node: fx.Node) -> bool:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if target is torch.ops.aten.detach.default or target is torch.ops.aten.alias.default:
        return True
    return bool(target.is_view)


def is_random(node: fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and \
        torch.Tag.nondeterministic_seeded in target.tags


def op_label(node: fx.Node) -> str:
    if node.op == "placeholder":
        return "input"
    if node.target is operator.getitem:
        base = node.args[0]
        return f"{op_label(base)}[{node.args[1]}]" if isinstance(base, fx.Node) else "getitem"
    if isinstance(node.target, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)):
        return str(node.target)
    return getattr(node.target, "__name__", str(node.target))


def is_sym(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), py_sym_types)


def is_opaque(node: fx.Node) -> bool:
    """A non-tensor, non-symbolic value the graph passes along as is: compiled autograd's
    ``BackwardState`` (a tensor hook on a region's output), a script object, an opaque
    object. Keeping it costs nothing; it is handed to the backward as torch's partitioner
    hands it (``_extract_fwd_bwd_modules``' ``saved_opaque_nodes``, or directly)."""
    from torch._library.fake_class_registry import FakeScriptObject
    from torch.fx.experimental._backward_state import BackwardState

    val = node.meta.get("val")
    if isinstance(val, (BackwardState, FakeScriptObject, torch.ScriptObject)):
        return True
    try:
        from torch._functorch._aot_autograd.graph_compile import is_opaque_node
    except ImportError:  # pragma: no cover - older torch
        return False
    return bool(is_opaque_node(node))
