"""One region call: through the eager runtime, or, while Dynamo traces, through the
compiler's region support (:mod:`sac_compile.compiler.regions_compiled`)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import runtime
from .logs import warn_once_per_region
from .policy import RegionFrame

__all__ = ["run_region"]


def run_region(frame: RegionFrame, fn: Callable[..., Any], args: tuple, kwargs: dict,
               allow_cache_entry_mutation: bool = False) -> Any:
    if torch.compiler.is_compiling():
        from .compiler import regions_compiled
        return regions_compiled.run_region(frame, fn, args, kwargs, allow_cache_entry_mutation)
    if torch.jit.is_tracing():
        _warn_jit_trace(frame)
    with runtime.eager_region(frame, allow_cache_entry_mutation):
        return fn(*args, **kwargs)


def _warn_jit_trace(frame: RegionFrame) -> None:
    warn_once_per_region(
        "jit.trace", frame.name,
        f"torch.jit.trace records the ops of sac_region {frame.name!r} without its "
        f"checkpointing: the traced module saves what plain autograd saves. Trace the model "
        f"for inference only, or use torch.compile(model, backend=sac_compile.sac_backend) to "
        f"keep the region (warned once per region)", stacklevel=3)
