"""The recorded graph of a region: ops, their arguments as references, and handles.

An ``OpNode`` is one ATen op of a region. Its arguments hold references to outputs of
earlier nodes (the ``OpNode`` itself for its output 0, a ``NodeOutput`` for another) or
``LeafRef``s (a tensor from outside the recorded ops) where the forward had tensors.
Autograd stores a ``NodeOutput`` too (always one of its own), instead of a tensor produced
in the region.
"""
from __future__ import annotations

import threading
from typing import Any

import torch

from ..policy import Decision, Opinion, op_name
from ..effects import effect_reason, is_process_group_collective
from ..tensor_memory import is_view_op
from ..torch_internals import OpOverload
from .stats import EagerStats

_NON_DIFF_DTYPES = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32,
                              torch.int64})

# Ops that update their running-statistics arguments in place without saying so in
# their schema: replay must write into copies, never into the module's buffers.
_HIDDEN_MUTATIONS: dict[Any, tuple[int, ...]] = {}
for _name in ("native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm"):
    _packet = getattr(torch.ops.aten, _name, None)
    if _packet is not None and hasattr(_packet, "default"):
        _HIDDEN_MUTATIONS[_packet.default] = (3, 4)

# Ops that write into an argument without bumping its version counter (no
# ADInplaceOrView kernel). Autograd saves that argument *before* the op fills it and
# reads it afterwards, so a handle packed for it must follow the write.
_NO_VERSION_BUMP: set[Any] = set(_HIDDEN_MUTATIONS)
for _name in ("rrelu_with_noise",):
    _packet = getattr(torch.ops.aten, _name, None)
    if _packet is not None:
        _NO_VERSION_BUMP.update(getattr(_packet, o) for o in _packet.overloads())


_NO_NAMES: frozenset[str] = frozenset()


class OpInfo:
    """Static facts about an op, computed once per OpOverload."""

    __slots__ = ("op", "call", "random", "mutated", "bumps_version", "bump_ourselves", "effect",
                 "process_group", "is_view", "plain")

    def __init__(self, op: Any) -> None:
        self.op = op  # keeps the op alive, so its id (the OP_INFO key) is never reused
        # OpOverload.__call__ only forwards to its C++ builtin ``_op``: calling that
        # directly saves a Python frame per op recorded or replayed.
        self.call = getattr(op, "_op", op) if isinstance(op, OpOverload) else op
        tags = getattr(op, "tags", ())
        self.random = torch.Tag.nondeterministic_seeded in tags
        schema = getattr(op, "_schema", None)
        mutated: list[int] = []
        writes_lists = False
        if schema is not None and schema.is_mutable:
            for i, arg in enumerate(schema.arguments):
                if arg.alias_info is not None and arg.alias_info.is_write:
                    mutated.append(i if not arg.kwarg_only else -1 - i)
                    writes_lists = writes_lists or isinstance(arg.type, torch.ListType)
        mutated.extend(_HIDDEN_MUTATIONS.get(op, ()))
        self.mutated = tuple(mutated)
        self.bumps_version = op not in _NO_VERSION_BUMP
        # Ops writing Tensor(a!)[] (foreach, fused optimizers) bump versions without a
        # dispatch mode and none with one (torch 2.13): bump as the program would have.
        self.bump_ourselves = writes_lists and self.bumps_version
        # "collective" / "effectful op": never replayed unless the policy says
        # MUST_RECOMPUTE (see .effects); process_group: a collective with a Work handle,
        # which cannot be replayed at all.
        self.effect = effect_reason(op)
        self.process_group = is_process_group_collective(op)
        # A view op (an output aliasing an input, not written): autograd gives its output
        # the base's version counter only after the dispatch mode returns.
        self.is_view = is_view_op(op)
        # Writes nothing, draws no random numbers, is no collective: the recorder's fast path.
        self.plain = not self.mutated and not self.random and self.effect is None


# Keyed by id(op): an OpOverload's __hash__ runs Python code, and this is looked up for
# every op recorded and replayed.
OP_INFO: dict[int, OpInfo] = {}


def op_info(op: Any) -> OpInfo:
    info = OP_INFO.get(id(op))
    if info is None:
        info = OP_INFO[id(op)] = OpInfo(op)
    return info


class ReplayContext:
    """What replay needs from the region, kept small: nodes point here, not to the recorder."""

    __slots__ = ("name", "allow_cache_entry_mutation", "stats", "lock", "default_dtype",
                 "__weakref__")

    def __init__(self, name: str, allow_cache_entry_mutation: bool,
                 stats: tuple[EagerStats, ...]) -> None:
        self.name = name
        self.allow_cache_entry_mutation = allow_cache_entry_mutation
        self.stats = stats
        self.lock = threading.RLock()
        # Factory ops without a dtype follow the default dtype: replay under the one the
        # forward saw, whatever the program set in between.
        self.default_dtype = torch.get_default_dtype()


