"""The eager runtime: record a region's ATen ops, keep what the decisions save, and in
backward recompute only what autograd unpacks, starting from the nearest saved values.

How it fits together:

* ``RegionRecorder`` is a dispatch mode active while the outermost region runs forward.
  Each ATen op becomes an ``OpNode`` holding the op, its arguments (tensors replaced by
  references to the producing node, or by a ``LeafRef`` for tensors from outside the
  region) and its decision. Saved nodes hold their outputs; the others hold nothing.
* Autograd's saved tensors go through ``saved_tensors_hooks``: a tensor produced in the
  region is packed as a ``SavedHandle`` (node, output index) instead of the tensor.
* Unpacking a handle materialises its node: saved values are returned, missing ones are
  recomputed iteratively from their inputs, and each recomputed node drops its inputs, so
  a value lives exactly as long as some handle still needs it (Python refcounting does
  the "free after last use", and ``retain_graph=True`` keeps handles, hence values).
* The user's Python is never re-run; random ops replay the generator state they saw.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .policy import (CheckpointError, Decision, Opinion, RegionFrame, decide, make_decider,
                     op_name)

_NON_DIFF_DTYPES = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32,
                              torch.int64})

# Ops that update their running-statistics arguments in place without saying so in
# their schema: replay must write into copies, never into the module's buffers.
_HIDDEN_MUTATIONS: dict[Any, tuple[int, ...]] = {}
for _name in ("native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm"):
    _packet = getattr(torch.ops.aten, _name, None)
    if _packet is not None and hasattr(_packet, "default"):
        _HIDDEN_MUTATIONS[_packet.default] = (3, 4)


class OpInfo:
    """Static facts about an op, computed once per OpOverload."""

    __slots__ = ("random", "mutated")

    def __init__(self, op: Any) -> None:
        tags = getattr(op, "tags", ())
        self.random = torch.Tag.nondeterministic_seeded in tags
        schema = getattr(op, "_schema", None)
        mutated: list[int] = []
        if schema is not None and schema.is_mutable:
            for i, arg in enumerate(schema.arguments):
                if arg.alias_info is not None and arg.alias_info.is_write:
                    mutated.append(i if not arg.kwarg_only else -1 - i)
        mutated.extend(_HIDDEN_MUTATIONS.get(op, ()))
        self.mutated = tuple(mutated)


_OP_INFO: dict[Any, OpInfo] = {}


def op_info(op: Any) -> OpInfo:
    info = _OP_INFO.get(op)
    if info is None:
        info = _OP_INFO[op] = OpInfo(op)
    return info


# --------------------------------------------------------------------------------------
# Statistics: what was saved, what was replayed (read by explain/report/tests)
# --------------------------------------------------------------------------------------

class SavedValueRecord:
    """One value the runtime keeps for backward."""

    __slots__ = ("name", "op", "nbytes", "reason", "region", "decision")

    def __init__(self, name: str, op: str, nbytes: int, reason: str, region: str,
                 decision: str) -> None:
        self.name, self.op, self.nbytes, self.reason = name, op, nbytes, reason
        self.region, self.decision = region, decision

    def __repr__(self) -> str:
        return f"SavedValueRecord({self.name}, {self.op}, {self.nbytes} B, {self.reason!r})"


class EagerStats:
    """Counts gathered by :func:`collect_stats`: deterministic, so tests can assert them."""

    def __init__(self) -> None:
        self.saved: list[SavedValueRecord] = []
        self.recomputed_ops: list[str] = []
        self.ops_recorded = 0
        self.decisions: list[tuple[str, Decision]] = []

    @property
    def saved_bytes(self) -> int:
        return sum(r.nbytes for r in self.saved)

    @property
    def ops_replayed(self) -> int:
        return len(self.recomputed_ops)


_STATS = threading.local()


def _active_stats() -> list[EagerStats]:
    sinks = getattr(_STATS, "sinks", None)
    if sinks is None:
        sinks = _STATS.sinks = []
    return sinks


@contextlib.contextmanager
def collect_stats() -> Iterator[EagerStats]:
    """Collect what regions run inside this block save and, during backward, replay.

    Backward may run after the block ends: replays are still counted for regions whose
    forward ran inside it.
    """
    stats = EagerStats()
    sinks = _active_stats()
    sinks.append(stats)
    try:
        yield stats
    finally:
        sinks.remove(stats)


# --------------------------------------------------------------------------------------
# The recorded graph
# --------------------------------------------------------------------------------------

class ReplayContext:
    """What replay needs from the region, kept small: nodes point here, not to the recorder."""

    __slots__ = ("name", "allow_cache_entry_mutation", "stats", "lock", "__weakref__")

    def __init__(self, name: str, allow_cache_entry_mutation: bool,
                 stats: tuple[EagerStats, ...]) -> None:
        self.name = name
        self.allow_cache_entry_mutation = allow_cache_entry_mutation
        self.stats = stats
        self.lock = threading.RLock()


class LeafRef:
    """A tensor from outside the recorded ops (an input, a parameter, or a value whose
    identity was lost to a mutation through an alias). Snapshot before it is mutated."""

    __slots__ = ("value", "snapshot")

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value
        self.snapshot = False


class OutRef:
    """Output ``index`` of ``node``, as an argument of a later op."""

    __slots__ = ("node", "index")

    def __init__(self, node: OpNode, index: int) -> None:
        self.node = node
        self.index = index


class OpNode:
    __slots__ = ("op", "args", "kwargs", "deps", "decision", "frames", "ctx", "value",
                 "outs", "rng", "packed", "mutated_by", "seq",
                 "names", "tag", "__weakref__")

    def __init__(self, op: Any, args: tuple, kwargs: dict, deps: tuple, frames: tuple,
                 ctx: ReplayContext, seq: int) -> None:
        self.op = op
        self.args = args
        self.kwargs = kwargs
        self.deps = deps
        self.frames = frames
        self.ctx = ctx
        self.seq = seq
        self.decision: Decision | None = None
        self.value: list[Any] | None = None     # outputs, when saved or recomputed
        # Per output: (weakref to the forward tensor, its version when produced, shape,
        # dtype), or None for a non-tensor output.
        self.outs: list[tuple[Any, int, Any, Any] | None] = []
        self.rng: Any = None                    # (generator, state) for random ops
        self.packed: list[Any] | None = None    # SaveWithHooks / offload storage
        self.mutated_by: str | None = None      # op that mutated a saved output in forward
        self.names: frozenset[str] = frozenset()
        self.tag: Opinion | None = None

    @property
    def region(self) -> str:
        return self.frames[-1].name if self.frames else self.ctx.name

    def describe(self) -> str:
        return f"{op_name(self.op)} (op #{self.seq} of region {self.region!r})"


class SavedHandle:
    """What autograd stores instead of a tensor produced inside a region."""

    __slots__ = ("node", "index")

    def __init__(self, node: OpNode, index: int) -> None:
        self.node = node
        self.index = index


def _alias_for_saving(t: torch.Tensor) -> torch.Tensor:
    # Integer/bool tensors that are not views come back as the very same object; float
    # tensors are kept as detached aliases so saving them makes no autograd cycle.
    if t.dtype in _NON_DIFF_DTYPES and not t._is_view():
        return t
    return t.detach()


def _nbytes(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return t.numel() * t.element_size()


def _storage_key(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return id(t)


# --------------------------------------------------------------------------------------
# Forward: recording
# --------------------------------------------------------------------------------------

class RegionRecorder(TorchDispatchMode):
    """Records the ops of one outermost region (nested regions push frames onto it)."""

    def __init__(self, frame: RegionFrame, allow_cache_entry_mutation: bool) -> None:
        super().__init__()
        self.frames = (frame,)
        self.ctx = ReplayContext(frame.name, allow_cache_entry_mutation,
                                 tuple(_active_stats()))
        # id(tensor) -> (weakref(tensor), node, output index, expected version)
        self.producers: dict[int, tuple[Any, OpNode, int, int]] = {}
        self.leaves: dict[int, tuple[Any, LeafRef]] = {}
        self.leaves_by_storage: dict[int, list[LeafRef]] = {}
        self.saved_by_storage: dict[int, list[OpNode]] = {}
        self.handles: list[SavedHandle] = []
        self.nodes_recorded = 0
        self.decisions: list[OpNode] = []
        self.suspended = False

    @property
    def frames(self) -> tuple[RegionFrame, ...]:
        return self._frames

    @frames.setter
    def frames(self, frames: tuple[RegionFrame, ...]) -> None:
        self._frames = frames
        self.decider = make_decider(frames)

    # -- references ---------------------------------------------------------------

    def lookup(self, t: torch.Tensor) -> tuple[OpNode, int] | None:
        entry = self.producers.get(id(t))
        if entry is not None and entry[0]() is t and t._version == entry[3]:
            return entry[1], entry[2]
        return None

    def leaf(self, t: torch.Tensor) -> LeafRef:
        entry = self.leaves.get(id(t))
        if entry is not None and entry[0]() is t:
            return entry[1]
        ref = LeafRef(t.detach() if t.requires_grad else t)
        self.leaves[id(t)] = (weakref.ref(t), ref)
        self.leaves_by_storage.setdefault(_storage_key(t), []).append(ref)
        return ref

    def _ref(self, t: torch.Tensor, deps: list[OpNode]) -> Any:
        found = self.lookup(t)
        if found is None:
            return self.leaf(t)
        deps.append(found[0])
        return OutRef(found[0], found[1])

    def _convert(self, a: Any, deps: list[OpNode]) -> Any:
        if isinstance(a, torch.Tensor):
            return self._ref(a, deps)
        if isinstance(a, (list, tuple)) and a and any(isinstance(x, torch.Tensor) for x in a):
            converted = [self._ref(x, deps) if isinstance(x, torch.Tensor) else x for x in a]
            return converted if isinstance(a, list) else tuple(converted)
        return a

    # -- the mode -------------------------------------------------------------------

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps every __torch_dispatch__ call in a dynamo-disable trampoline unless
        # told otherwise; that doubles the per-op cost, and this mode never runs while
        # dynamo traces (compiled regions use the compiler's tagging mode instead).
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.suspended:
            return func(*args, **(kwargs or {}))
        info = _OP_INFO.get(func) or op_info(func)
        deps: list[OpNode] = []
        rec_args = tuple([self._convert(a, deps) for a in args])
        if kwargs:
            rec_kwargs = {k: self._convert(v, deps) for k, v in kwargs.items()}
        else:
            kwargs = rec_kwargs = {}
        mutated = [_arg_at(args, kwargs, func, i) for i in info.mutated] if info.mutated else ()
        for m in mutated:
            if isinstance(m, torch.Tensor):
                self._before_mutation(m, func)

        node = OpNode(func, rec_args, rec_kwargs, deps, self.frames, self.ctx,
                      self.nodes_recorded)
        self.nodes_recorded += 1
        if info.random:
            node.rng = _capture_rng(args, kwargs)

        out = func(*args, **kwargs)

        producers = self.producers
        outs = node.outs
        if type(out) is torch.Tensor:
            wr = weakref.ref(out)
            version = out._version + (1 if mutated and any(m is out for m in mutated) else 0)
            producers[id(out)] = (wr, node, 0, version)
            outs.append((wr, version, out.shape, out.dtype))
        else:
            outputs = _flat_outputs(out)
            # Arguments mutated but not returned are outputs too: later ops read them.
            for m in mutated:
                if isinstance(m, torch.Tensor) and not any(m is o for o in outputs):
                    outputs.append(m)
            for i, t in enumerate(outputs):
                if isinstance(t, torch.Tensor):
                    # An in-place op's version bump happens after the mode returns.
                    version = t._version + (1 if any(m is t for m in mutated) else 0)
                    wr = weakref.ref(t)
                    producers[id(t)] = (wr, node, i, version)
                    outs.append((wr, version, t.shape, t.dtype))
                else:
                    outs.append(None)

        self._set_decision(node, self.decider(func, args, kwargs, out))
        return out

    def _before_mutation(self, m: torch.Tensor, func: Any) -> None:
        key = _storage_key(m)
        for leaf in self.leaves_by_storage.get(key, ()):
            if not leaf.snapshot:
                leaf.value = leaf.value.clone()
                leaf.snapshot = True
        for node in self.saved_by_storage.get(key, ()):
            if node.value is None:
                continue
            if self.ctx.allow_cache_entry_mutation:
                node.value = [v.clone() if isinstance(v, torch.Tensor) else v for v in node.value]
            elif node.mutated_by is None:
                node.mutated_by = op_name(func)

    def _set_decision(self, node: OpNode, decision: Decision) -> None:
        first = node.decision is None
        was_saved = not first and node.decision.saves
        node.decision = decision
        if decision.saves and not was_saved:
            values = []
            for facts in node.outs:
                t = facts[0]() if facts is not None else None
                values.append(_alias_for_saving(t) if t is not None else None)
            node.value = values
            for v in values:
                if isinstance(v, torch.Tensor):
                    self.saved_by_storage.setdefault(_storage_key(v), []).append(node)
        elif was_saved and not decision.saves:
            node.value = None
        if first:
            self.decisions.append(node)

    # -- tags and labels (retroactive opinions on the producer of a tensor) ------------

    def redecide(self, t: torch.Tensor, *, tag: Opinion | None = None,
                 label: str | None = None) -> bool:
        found = self.lookup(t)
        if found is None:
            return False
        node = found[0]
        if tag is not None:
            node.tag = tag
        if label is not None:
            node.names = node.names | {label}
        args, kwargs = _forward_args(node)
        out = [f[0]() if f is not None else None for f in node.outs]
        output = out[0] if len(out) == 1 else tuple(out)
        self.suspended = True
        try:
            decision = decide(node.frames, node.op, args, kwargs, output, names=node.names,
                              tag=node.tag, tag_region=node.region)
        finally:
            self.suspended = False
        self._set_decision(node, decision)
        return True

    # -- saved tensor hooks -------------------------------------------------------------

    def pack(self, t: torch.Tensor) -> Any:
        found = self.lookup(t)
        if found is None:
            if t.grad_fn is not None:
                self.suspended = True
                try:
                    return t.detach()  # a tensor with history: no cycle through our storage
                finally:
                    self.suspended = False
            return t
        handle = SavedHandle(found[0], found[1])
        self.handles.append(handle)
        return handle

    # -- region exit ----------------------------------------------------------------------

    def finish(self) -> None:
        """Keep only what some backward needs, then forget the forward bookkeeping."""
        needed = _needed_nodes(self.handles)
        records: list[SavedValueRecord] = []
        seen: set[int] = set()
        for node in self.decisions:
            if not node.decision.saves:
                continue
            if id(node) not in needed:
                node.value = None  # saved by policy, but no backward ever asks for it
                continue
            records.extend(_saved_records(node, seen))
            if all(v is not None for v in node.value):
                node.args = node.kwargs = None  # never recomputed: its inputs may go
                node.deps = ()
            _store_saved(node)
        for stats in self.ctx.stats:
            stats.ops_recorded += self.nodes_recorded
            stats.saved.extend(records)
            stats.decisions.extend((op_name(n.op), n.decision) for n in self.decisions)
        self.producers.clear()
        self.leaves.clear()
        self.leaves_by_storage.clear()
        self.saved_by_storage.clear()
        self.handles.clear()
        self.decisions.clear()


def _arg_at(args: tuple, kwargs: dict, func: Any, i: int) -> Any:
    if i >= 0:
        if i < len(args):
            return args[i]
        name = func._schema.arguments[i].name
        return kwargs.get(name)
    return kwargs.get(func._schema.arguments[-1 - i].name)


def _flat_outputs(out: Any) -> list[Any]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return list(out)
    return [out]


def _needed_nodes(handles: Sequence[SavedHandle]) -> dict[int, OpNode]:
    """Nodes some handle needs: its own node, and inputs of nodes that will be recomputed."""
    needed: dict[int, OpNode] = {}
    stack = [h.node for h in handles]
    while stack:
        node = stack.pop()
        if id(node) in needed:
            continue
        needed[id(node)] = node
        if not (node.decision is not None and node.decision.saves):
            stack.extend(node.deps)
    return needed


def _store_saved(node: OpNode) -> None:
    """Apply the decision's storage: plain, CPU offload, or the user's pack hook."""
    decision = node.decision
    if decision.hooks is not None:
        node.packed = [decision.hooks.pack(v) if isinstance(v, torch.Tensor) else v
                       for v in node.value]
        node.value = None
    elif decision.offloads:
        node.packed = [_offload(v) for v in node.value]
        node.value = None


def _offload(v: Any) -> Any:
    if not isinstance(v, torch.Tensor) or v.device.type == "cpu":
        return v
    host = torch.empty(v.shape, dtype=v.dtype, device="cpu",
                       pin_memory=torch.cuda.is_available() if v.is_cuda else False)
    host.copy_(v, non_blocking=True)
    return (host, v.device)


def _saved_records(node: OpNode, seen: set[int]) -> list[SavedValueRecord]:
    """One record per saved tensor output; a storage shared by several counts once."""
    records = []
    for i, t in enumerate(node.value):
        if not isinstance(t, torch.Tensor):
            continue
        key = _storage_key(t)
        nbytes = 0 if key in seen else _nbytes(t)
        seen.add(key)
        records.append(SavedValueRecord(f"{op_name(node.op)}#{node.seq}:{i}", op_name(node.op),
                                        nbytes, node.decision.reason(), node.region,
                                        node.decision.label))
    return records


def _capture_rng(args: tuple, kwargs: dict) -> tuple[torch.Generator, torch.Tensor]:
    gen = kwargs.get("generator")
    if gen is None:
        device = kwargs.get("device")
        if device is None:
            device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        device = torch.device(device) if device is not None else torch.get_default_device()
        if device.type == "cpu":
            gen = torch.default_generator
        else:
            mod = getattr(torch, device.type)
            idx = device.index if device.index is not None else mod.current_device()
            gen = mod.default_generators[idx]
    return gen, gen.get_state()


# --------------------------------------------------------------------------------------
# Backward: unpacking and replay
# --------------------------------------------------------------------------------------

def unpack(packed: Any) -> torch.Tensor:
    if type(packed) is not SavedHandle:
        return packed
    node = packed.node
    value = node.value
    if value is not None and node.mutated_by is None:
        return value[packed.index]
    with node.ctx.lock, torch.no_grad(), _autocast_off():
        return _materialize(node)[packed.index]


def _materialize(target: OpNode) -> list[Any]:
    """The outputs of ``target``, recomputing missing ancestors iteratively."""
    if target.value is not None and target.mutated_by is None:
        return target.value
    stack = [target]
    expanded: set[int] = set()
    while stack:
        node = stack[-1]
        if node.value is not None:
            if node.mutated_by is not None:
                _check_not_mutated(node)
            stack.pop()
            continue
        if id(node) not in expanded:
            if node.packed is not None:
                node.value = _restore_packed(node)
                stack.pop()
                continue
            if node.args is None:
                raise CheckpointError(
                    f"the value of {node.describe()} is no longer available: backward needs "
                    f"it again after it was freed. Pass retain_graph=True to the first "
                    f"backward to run backward twice")
            reused = _live_forward_outputs(node)
            if reused is not None:
                node.value = reused
                stack.pop()
                continue
            expanded.add(id(node))
            pushed = False
            for dep in node.deps:
                if dep.value is None or dep.mutated_by is not None:
                    stack.append(dep)
                    pushed = True
            if pushed:
                continue
        stack.pop()
        node.value = _replay(node)
        # The node never needs its inputs again: dropping them frees ancestors whose
        # last consumer this was.
        node.args = node.kwargs = None
        node.deps = ()
    return target.value


def _check_not_mutated(node: OpNode) -> None:
    if node.mutated_by is not None:
        raise CheckpointError(
            f"the saved output of {node.describe()} was mutated in place by "
            f"{node.mutated_by} after it was saved, so backward would use a wrong value. "
            f"Clone it before mutating, make the policy recompute {op_name(node.op)}, or pass "
            f"allow_cache_entry_mutation=True to the region (which keeps a copy)")


def _live_forward_outputs(node: OpNode) -> list[Any] | None:
    """The forward's own outputs, if every one is still alive and unmutated: no need to
    recompute what the program still holds."""
    values = []
    for facts in node.outs:
        if facts is None:
            values.append(None)
            continue
        t = facts[0]()
        if t is None or t._version != facts[1]:
            return None
        values.append(_alias_for_saving(t))
    return values


def _restore_packed(node: OpNode) -> list[Any]:
    hooks = node.decision.hooks
    values = []
    for i, p in enumerate(node.packed):
        if hooks is not None and node.outs[i] is not None:
            v = hooks.unpack(p)
            shape, dtype = node.outs[i][2:]
            if not isinstance(v, torch.Tensor) or v.shape != shape or v.dtype != dtype:
                got = (f"{tuple(v.shape)} {v.dtype}" if isinstance(v, torch.Tensor)
                       else type(v).__name__)
                raise CheckpointError(
                    f"SaveWithHooks unpack for {node.describe()} returned {got}, expected "
                    f"{tuple(shape)} {dtype}; unpack must return a tensor like the one pack got")
            values.append(v)
        elif isinstance(p, tuple):
            host, device = p
            values.append(host.to(device, non_blocking=True))
        else:
            values.append(p)
    node.packed = None
    return values


def _resolve(a: Any) -> Any:
    t = type(a)
    if t is OutRef:
        return a.node.value[a.index]
    if t is LeafRef:
        return a.value
    if (t is list or t is tuple) and a and any(type(x) in (OutRef, LeafRef) for x in a):
        vals = [_resolve(x) for x in a]
        return vals if t is list else tuple(vals)
    return a


def _forward_ref(a: Any) -> Any:
    t = type(a)
    if t is OutRef:
        facts = a.node.outs[a.index]
        return facts[0]() if facts is not None else None
    if t is LeafRef:
        return a.value
    if (t is list or t is tuple) and a and any(type(x) in (OutRef, LeafRef) for x in a):
        vals = [_forward_ref(x) for x in a]
        return vals if t is list else tuple(vals)
    return a


def _forward_args(node: OpNode) -> tuple[tuple, dict]:
    """The op's arguments as the forward saw them (for asking policies again)."""
    args = tuple([_forward_ref(a) for a in node.args])
    kwargs = {k: _forward_ref(v) for k, v in node.kwargs.items()} if node.kwargs else {}
    return args, kwargs


