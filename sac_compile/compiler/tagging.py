"""Tags on the joint graph.

While AOTAutograd traces a region (torch's ``tag_activation_checkpoint`` HOP, entered with
our ``context_fn``), :class:`SACTaggingMode` sees every ATen op the region runs, asks the
policies of *all* active regions (outermost first) through :func:`sac_compile.policy.decide`
- the very function the eager runtime uses - and writes the decision on the graph nodes
the op created:

* ``node.meta["recompute"]``: torch's key and enum, so torch's own passes understand it;
* ``node.meta["sac_decision"]``: the :class:`~sac_compile.policy.Decision`;
* ``node.meta["sac_region_path"]``: the names of the active regions, outermost first;
* ``node.meta["sac_source"]``: ``policy`` | ``tag`` | ``name`` | ``default`` | ``resolution``;
* ``node.meta["sac_call"]``: one id per dispatched op, shared by its decomposition and its
  ``getitem`` nodes, so that :mod:`.normalize` keeps them consistent;
* ``node.meta["sac_op"]``: that dispatched op (``aten.gelu.default`` on the nodes of its
  decomposition under Inductor);
* ``node.meta["sac_ask"]``: what is needed to ask the policies again when ``name()``
  labels the output later (removed by :mod:`.normalize`);
* ``node.meta["sac_region_id"]`` / ``["sac_outer_region_id"]``: the innermost and the
  outermost region call that ran the op. The eager runtime records one outermost region
  call at a time; a ``tag()`` in it may only name values that call produced.

Nested regions: only the innermost of our active modes writes, with the frames of all of
them, so outer and inner opinions resolve as in eager mode (torch lets the inner one win).

``tag(t, opinion)`` and ``name(t, label)`` under compile become the identity marker ops
``sac_compile::tag_marker`` / ``sac_compile::name_marker``; :mod:`.normalize` folds them into the
decision of the producer and removes them from the graph. A marker traced inside a region
carries ``node.meta["sac_marker_region"]`` = (outermost region call, innermost region name);
one traced outside every region carries nothing and is a no-op, as in eager mode.
"""
from __future__ import annotations

import itertools
import operator
import threading
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import SAC_IGNORED_OPS

from ..policy import (PREFER_RECOMPUTE, CheckpointError, CheckpointPolicy, DecidedOp, Decision,
                      Opinion, RegionFrame, SaveWithHooks, decide, foreign_tensor_message,
                      warn_inert_policies)

__all__ = ["SACTaggingMode", "NoOpMode", "region_contexts", "tag_op", "name_op",
           "CompiledCheckpointError", "encode_opinion", "decode_opinion", "META_KEYS"]

META_KEYS = ("sac_decision", "sac_region_path", "sac_source", "sac_call", "sac_op", "sac_ask",
             "sac_region_id", "sac_outer_region_id", "sac_marker_region", "sac_marked",
             "sac_view_of")

_state = threading.local()
_call_ids = itertools.count()
_region_ids = itertools.count()


def _active() -> list[SACTaggingMode]:
    stack = getattr(_state, "stack", None)
    if stack is None:
        stack = _state.stack = []
    return stack


def active_frames() -> tuple[RegionFrame, ...]:
    return tuple(m.frame for m in _active())


def _compiled_error_type() -> type:
    # Dynamo wraps what a backend raises into BackendCompilerFailed, except ShortenTraceback
    # subclasses: an error that is both keeps its type and message for the user.
    from torch._dynamo.exc import ShortenTraceback

    class CompiledCheckpointError(CheckpointError, ShortenTraceback):
        """A :class:`CheckpointError` raised while compiling; same message as in eager."""

        def __init__(self, msg: str) -> None:
            ShortenTraceback.__init__(self, msg, first_useful_frame=None)

    CompiledCheckpointError.__module__ = __name__
    CompiledCheckpointError.__qualname__ = "CompiledCheckpointError"
    return CompiledCheckpointError


