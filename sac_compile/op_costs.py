"""FLOPs of one op, by ``torch.utils.flop_counter``'s rules (matmuls, convolutions,
attention), with estimates from shapes where it has no formula (custom ops such as
Hugging Face's grouped matmul, ATen matmuls without a formula). Shared by both modes: the
partitioner costs recomputes with it (``cut.costs``), and ``explain(mode="eager")``
counts the eager runtime's recompute FLOPs with it.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

from .torch_internals import OpOverload, pytree, symbolic_hint

__all__ = ["op_flops", "is_cost_estimated"]


def _tensor_bytes(t: Any) -> int:
    if not isinstance(t, torch.Tensor):
        return 0
    return hint(t.numel(), fallback=4096) * t.dtype.itemsize


def hint(value: Any, *, fallback: int) -> int:
    """An int for a cost that may be symbolic (dynamic shapes), without ``int()``: that
    would specialise the shape and add a guard, recompiling for every new size."""
    if isinstance(value, int):
        return value
    try:
        return int(symbolic_hint(value, fallback=fallback))
    except Exception:
        return fallback


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
    if not isinstance(target, OpOverload) or _formula(target) is not None:
        return False
    if target.namespace not in _KNOWN_NAMESPACES:
        return True
    if target.namespace != "aten":
        return False
    from .policies import MATMUL_OPS
    return target in MATMUL_OPS


_MATMUL_DTYPES = frozenset({torch.int8, torch.uint8})


def _matmul_like(tensors: list[torch.Tensor]) -> int | None:
    """2 x numel(a) x N for the first pair of inputs (a, b) that multiply as a matmul:
    ``a[..., K]`` with ``b[..., K, N]`` (or ``b[..., N, K]``, a transposed weight; or a vector
    ``b[K]``). Dims are compared by their size hints (no guard on a symbolic shape)."""
    ops = [t for t in tensors if t.dim() >= 1
           and (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype in _MATMUL_DTYPES)]
    dims = [[hint(d, fallback=64) for d in t.shape] for t in ops]

    def first(match: Callable[[list[int], list[int]], int | None]) -> int | None:
        for i, a in enumerate(dims):
            for b in dims[i + 1:]:
                n = match(a, b)
                if n is not None:
                    return 2 * hint(ops[i].numel(), fallback=4096) * n
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
