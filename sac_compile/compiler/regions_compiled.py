"""``sac_region`` / ``checkpoint`` / ``tag`` / ``name`` while dynamo traces.

A region becomes torch's ``tag_activation_checkpoint`` higher-order op (through
``torch.utils.checkpoint.checkpoint`` with our ``context_fn``): dynamo traces the body once
into a subgraph, and while AOTAutograd traces it, :class:`.tagging.SACTaggingMode` writes
the decisions. Nested regions nest the modes; the innermost decides with all frames.

``tag`` and ``name`` become identity marker ops (no graph break), folded into the
producer's decision by :mod:`.normalize`.

If the body graph-breaks, dynamo cannot build the higher-order op and runs the region call
eagerly instead: the region then goes through the eager runtime (``regions.run_region``
sees ``is_compiling()`` false), which gives correct results; :func:`note_eager_fallback`
logs that once per region.

torch logs a warning (once per process) when a checkpoint with a ``context_fn`` is traced
under compile ("... make sure the checkpointed region does not contain in-place ops").
Library code prints nothing unless asked, so :func:`quiet_torch_context_fn_warning` skips it
when the ``context_fn`` is one of ours - our regions', or :func:`torch_sac_contexts`, torch's
SAC as the report runs it for comparison; a user's own ``torch.utils.checkpoint(...,
context_fn=...)`` still gets it, once, as before.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .. import graph_meta
from ..logs import warn_once_per_region
from ..policy import Opinion, RegionFrame
from ..markers import encode_opinion, name_op, tag_op
from ..region_groups import group_of_token, name_in_graph
from ..torch_internals import (CONSTANT_RESULT_TAKES_OBJECTS,
                               dynamo_graph_break)
from ..torch_patches import close_checkpoints_left_open, quiet_context_fn_warning
from .tagging import region_contexts, take_eager_entry

__all__ = ["run_region", "checkpoint", "torch_checkpoint", "tag", "name", "note_eager_fallback",
           "torch_sac_contexts", "context_fn_kind", "close_checkpoints_left_open",
           "hooks_fall_back_to_eager"]

log = logging.getLogger("sac_compile")


def run_region(frame: RegionFrame, fn: Callable[..., Any], args: tuple, kwargs: dict,
               allow_cache_entry_mutation: bool = False) -> Any:
    # Only the region's group token travels into the partials: Dynamo guards it by value.
    # The name and the policy object would be guarded too (the name: one graph per layer;
    # a closure policy: by its code alone, so closures over different values would share a
    # graph). The group (sac_compile.region_groups) holds the policy and the names.
    slot = frame.slot
    if slot is None:
        # A region made while Dynamo traces (sac_region applied inside compiled code) has
        # no group: its policy's identity cannot be computed in traced code. Its name and
        # policy travel as constants, guarded by Dynamo, as a checkpoint() call's do.
        context_fn = functools.partial(policy_contexts, frame.name, frame.policy,
                                       allow_cache_entry_mutation)
        body = functools.partial(_checkpoint_body, frame.name, frame.policy,
                                 allow_cache_entry_mutation, fn)
    else:
        context_fn = functools.partial(region_contexts, slot.token)
        body = functools.partial(_region_body, slot.token, fn)
    try:
        return torch_checkpoint(body, args, kwargs, context_fn)
    except BaseException as e:  # reached when the call runs as Python (a graph break)
        close_checkpoints_left_open(e)
        raise


def region_checkpoints(gm: torch.fx.GraphModule) -> Iterator[tuple[torch.fx.Node, Any, Any]]:
    """``(node, body, context_fn)`` of every checkpoint call in Dynamo's graph ``gm`` (and
    its subgraphs) whose ``context_fn`` is one of our regions'."""
    for owner in gm.modules():
        if not isinstance(owner, torch.fx.GraphModule):
            continue
        for node in owner.graph.find_nodes(op="call_function", target=_CHECKPOINT_HOP):
            body = getattr(owner, getattr(node.args[0], "target", ""), None)
            context_fn = graph_meta.checkpoint_context_fn(body)
            if context_fn_kind(context_fn) == "region":
                yield node, body, context_fn


def name_regions(gm: torch.fx.GraphModule) -> int:
    """Give each region of Dynamo's graph ``gm`` its own name: regions of one group (the
    blocks of a model compiled whole) share a token, so the ``context_fn`` torch will call
    becomes ``partial(region_contexts, token, name, together)``, the name read from the
    checkpoint node's module stack (:func:`sac_compile.region_groups.name_in_graph`),
    ``together`` the names of the group's members in this graph. The graph's guards are
    already built: the name is data here. Returns how many were renamed."""
    found: list[tuple[Any, str, str]] = []  # (the body, its token, its member's name)
    for node, body, context_fn in region_checkpoints(gm):
        if len(context_fn.args) != 1:
            continue
        token = context_fn.args[0]
        found.append((body, token, name_in_graph(group_of_token(token), node)))
    # The members of a group in this one graph are each decided under their own name: the
    # check that a group's members decide alike (.group_check) need not split them.
    together: dict[str, set[str]] = {}
    for _, token, name in found:
        together.setdefault(token, set()).add(name)
    renamed = 0
    for body, token, name in found:
        here = frozenset(together[token])
        if name != group_of_token(token).name or len(here) > 1:
            graph_meta.set_checkpoint_context_fn(body, functools.partial(
                region_contexts, token, name, here))
            renamed += 1
    return renamed