CompiledCheckpointError = _compiled_error_type()


def reraise_compiled(e: CheckpointError) -> None:
    if isinstance(e, CompiledCheckpointError):
        raise e
    raise CompiledCheckpointError(str(e)) from None


def _proxy_mode() -> Any:
    if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is None:
        return None
    from torch.fx.experimental.proxy_tensor import get_proxy_mode
    return get_proxy_mode()


class SACTaggingMode(TorchDispatchMode):
    """The forward context of a compiled region: writes decisions into the traced graph."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(self, frame: RegionFrame) -> None:
        super().__init__()
        self.frame = frame
        self.region_id = next(_region_ids)
        self.ac_graph_id: int | None = None  # set by torch's tag_activation_checkpoint
        # The ops this region call decided, kept by the outermost of our active modes for
        # the inert-policy warning when it exits (as the eager runtime does at region exit).
        self.decided: list[DecidedOp] = []

    def __enter__(self) -> SACTaggingMode:
        _active().append(self)
        try:
            return super().__enter__()
        except BaseException:
            _active().pop()
            raise

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            stack = _active()
            outermost = bool(stack) and stack[0] is self
            if self in stack:
                stack.remove(self)
            if outermost and exc[0] is None and self.decided:
                decided, self.decided = self.decided, []
                warn_inert_policies(decided)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = {} if kwargs is None else kwargs
        stack = _active()
        proxy_mode = _proxy_mode()
        if proxy_mode is None or not stack or stack[-1] is not self:
            # Not tracing (AOTAutograd's metadata pass), or an inner region of ours decides.
            return func(*args, **kwargs)
        graph = proxy_mode.tracer.graph
        before = len(graph.nodes)
        out = func(*args, **kwargs)
        new = len(graph.nodes) - before
        if new == 0:
            return out
        if func in _MARKER_OPS:
            for node in itertools.islice(reversed(graph.nodes), new):
                node.meta["sac_marker_region"] = (stack[0].region_id, self.frame.name)
                if node.target in _MARKER_OPS:
                    _check_marker(node)
            if func is TAG_OP:  # a tag decides: the region's policies are not inert
                frames = tuple(m.frame for m in stack)
                stack[0].decided.append(DecidedOp(frames, func, _TAG_DECISION))
            return out
        frames = tuple(m.frame for m in stack)
        path = tuple(f.name for f in frames)
        if func in SAC_IGNORED_OPS:
            decision = Decision(PREFER_RECOMPUTE, region=path[-1], source="default")
            ask = None
        else:
            try:
                decision = decide(frames, func, args, kwargs, out)
            except CheckpointError as e:
                reraise_compiled(e)
            ask = (frames, func, args, kwargs, out)
            stack[0].decided.append(DecidedOp(frames, func, decision))
        call = next(_call_ids)
        for node in itertools.islice(reversed(graph.nodes), new):
            write_decision(node, decision, path)
            node.meta["sac_call"] = call
            node.meta["sac_op"] = func  # the op the policies were asked about
            node.meta["sac_region_id"] = self.region_id
            node.meta["sac_outer_region_id"] = stack[0].region_id
            node.meta["ac_graph_id"] = self.ac_graph_id if self.ac_graph_id is not None \
                else self.region_id
            if ask is not None:
                node.meta["sac_ask"] = ask
        return out


def marker_producer(marker: torch.fx.Node) -> torch.fx.Node:
    """The node whose decision a tag()/name() marker is about: through other markers
    (``tag(name(y, ...), ...)``) and ``getitem`` to the op that produced the value."""
    src = marker.args[0]
    while src.target in _MARKER_OPS:
        src = src.args[0]
    return src.args[0] if src.target is operator.getitem else src


def _check_marker(marker: torch.fx.Node) -> None:
    """Raise at the tag()/name() call, as eager does, what :mod:`.normalize` would raise
    for it later: a foreign tensor, or a conflict the tag or label creates. Raising here
    keeps the order of errors the same as in eager (the first error in program order)."""
    producer = marker_producer(marker)
    outer, region = marker.meta["sac_marker_region"]
    what = "tag()" if marker.target is TAG_OP else "name()"
    if producer.meta.get("sac_outer_region_id") != outer:
        raise CompiledCheckpointError(foreign_tensor_message(what, region))
    ask = producer.meta.get("sac_ask")
    if ask is None:
        return
    tag, names = producer.meta.get("sac_marked", (None, frozenset()))
    if marker.target is TAG_OP:
        tag = decode_opinion(marker.args[1])
    else:
        names = names | {marker.args[1]}
    producer.meta["sac_marked"] = (tag, names)
    frames, func, args, kwargs, out = ask
    try:
        decide(frames, func, args, kwargs, out, names=names, tag=tag,
               tag_region=producer.meta["sac_region_path"][-1])
    except CheckpointError as e:
        reraise_compiled(e)


def write_decision(node: torch.fx.Node, decision: Decision, path: tuple[str, ...]) -> None:
    node.meta["recompute"] = decision.policy
    node.meta["sac_decision"] = decision
    node.meta["sac_region_path"] = path
    node.meta["sac_source"] = decision.source


class NoOpMode(TorchDispatchMode):
    """The recompute context: under AOTAutograd nothing is recomputed at trace time."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def region_contexts(name: str, policy: Any) -> tuple[SACTaggingMode, NoOpMode]:
    """``context_fn`` for ``torch.utils.checkpoint`` under compile (used via functools.partial)."""
    return SACTaggingMode(RegionFrame(name, policy)), NoOpMode()