def _resolve_args(node: OpNode) -> tuple[tuple, dict]:
    args = tuple([_resolve(a) for a in node.args])
    kwargs = {k: _resolve(v) for k, v in node.kwargs.items()} if node.kwargs else {}
    return args, kwargs


def _replay(node: OpNode) -> list[Any]:
    if node.kwargs:
        args, kwargs = _resolve_args(node)
    else:
        args, kwargs = tuple([_resolve(a) for a in node.args]), {}
    info = _OP_INFO[node.op]
    if info.mutated:
        # Replay writes into copies: saved values, leaves and module buffers stay intact.
        args = list(args)
        for i in info.mutated:
            if i >= 0 and i < len(args) and isinstance(args[i], torch.Tensor):
                args[i] = args[i].clone()
            elif i < 0 or i >= len(args):
                name = node.op._schema.arguments[i if i >= 0 else -1 - i].name
                if isinstance(kwargs.get(name), torch.Tensor):
                    kwargs[name] = kwargs[name].clone()
        args = tuple(args)
    if node.rng is not None:
        gen, state = node.rng
        current = gen.get_state()
        gen.set_state(state)
        try:
            out = node.op(*args, **kwargs)
        finally:
            gen.set_state(current)
    else:
        out = node.op(*args, **kwargs)
    outputs = _flat_outputs(out)
    if len(outputs) < len(node.outs):
        outputs.extend(_mutated_outputs(node.op, args, kwargs, outputs, len(node.outs)))
    for i, (t, facts) in enumerate(zip(outputs, node.outs)):
        if facts is not None and (not isinstance(t, torch.Tensor) or t.shape != facts[2]
                                  or t.dtype != facts[3]):
            meta = facts[2:]
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else repr(t)
            raise CheckpointError(
                f"recomputing {node.describe()} gave output {i} as {got}, but the forward "
                f"produced {tuple(meta[0])} {meta[1]}: the region's ops are not deterministic "
                f"in shape or dtype. Make the policy save this op (MUST_SAVE)")
    for stats in node.ctx.stats:
        stats.recomputed_ops.append(op_name(node.op))
    return outputs


