"""``sac_compile.checkpoint`` under ``torch.compile`` with a policy built per call
(:mod:`sac_compile.per_call`): torch's ``context_fn=lambda: create_selective_checkpoint_
contexts(make_policy())``, or ``policy=per_call(make_policy)`` written in the compiled code.

As for torch's own checkpoint, the ``context_fn`` (or the factory) travels into torch's
``tag_activation_checkpoint`` op inside a ``functools.partial`` that Dynamo keeps as a
constant; it is called while AOTAutograd traces the region - once per region trace - and
the policy it gives tags the joint graph (:mod:`.tagging`). Nothing is built inside the
traced code. If the body graph-breaks, the checkpoint call runs as Python
and the region goes through the eager runtime with the policy of that call.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ..per_call import build
from ..policy import CheckpointError, RegionFrame
from .regions_compiled import OUR_CONTEXT_FNS, note_eager_fallback, torch_checkpoint
from .tagging import frame_contexts, reraise_compiled, take_eager_entry

__all__ = ["checkpoint_per_call", "per_call_contexts"]


def checkpoint_per_call(fn: Callable[..., Any], args: tuple, kwargs: dict, make: Any,
                        kind: str, name: str) -> Any:
    contexts = functools.partial(per_call_contexts, name, make, kind)
    body = functools.partial(_body, name, make, kind, fn)
    return torch_checkpoint(body, args, kwargs, contexts)


def per_call_contexts(name: str, make: Any, kind: str) -> Any:
    """The region's contexts for this trace (or this eager run), with the policy built
    for it (:func:`sac_compile.per_call.build`)."""
    try:
        policy, allow = build(make, kind, name)
    except CheckpointError as e:
        reraise_compiled(e)  # raised to the user as is, not as a backend failure
    return frame_contexts(RegionFrame(name, policy), allow)


def _body(name: str, make: Any, kind: str, fn: Callable[..., Any], *args: Any,
          **kwargs: Any) -> Any:
    """Traced by Dynamo: ``fn``. Run as Python (a graph break in the region): through the
    eager runtime, which :func:`per_call_contexts` entered already for this call."""
    if torch.compiler.is_compiling():
        return fn(*args, **kwargs)
    from .. import runtime
    note_eager_fallback(RegionFrame(name, make))  # (reads the name only)
    if take_eager_entry():
        return fn(*args, **kwargs)
    policy, allow = build(make, kind, name)
    with runtime.eager_region(RegionFrame(name, policy), allow):
        return fn(*args, **kwargs)


OUR_CONTEXT_FNS.append(per_call_contexts)  # torch's context_fn warning: ours, quiet