class LeafRef:
    """A tensor from outside the recorded ops (an input, a parameter, or a value whose
    identity was lost to a mutation through an alias). Snapshot before the region mutates
    it; ``version`` catches a mutation after the region, which no snapshot can see."""

    __slots__ = ("value", "snapshot", "version", "is_parameter")

    def __init__(self, value: torch.Tensor, is_parameter: bool = False) -> None:
        self.value = value
        self.snapshot = False
        # Inference tensors have no version counter (and cannot be mutated outside
        # inference mode, so there is nothing to check).
        self.version = None if value.is_inference() else value._version
        self.is_parameter = is_parameter

    def stale(self) -> bool:
        return not self.snapshot and self.version is not None and \
            self.value._version != self.version


class ForeignSaved:
    """A tensor autograd saved that the region did not produce (a parameter, a buffer, an
    input). Saved-tensor hooks turn off autograd's own version check; this restores it."""

    __slots__ = ("value", "version", "region")

    def __init__(self, value: torch.Tensor, region: str) -> None:
        self.value = value
        self.version = None if value.is_inference() else value._version
        self.region = region


class NodeOutput:
    """Output ``index`` of ``node``: where a later op of the region read it (an argument;
    for output 0 the node itself is the reference, no object of its own), and what autograd
    stores instead of it (the saved-tensor hooks' handle; unpacking it returns the saved
    value or recomputes it). ``outs`` is ``node.outs``: ``ref.outs[ref.index]`` reads the
    output's facts from either kind of reference."""

    __slots__ = ("node", "index", "outs")

    def __init__(self, node: OpNode, index: int) -> None:
        self.node = node
        self.index = index
        self.outs = node.outs


class OpNode:
    __slots__ = ("op", "args", "kwargs", "decision", "frames", "ctx", "value",
                 "versions", "outs", "seq", "uses", "spent", "__dict__", "__weakref__")

    # Every object a node keeps is one more for Python's cyclic collector to walk until
    # backward frees it (a full collection walks every live object: its cost per recorded
    # op was larger than the recording's own). So a node keeps little: the nodes it reads
    # are found from its arguments (``deps``), not kept in a list of their own.

    # What few nodes ever set: class-level defaults, read through the instance; a node that
    # sets one gets its ``__dict__`` then (Python creates it on the first such write). The
    # recorder so stores 12 fields per op instead of 20.
    rng: Any = None                    # (generator, state) for random ops
    packed: list[Any] | None = None    # SaveWithHooks / offload storage
    mutated_by: str | None = None      # op that mutated a saved output in forward
    names: frozenset[str] = _NO_NAMES
    tag: Opinion | None = None
    # Some outputs of a multi-output op kept under a memory budget (None where not),
    # and their versions then; the op stays recomputable for the others.
    kept: list[Any] | None = None
    kept_versions: list[int | None] | None = None
    # Whether recomputing this node reads a value restored by SaveWithHooks (None until
    # a backward asks; replay.py): then a live forward output is not reused for it.
    via_hooks: bool | None = None
    # A node in a recorded argument (or the recorder's producers) stands for its output 0:
    # ``ref.outs[ref.index]`` and ``value[ref.index]`` read it as they read a NodeOutput.
    index = 0

    def __init__(self, op: Any, args: tuple, kwargs: dict, frames: tuple,
                 ctx: ReplayContext, seq: int, outs: list | tuple) -> None:
        self.op = op
        self.args = args   # None once the node can never be recomputed again
        self.kwargs = kwargs
        self.frames = frames
        self.ctx = ctx
        self.seq = seq
        self.decision: Decision | None = None
        self.value: list[Any] | None = None     # outputs, when saved or recomputed
        # While ``value`` aliases tensors the program holds (a saved output, a live forward
        # output), their versions then: the program may mutate them before backward.
        self.versions: list[int | None] | None = None
        # Per output: (weakref to the forward tensor, its version when produced, shape,
        # dtype), or None for a non-tensor output. The recorder's fast path passes a tuple
        # (smaller than a list, built without a call); only ``RegionRecorder._add`` appends.
        self.outs: list[tuple[Any, int, Any, Any] | None] = outs
        # Progressive release (compiled autograd holds every handle until its graph
        # returns): ``uses`` is how often one backward reads this node (its handles'
        # unpacks and the replays of the recomputed nodes that read it), counted when the
        # region ends; ``spent`` counts them within the current backward. At the last one a
        # recomputed value is dropped.
        self.uses = self.spent = 0

    @property
    def deps(self) -> list[OpNode]:
        """The nodes whose outputs this node's recorded arguments read (none once dropped)."""
        deps: list[OpNode] = []
        if self.args is None:
            return deps
        for a in self.args:
            cls = type(a)
            if cls is OpNode:
                deps.append(a)
            elif cls is NodeOutput:
                deps.append(a.node)
            elif (cls is list or cls is tuple) and a:
                deps.extend(ref_node(x) for x in a if type(x) in _REFS)
        if self.kwargs:
            for v in self.kwargs.values():
                if type(v) in _REFS:
                    deps.append(ref_node(v))
                elif isinstance(v, (list, tuple)):
                    deps.extend(ref_node(x) for x in v if type(x) in _REFS)
        return deps

    @property
    def region(self) -> str:
        return self.frames[-1].name if self.frames else self.ctx.name

    def describe(self) -> str:
        return f"{op_name(self.op)} (op #{self.seq} of region {self.region!r})"


