"""Tags on the joint graph.

While AOTAutograd traces a region (torch's ``tag_activation_checkpoint`` HOP, entered with
our ``context_fn``), :class:`SACTaggingMode` sees every ATen op the region runs, asks the
policies of *all* active regions (outermost first) through :func:`sac_compile.policy.decide`
- the very function the eager runtime uses - and writes the decision on the graph nodes
the op created (the keys are in :mod:`sac_compile.graph_meta`): torch's ``recompute`` (so
torch's own passes understand it) and ``ac_graph_id``; our decision, region path, dispatched
op and its call id (shared by its decomposition and its ``getitem`` nodes, so that
:mod:`.normalize` keeps them consistent), what it takes to ask the policies again when
``name()`` labels the output later (removed by :mod:`.normalize`), and the innermost and
outermost region call that ran the op. The eager runtime records one outermost region call
at a time; a ``tag()`` in it may only name values that call produced.

Nested regions: only the innermost of our active modes writes, with the frames of all of
them, so outer and inner opinions resolve as in eager mode (torch lets the inner one win).

Who runs the region (:func:`region_contexts`, the ``context_fn`` of every region):

* AOTAutograd tracing a joint graph for our partitioner (:mod:`.who_splits`: one of our
  backends, Inductor's ``custom_partitioner_fn``, or an ``aot_autograd`` ``partition_fn``
  that is or calls ours): the tagging mode.
* AOTAutograd tracing for another partitioner (``backend="aot_eager"``, ``"inductor"``):
  the tagging mode too - torch's partitioner reads ``node.meta["recompute"]`` and
  functionalises recomputed random ops - plus one ``UserWarning`` per region name, since
  tag()/name() opinions, reports and budgets need ours.
* An inference graph (no tangents: never partitioned): random ops are tagged as saved, as
  torch's forward-loss-backward remat pass refuses random ops tagged for recompute.
* No tracing at all: a backend without AOTAutograd (``backend="eager"``) runs torch's
  checkpoint op as Python, with ``preserve_rng_state=False``; the region then runs through
  the eager runtime (:class:`_EagerRegion`), and the markers apply as eager
  ``tag()``/``name()`` do.

``tag(t, opinion)`` and ``name(t, label)`` under compile become the identity marker ops
``sac_compile::tag_marker`` / ``sac_compile::name_marker`` (:mod:`sac_compile.markers`, where a
``SaveWithHooks`` opinion keeps its hooks); :mod:`.normalize` folds them into the decision
of the producer and removes them from the graph. A marker traced inside a region carries
:data:`~sac_compile.graph_meta.MARKER_REGION` = (outermost region call, innermost region
name); one traced outside every region carries nothing and is a no-op, as in eager mode.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
from typing import Any

import torch
from torch.utils.checkpoint import SAC_IGNORED_OPS

from .. import graph_meta
from ..errors import CompiledCheckpointError, reraise_compiled
from ..logs import warn_once_per_region
from ..per_call import fresh_frame
from ..inert_policies import DecidedOp, warn_inert_policies
from ..policy import (PREFER_RECOMPUTE, CheckpointError, CheckpointPolicy, Decision,
                      RegionFrame, decide, foreign_tensor_message)
from ..region_groups import RegionGroup, group_of_token
from .group_check import check_group
from ..markers import MARKER_OPS as _MARKER_OPS, TAG_OP, decode_opinion, marker_producer
from ..cut.roles import is_joint_graph
from ..torch_internals import TorchDispatchMode, TorchDispatchModeKey, get_dispatch_mode
from .who_splits import partitioned_by_us, sac_partitioning  # noqa: F401  (re-exported)

__all__ = ["SACTaggingMode", "NoOpMode", "region_contexts", "CompiledCheckpointError"]

_state = threading.local()
_call_ids = itertools.count()
_region_ids = itertools.count()


def _active() -> list[SACTaggingMode]:
    stack = getattr(_state, "stack", None)
    if stack is None:
        stack = _state.stack = []
    return stack


def _proxy_mode() -> Any:
    if get_dispatch_mode(TorchDispatchModeKey.PROXY) is None:
        return None
    from torch.fx.experimental.proxy_tensor import get_proxy_mode
    return get_proxy_mode()


class SACTaggingMode(TorchDispatchMode):
    """The forward context of a compiled region: writes decisions into the traced graph."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(self, frame: RegionFrame, group: RegionGroup | None = None,
                 together: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.frame = frame
        self.group = group  # the regions that share this graph (None: a checkpoint() call)
        self.together = together  # the group's members traced in this graph, by name
        self.region_id = next(_region_ids)
        self.ac_graph_id: int | None = None  # set by torch's tag_activation_checkpoint
        # The ops this region call decided, kept by the outermost of our active modes for
        # the inert-policy warning when it exits (as the eager runtime does at region exit).
        self.decided: list[DecidedOp] = []
        self.joint: bool | None = None  # see _joint
        # What this region's policy was asked, in order (.group_check.Ask):
        # its group's other members are asked the same at exit (.group_check).
        self.asks: list[tuple[Any, tuple, dict, Any, tuple[str, ...], int]] = []

    def _joint(self, graph: torch.fx.Graph) -> bool:
        """Whether the graph being traced is a joint forward/backward graph (has tangents);
        an inference graph (or one whose backward dynamo traced in) is not partitioned."""
        if self.joint is None:
            self.joint = is_joint_graph(graph)
        return self.joint

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
            asks, self.asks = self.asks, []
            if exc[0] is None and self.group is not None:
                check_group(self.group, self.frame.name, asks, skip=self.together)

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
                graph_meta.set_marker_region(node, stack[0].region_id, self.frame.name)
                if node.target in _MARKER_OPS:
                    _check_marker(node)
            if func is TAG_OP:  # a tag decides: the region's policies are not inert
                frames = tuple(m.frame for m in stack)
                stack[0].decided.append(DecidedOp(frames, func, _TAG_DECISION))
            return out
        # The nodes the op created, taken before the policies are asked: a policy that
        # computes with SymInts (ctx.op_output.numel() > 64) adds nodes of its own.
        created = list(itertools.islice(reversed(graph.nodes), new))
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
            for index, mode in enumerate(stack):
                if mode.group is not None:
                    mode.asks.append((func, args, kwargs, out, path, index))
            ask = (frames, func, args, kwargs, out)
            stack[0].decided.append(DecidedOp(frames, func, decision))
        call = next(_call_ids)
        joint = self._joint(graph)
        budgets = tuple((m.region_id, m.frame.name, m.frame.budget) for m in stack
                        if m.frame.budget is not None)
        for node in created:
            write_decision(node, decision, path)
            if not joint and _is_seeded(node) and decision.policy in _RECOMPUTES:
                # A graph without tangents is never partitioned; torch's forward-loss-
                # backward remat pass runs on it instead and refuses random ops tagged for
                # recompute (even when no backward is traced in it): keep their values.
                graph_meta.set_recompute(node, CheckpointPolicy.MUST_SAVE)
            graph_meta.set_call(node, call)
            graph_meta.set_op(node, func)  # the op the policies were asked about
            graph_meta.set_region_ids(node, self.region_id, stack[0].region_id)
            if budgets:  # memory budgets of the active regions (budgets/groups.py)
                graph_meta.set_region_budgets(node, budgets)
            graph_meta.set_ac_graph_id(node, self.ac_graph_id if self.ac_graph_id is not None
                                       else self.region_id)
            if ask is not None:
                graph_meta.set_ask(node, ask)
        return out


