"""Regions: where a policy applies (``sac_region``, ``checkpoint``, ``apply_regions``), and
per-tensor opinions (``tag``, ``name``). A region call runs through the eager runtime, or
under ``torch.compile`` through the compiler's region support (:mod:`.region_run`). On an
``nn.Module`` instance, ``sac_region`` swaps its class (:mod:`.module_regions`).
"""
from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

from . import runtime
from .module_regions import RegionConfig, wrap_module
from .budgets import ModelBudget, PeakBudget, RegionBudget, module_kind, region_budget
from .budgets.step_peak import StepPeak
from .region_steps import BudgetStep, EagerHook, MeasuredSteps, step_peak_of  # noqa: F401 (public here)
from .region_groups import frame_in_group
from .region_names import _check_target, _region_name
from .region_run import run_region
from .policy import (CheckpointError, CheckpointPolicy, Opinion, PolicyLike, RegionFrame,
                     SaveWithHooks, _is_numpy_bool, coerce_opinion, foreign_tensor_message,
                     normalize_policy)

T = TypeVar("T")

# --------------------------------------------------------------------------------------
# sac_region
# --------------------------------------------------------------------------------------

class sac_region:  # noqa: N801 - used like a decorator/context manager, as torch's are
    """A selective-checkpointing region with ``policy``.

    Use it as a decorator on a function, apply it to an ``nn.Module`` instance (its
    forward becomes the region; the same module is returned, see the module docstring),
    or as a context manager in eager mode (re-entrant and usable from several threads).
    Regions nest: opinions resolve outermost to innermost, MUST beats PREFER. Applying a
    region to a function or module that already is one nests the new region outside.

    A class, a generator function or an async function is a ``TypeError`` (calling it
    would run no tensor code inside the region).

    >>> import torch
    >>> from sac_compile import policies, sac_region
    >>> def mlp(x, w):
    ...     return (x @ w).relu() @ w
    >>> block = sac_region(policies.save_matmuls, name="block")(mlp)
    >>> x, w = torch.randn(4, 8), torch.randn(8, 8, requires_grad=True)
    >>> block(x, w).sum().backward()
    >>> with_region, w.grad = w.grad, None
    >>> mlp(x, w).sum().backward()  # the same gradients as without checkpointing
    >>> torch.equal(with_region, w.grad)
    True
    """

    def __init__(self, policy: PolicyLike = "recompute_all", *, name: str | None = None,
                 allow_cache_entry_mutation: bool = False,
                 memory_budget: float | int | str | RegionBudget | None = None) -> None:
        self.spec = policy
        self.policy = normalize_policy(policy)
        self.name = name
        self.allow_cache_entry_mutation = allow_cache_entry_mutation
        self.budget = memory_budget if isinstance(memory_budget, RegionBudget) else \
            region_budget(memory_budget)
        self._local = threading.local()  # this thread's stack of entered contexts

    def _frame(self, target: Any) -> RegionFrame:
        # Module regions share a graph across names (identical blocks); see region_groups.
        return frame_in_group(self.name or _region_name(target), self.policy,
                              self.allow_cache_entry_mutation,
                              by_name=not isinstance(target, nn.Module), budget=self.budget)

    def __call__(self, target: T) -> T:
        _check_target(target)
        if isinstance(target, nn.Module):
            config = RegionConfig(self.spec, self._frame(target), self.allow_cache_entry_mutation)
            return wrap_module(target, config)  # type: ignore[return-value]
        if not callable(target):
            raise TypeError(f"sac_region(...) must decorate a function or be applied to an "
                            f"nn.Module, got {target!r} of type {type(target).__name__}")
        return functools.wraps(target)(self._wrap(self._frame(target), target))  # type: ignore

    def _wrap(self, frame: RegionFrame, fn: Callable[..., Any]) -> Callable[..., Any]:
        allow = self.allow_cache_entry_mutation

        def region(*args: Any, **kwargs: Any) -> Any:
            return run_region(frame, fn, args, kwargs, allow)

        return region

    def _contexts(self) -> list[Any]:
        stack = getattr(self._local, "contexts", None)
        if stack is None:
            stack = self._local.contexts = []
        return stack

    def __enter__(self) -> sac_region:
        if not _dynamo_kept_out and "torch._dynamo" in sys.modules:
            _keep_dynamo_out()  # this block may be in compiled code: enter outside Dynamo
            return self.__enter__()
        if torch.compiler.is_compiling():
            raise CheckpointError(
                f"`with sac_region(...)` is eager-only; under torch.compile decorate the "
                f"function (or module) with @sac_region({self.policy!r}) instead")
        frame = RegionFrame(self.name or "sac_region", self.policy, budget=self.budget)
        context = runtime.eager_region(frame, self.allow_cache_entry_mutation)
        context.__enter__()
        self._contexts().append(context)
        return self

    def __exit__(self, *exc: Any) -> bool | None:
        return self._contexts().pop().__exit__(*exc)

    # Copies and pickles carry the configuration, not the entered contexts (those belong to
    # the thread that entered them). A pickle stores the policy as given.
    def __copy__(self) -> sac_region:
        new = object.__new__(sac_region)
        new.__dict__.update(self.__dict__)
        new._local = threading.local()
        return new

    def __deepcopy__(self, memo: dict) -> sac_region:
        return self.__copy__()

    def __reduce__(self) -> Any:
        config = RegionConfig(self.spec, RegionFrame(self.name or "sac_region", self.policy,
                                                     budget=self.budget),
                              self.allow_cache_entry_mutation)
        return (_restore_sac_region, (config, self.name))

    def __repr__(self) -> str:
        return f"sac_region({self.policy!r}, name={self.name!r})"