def _mutated_outputs(op: Any, args: tuple, kwargs: dict, outputs: list[Any],
                     n: int) -> list[Any]:
    extra = []
    for i in op_info(op).mutated:
        m = _arg_at(args, kwargs, op, i)
        if isinstance(m, torch.Tensor) and not any(m is o for o in outputs):
            extra.append(m)
    return extra[: n - len(outputs)]


@contextlib.contextmanager
def _autocast_off() -> Iterator[None]:
    # The recorded ops already carry autocast's casts; casting again would change dtypes.
    if not (torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")):
        yield
        return
    with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
        yield


# --------------------------------------------------------------------------------------
# Entering and leaving a region
# --------------------------------------------------------------------------------------

_ACTIVE = threading.local()


def active_recorder() -> RegionRecorder | None:
    return getattr(_ACTIVE, "recorder", None)


@contextlib.contextmanager
def eager_region(frame: RegionFrame, allow_cache_entry_mutation: bool = False) -> Iterator[None]:
    """Run the body as a region: the outermost one records, nested ones add their policy."""
    recorder = active_recorder()
    if recorder is not None:
        outer = recorder.frames
        recorder.frames = outer + (frame,)
        try:
            yield
        finally:
            recorder.frames = outer
        return
    if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        yield  # nothing will be saved for backward: a plain forward
        return
    recorder = RegionRecorder(frame, allow_cache_entry_mutation)
    _ACTIVE.recorder = recorder
    try:
        with torch.autograd.graph.saved_tensors_hooks(recorder.pack, unpack), recorder:
            yield
    finally:
        _ACTIVE.recorder = None
    recorder.finish()