# The two kinds of reference to a node's output in a recorded argument.
_REFS = (OpNode, NodeOutput)


def ref_node(ref: OpNode | NodeOutput) -> OpNode:
    """The node whose output ``ref`` (a recorded argument's reference) is."""
    return ref if type(ref) is OpNode else ref.node


def kept_for(dep: OpNode, node: OpNode) -> bool:
    """Whether the outputs of ``dep`` that ``node`` reads are all kept (``dep.kept``)."""
    kept = dep.kept
    if kept is None:
        return False
    refs = [r for a in (*node.args, *(node.kwargs or {}).values())
            for r in (a if isinstance(a, (list, tuple)) else (a,))
            if type(r) in _REFS and ref_node(r) is dep]
    return all(kept[r.index] is not None for r in refs)


def recomputes_through_hooks(target: OpNode) -> bool:
    """Whether recomputing ``target`` reads, directly or through other recomputed nodes, a
    value saved with ``SaveWithHooks``. Plainly saved (or offloaded) values stop the walk:
    they come back exact. Memoized on the nodes (``via_hooks``): decisions are final once
    the region has returned."""
    if target.via_hooks is not None:
        return target.via_hooks
    stack = [target]
    while stack:
        node = stack[-1]
        if node.via_hooks is not None:
            stack.pop()
            continue
        pending = [d for d in node.deps if d.via_hooks is None and not _hooked(d)
                   and not _exact_when_read(d, node)]
        if pending:
            stack.extend(pending)
            continue
        stack.pop()
        node.via_hooks = any(_hooked(d) or (d.via_hooks and not _exact_when_read(d, node))
                             for d in node.deps)
    return target.via_hooks


def _hooked(node: OpNode) -> bool:
    return node.decision is not None and node.decision.hooks is not None


def _exact_when_read(dep: OpNode, reader: OpNode) -> bool:
    """Whether ``reader``'s recompute reads ``dep`` as the forward computed it: saved
    without hooks, or the outputs it reads kept under a memory budget."""
    decision = dep.decision
    if decision is not None and decision.saves and decision.hooks is None:
        return True
    return kept_for(dep, reader)


def needs_detach(t: torch.Tensor) -> bool:
    # Integer/bool tensors that are not views are kept as the very same object; float
    # tensors as detached aliases, so saving them makes no autograd cycle.
    return not (t.dtype in _NON_DIFF_DTYPES and not t._is_view())


def alias_for_saving(t: torch.Tensor) -> torch.Tensor:
    return t.detach() if needs_detach(t) else t


def arg_at(args: tuple, kwargs: dict, func: Any, i: int) -> Any:
    if i >= 0:
        if i < len(args):
            return args[i]
        name = func._schema.arguments[i].name
        return kwargs.get(name)
    return kwargs.get(func._schema.arguments[-1 - i].name)


def flat_outputs(out: Any) -> list[Any]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return list(out)
    return [out]


def map_refs(a: Any, out_value: Any, leaf_value: Any = None) -> Any:
    """``a`` (an argument as recorded) with each reference to output ``index`` of ``node``
    replaced by ``out_value(node, index)`` and each ``LeafRef`` by ``leaf_value(ref)``
    (default: its tensor); lists and tuples of them likewise."""
    t = type(a)
    if t is OpNode:
        return out_value(a, 0)
    if t is NodeOutput:
        return out_value(a.node, a.index)
    if t is LeafRef:
        return a.value if leaf_value is None else leaf_value(a)
    if (t is list or t is tuple) and a and any(type(x) in _ALL_REFS for x in a):
        vals = [map_refs(x, out_value, leaf_value) for x in a]
        return vals if t is list else tuple(vals)
    return a


_ALL_REFS = (OpNode, NodeOutput, LeafRef)


def _forward_value(node: OpNode, index: int) -> Any:
    facts = node.outs[index]
    return facts[0]() if facts is not None else None


def forward_args(node: OpNode) -> tuple[tuple, dict]:
    """The op's arguments as the forward saw them (for asking policies again)."""
    args = tuple([map_refs(a, _forward_value) for a in node.args])
    kwargs = {k: map_refs(v, _forward_value) for k, v in node.kwargs.items()} if node.kwargs else {}
    return args, kwargs


def mutated_tensors(args: tuple, kwargs: dict, func: Any, info: OpInfo) -> list[torch.Tensor]:
    """The tensors an op writes into, lists (``Tensor(a!)[]``, foreach ops) flattened."""
    out: list[torch.Tensor] = []
    for i in info.mutated:
        m = arg_at(args, kwargs, func, i)
        if isinstance(m, torch.Tensor):
            out.append(m)
        elif isinstance(m, (list, tuple)):
            out.extend(x for x in m if isinstance(x, torch.Tensor))
    return out


def tensor_text(t: Any) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    dtype = str(t.dtype).replace("torch.", "")
    return f"a {tuple(t.shape)} {dtype} tensor"