def _restore_sac_region(config: RegionConfig, name: str | None) -> sac_region:
    return sac_region(config.spec, name=name,
                      allow_cache_entry_mutation=config.allow_cache_entry_mutation,
                      memory_budget=config.frame.budget)


_dynamo_kept_out = False


def _keep_dynamo_out() -> None:
    """Dynamo is loaded, so this region may run inside compiled code. ``with sac_region(...)``
    enters and leaves outside Dynamo, so the block is a clean graph break whose ops go
    through the eager runtime (correct, not compiled); the runtime's own frames are never
    traced (:func:`sac_compile.runtime.keep_dynamo_out`)."""
    from .torch_internals import dynamo_disable
    global _dynamo_kept_out
    _dynamo_kept_out = True
    for name in ("__enter__", "__exit__"):
        method = sac_region.__dict__[name]
        if not getattr(method, "_sac_compile_outside_dynamo", False):
            wrapped = dynamo_disable(
                method, reason="`with sac_region(...)` runs through the eager runtime; "
                               "decorate the function or module to compile the region")
            wrapped._sac_compile_outside_dynamo = True  # type: ignore[attr-defined]
            setattr(sac_region, name, wrapped)
    runtime.keep_dynamo_out()


# --------------------------------------------------------------------------------------
# apply_regions: every matching block of a model, named by its path
# --------------------------------------------------------------------------------------

def apply_regions(model: nn.Module, policy: PolicyLike = "recompute_all", *,
                  where: type | tuple[type, ...] | Callable[[str, nn.Module], bool],
                  allow_cache_entry_mutation: bool = False,
                  memory_budget: float | int | str | None = None) -> nn.Module:
    """Make each submodule of ``model`` that ``where`` matches a region with ``policy``,
    named by its path in ``model`` (``model.layers.0``), so reports tell blocks apart.

    ``where`` is a module class (or a tuple of them), or a predicate ``(path, module)``.
    Only the outermost matches are wrapped: one region per block, not one per layer inside
    it. ``memory_budget``: bytes (an int >= 2 or a string such as ``"2GiB"``) are one budget
    for all the regions together (a price per byte found over all of them, see
    :mod:`sac_compile.budgets`); a fraction in (0, 1] is each region's own; a
    :class:`~sac_compile.budgets.PeakBudget` in bytes caps the step's peak, measured
    (eager: :mod:`sac_compile.budgets.step_peak`; compiled, give it to ``make_backend``). Returns
    ``model`` (its submodules are wrapped in place, as ``sac_region`` does)."""
    if isinstance(where, type) or (isinstance(where, tuple) and all(isinstance(c, type)
                                                                      for c in where)):
        classes = where
        matches: Callable[[str, nn.Module], bool] = lambda path, m: isinstance(m, classes)
    elif callable(where):
        matches = where
    else:
        raise TypeError(f"apply_regions(where=...) takes a module class, a tuple of classes or "
                        f"a predicate (path, module) -> bool, got {where!r}")
    found: list[tuple[str, nn.Module]] = []
    for path, module in list(model.named_modules()):
        if any(path == w or path.startswith(w + ".") for w, _ in found if w):
            continue  # inside a block already matched
        if not matches(path, module):
            continue
        found.append((path, module))
        if not path:
            break  # the model itself: everything is inside it
    if not found:
        raise ValueError(f"apply_regions: no submodule of {type(model).__name__} matches "
                         f"where={where!r}; pass the block class (e.g. type(model.layers[0])) "
                         f"or a predicate")
    peak = memory_budget if isinstance(memory_budget, PeakBudget) else None
    # (a PeakBudget: the regions share a kept-byte cap its controller sets from measured
    # steps; their RegionBudgets carry the PeakBudget, which is what they were given)
    budget = RegionBudget(peak) if peak is not None else region_budget(memory_budget)
    names = [path or _region_name(module) for path, module in found]
    kinds = tuple(module_kind(module) for _, module in found)
    shared = ModelBudget(0 if peak is not None else budget.value, tuple(names), kinds) \
        if budget is not None and not isinstance(budget.value, float) else None
    if peak is not None:
        measured = MeasuredSteps(StepPeak(peak, shared))
        # (run eagerly under a compile of the whole model: a graph break at them)
        model.register_forward_pre_hook(EagerHook(BudgetStep(shared)))
        model.register_forward_pre_hook(EagerHook(measured.begin), with_kwargs=True)
        model.register_forward_hook(EagerHook(measured.after_forward), always_call=True)
    elif shared is not None:
        # A call of the model is a step: the budget caps what a step's region calls keep
        # together (eager: its calls are counted and priced when it ends; blocks compiled
        # one by one: their graphs' runs are counted, and kinds whose split changes are
        # compiled again at the next call, never within a step).
        model.register_forward_pre_hook(BudgetStep(shared))
    for (path, module), region_name, kind in zip(found, names, kinds):
        own = RegionBudget(budget.value, shared, kind if shared is not None else "") \
            if budget is not None else None
        sac_region(policy, name=region_name, allow_cache_entry_mutation=allow_cache_entry_mutation,
                   memory_budget=own)(module)
        if peak is not None:  # where each call holds its values, in the measured steps
            module.register_forward_pre_hook(measured.region_entered)
            module.register_forward_hook(measured.region_left)
    return model