_CHECKPOINT_HOP = torch.ops.higher_order.tag_activation_checkpoint


def _region_body(token: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The region's body. Traced by dynamo, it is just ``fn``. Run eagerly - dynamo broke the
    graph inside the region and executes the checkpoint call as Python - it runs ``fn``
    through the eager runtime, whose saved-tensor hooks take over from torch's checkpoint
    (nothing is left for torch to recompute, so the user's Python runs once)."""
    if torch.compiler.is_compiling():
        if _PROBE_HOOKS_WHILE_TRACED and _untraceable_hooks(token):
            dynamo_graph_break()  # the region then runs through the eager runtime
        return fn(*args, **kwargs)
    group = group_of_token(token)
    return _run_eagerly(RegionFrame(group.name, group.policy, budget=group.budget),
                        group.allow, fn, args, kwargs)


def _checkpoint_body(name: str, policy: Any, allow: bool, fn: Callable[..., Any], *args: Any,
                     **kwargs: Any) -> Any:
    """:func:`_region_body` of a ``sac_compile.checkpoint`` call (its raw policy and name)."""
    if torch.compiler.is_compiling():
        if _PROBE_HOOKS_WHILE_TRACED and _untraceable_checkpoint_hooks(name, policy):
            dynamo_graph_break()
        return fn(*args, **kwargs)
    from ..policy import normalize_policy
    return _run_eagerly(RegionFrame(name, normalize_policy(policy)), allow, fn, args, kwargs)


def _run_eagerly(frame: RegionFrame, allow: bool, fn: Callable[..., Any], args: tuple,
                 kwargs: dict) -> Any:
    from .. import runtime
    note_eager_fallback(frame)
    if take_eager_entry():  # our context_fn already runs this call through the eager runtime
        return fn(*args, **kwargs)
    with runtime.eager_region(frame, allow):
        return fn(*args, **kwargs)


_HOOKS_FALLBACK: set[str] = set()  # regions run eagerly for their hooks (one warning, not two)

# torch >= 2.12 (the gate and why: torch_internals.CONSTANT_RESULT_TAKES_OBJECTS). Before,
# the hooks are not probed before tracing: untraceable hooks are the partitioner's
# CheckpointError, which says that the eager fallback needs torch >= 2.12.
_PROBE_HOOKS_WHILE_TRACED = CONSTANT_RESULT_TAKES_OBJECTS


def hooks_fall_back_to_eager() -> bool:
    """Whether a region whose policy returns hooks that cannot be traced runs through the
    eager runtime under compile (torch >= 2.12), rather than raising the partitioner's
    ``CheckpointError``."""
    return _PROBE_HOOKS_WHILE_TRACED


@torch.compiler.assume_constant_result
def _untraceable_hooks(token: str) -> bool:
    """Whether the region's policy can return ``SaveWithHooks`` that cannot be traced into
    the compiled graphs (Python on tensor values, ``.item()``...). Such a region runs
    through the eager runtime, where hooks run as Python; warned once per region. Run
    once per trace (a constant to Dynamo)."""
    group = group_of_token(token)
    return _falls_back_for_hooks(group.name, group.policy)


@torch.compiler.assume_constant_result
def _untraceable_checkpoint_hooks(name: str, policy: Any) -> bool:
    from ..policy import normalize_policy
    return _falls_back_for_hooks(name, normalize_policy(policy))


def _falls_back_for_hooks(name: str, policy: Any) -> bool:
    from .save_hooks import untraceable_hooks
    try:
        why = untraceable_hooks(policy)
    except Exception:  # an unusual policy object: the partitioner still checks each value
        return False
    if why is None:
        return False
    _HOOKS_FALLBACK.add(name)
    warn_once_per_region(
        "untraceable-hooks", name,
        f"sac_region {name!r}: {why}; under torch.compile hooks are traced into the compiled "
        f"graphs, so this region runs through the eager runtime instead (correct, not "
        f"compiled). To compile it, write pack/unpack as torch code on tensors without "
        f".item() or Python branches on values (warned once per region)", stacklevel=4)
    log.info("sac_compile: region %r runs through the eager runtime: %s", name, why)
    return True


def checkpoint(fn: Callable[..., Any], args: tuple, kwargs: dict, policy: Any,
               name: str, allow_cache_entry_mutation: bool = False) -> Any:
    """``sac_compile.checkpoint`` under compile: the raw policy (a list of ops, a preset
    name, a function) is a constant dynamo can guard; it is normalised at trace time.
    ``name`` was computed by ``regions._region_name`` while dynamo traced, by the same rule
    as in eager mode."""
    context_fn = functools.partial(policy_contexts, name, policy)
    body = functools.partial(_checkpoint_body, name, policy, allow_cache_entry_mutation, fn)
    return torch_checkpoint(body, args, kwargs, context_fn)


# torch's checkpoint takes these keywords itself: the function's own go into its partial
_TORCH_CHECKPOINT_KEYWORDS = frozenset(("function", "use_reentrant", "context_fn",
                                        "determinism_check", "debug", "early_stop",
                                        "preserve_rng_state"))


def torch_checkpoint(body: Callable[..., Any], args: tuple, kwargs: dict,
                     context_fn: Callable[[], Any]) -> Any:
    """``torch.utils.checkpoint.checkpoint(body, *args, **kwargs)`` with our contexts, where
    keywords of the region's function named like torch's own (``debug=``, ...) reach the
    function instead of torch's checkpoint."""
    if any(k in _TORCH_CHECKPOINT_KEYWORDS for k in kwargs):
        body = functools.partial(body, **{k: v for k, v in kwargs.items()
                                          if k in _TORCH_CHECKPOINT_KEYWORDS})
        kwargs = {k: v for k, v in kwargs.items() if k not in _TORCH_CHECKPOINT_KEYWORDS}
    return torch.utils.checkpoint.checkpoint(body, *args, use_reentrant=False,
                                             context_fn=context_fn, **kwargs)


def policy_contexts(name: str, policy: Any, allow: bool = False) -> Any:
    from ..policy import normalize_policy
    from .tagging import frame_contexts
    return frame_contexts(RegionFrame(name, normalize_policy(policy)), allow)


def tag(tensor: torch.Tensor, opinion: Opinion) -> torch.Tensor:
    return tag_op(tensor, encode_opinion(opinion))


def name(tensor: torch.Tensor, label: str) -> torch.Tensor:
    return name_op(tensor, label)


def context_fn_kind(context_fn: Any) -> str | None:
    """``"region"`` (``partial(region_contexts, token)``), ``"checkpoint"``
    (``partial(policy_contexts, name, raw_policy)``), or None: not one of ours."""
    func = getattr(context_fn, "func", None)
    if func is region_contexts:
        return "region"
    if func is policy_contexts:
        return "checkpoint"
    return None


def torch_sac_contexts(policy: Any) -> Any:
    """torch's own ``create_selective_checkpoint_contexts(policy)``, for sac_compile code
    that runs torch's SAC on purpose (the report's "torch SAC" rows compare against it):
    pass ``functools.partial(torch_sac_contexts, ops)`` as the ``context_fn``. torch's
    context_fn warning is skipped for it as for our regions (Dynamo rebuilds the partial,
    but keeps its function, which is what :func:`_is_ours` looks at)."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts
    return create_selective_checkpoint_contexts(policy)


#: Other context functions of ours (the per-call form registers its own on import).
OUR_CONTEXT_FNS: list[Any] = [torch_sac_contexts]


def _is_ours(context_fn: Any) -> bool:
    return context_fn_kind(context_fn) is not None or \
        getattr(context_fn, "func", None) in OUR_CONTEXT_FNS


def quiet_torch_context_fn_warning() -> None:
    """Skip torch's context_fn warning when the caller's ``context_fn`` (the
    ``tag_activation_checkpoint`` implementation's local, or on torch 2.11 its
    ``gmod.meta["_checkpoint_context_fn"]``) is ours; every other call goes to torch's
    ``warning_once`` unchanged, cache included. The rebinding itself is quarantined in
    :func:`sac_compile.torch_patches.quiet_context_fn_warning` (idempotent)."""
    quiet_context_fn_warning(_is_ours)


quiet_torch_context_fn_warning()


def note_eager_fallback(frame: RegionFrame) -> None:
    """Say once per region name, by default (a ``UserWarning``, and the ``sac_compile``
    log), that a compiled region graph-broke and runs through the eager runtime: correct,
    but not what the user compiled for, so it must not pass unseen."""
    message = ("sac_compile: region %r graph-broke under torch.compile; it runs through "
               "the eager runtime (correct, but not compiled)")
    if frame.name in _HOOKS_FALLBACK:  # already said why (untraceable hooks)
        return
    if warn_once_per_region(
            "graph break", frame.name,
            message % (frame.name,) + ". TORCH_LOGS=graph_breaks shows where; a common cause "
            "is a KV cache (Hugging Face: config.use_cache=False for training) (warned once "
            "per region)", stacklevel=2):
        log.warning(message, frame.name)
