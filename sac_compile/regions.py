"""Regions: where a policy applies (``sac_region``, ``checkpoint``), and per-tensor
opinions (``tag``, ``name``). Eager calls go to the eager runtime; under
``torch.compile`` they go to the compiler's region support."""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

from . import eager
from .policy import (CheckpointError, CheckpointPolicy, Opinion, PolicyLike, RegionFrame,
                     SaveWithHooks, coerce_opinion, foreign_tensor_message, normalize_policy)

T = TypeVar("T")


def _region_name(target: Any) -> str:
    if isinstance(target, nn.Module):
        return type(target).__name__
    return getattr(target, "__qualname__", None) or getattr(target, "__name__", None) \
        or type(target).__name__


class sac_region:  # noqa: N801 - used like a decorator/context manager, as torch's are
    """A selective-checkpointing region with ``policy``.

    Use it as a decorator on a function, apply it to an ``nn.Module`` instance (its
    forward becomes the region; the module is returned), or as a context manager in
    eager mode. Regions nest: opinions resolve outermost to innermost, MUST beats PREFER.
    """

    def __init__(self, policy: PolicyLike = "recompute_all", *, name: str | None = None,
                 allow_cache_entry_mutation: bool = False) -> None:
        self.policy = normalize_policy(policy)
        self.name = name
        self.allow_cache_entry_mutation = allow_cache_entry_mutation
        self._context: Any = None

    def _frame(self, target: Any) -> RegionFrame:
        return RegionFrame(self.name or _region_name(target), self.policy)

    def __call__(self, target: T) -> T:
        if isinstance(target, nn.Module):
            frame = self._frame(target)
            forward = target.forward
            target.forward = functools.wraps(forward)(self._wrap(frame, forward))
            return target
        if not callable(target):
            raise TypeError(f"sac_region(...) must decorate a function or be applied to an "
                            f"nn.Module, got {target!r} of type {type(target).__name__}")
        return functools.wraps(target)(self._wrap(self._frame(target), target))  # type: ignore

    def _wrap(self, frame: RegionFrame, fn: Callable[..., Any]) -> Callable[..., Any]:
        allow = self.allow_cache_entry_mutation

        def region(*args: Any, **kwargs: Any) -> Any:
            return run_region(frame, fn, args, kwargs, allow)

        return region

    def __enter__(self) -> sac_region:
        if torch.compiler.is_compiling():
            raise CheckpointError(
                f"`with sac_region(...)` is eager-only; under torch.compile decorate the "
                f"function (or module) with @sac_region({self.policy!r}) instead")
        frame = RegionFrame(self.name or "sac_region", self.policy)
        self._context = eager.eager_region(frame, self.allow_cache_entry_mutation)
        self._context.__enter__()
        return self

    def __exit__(self, *exc: Any) -> bool | None:
        context, self._context = self._context, None
        return context.__exit__(*exc)

    def __repr__(self) -> str:
        return f"sac_region({self.policy!r}, name={self.name!r})"


def run_region(frame: RegionFrame, fn: Callable[..., Any], args: tuple, kwargs: dict,
               allow_cache_entry_mutation: bool = False) -> Any:
    if torch.compiler.is_compiling():
        from .compiler import regions_compiled
        return regions_compiled.run_region(frame, fn, args, kwargs, allow_cache_entry_mutation)
    with eager.eager_region(frame, allow_cache_entry_mutation):
        return fn(*args, **kwargs)


def checkpoint(fn: Callable[..., Any], *args: Any, policy: PolicyLike = "recompute_all",
               **kwargs: Any) -> Any:
    """Call ``fn(*args, **kwargs)`` as a region with ``policy``."""
    if torch.compiler.is_compiling():  # the policy is normalised where AOTAutograd traces
        from .compiler import regions_compiled
        return regions_compiled.checkpoint(fn, args, kwargs, policy, _region_name(fn))
    frame = RegionFrame(_region_name(fn), normalize_policy(policy))
    return run_region(frame, fn, args, kwargs)


def _check_tensor(what: str, tensor: Any) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} takes a tensor, got {tensor!r} of type "
                        f"{type(tensor).__name__}")


def tag(tensor: torch.Tensor, policy: CheckpointPolicy | SaveWithHooks | bool) -> torch.Tensor:
    """Decide for the op that produced ``tensor`` (the innermost opinion); returns ``tensor``."""
    _check_tensor("tag()", tensor)
    opinion = coerce_opinion(policy, "tag()", "<tag>")
    if opinion is None:
        raise TypeError("tag() needs a decision (a CheckpointPolicy, a bool or SaveWithHooks), "
                        "got None")
    if torch.compiler.is_compiling():
        from .compiler import regions_compiled
        return regions_compiled.tag(tensor, opinion)
    _redecide("tag()", tensor, tag=opinion)
    return tensor


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
    recorder = eager.active_recorder()
    if recorder is None:
        # Outside any region (or in one running as a plain no_grad forward) nothing is
        # checkpointed: the same model code runs with and without regions, as in JAX.
        return
    if not recorder.redecide(tensor, tag=tag, label=label):
        raise CheckpointError(foreign_tensor_message(what, recorder.frames[-1].name))
