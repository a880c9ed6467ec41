"""Preset policies: tiny named predicates that compose.

Each returns a decision for the ops it knows and ``None`` ("no opinion") for the rest,
so ``compose(a, b)`` asks ``b`` only where ``a`` has nothing to say, and an outer
region's opinion stands where an inner preset is silent.
"""
from __future__ import annotations

from typing import Any

import torch

from .policy import (PRESETS, MUST_CPU_OFFLOAD, MUST_RECOMPUTE, MUST_SAVE, PREFER_CPU_OFFLOAD,
                     PREFER_RECOMPUTE, PREFER_SAVE, CheckpointPolicy, NamedPolicy, PolicyLike,
                     coerce_opinion, expand_ops, normalize_policy)

aten = torch.ops.aten

__all__ = ["recompute_all", "save_all", "save_ops", "save_matmuls", "save_only_these_names",
           "offload_ops", "compose", "relaxed", "MATMUL_OPS", "CUSTOM_MATMUL_OPS", "PRESETS"]


def _recompute_all(ctx, op, *args, **kwargs):
    return PREFER_RECOMPUTE


def _save_all(ctx, op, *args, **kwargs):
    return PREFER_SAVE


recompute_all = NamedPolicy(_recompute_all, "recompute_all", PREFER_RECOMPUTE)
"""Recompute everything (PREFER, so an outer MUST still holds): plain activation checkpointing."""

save_all = NamedPolicy(_save_all, "save_all", PREFER_SAVE)
"""Save everything (PREFER: the compiler may still recompute what is cheaper to recompute)."""


def _optional(*names: str) -> list[Any]:
    """Ops that exist only in some builds or torch versions are skipped, not required."""
    return [getattr(aten, n) for n in names if hasattr(aten, n)]


MATMUL_OPS: frozenset[Any] = expand_ops([
    aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.matmul, aten.mv, aten.addmv,
    aten.addbmm, aten.dot, aten.vdot,
    # Grouped (mixture-of-experts: one matmul per expert over a sorted token slice; what
    # torch.nn.functional.grouped_mm and Hugging Face's MoE layers dispatch), scaled (fp8),
    # quantized and fused matmuls: whichever this torch has.
    *_optional(
        "_grouped_mm", "_scaled_grouped_mm", "_scaled_grouped_mm_v2", "_scaled_mm",
        "_scaled_mm_v2", "_int_mm", "_weight_int8pack_mm", "_weight_int4pack_mm",
        "_weight_int4pack_mm_for_cpu", "_weight_int4pack_mm_with_scales_and_zeros",
        "_dyn_quant_matmul_4bit", "_addmm_activation", "_foreach_mm"),
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


#: Matmuls that libraries register as custom ops, by qualified name (so the library need not
#: be imported): Hugging Face transformers' grouped matmul of mixture-of-experts layers,
#: which it calls instead of ``aten._grouped_mm`` under ``torch.compile`` when that cannot
#: run (weights not in bfloat16, older torch).
CUSTOM_MATMUL_OPS: frozenset[str] = frozenset({"transformers::grouped_mm_fallback"})


_IS_MATMUL: dict[Any, bool] = dict.fromkeys(MATMUL_OPS, True)  # filled per op on first ask


def _saves_matmuls(ctx, op, *args, **kwargs):
    is_matmul = _IS_MATMUL.get(op)
    if is_matmul is None:
        is_matmul = _IS_MATMUL[op] = isinstance(op, torch._ops.OpOverload) and \
            op.name() in CUSTOM_MATMUL_OPS
    return MUST_SAVE if is_matmul else None


save_matmuls = NamedPolicy(_saves_matmuls, "save_matmuls")
"""MUST_SAVE matmuls (dense, batched, grouped, scaled, quantized: :data:`MATMUL_OPS`, and
the custom ops of :data:`CUSTOM_MATMUL_OPS`) and attention: the expensive ops; everything
else is recomputed."""


def save_only_these_names(*labels: str) -> NamedPolicy:
    """MUST_SAVE outputs labelled with :func:`sac_compile.name` as one of ``labels``."""
    if len(labels) == 1 and isinstance(labels[0], (list, tuple, set, frozenset)):
        labels = tuple(labels[0])  # save_only_these_names(["a", "b"]), as JAX's takes
    if not all(isinstance(label, str) for label in labels):
        raise TypeError(f"save_only_these_names takes label strings, e.g. "
                        f"save_only_these_names('attn_out', 'mlp_in'), got {labels!r}")
    wanted = frozenset(labels)

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


_RELAXED = {MUST_SAVE: PREFER_SAVE, MUST_RECOMPUTE: PREFER_RECOMPUTE,
            MUST_CPU_OFFLOAD: PREFER_CPU_OFFLOAD}


def relaxed(policy: PolicyLike) -> NamedPolicy:
    """``policy`` with its MUSTs turned into PREFERs: MUST_SAVE -> PREFER_SAVE,
    MUST_RECOMPUTE -> PREFER_RECOMPUTE, MUST_CPU_OFFLOAD -> PREFER_CPU_OFFLOAD (a ``True``
    counts as MUST_SAVE, as torch reads it). Every other answer (PREFERs, ``None``,
    ``SaveWithHooks``) is unchanged.

    What a memory budget needs to evict a preset's values: the compiler never overrides a
    MUST, so ``make_backend(memory_budget=0.5)`` with ``save_matmuls`` can only recompute
    what the preset leaves to it; with ``relaxed(save_matmuls)`` the matmuls are saved
    unless the budget says otherwise. Eager mode honours PREFER_SAVE as a save, so there a
    relaxed policy saves the same values.
    """
    fn = normalize_policy(policy)

    def relaxed_policy(ctx, op, *args, **kwargs):
        opinion = coerce_opinion(fn(ctx, op, *args, **kwargs), op, getattr(ctx, "region", ""))
        return _RELAXED.get(opinion, opinion) if isinstance(opinion, CheckpointPolicy) \
            else opinion

    constant = getattr(fn, "constant", None)
    return NamedPolicy(relaxed_policy, f"relaxed({fn!r})",
                       _RELAXED.get(constant, constant) if constant is not None else None)


PRESETS.update({  # the core's table of names (see policy.PRESETS)
    "recompute_all": recompute_all,
    "save_all": save_all,
    "save_matmuls": save_matmuls,
})