# --------------------------------------------------------------------------------------
# tag / name
# --------------------------------------------------------------------------------------

def _check_tensor(what: str, tensor: Any) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} takes a tensor, got {tensor!r} of type "
                        f"{type(tensor).__name__}")


def tag(tensor: torch.Tensor, policy: CheckpointPolicy | SaveWithHooks | bool) -> torch.Tensor:
    """Decide for the op that produced ``tensor`` (the innermost opinion); returns ``tensor``.

    >>> import torch
    >>> from sac_compile import CheckpointPolicy, explain, sac_region, tag
    >>> @sac_region("recompute_all", name="block")
    ... def block(x, w):
    ...     h = tag(x @ w, CheckpointPolicy.MUST_SAVE)  # kept, though the region recomputes
    ...     return h.sin().sin()
    >>> report = explain(block, torch.randn(4, 8), torch.randn(8, 8, requires_grad=True))
    >>> [(record.op, record.nbytes) for record in report.saved], report.recomputed
    ([('aten.mm.default', 128)], ['aten.sin.default'])
    """
    _check_tensor("tag()", tensor)
    if policy is None or not (isinstance(policy, (CheckpointPolicy, SaveWithHooks, bool))
                              or _is_numpy_bool(policy)):
        raise TypeError(_tag_type_message(policy))
    opinion = coerce_opinion(policy, "tag()", "<tag>")
    if torch.compiler.is_compiling():
        from .compiler import regions_compiled
        return regions_compiled.tag(tensor, opinion)
    _redecide("tag()", tensor, tag=opinion)
    return tensor


def _tag_type_message(policy: Any) -> str:
    hint = ""
    if isinstance(policy, str) and policy.upper() in CheckpointPolicy.__members__:
        hint = f"; use CheckpointPolicy.{policy.upper()}"
    elif isinstance(policy, str) and policy in ("save_all", "recompute_all", "save_matmuls"):
        hint = "; a preset is a region's policy (sac_region(...)), tag() takes one decision"
    return (f"tag() takes a decision for the op that produced the tensor (a CheckpointPolicy, "
            f"a bool or SaveWithHooks), got {policy!r} of type {type(policy).__name__}{hint}")


def name(tensor: torch.Tensor, label: str) -> torch.Tensor:
    """Label ``tensor`` for name-based policies (``save_only_these_names``); returns it."""
    _check_tensor("name()", tensor)
    if not isinstance(label, str):
        raise TypeError(f"name() takes a string label, got {label!r}")
    if torch.compiler.is_compiling():
        from .compiler import regions_compiled
        return regions_compiled.name(tensor, label)
    _redecide("name()", tensor, label=label)
    return tensor


def _redecide(what: str, tensor: torch.Tensor, *, tag: Opinion | None = None,
              label: str | None = None) -> None:
    recorder = runtime.active_recorder()
    if recorder is None:
        # Outside any region (or in one running as a plain no_grad forward) nothing is
        # checkpointed: the same model code runs with and without regions, as in JAX.
        return
    if not recorder.redecide(tensor, tag=tag, label=label):
        raise CheckpointError(foreign_tensor_message(what, recorder.frames[-1].name))


from .checkpoint_call import checkpoint  # noqa: E402  (it reads _region_name from here)
