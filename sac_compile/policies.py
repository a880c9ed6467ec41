"""Preset policies: small values that compose.

Each preset is a frozen dataclass (as JAX's ``SaveOnlyTheseNames``): it hashes, compares and
pickles by what it holds (ops by qualified name, labels, the policies it combines), and that
value is what a compiled region's graph and the compile caches are keyed by. Each returns a
decision for the ops it knows and ``None`` ("no opinion") for the rest, so
``compose(a, b)`` asks ``b`` only where ``a`` has nothing to say, and an outer region's
opinion stands where an inner preset is silent.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .policy import (PRESETS, MUST_CPU_OFFLOAD, MUST_RECOMPUTE, MUST_SAVE, PREFER_CPU_OFFLOAD,
                     PREFER_RECOMPUTE, PREFER_SAVE, CheckpointPolicy, OpSetPolicy, PolicyFn,
                     PolicyLike, PolicyValue, SaveWithHooks, answers_by_op, coerce_opinion,
                     expand_ops, normalize_policy, op_names, region_of)
from .torch_internals import OpOverload

aten = torch.ops.aten

__all__ = ["recompute_all", "save_all", "save_ops", "save_matmuls", "save_only_these_names",
           "offload_ops", "compose", "relaxed", "MATMUL_OPS", "CUSTOM_MATMUL_OPS", "PRESETS",
           "RecomputeAll", "SaveAll", "SaveOps", "SaveMatmuls", "SaveOnlyTheseNames",
           "OffloadOps", "Compose", "Relaxed"]


@dataclasses.dataclass(frozen=True)
class RecomputeAll(PolicyValue):
    """Recompute everything (PREFER, so an outer MUST still holds): plain activation
    checkpointing."""

    constant = PREFER_RECOMPUTE

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return PREFER_RECOMPUTE

    def by_op(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "recompute_all"


@dataclasses.dataclass(frozen=True)
class SaveAll(PolicyValue):
    """Save everything (PREFER: the compiler may still recompute what is cheaper to
    recompute)."""

    constant = PREFER_SAVE

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return PREFER_SAVE

    def by_op(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "save_all"


recompute_all = RecomputeAll()
save_all = SaveAll()


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


@dataclasses.dataclass(frozen=True, repr=False)
class SaveOps(OpSetPolicy):
    """MUST_SAVE the outputs of ``ops`` (qualified names, e.g. ``aten.mm.default``)."""

    ops: tuple[str, ...]
    opinion = MUST_SAVE
    label = "save_ops"


def save_ops(*ops: Any) -> SaveOps:
    """MUST_SAVE the outputs of ``ops`` (OpOverloads, or packets for all overloads)."""
    return SaveOps(op_names(ops, what="save_ops"))


#: Matmuls that libraries register as custom ops, by qualified name (so the library need not
#: be imported): Hugging Face transformers' grouped matmul of mixture-of-experts layers,
#: which it calls instead of ``aten._grouped_mm`` under ``torch.compile`` when that cannot
#: run (weights not in bfloat16, older torch).
CUSTOM_MATMUL_OPS: frozenset[str] = frozenset({"transformers::grouped_mm_fallback"})


_IS_MATMUL: dict[Any, bool] = dict.fromkeys(MATMUL_OPS, True)  # filled per op on first ask


@dataclasses.dataclass(frozen=True)
class SaveMatmuls(PolicyValue):
    """MUST_SAVE matmuls (dense, batched, grouped, scaled, quantized: :data:`MATMUL_OPS`, and
    the custom ops of :data:`CUSTOM_MATMUL_OPS`) and attention: the expensive ops;
    everything else is recomputed."""

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        is_matmul = _IS_MATMUL.get(op)
        if is_matmul is None:
            is_matmul = _IS_MATMUL[op] = isinstance(op, OpOverload) and \
                op.name() in CUSTOM_MATMUL_OPS
        return MUST_SAVE if is_matmul else None

    def by_op(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "save_matmuls"


save_matmuls = SaveMatmuls()


@dataclasses.dataclass(frozen=True)
class SaveOnlyTheseNames(PolicyValue):
    """MUST_SAVE outputs labelled with :func:`sac_compile.name` as one of ``labels``."""

    labels: frozenset[str]

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return MUST_SAVE if self.labels & getattr(ctx, "names", frozenset()) else None

    def __repr__(self) -> str:  # sorted: set order differs between processes
        return f"save_only_these_names({', '.join(map(repr, sorted(self.labels)))})"


def save_only_these_names(*labels: str) -> SaveOnlyTheseNames:
    """MUST_SAVE outputs labelled with :func:`sac_compile.name` as one of ``labels``."""
    if len(labels) == 1 and isinstance(labels[0], (list, tuple, set, frozenset)):
        labels = tuple(labels[0])  # save_only_these_names(["a", "b"]), as JAX's takes
    if not all(isinstance(label, str) for label in labels):
        raise TypeError(f"save_only_these_names takes label strings, e.g. "
                        f"save_only_these_names('attn_out', 'mlp_in'), got {labels!r}")
    return SaveOnlyTheseNames(frozenset(labels))


@dataclasses.dataclass(frozen=True, repr=False)
class OffloadOps(OpSetPolicy):
    """MUST_CPU_OFFLOAD the outputs of ``ops``: kept on the CPU until backward needs them."""

    ops: tuple[str, ...]
    opinion = MUST_CPU_OFFLOAD
    label = "offload_ops"


def offload_ops(*ops: Any) -> OffloadOps:
    """MUST_CPU_OFFLOAD the outputs of ``ops``: kept on the CPU until backward needs them."""
    return OffloadOps(op_names(ops, what="offload_ops"))


@dataclasses.dataclass(frozen=True)
class Compose(PolicyValue):
    """The first of ``policies`` (normalised) with an opinion (not ``None``) decides."""

    policies: tuple[PolicyFn, ...]

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        for fn in self.policies:
            opinion = coerce_opinion(fn(ctx, op, *args, **kwargs), op, region_of(ctx))
            if opinion is not None:
                return opinion
        return None

    def by_op(self) -> bool:
        return all(answers_by_op(p) for p in self.policies)

    def __repr__(self) -> str:
        return f"compose({', '.join(map(repr, self.policies))})"


def compose(*policies: PolicyLike) -> Compose:
    """The first policy with an opinion (not ``None``) decides.

    >>> import torch
    >>> from sac_compile import explain, sac_region
    >>> from sac_compile.policies import compose, save_ops
    >>> policy = compose(save_ops(torch.ops.aten.mm.default), "recompute_all")
    >>> policy
    compose(save_ops(aten.mm.default), recompute_all)
    >>> block = sac_region(policy, name="block")(lambda x, w: (x @ w).sin().sin())
    >>> report = explain(block, torch.randn(4, 8), torch.randn(8, 8, requires_grad=True))
    >>> [record.op for record in report.saved], report.recomputed  # mm kept, sin replayed
    (['aten.mm.default'], ['aten.sin.default'])
    """
    return Compose(tuple(normalize_policy(p) for p in policies))


_RELAXED = {MUST_SAVE: PREFER_SAVE, MUST_RECOMPUTE: PREFER_RECOMPUTE,
            MUST_CPU_OFFLOAD: PREFER_CPU_OFFLOAD}


@dataclasses.dataclass(frozen=True)
class Relaxed(PolicyValue):
    """``policy`` (normalised) with its MUSTs turned into PREFERs, and with ``hooks`` its
    ``SaveWithHooks`` into PREFER_SAVE; see :func:`relaxed`."""

    policy: PolicyFn
    hooks: bool = False

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return self._relax(coerce_opinion(self.policy(ctx, op, *args, **kwargs), op,
                                          region_of(ctx)))

    def by_op(self) -> bool:
        return answers_by_op(self.policy)

    def _relax(self, opinion: Any) -> Any:
        if isinstance(opinion, CheckpointPolicy):
            return _RELAXED.get(opinion, opinion)
        if self.hooks and isinstance(opinion, SaveWithHooks):
            return PREFER_SAVE
        return opinion

    @property
    def constant(self) -> Any:  # type: ignore[override]
        inner = getattr(self.policy, "constant", None)
        return self._relax(inner) if inner is not None else None

    def __repr__(self) -> str:
        return f"relaxed({self.policy!r}{', hooks=True' if self.hooks else ''})"


def relaxed(policy: PolicyLike, *, hooks: bool = False) -> Relaxed:
    """``policy`` with its MUSTs turned into PREFERs: MUST_SAVE -> PREFER_SAVE,
    MUST_RECOMPUTE -> PREFER_RECOMPUTE, MUST_CPU_OFFLOAD -> PREFER_CPU_OFFLOAD (a ``True``
    counts as MUST_SAVE, as torch reads it). With ``hooks=True`` a ``SaveWithHooks`` becomes
    PREFER_SAVE too (the hooks are dropped: a value the budget keeps is kept as it is, and
    one it drops is recomputed); without it a ``SaveWithHooks`` is unchanged, as every
    other answer (PREFERs, ``None``).

    What a memory budget needs to evict a preset's values: the compiler never overrides a
    MUST, so ``make_backend(memory_budget=0.5)`` with ``save_matmuls`` can only recompute
    what the preset leaves to it; with ``relaxed(save_matmuls)`` the matmuls are saved
    unless the budget says otherwise. Eager mode honours PREFER_SAVE as a save, so there a
    relaxed policy saves the same values.
    """
    if not isinstance(hooks, bool):
        raise TypeError(f"relaxed(..., hooks=) takes True or False, got {hooks!r}")
    return Relaxed(normalize_policy(policy), hooks)


PRESETS.update({  # the core's table of names (see policy.PRESETS)
    "recompute_all": recompute_all,
    "save_all": save_all,
    "save_matmuls": save_matmuls,
})