_RECOMPUTES = (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)


def _is_seeded(node: torch.fx.Node) -> bool:
    tags = getattr(node.target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


def _check_marker(marker: torch.fx.Node) -> None:
    """Raise at the tag()/name() call, as eager does, what :mod:`.normalize` would raise
    for it later: a foreign tensor, or a conflict the tag or label creates. Raising here
    keeps the order of errors the same as in eager (the first error in program order)."""
    producer = marker_producer(marker)
    outer, region = graph_meta.marker_region(marker)
    what = "tag()" if marker.target is TAG_OP else "name()"
    if graph_meta.outer_region_id(producer) != outer:
        raise CompiledCheckpointError(foreign_tensor_message(what, region))
    ask = graph_meta.ask(producer)
    if ask is None:
        return
    tag, names = graph_meta.marked(producer)
    if marker.target is TAG_OP:
        tag = decode_opinion(marker.args[1])
    else:
        names = names | {marker.args[1]}
    graph_meta.set_marked(producer, tag, names)
    frames, func, args, kwargs, out = ask
    try:
        decide(frames, func, args, kwargs, out, names=names, tag=tag,
               tag_region=graph_meta.region_path(producer)[-1])
    except CheckpointError as e:
        reraise_compiled(e)


def write_decision(node: torch.fx.Node, decision: Decision, path: tuple[str, ...]) -> None:
    graph_meta.set_recompute(node, decision.policy)
    graph_meta.set_decision(node, decision)
    graph_meta.set_region_path(node, path)


class NoOpMode(TorchDispatchMode):
    """The recompute context: under AOTAutograd nothing is recomputed at trace time."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def region_contexts(token: str, name: str | None = None,
                    together: frozenset[str] = frozenset()) -> Any:
    """``context_fn`` of a region under compile (``functools.partial(region_contexts,
    token)``): the contexts of :func:`frame_contexts` for the region's group
    (:mod:`sac_compile.region_groups`), its policy asked under the group's name, or under
    ``name`` where our backend found which member of the group the region is; ``together``:
    the members in the same graph, each decided under its own name."""
    group = group_of_token(token)
    return frame_contexts(RegionFrame(name or group.name, group.policy, budget=group.budget),
                          group.allow, group, together)


def frame_contexts(frame: RegionFrame, allow_cache_entry_mutation: bool = False,
                   group: RegionGroup | None = None,
                   together: frozenset[str] = frozenset()) -> Any:
    """The forward and recompute contexts of a region call under compile.

    While AOTAutograd traces: the tagging mode (and, once per region, a warning when the
    joint graph will not be split by our partitioner). When torch's checkpoint op runs for
    real - a backend without AOTAutograd (``backend="eager"``, a backend that runs dynamo's
    graph as is) executes ``tag_activation_checkpoint`` eagerly, through
    ``torch.utils.checkpoint`` with ``preserve_rng_state=False`` - the region runs through
    the eager runtime instead, whose saved-tensor hooks take over from torch's: nothing is
    left for torch to recompute (which would redraw random ops and update buffers twice).
    """
    frame = fresh_frame(frame)  # a per_call(...) policy: built for this trace
    if _runs_eagerly():
        return _EagerRegion(frame, allow_cache_entry_mutation), contextlib.nullcontext()
    if _joint_tracing() and not partitioned_by_us():
        _warn_foreign_partitioner(frame.name)
    return SACTaggingMode(frame, group, together), NoOpMode()


def _runs_eagerly() -> bool:
    """No tracing of any kind: real tensors, torch's checkpoint op executed as Python."""
    if torch.compiler.is_compiling():
        return False
    key = TorchDispatchModeKey
    return all(get_dispatch_mode(k) is None
               for k in (key.PROXY, key.FAKE, key.FUNCTIONAL))


def _joint_tracing() -> bool:
    """AOTAutograd is tracing a joint forward/backward graph (a graph with tangents),
    i.e. one that a partitioner will split; not an inference graph."""
    proxy_mode = _proxy_mode()
    return proxy_mode is not None and is_joint_graph(proxy_mode.tracer.graph)


class _EagerRegion:
    """The forward context of a region whose checkpoint op runs eagerly: the eager runtime
    records the region, and its saved-tensor hooks are the innermost ones (torch's
    checkpoint pushed its own just before; a nested region pushes ours again)."""

    def __init__(self, frame: RegionFrame, allow: bool) -> None:
        self.frame, self.allow = frame, allow
        self._stack: contextlib.ExitStack | None = None
        self._outer_entry: Any = None

    def __enter__(self) -> _EagerRegion:
        from .. import runtime
        from ..runtime.replay import unpack_hook
        stack = contextlib.ExitStack()
        self._outer_entry = getattr(_state, "eager_entry", None)
        _state.eager_entry = self
        stack.callback(setattr, _state, "eager_entry", self._outer_entry)
        try:
            stack.enter_context(runtime.eager_region(self.frame, self.allow))
            recorder = runtime.active_recorder()
            if recorder is not None:
                # The runtime's own hooks, as runtime.eager_region installs them.
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(recorder.pack,
                                                                             unpack_hook()))
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        return self

    def __exit__(self, *exc: Any) -> Any:
        stack, self._stack = self._stack, None
        return stack.__exit__(*exc) if stack is not None else None


