"""The eager runtime: record a region's ATen ops, keep what the decisions save, and in
backward recompute only what autograd unpacks, starting from the nearest saved values.

How it fits together:

* ``RegionRecorder`` is a dispatch mode active while the outermost region runs forward.
  Each ATen op becomes an ``OpNode`` holding the op, its arguments (tensors replaced by
  references to the producing node, or by a ``LeafRef`` for tensors from outside the
  region) and its decision. Saved nodes hold their outputs; the others hold nothing.
* Autograd's saved tensors go through ``saved_tensors_hooks``: a tensor produced in the
  region is packed as a ``NodeOutput`` (node, output index) instead of the tensor.
* Unpacking a handle materialises its node: saved values are returned, missing ones are
  recomputed iteratively from their inputs, and each recomputed node drops its inputs, so
  a value lives exactly as long as some handle still needs it (Python refcounting does
  the "free after last use", and ``retain_graph=True`` keeps handles, hence values).
* The user's Python is never re-run; random ops replay the generator state they saw.
"""
from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator

import torch

from ..per_call import fresh_frame
from ..policy import RegionFrame
from ..torch_internals import TorchAPIMissing, peek_interpreter_stack
from . import marker_rules
from .record import RegionRecorder
from .replay import unpack_hook
from .stats import EagerStats, SavedValueRecord, collect_stats

marker_rules.register()  # the compiler's tag()/name() markers, run under the recorder

__all__ = ["EagerStats", "RegionRecorder", "SavedValueRecord", "active_recorder",
           "collect_stats", "eager_region"]

_ACTIVE = threading.local()


def active_recorder() -> RegionRecorder | None:
    return getattr(_ACTIVE, "recorder", None)


@contextlib.contextmanager
def eager_region(frame: RegionFrame, allow_cache_entry_mutation: bool = False) -> Iterator[None]:
    """Run the body as a region: the outermost one records, nested ones add their policy."""
    frame = fresh_frame(frame)  # a per_call(...) policy: built for this call
    recorder = active_recorder()
    if recorder is not None:
        if frame.budget is not None:
            from ..policy import CheckpointError
            raise CheckpointError(
                f"region {frame.name!r} has a memory budget but runs inside region "
                f"{recorder.frames[0].name!r}; in eager mode a budget applies to an outermost "
                f"region only. Put the budget on the outer region, or call this region "
                f"outside it")
        outer = recorder.frames
        recorder.frames = outer + (frame,)
        if allow_cache_entry_mutation:  # applies to the values this inner region saves
            recorder.allowing_frames.add(id(frame))
        try:
            yield
        finally:
            recorder.frames = outer
        return
    if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        yield  # nothing will be saved for backward: a plain forward
        return
    _refuse_functorch(frame)
    if not _dynamo_kept_out and "torch._dynamo" in sys.modules:
        keep_dynamo_out()
    recorder = RegionRecorder(frame, allow_cache_entry_mutation)
    _ACTIVE.recorder = recorder
    try:
        with torch.autograd.graph.saved_tensors_hooks(recorder.pack, unpack_hook()), recorder:
            yield
    finally:
        _ACTIVE.recorder = None
    recorder.finish()


_TRANSFORMS = {"Grad": "grad/vjp/jacrev/hessian", "Vmap": "vmap", "Jvp": "jvp/jacfwd",
               "Functionalize": "functionalize"}


def _refuse_functorch(frame: RegionFrame) -> None:
    """A region recording under a ``torch.func`` transform: torch refuses saved-tensor
    hooks under grad/vjp (its message names neither the region nor another way), and the
    recorder's own ops fail under vmap/jvp (an internal assert). Say which region, and what
    works instead."""
    interpreter = peek_interpreter_stack()
    if interpreter is None:
        return
    from ..policy import CheckpointError
    kind = interpreter.key().name
    raise CheckpointError(
        f"region {frame.name!r} ran under torch.func.{_TRANSFORMS.get(kind, kind.lower())}, "
        f"and a region cannot record under torch.func transforms (its saved-tensor hooks; "
        f"torch's own checkpoint is refused under torch.func.grad too). To fix: compute "
        f"gradients with torch.autograd (loss.backward() or torch.autograd.grad), which "
        f"regions support; or run the transformed call under torch.no_grad() when it needs "
        f"no autograd graph (vmap of a forward, jvp: the region then runs as a plain "
        f"function); or call the function without its region inside the transform")


_dynamo_kept_out = False


def keep_dynamo_out() -> None:
    """The runtime runs inside compiled code after a graph break (a region that graph-breaks,
    a ``with sac_region(...)`` block, a backend without AOTAutograd). Dynamo must not trace
    it: it cannot (dispatch modes, saved-tensor hooks), and trying costs recompiles
    ("hit config.recompile_limit") and prints warnings about torch internals. The runtime's
    per-op and per-tensor frames (the recorder's ``__torch_dispatch__``, the pack and unpack
    hooks, this context manager) are skipped with everything they call: a flag on their code
    objects, free per call (the dispatch mode opts out of torch's per-call disable trampoline
    for speed).

    Called on the first region entry once Dynamo is loaded (``"torch._dynamo" in
    sys.modules``): an eager-only user never imports it."""
    global _dynamo_kept_out
    if _dynamo_kept_out:
        return
    _dynamo_kept_out = True
    try:
        from ..torch_internals import FrameAction, FrameExecStrategy, set_code_exec_strategy
    except TorchAPIMissing:  # pragma: no cover - another torch: Dynamo may try, and fall back
        return
    from . import replay
    skip_all = FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP)
    for fn in (RegionRecorder.__torch_dispatch__, RegionRecorder.pack, replay.unpack,
               getattr(eager_region, "__wrapped__", eager_region)):
        set_code_exec_strategy(fn.__code__, skip_all)
