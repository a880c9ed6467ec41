"""Quarantine: where sac_compile reads torch's stack frames or rebinds a torch function.

Each of these depends on torch's code, not its API: a local variable's name, a function's
name, a module global torch calls through. Each was written against the torch versions in
:data:`WRITTEN_AGAINST`, and ``tests/test_torch_internals.py`` checks, on the torch it runs
with, that what it looks for is still there (and fails on a torch none was verified on).
No other module of the package reads a frame or assigns to a torch module's attribute
(the same test walks the package for it).

1. :func:`partition_fn_on_stack`: AOTAutograd's ``partition_fn`` while it traces a joint
   graph (who will split it: ours or torch's?). AOTAutograd keeps no global of it.
2. :func:`close_checkpoints_left_open`: the generator torch < 2.13's
   ``torch.utils.checkpoint.checkpoint`` leaves open when the checkpointed forward raises.
3. :func:`quiet_context_fn_warning`: rebinds ``torch._higher_order_ops.wrap.warning_once``
   (at import of ``compiler/regions_compiled.py``) to skip torch's context_fn warning for
   our own regions.
"""
from __future__ import annotations

import functools
import inspect
import logging
import sys
from collections.abc import Callable
from typing import Any

from . import graph_meta, torch_internals

__all__ = ["WRITTEN_AGAINST", "AOT_ENTRY", "AOT_PARTITION_FN", "CHECKPOINT_MODULE",
           "CHECKPOINT_FN", "CHECKPOINT_GENERATOR", "CONTEXT_FN_WARNING",
           "CONTEXT_FN_CALLER_LOCALS", "partition_fn_on_stack", "close_checkpoints_left_open",
           "quiet_context_fn_warning"]

#: (major, minor) of each torch these peeks and the rebinding were written against.
WRITTEN_AGAINST = ((2, 11), (2, 13))

log = logging.getLogger("sac_compile")

# 1. torch._functorch.aot_autograd.aot_module_simplified(mod, args, fw_compiler,
#    bw_compiler, partition_fn, ...): the frame's local ``partition_fn``. If renamed, a user's
#    aot_autograd(partition_fn=SACPartitioner()) reads as torch's partitioner (a wrong
#    warning that tag()/name() are ignored; the split itself is unaffected).
AOT_ENTRY = "aot_module_simplified"
AOT_PARTITION_FN = "partition_fn"


def partition_fn_on_stack() -> Any:
    """The ``partition_fn`` of the innermost ``aot_module_simplified`` frame above the
    caller, or None."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == AOT_ENTRY:
            return frame.f_locals.get(AOT_PARTITION_FN)
        frame = frame.f_back
    return None


# 2. torch.utils.checkpoint.checkpoint's local ``gen`` (its non-reentrant generator). If
#    renamed, a region's forward context stays entered after an error on torch < 2.13 (the
#    next compile finds our tagging mode or recorder still active).
CHECKPOINT_MODULE = "torch.utils.checkpoint"
CHECKPOINT_FN = "checkpoint"
CHECKPOINT_GENERATOR = "gen"


def close_checkpoints_left_open(exc: BaseException) -> None:
    """Exit the ``context_fn`` contexts torch < 2.13 leaves entered when a checkpointed
    forward raises. Its ``torch.utils.checkpoint`` neither throws the error into its
    generator nor closes it (2.13 does), so a region's forward context - our tagging mode,
    or the eager runtime's recorder and saved-tensor hooks - stays entered until the
    traceback is freed, and its exit then pops whatever is on top of the stacks by that
    time. Called where the error passes through our code (our backends, a region run as
    Python); closes each such generator in ``exc``'s tracebacks, innermost first."""
    gens: list[Any] = []
    seen: set[int] = set()
    stack: list[BaseException | None] = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        stack += [e.__cause__, e.__context__]
        tb = e.__traceback__
        while tb is not None:
            f = tb.tb_frame
            if f.f_code.co_name == CHECKPOINT_FN and \
                    f.f_globals.get("__name__") == CHECKPOINT_MODULE:
                gen = f.f_locals.get(CHECKPOINT_GENERATOR)
                if inspect.isgenerator(gen) and gen.gi_frame is not None and \
                        not gen.gi_running and all(g is not gen for g in gens):
                    gens.append(gen)
            tb = tb.tb_next
    for gen in reversed(gens):
        try:
            gen.close()
        except Exception:  # pragma: no cover - an exit that fails: the first error stands
            log.debug("sac_compile: closing a checkpoint left open failed", exc_info=True)


# 3. torch._higher_order_ops.wrap: ``warning_once(logger, msg)``, a module global its
#    tag_activation_checkpoint implementation calls with this message; the caller's local
#    ``context_fn`` (2.13), or on 2.11 ``gmod`` whose ``meta["_checkpoint_context_fn"]`` holds
#    it. If the global goes, the rebinding is skipped (the warning shows for our regions);
#    if the locals are renamed, every context_fn gets the warning, ours included.
CONTEXT_FN_WARNING = "Detected that context_fn is passed to torch.utils.checkpoint"
CONTEXT_FN_CALLER_LOCALS = ("context_fn", "gmod")


def quiet_context_fn_warning(is_ours: Callable[[Any], bool]) -> None:
    """Wrap ``torch._higher_order_ops.wrap.warning_once`` (idempotent): its context_fn
    warning is skipped when ``is_ours(context_fn)`` for the caller's ``context_fn``; every
    other call goes to torch's ``warning_once`` unchanged, cache included."""
    try:
        wrap = torch_internals.checkpoint_hop_module
    except torch_internals.TorchAPIMissing:  # pragma: no cover
        return
    original = getattr(wrap, "warning_once", None)
    if original is None or getattr(original, "_sac_compile_quiet", False):
        return

    @functools.wraps(original)
    def warning_once(logger_obj: Any, *args: Any, **kwargs: Any) -> None:
        if args and CONTEXT_FN_WARNING in str(args[0]):
            caller = sys._getframe(1).f_locals
            context_fn = caller.get("context_fn")
            if context_fn is None:  # torch 2.11 reads it from the graph after the warning
                gmod = caller.get("gmod")
                context_fn = graph_meta.checkpoint_context_fn(gmod)
            if is_ours(context_fn):
                return None
        return original(logger_obj, *args, **kwargs)

    warning_once._sac_compile_quiet = True  # type: ignore[attr-defined]
    wrap.warning_once = warning_once
