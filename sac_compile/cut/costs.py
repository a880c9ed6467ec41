"""What one FX node costs: bytes to keep its output, FLOPs and memory traffic to recompute it.

FLOPs come from ``torch.utils.flop_counter``'s registry (matmuls, convolutions, attention);
other ATen ops are memory-bound, and cost the bytes they read and write. Custom ops and the
ATen matmuls the registry has no formula for are estimated from their shapes
(:func:`sac_compile.op_costs.op_flops`, shared with the eager report), and reports flag them
as "cost estimated".
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import py_sym_types

from .. import graph_meta
from ..op_costs import hint as _hint
from ..op_costs import op_flops
from ..torch_internals import HigherOrderOperator, OpOverload, TorchAPIMissing, pytree
from ..tensor_memory import is_view_op

__all__ = ["nbytes", "flops", "traffic", "is_view", "is_random", "rng_state_bytes", "is_sym", "is_opaque",
           "op_label"]


def _tensor_bytes(t: Any) -> int:
    if not isinstance(t, torch.Tensor):
        return 0
    return _hint(t.numel(), fallback=4096) * t.dtype.itemsize


def nbytes(node: fx.Node) -> int:
    """Bytes of the node's output (a SymInt counts as 1 byte; tuples sum their tensors)."""
    val = graph_meta.val(node)
    if isinstance(val, py_sym_types):
        return 1
    if isinstance(val, torch.Tensor):
        return _tensor_bytes(val)
    if isinstance(val, (list, tuple)):
        return sum(_tensor_bytes(v) for v in val)
    return 0


def _val(a: Any) -> Any:
    return graph_meta.val(a) if isinstance(a, fx.Node) else a


def flops(node: fx.Node) -> int:
    """FLOPs to recompute ``node``: :func:`op_flops` of its target on its ``meta["val"]``s."""
    if node.op != "call_function":
        return 0
    args, kwargs = pytree.tree_map(_val, (node.args, node.kwargs))
    count, _ = op_flops(node.target, args, kwargs, graph_meta.val(node))
    return _hint(count, fallback=0)


def _memory_bytes(t: Any) -> int:
    """Bytes of memory a tensor's elements occupy: its numel's bytes, or fewer when elements
    share memory (an ``expand``, stride 0: a [N, 1] index expanded to [N, V] reads N
    elements, not N x V). The span of its strides, at most its numel."""
    if not isinstance(t, torch.Tensor):
        return 0
    try:
        if t.layout is not torch.strided or t.is_nested:
            return _tensor_bytes(t)
        sizes = [_hint(s, fallback=64) for s in t.shape]
        strides = [_hint(s, fallback=1) for s in t.stride()]
    except Exception:  # no strides (a sparse or subclass value)
        return _tensor_bytes(t)
    numel = _hint(t.numel(), fallback=4096)
    if numel == 0 or any(s == 0 for s in sizes):
        return 0
    span = 1 + sum((size - 1) * abs(stride) for size, stride in zip(sizes, strides))
    return min(numel, span) * t.dtype.itemsize


def _read_bytes(node: fx.Node) -> int:
    val = graph_meta.val(node)
    if isinstance(val, py_sym_types):
        return 1
    return sum(_memory_bytes(v) for v in pytree.tree_leaves(val))


def traffic(node: fx.Node) -> int:
    """Bytes read and written when the node runs: its tensor inputs, each by the memory its
    elements occupy (an expanded view reads its small base, not its expanded size), and its
    output. Views and ``getitem`` cost nothing."""
    if node.op != "call_function" or node.target is operator.getitem or is_view(node):
        return 0
    read = 0
    for a in pytree.tree_leaves((node.args, node.kwargs)):
        if isinstance(a, fx.Node):
            read += _read_bytes(a)
    return read + nbytes(node)


def is_view(node: fx.Node) -> bool:
    """The node's op returns a view of an input (:func:`~sac_compile.tensor_memory.is_view_op`)."""
    return is_view_op(node.target)


def is_random(node: fx.Node) -> bool:
    """Whether the op draws random numbers: tagged ``nondeterministic_seeded``, except an
    attention kernel (or dropout) whose dropout probability is 0 - SDPA ops carry the tag
    whatever their ``dropout_p``, which would ban recomputing every attention."""
    target = node.target
    if not (isinstance(target, OpOverload)
            and torch.Tag.nondeterministic_seeded in target.tags):
        return False
    return _dropout_p(node) != 0


def _dropout_p(node: fx.Node) -> Any:
    """The op's ``dropout_p`` (``p`` for a dropout op), or None when it has none."""
    names = [a.name for a in node.target._schema.arguments]
    for name in ("dropout_p", "p"):
        if name in names:
            i = names.index(name)
            value = node.kwargs.get(name, node.args[i] if i < len(node.args) else
                                    node.target._schema.arguments[i].default_value)
            if name == "p" and "train" in names:  # native_dropout(input, p, train)
                j = names.index("train")
                train = node.kwargs.get("train", node.args[j] if j < len(node.args) else None)
                if train is False:
                    return 0
            return value if isinstance(value, (int, float)) else None
    return None


def rng_state_bytes(node: fx.Node) -> int:
    """Bytes of the RNG state kept for the backward when the random op ``node`` is
    recomputed (torch's RNG functionalisation saves its generator's state): the CPU
    generator's whole state (5,056 bytes), an accelerator's seed and offset (16)."""
    val = graph_meta.val(node)
    if isinstance(val, (list, tuple)):
        val = next((v for v in val if isinstance(v, torch.Tensor)), None)
    if isinstance(val, torch.Tensor) and val.device.type == "cpu":
        return int(torch.get_rng_state().numel())
    return 16


def op_label(node: fx.Node) -> str:
    if node.op == "placeholder":
        return "input"
    if node.target is operator.getitem:
        base = node.args[0]
        return f"{op_label(base)}[{node.args[1]}]" if isinstance(base, fx.Node) else "getitem"
    if isinstance(node.target, (OpOverload, HigherOrderOperator)):
        return str(node.target)
    return getattr(node.target, "__name__", str(node.target))


def is_sym(node: fx.Node) -> bool:
    return isinstance(graph_meta.val(node), py_sym_types)


def is_opaque(node: fx.Node) -> bool:
    """A non-tensor, non-symbolic value the graph passes along as is: compiled autograd's
    ``BackwardState`` (a tensor hook on a region's output), a script object, an opaque
    object. Keeping it costs nothing; it is handed to the backward as torch's partitioner
    hands it (``_extract_fwd_bwd_modules``' ``saved_opaque_nodes``, or directly)."""
    from ..torch_internals import BackwardState, FakeScriptObject

    val = graph_meta.val(node)
    if isinstance(val, (BackwardState, FakeScriptObject, torch.ScriptObject)):
        return True
    try:
        from ..torch_internals import is_opaque_node
    except TorchAPIMissing:  # pragma: no cover - older torch
        return False
    return bool(is_opaque_node(node))
