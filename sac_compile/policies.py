"""Preset policies: tiny named predicates that compose.

Each returns a decision for the ops it knows and ``None`` ("no opinion") for the rest,
so ``compose(a, b)`` asks ``b`` only where ``a`` has nothing to say, and an outer
region's opinion stands where an inner preset is silent.
"""
from __future__ import annotations

from typing import Any

import torch

from .policy import (MUST_CPU_OFFLOAD, MUST_SAVE, PREFER_RECOMPUTE, PREFER_SAVE, NamedPolicy,
                     PolicyLike, coerce_opinion, expand_ops, normalize_policy)

aten = torch.ops.aten

__all__ = ["recompute_all", "save_all", "save_ops", "save_matmuls", "save_only_these_names",
           "offload_ops", "compose", "MATMUL_OPS", "PRESETS"]


def _recompute_all(ctx, op, *args, **kwargs):
    return PREFER_RECOMPUTE


def _save_all(ctx, op, *args, **kwargs):
    return PREFER_SAVE


recompute_all = NamedPolicy(_recompute_all, "recompute_all", PREFER_RECOMPUTE)
"""Recompute everything (PREFER, so an outer MUST still holds): plain activation checkpointing."""

save_all = NamedPolicy(_save_all, "save_all", PREFER_SAVE)
"""Save everything (PREFER: the compiler may still recompute what is cheaper to recompute)."""


def _optional(*names: str) -> list[Any]:
    """Attention kernels that exist only in some builds are skipped, not required."""
    return [getattr(aten, n) for n in names if hasattr(aten, n)]


MATMUL_OPS: frozenset[Any] = expand_ops([
    aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.matmul, aten.mv, aten.addmv,
    aten._scaled_mm if hasattr(aten, "_scaled_mm") else aten.mm,
    *_optional(
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
        "_flash_attention_forward", "_efficient_attention_forward", "scaled_dot_product_attention",
        "_scaled_dot_product_attention_math"),
])


def save_ops(*ops: Any) -> NamedPolicy:
    """MUST_SAVE the outputs of ``ops`` (OpOverloads, or packets for all overloads)."""
    op_set = expand_ops(ops, what="save_ops")

    def saves_these_ops(ctx, op, *args, **kwargs):
        return MUST_SAVE if op in op_set else None

    return NamedPolicy(saves_these_ops, f"save_ops({', '.join(sorted(map(str, op_set)))})")


save_matmuls = NamedPolicy(save_ops(*MATMUL_OPS).fn, "save_matmuls")
"""MUST_SAVE matmuls and attention: the expensive ops; everything else is recomputed."""


def save_only_these_names(*labels: str) -> NamedPolicy:
    """MUST_SAVE outputs labelled with :func:`sac_compile.name` as one of ``labels``."""
    wanted = frozenset(labels)
    if not all(isinstance(label, str) for label in wanted):
        raise TypeError(f"save_only_these_names takes strings, got {labels!r}")

    def saves_named(ctx, op, *args, **kwargs):
        return MUST_SAVE if wanted & getattr(ctx, "names", frozenset()) else None

    return NamedPolicy(saves_named, f"save_only_these_names({', '.join(map(repr, labels))})")


def offload_ops(*ops: Any) -> NamedPolicy:
    """MUST_CPU_OFFLOAD the outputs of ``ops``: kept on the CPU until backward needs them."""
    op_set = expand_ops(ops, what="offload_ops")

    def offloads_these_ops(ctx, op, *args, **kwargs):
        return MUST_CPU_OFFLOAD if op in op_set else None

    return NamedPolicy(offloads_these_ops, f"offload_ops({', '.join(sorted(map(str, op_set)))})")


def compose(*policies: PolicyLike) -> NamedPolicy:
    """The first policy with an opinion (not ``None``) decides."""
    fns = [normalize_policy(p) for p in policies]

    def first_opinion(ctx, op, *args, **kwargs):
        for fn in fns:
            opinion = coerce_opinion(fn(ctx, op, *args, **kwargs), op, getattr(ctx, "region", ""))
            if opinion is not None:
                return opinion
        return None

    return NamedPolicy(first_opinion, f"compose({', '.join(map(repr, fns))})")


PRESETS = {
    "recompute_all": recompute_all,
    "save_all": save_all,
    "save_matmuls": save_matmuls,
}