region_contexts.cache_hash = "sac_compile.region_contexts"  # type: ignore[attr-defined]


# --------------------------------------------------------------------------------------
# tag() and name() under compile: identity marker ops, folded away by normalize.
# --------------------------------------------------------------------------------------

def encode_opinion(opinion: Opinion) -> str:
    if isinstance(opinion, SaveWithHooks):
        # The hooks cannot be represented in a compiled graph; the value is saved.
        return "SaveWithHooks"
    return opinion.name


def decode_opinion(text: str) -> Opinion:
    if text == "SaveWithHooks":
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy[text]


@torch.library.custom_op("sac_compile::tag_marker", mutates_args=())
def tag_op(x: torch.Tensor, opinion: str) -> torch.Tensor:
    """Identity; ``opinion`` is a CheckpointPolicy name for the op that produced ``x``."""
    return x.clone()


@tag_op.register_fake
def _tag_fake(x: torch.Tensor, opinion: str) -> torch.Tensor:
    return torch.empty_like(x)


tag_op.register_autograd(lambda ctx, grad: (grad, None))


@torch.library.custom_op("sac_compile::name_marker", mutates_args=())
def name_op(x: torch.Tensor, label: str) -> torch.Tensor:
    """Identity; labels the output of the op that produced ``x``."""
    return x.clone()


@name_op.register_fake
def _name_fake(x: torch.Tensor, label: str) -> torch.Tensor:
    return torch.empty_like(x)


name_op.register_autograd(lambda ctx, grad: (grad, None))

# What a tag() counts as for the inert-policy warning: an opinion from a tag.
_TAG_DECISION = Decision(CheckpointPolicy.MUST_SAVE, source="tag")

TAG_OP = torch.ops.sac_compile.tag_marker.default
NAME_OP = torch.ops.sac_compile.name_marker.default
_MARKER_OPS = frozenset({TAG_OP, NAME_OP})

# ``tag(y, ...)`` whose result is unused is still an opinion on y's producer (eager applies
# it): FX dead-code elimination (dynamo's, AOTAutograd's) must keep the marker. normalize
# removes every marker before the cut, so nothing of it reaches the compiled code.
for _op in (TAG_OP, NAME_OP, torch.ops.sac_compile.tag_marker, torch.ops.sac_compile.name_marker):
    torch.fx.node.has_side_effect(_op)