def take_eager_entry() -> bool:
    """For a region body that dynamo left to Python (a graph break in the region): True,
    once, when the checkpoint context just entered already runs the region through the
    eager runtime, so that the body does not open a second region for the same call."""
    if getattr(_state, "eager_entry", None) is None:
        return False
    _state.eager_entry = None
    return True


def _warn_foreign_partitioner(name: str) -> None:
    warn_once_per_region(
        "torch's partitioner", name,
        f"sac_compile: region {name!r} is compiled by a backend that splits forward and "
        f"backward with torch's partitioner, not sac_compile's: torch applies the policy's "
        f"decisions as its own SAC tags, but tag()/name() opinions (and policies that "
        f"decide by name) are ignored, no PartitionReport or memory budget applies, and "
        f"collectives that a recomputed value depends on are issued again in backward, as "
        f"torch's eager SAC does (measured on a torchtitan Llama block, 2 ranks: 1 "
        f"all_reduce more per block under colwise/rowwise tensor parallelism; 2 all_gathers "
        f"and 1 reduce_scatter more with SequenceParallel). Compile with "
        f"backend=sac_compile.sac_backend or sac_compile.make_backend(...) "
        f"(or, with backend='inductor', set torch._inductor.config.custom_partitioner_fn="
        f"sac_compile.compiler.SACPartitioner())", stacklevel=3)


# What a tag() counts as for the inert-policy warning: an opinion from a tag.
_TAG_DECISION = Decision(CheckpointPolicy.MUST_SAVE, source="tag")
