"""The checkpointing strategies the report compares, as wrappers of a model's blocks,
and the eager measurement of ours (the others are in :mod:`.measure`).

A model is measured per block: ``model.blocks[i]`` runs as full AC, torch SAC, or our
region ``blocks.{i}``. A model without ``.blocks`` (or a plain function) is one block.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.utils.checkpoint as tuc

from .. import runtime
from ..regions import sac_region
from ..tensor_memory import param_storages
from ..torch_internals import pytree
from .measure import TORCH_SAVE_MATMUL_OPS, SavedBytes, StepResult, wrapped_blocks
from .gradients import clear_grads, grads_of, loss_fn

__all__ = ["UnusableModel", "as_blocked_model", "copy_model", "loss_of", "full_ac", "torch_sac",
           "torch_sac_with", "torch_sac_prefer", "ours", "ours_blocks", "measure_ours"]


class UnusableModel(ValueError):
    """The model cannot be measured as given (e.g. nothing to differentiate); the message
    says what to change."""


class _CallableModule(nn.Module):
    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)


class _WholeModel(nn.Module):
    """A model without ``.blocks`` (or a plain function), checkpointed as one block."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        inner = inner if isinstance(inner, nn.Module) else _CallableModule(inner)
        self.blocks = nn.ModuleList([inner])

    def forward(self, *args: Any) -> Any:
        return self.blocks[0](*args)


def as_blocked_model(fn: Any) -> nn.Module:
    """``fn`` if it has a ``.blocks`` list, else ``fn`` as the only block."""
    if isinstance(fn, nn.Module) and isinstance(getattr(fn, "blocks", None), (nn.ModuleList, list,
                                                                               tuple)):
        return fn
    return _WholeModel(fn)


def copy_model(model: nn.Module) -> nn.Module:
    """``copy.deepcopy(model)``, where blocks that are functions closing over the model
    (``self.blocks = [lambda x: f(x, self.w)]``) compute with the copy's parameters too:
    deepcopy keeps a function as it is, so the copy's block would read the original's.
    Their closure cells are copied with the model's memo. (Bound methods, ``partial``s and
    modules are copied by deepcopy itself.)"""
    memo: dict[int, Any] = {}
    new = copy.deepcopy(model, memo)
    blocks = getattr(new, "blocks", None)
    if not isinstance(blocks, (list, tuple)):
        return new
    copied = [_copy_closure(b, memo) if isinstance(b, types.FunctionType) and b.__closure__
              else b for b in blocks]
    if isinstance(blocks, list):
        blocks[:] = copied
    else:
        new.blocks = type(blocks)(copied)
    return new


def _copy_closure(fn: types.FunctionType, memo: dict[int, Any]) -> types.FunctionType:
    cells = []
    for cell in fn.__closure__:
        try:
            cells.append(types.CellType(copy.deepcopy(cell.cell_contents, memo)))
        except ValueError:  # an empty cell (a name bound later in the enclosing function)
            cells.append(types.CellType())
    out = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__,
                             tuple(cells))
    out.__kwdefaults__, out.__qualname__ = fn.__kwdefaults__, fn.__qualname__
    out.__dict__.update(fn.__dict__)
    return out


