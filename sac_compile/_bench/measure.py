"""Measurement helpers shared by the demo, the benchmarks and the tests.

* :class:`SavedBytes` — unique storage bytes of the tensors autograd packs (a
  ``saved_tensors_hooks`` pair), i.e. what a step keeps for backward without checkpointing,
  or what is kept *outside* any checkpoint when used around a checkpointed forward.
* :class:`TorchSAC` — ``torch.utils.checkpoint`` selective checkpointing with its two
  dispatch modes created here, so that after forward we can sum the bytes held in its cache
  (:meth:`TorchSAC.cached_bytes`) and, in backward, count the ops it really recomputes.
* :func:`wrapped_blocks` — run ``model.blocks[i]`` through a wrapper (a checkpoint, a region)
  for the duration of a ``with`` block, without replacing the modules.
* :func:`measure_noac`, :func:`measure_torch_sac` — one seeded forward+backward, returning a
  :class:`StepResult` (bytes kept, policy-saved bytes, ops recomputed, gradients). The
  sac_compile counterpart is ``_bench.strategies.measure_ours``.
* :func:`count_aten_ops` — ATen ops one call dispatches (for "overhead per op").
* :func:`interleaved_medians`, :func:`paired` — step times of several strategies measured
  round-robin in one run; medians, and medians of per-round ratios or differences.

Of the rest of ``sac_compile`` this imports only ``tensor_memory`` and ``gradients``. Bytes are counted per
unique storage (views of one storage count once, :func:`~sac_compile.tensor_memory.storage_key`)
and exclude the storages of ``exclude`` (e.g. ``param_storages(model)``, the model's
parameters and buffers: weights are not activations).
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.utils.checkpoint as tuc

from ..torch_internals import (SAC_RECOMPUTE_MARKER, CachedTorchDispatchMode,
                               TorchDispatchMode, VersionWrapper, policy_from_bool, pytree,
                               sac_storage_key)

from ..tensor_memory import param_storages, storage_key, storage_nbytes
from .gradients import clear_grads, grads_of, loss_fn

aten = torch.ops.aten

__all__ = ["TORCH_SAVE_MATMUL_OPS", "SavedBytes", "TorchSAC", "torch_sac_blocks", "wrap_blocks",
           "wrapped_blocks", "StepResult", "measure_noac", "measure_torch_sac", "count_aten_ops",
           "interleaved_medians", "paired"]


def _optional_ops(*names: str) -> list[Any]:
    return [getattr(aten, n).default for n in names if hasattr(aten, n)]


#: The op list given to upstream SAC as "save matmuls" (the torchtitan-style list):
#: matmuls (MoE experts' grouped matmul included, as our save_matmuls) and the
#: scaled-dot-product-attention kernels.
TORCH_SAVE_MATMUL_OPS: list[Any] = [
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
    *_optional_ops("_grouped_mm"),
    *_optional_ops("_scaled_dot_product_flash_attention",
                   "_scaled_dot_product_flash_attention_for_cpu",
                   "_scaled_dot_product_efficient_attention",
                   "_scaled_dot_product_cudnn_attention"),
]


# --------------------------------------------------------------------------------------
# Bytes
# --------------------------------------------------------------------------------------

class SavedBytes:
    """Unique storages of tensors packed by autograd while the context is active.

    ``with SavedBytes(exclude=param_storages(model)) as sb: loss = model(x).sum()``; then
    ``sb.nbytes`` is the activation bytes a backward would need (without checkpointing).
    Tensors that live in the storages of ``exclude`` are not counted. The pack hook returns
    the tensor itself, so the step behaves exactly as without the context. Storages are
    recorded by key only (no reference is kept beyond what autograd keeps anyway).

    Around a ``torch.utils.checkpoint`` call the hooks see only what is saved outside the
    checkpointed function (the checkpoint's saved inputs included): the checkpoint installs
    its own hooks inside.
    """

    def __init__(self, exclude: Iterable[int] = ()) -> None:
        self.exclude = set(exclude)
        self.storages: dict[int, int] = {}
        self.packed = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.packed += 1
        self.add(t)
        return t

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def add(self, t: Any) -> None:
        if isinstance(t, torch.Tensor):
            key = storage_key(t)
            # A storage at address 0 holds no memory (empty, meta or fake).
            if key not in self.exclude and t.untyped_storage().data_ptr() != 0:
                self.storages[key] = storage_nbytes(t)

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())

    def __enter__(self) -> "SavedBytes":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


# --------------------------------------------------------------------------------------
# Upstream selective activation checkpointing, instrumented
# --------------------------------------------------------------------------------------

_RECOMPUTE = SAC_RECOMPUTE_MARKER
_MISSING = object()
_IGNORED = getattr(tuc, "SAC_IGNORED_OPS", frozenset({aten.detach.default}))
_storage_key_fn = sac_storage_key


class _CountingCachedMode(CachedTorchDispatchMode):
    """torch's recompute-side SAC mode, counting the ops it runs (cache misses) by op."""

    def __init__(self, storage: Any, owner: "TorchSAC", allow_cache_entry_mutation: bool,
                 policy_fn: Any = None) -> None:
        # torch < 2.13's mode asks the policy again (is_recompute=True); 2.13's ignores it.
        super().__init__(policy_fn, storage, allow_cache_entry_mutation)
        self._owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in _IGNORED and self._recomputes(func, args, kwargs):
            self._owner.recomputed[func] += 1
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _recomputes(self, func: Any, args: Any, kwargs: Any) -> bool:
        if _RECOMPUTE is not None:  # torch 2.13: the forward left a marker per call
            key = _storage_key_fn(func, args)
            return self.storage.get(key, {}).get(self.func_counter[key]) is _RECOMPUTE
        # older torch: what the policy does not save, the mode re-runs
        policy = self.policy_fn(tuc.SelectiveCheckpointContext(is_recompute=True), func,
                                *args, **(kwargs or {}))
        if isinstance(policy, bool):
            policy = policy_from_bool(policy)
        return policy not in (tuc.CheckpointPolicy.MUST_SAVE, tuc.CheckpointPolicy.PREFER_SAVE)


class TorchSAC:
    """``torch.utils.checkpoint.checkpoint`` with ``create_selective_checkpoint_contexts``,
    keeping hold of the context pairs.

    ``sac = TorchSAC(policy)``; ``sac.checkpoint(fn, *args)`` checkpoints ``fn`` (any number
    of calls: one context pair each). After forward, :meth:`cached_bytes` sums the unique
    storages held in the SAC caches (the values the policy saves); after backward,
    ``sac.recomputed`` counts the ops re-run by the recompute (cache hits and ignored ops
    such as ``detach`` excluded). :meth:`reset` forgets the pairs and counts.

    ``policy`` is what ``create_selective_checkpoint_contexts`` takes: a list of
    OpOverloads or a policy function.
    """

    def __init__(self, policy: Any = TORCH_SAVE_MATMUL_OPS, *,
                 allow_cache_entry_mutation: bool = False) -> None:
        self.policy = policy
        self.allow_cache_entry_mutation = allow_cache_entry_mutation
        self.storages: list[Any] = []
        self.recomputed: Counter = Counter()

    def reset(self) -> None:
        self.storages.clear()
        self.recomputed.clear()

    def context_fn(self) -> tuple[TorchDispatchMode, TorchDispatchMode]:
        caching, _ = tuc.create_selective_checkpoint_contexts(
            self.policy, self.allow_cache_entry_mutation)
        self.storages.append(caching.storage)
        return caching, _CountingCachedMode(caching.storage, self,
                                            self.allow_cache_entry_mutation,
                                            getattr(caching, "policy_fn", None))

    def checkpoint(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self.calls = getattr(self, "calls", 0) + 1
        return tuc.checkpoint(fn, *args, use_reentrant=False, context_fn=self.context_fn,
                              **kwargs)

    def cached_tensors(self) -> Iterator[torch.Tensor]:
        """Tensors in the caches now (before backward consumes them)."""
        for storage in self.storages:
            for per_op in storage.values():  # op -> {call: entry} (a list before 2.13)
                for entry in (per_op.values() if isinstance(per_op, dict) else per_op):
                    leaves, _ = pytree.tree_flatten(entry)
                    for leaf in leaves:
                        if isinstance(leaf, VersionWrapper) and \
                                isinstance(leaf.val, torch.Tensor):
                            yield leaf.val

    def cached_bytes(self, exclude: Iterable[int] = ()) -> int:
        meter = SavedBytes(exclude)
        for t in self.cached_tensors():
            meter.add(t)
        return meter.nbytes

    @property
    def recomputed_ops(self) -> int:
        return sum(self.recomputed.values())

    def wrap_blocks(self, model: nn.Module) -> Callable[[], None]:
        """Make every ``model.blocks[i]`` run under :meth:`checkpoint`; returns an undo."""
        return wrap_blocks(model, lambda i, fwd: lambda *a, **k: self.checkpoint(fwd, *a, **k))


def wrap_blocks(model: nn.Module, wrap: Callable[[int, Callable[..., Any]], Callable[..., Any]]
                ) -> Callable[[], None]:
    """Replace ``model.blocks[i].forward`` by ``wrap(i, forward)``; returns a function that
    puts the original forwards back. The module objects themselves are not replaced. A
    block that is not a module (a function, a ``functools.partial``, a builtin such as
    ``torch.tanh``) has no forward to swap: its entry in ``model.blocks`` (a list or a
    tuple) becomes ``wrap(i, block)`` instead, put back by the undo as well."""
    originals, blocks = [], model.blocks
    before = list(blocks)
    swapped = list(before)
    for i, block in enumerate(before):
        if isinstance(block, nn.Module):
            originals.append((block, vars(block).get("forward", _MISSING)))
            block.forward = wrap(i, block.forward)
        else:
            swapped[i] = wrap(i, block)
    loose = any(not isinstance(b, nn.Module) for b in before)
    if loose:
        if isinstance(blocks, list):
            blocks[:] = swapped
        else:
            model.blocks = type(blocks)(swapped)

    def undo() -> None:
        for block, previous in originals:
            if previous is _MISSING:
                del block.forward
            else:
                block.forward = previous
        if loose:
            if isinstance(blocks, list):
                blocks[:] = before
            else:
                model.blocks = blocks
    return undo


@contextlib.contextmanager
def wrapped_blocks(model: nn.Module,
                   wrap: Callable[[int, Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    """``with wrapped_blocks(model, wrap): ...`` — :func:`wrap_blocks` for the block's duration."""
    undo = wrap_blocks(model, wrap)
    try:
        yield
    finally:
        undo()


@contextlib.contextmanager
def torch_sac_blocks(model: nn.Module, sac: TorchSAC) -> Iterator[TorchSAC]:
    """``with torch_sac_blocks(model, sac): ...`` runs the blocks under upstream SAC."""
    undo = sac.wrap_blocks(model)
    try:
        yield sac
    finally:
        undo()


# --------------------------------------------------------------------------------------
# One measured step per strategy
# --------------------------------------------------------------------------------------

@dataclasses.dataclass
class StepResult:
    """What one measured forward+backward of a strategy kept and did.

    ``saved_bytes``: activation bytes kept for backward at the end of forward (unique
    storages; parameters and buffers excluded), inside and outside the checkpointed blocks.
    ``policy_bytes``: the part kept because the policy said save (upstream SAC: its cache;
    sac_compile: its runtime's ``saved_bytes``); ``None`` without checkpointing.
    ``recomputed_ops``: ATen ops re-run in backward. ``grads``: see ``gradients.grads_of``.
    """

    strategy: str
    saved_bytes: int
    policy_bytes: int | None
    recomputed_ops: int
    grads: dict[str, torch.Tensor]
    note: str = ""
    # torch's checkpoint stashes the CPU generator's state per call (preserve_rng_state),
    # outside autograd's saved tensors: not in saved_bytes; compiled splits that recompute
    # a random op list their RNG states as saved values.
    rng_state_bytes: int = 0


def _step(model: nn.Module, inputs: tuple, seed: int, loss: Callable[[Any], torch.Tensor],
          forward_ctx: Callable[[], Any]) -> tuple[Any, torch.Tensor]:
    clear_grads(model, inputs)
    torch.manual_seed(seed)
    with forward_ctx() as ctx:
        out = loss(model(*inputs))
    return ctx, out


def measure_noac(model: nn.Module, inputs: tuple, *, seed: int = 0,
                 loss: Callable[[Any], torch.Tensor] | None = None) -> StepResult:
    """No checkpointing: bytes are what autograd packs (a :class:`SavedBytes` pair)."""
    exclude = param_storages(model)
    meter, out = _step(model, inputs, seed, loss or loss_fn, lambda: SavedBytes(exclude))
    out.backward()
    grads = grads_of(model, inputs)
    clear_grads(model, inputs)
    return StepResult("no AC", meter.nbytes, None, 0, grads)


def measure_torch_sac(model: nn.Module, inputs: tuple, policy: Any = TORCH_SAVE_MATMUL_OPS, *,
                      seed: int = 0, loss: Callable[[Any], torch.Tensor] | None = None,
                      strategy: str = "torch SAC") -> StepResult:
    """Every block under upstream SAC with ``policy``.

    Bytes: the unique storages in its caches after forward (``policy_bytes``) together with
    what autograd packs outside the checkpointed functions, the checkpoints' saved inputs
    included. Recomputed ops: cache misses of its recompute-side dispatch mode.
    """
    exclude = param_storages(model)
    sac = TorchSAC(policy)

    @contextlib.contextmanager
    def ctx() -> Iterator[SavedBytes]:
        with torch_sac_blocks(model, sac), SavedBytes(exclude) as outside:
            yield outside

    outside, out = _step(model, inputs, seed, loss or loss_fn, ctx)
    total = SavedBytes(exclude)
    total.storages.update(outside.storages)
    for t in sac.cached_tensors():
        total.add(t)
    policy_bytes = sac.cached_bytes(exclude)
    out.backward()
    grads = grads_of(model, inputs)
    clear_grads(model, inputs)
    rng = getattr(sac, "calls", 0) * int(torch.get_rng_state().numel())
    return StepResult(strategy, total.nbytes, policy_bytes, sac.recomputed_ops, grads,
                      rng_state_bytes=rng)


# --------------------------------------------------------------------------------------
# Ops and time
# --------------------------------------------------------------------------------------

class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func] += 1
        return func(*args, **(kwargs or {}))


def count_aten_ops(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Counter:
    """ATen ops (after autograd, as a dispatch mode sees them) dispatched by ``fn(*args)``."""
    with _OpCounter() as counter:
        fn(*args, **kwargs)
    return counter.ops


@dataclasses.dataclass
class Timing:
    samples: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)


def interleaved_medians(fns: dict[str, Callable[[], Any]], *, reps: int = 7, warmup: int = 1,
                        budget_s: float | None = None) -> dict[str, Timing]:
    """Time each zero-argument ``fn`` ``reps`` times, round-robin (the order rotates each
    round so no strategy always runs first), after ``warmup`` untimed rounds.

    Garbage collection runs between calls and is disabled during them. With ``budget_s``,
    rounds stop early (after at least 3) once the budget is spent.
    """
    names = list(fns)
    for _ in range(warmup):
        for n in names:
            fns[n]()
    out = {n: Timing([]) for n in names}
    start = time.perf_counter()
    gc_was_enabled = gc.isenabled()
    try:
        for r in range(reps):
            order = names[r % len(names):] + names[:r % len(names)]
            for n in order:
                gc.collect()
                gc.disable()
                t0 = time.perf_counter()
                fns[n]()
                out[n].samples.append(time.perf_counter() - t0)
                gc.enable()
            if budget_s is not None and r >= 2 and time.perf_counter() - start > budget_s:
                break
    finally:
        if gc_was_enabled:
            gc.enable()
    return out


def paired(timings: dict[str, Timing], a: str, b: str,
           op: Callable[[float, float], float] = lambda x, y: x / y) -> float:
    """Median over rounds of ``op(a's sample, b's sample)`` from the same round of
    :func:`interleaved_medians` (default: the ratio a/b). Pairing by round cancels slow
    drifts of the machine's load, which medians of each strategy alone do not."""
    return statistics.median(op(x, y) for x, y in zip(timings[a].samples, timings[b].samples))