def loss_of(out: Any) -> torch.Tensor:
    """The fixtures' loss (``out.sum()``), extended to outputs that are tuples/dicts."""
    if isinstance(out, torch.Tensor) and out.requires_grad:
        return out.sum()
    leaves = [t for t in pytree.tree_leaves(out)
              if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    if not leaves:
        raise UnusableModel(
            "the model's output has no floating-point tensor that requires grad (do its "
            "parameters or inputs require grad? e.g. a model frozen with requires_grad_(False), "
            "or built under torch.no_grad()); the report runs forward and backward, so give "
            "it a model with trainable parameters or inputs with requires_grad=True")
    return functools.reduce(lambda a, b: a + b, (t.float().sum() for t in leaves))


# --------------------------------------------------------------------------------------
# Block wrappers: (block index, its forward) -> the forward the strategy runs
# --------------------------------------------------------------------------------------

def full_ac(i: int, fwd: Callable[..., Any]) -> Callable[..., Any]:
    return lambda *a, **k: tuc.checkpoint(fwd, *a, use_reentrant=False, **k)


def torch_sac_with(policy: Any) -> Callable[[int, Callable[..., Any]], Callable[..., Any]]:
    """Block wrappers running torch's own SAC with ``policy`` (a policy function or a
    list of ops to save), on purpose through torch_sac_contexts, so that torch's
    "context_fn under torch.compile" warning stays out of the report's output."""
    def wrap(i: int, fwd: Callable[..., Any]) -> Callable[..., Any]:
        from ..compiler.regions_compiled import torch_sac_contexts
        ctx = functools.partial(torch_sac_contexts, policy)
        return lambda *a, **k: tuc.checkpoint(fwd, *a, use_reentrant=False, context_fn=ctx,
                                              **k)
    return wrap


#: torch's SAC saving the matmuls and attention (the report's row).
torch_sac = torch_sac_with(TORCH_SAVE_MATMUL_OPS)


def torch_sac_prefer(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """torch SAC's relaxed form: matmuls and attention PREFER_SAVE, the rest
    PREFER_RECOMPUTE (what torch's activation_memory_budget may trade)."""
    from ..policies import MATMUL_OPS
    from ..policy import CheckpointPolicy as CP
    return CP.PREFER_SAVE if op in MATMUL_OPS else CP.PREFER_RECOMPUTE


def ours(policy: Any, budget: Any = None, n_blocks: int = 0
         ) -> Callable[[int, Callable[..., Any]], Callable[..., Any]]:
    """Block ``i`` as ``sac_region(policy, name=f"blocks.{i}")``; with ``budget``, each
    with it as ``apply_regions`` gives it (bytes: one budget for the ``n_blocks`` blocks
    together), the budgets made once so that their plans persist across steps."""
    budgets = _block_budgets(budget, n_blocks) if budget is not None else None

    def wrap(i: int, fwd: Callable[..., Any]) -> Callable[..., Any]:
        own = budgets[i] if budgets is not None else None
        return sac_region(policy, name=f"blocks.{i}", memory_budget=own)(fwd)
    return wrap


def _block_budgets(budget: Any, n: int) -> list[Any]:
    from ..budgets import ModelBudget, RegionBudget, region_budget
    value = region_budget(budget).value
    shared = None if isinstance(value, float) else \
        ModelBudget(value, tuple(f"blocks.{i}" for i in range(n)))
    return [RegionBudget(value, shared) for _ in range(n)]


def ours_blocks(model: nn.Module, policy: Any = "save_matmuls",
                on_call: Callable[[tuple], None] | None = None,
                regions: Callable[..., Any] | None = None) -> contextlib.AbstractContextManager:
    """Run every ``model.blocks[i]`` as ``sac_region(policy, name=f"blocks.{i}")`` while the
    context is active (the module objects are not replaced). ``on_call(args)`` sees the
    arguments of every region call."""

    def wrap(i: int, fwd: Callable[..., Any]) -> Callable[..., Any]:
        region = regions(i, fwd) if regions is not None else \
            sac_region(policy, name=f"blocks.{i}")(fwd)
        if on_call is None:
            return region

        def observed(*args: Any, **kwargs: Any) -> Any:
            on_call(args)
            return region(*args, **kwargs)
        return observed

    return wrapped_blocks(model, wrap)


def measure_ours(model: nn.Module, inputs: tuple, policy: Any = "save_matmuls", *,
                 seed: int = 0, loss: Callable[[Any], torch.Tensor] = loss_fn,
                 strategy: str = "sac_compile", regions: Callable[..., Any] | None = None
                 ) -> StepResult:
    """Every block as an eager region with ``policy`` (or as ``regions(i, forward)``
    makes it); figures from ``collect_stats()``."""
    exclude = param_storages(model)
    region_inputs = SavedBytes(exclude)

    def record_inputs(args: tuple) -> None:
        for a in args:
            region_inputs.add(a)

    clear_grads(model, inputs)
    torch.manual_seed(seed)
    with runtime.collect_stats() as stats:
        with ours_blocks(model, policy, record_inputs, regions), \
                SavedBytes(exclude) as outside:
            out = loss(model(*inputs))
        policy_bytes = stats.saved_bytes
        out.backward()
    recomputed = stats.recomputed_ops
    recomputed = recomputed if isinstance(recomputed, int) else len(recomputed)
    # Storages seen both outside and as region inputs count once; the runtime's own saved
    # values cannot be matched against them (the stats hold sizes, not tensors), so a value
    # saved by one region and passed into the next would count twice: never in our favour.
    others = SavedBytes(exclude)
    others.storages.update(outside.storages)
    others.storages.update(region_inputs.storages)
    grads = grads_of(model, inputs)
    clear_grads(model, inputs)
    result = StepResult(strategy, policy_bytes + others.nbytes, policy_bytes, recomputed, grads)
    result.note = "\n".join(dict.fromkeys(stats.budget_notes))
    return result
