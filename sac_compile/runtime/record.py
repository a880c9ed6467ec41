"""Forward: record a region's ops, decide each one, and hand autograd handles."""
from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from ..inert_policies import DecidedOp, may_warn_inert, warn_inert_policies
from ..policy import (CheckpointError, CheckpointPolicy, Decision, Opinion, RegionFrame, decide,
                      op_name)
from ..effects import kept_decision
from ..tensor_memory import storage_key
from ..torch_internals import (ForceDispatchKeyGuard, TorchDispatchMode,
                               dispatch_tls_local_exclude_set, dispatch_tls_local_include_set)
from .decider import fixed_decision, make_decider
from .graph import (OP_INFO, ForeignSaved, LeafRef, NodeOutput, OpNode, ReplayContext,
                    flat_outputs, forward_args, mutated_tensors, needs_detach, op_info)
from .mutations import before_mutation, follow_unversioned_write, index_saved
from .stats import SavedValueRecord, active_stats
from .store import capture_rng, count_uses, saved_records, store_saved

Tensor = torch.Tensor
_weakref = weakref.ref
_inference_mode = torch.is_inference_mode_enabled
_OP_INFO_get = OP_INFO.get
# Argument types recorded as they are (no tensor inside): the fast path's common scalars.
_ATOMS = frozenset({int, float, bool, type(None), str, torch.dtype, torch.device,
                    torch.memory_format, torch.layout})
# The recorded keyword arguments of an op called without any; never written to.
_NO_KWARGS: dict[str, Any] = {}


class RegionRecorder(TorchDispatchMode):
    """Records the ops of one outermost region (nested regions push frames onto it)."""

    # Some node's decision saves (set by _set_decision): else region exit skips the walk
    # over the decisions that keeps saved values.
    saving = False
    # Some region's policy may be inert (a function not yet checked): region exit then runs
    # warn_inert_policies over every node; else nothing there could warn.
    inert_check = False

    def __init__(self, frame: RegionFrame, allow_cache_entry_mutation: bool) -> None:
        super().__init__()
        self.frames = (frame,)
        self.ctx = ReplayContext(frame.name, allow_cache_entry_mutation,
                                 tuple(active_stats()))
        # id(tensor) -> a reference to it: its producer node for output 0, else a
        # NodeOutput (its weakref and version: ref.outs[ref.index])
        self.producers: dict[int, OpNode | NodeOutput] = {}
        self.leaves: dict[int, tuple[Any, LeafRef]] = {}
        # Which leaves and saved values live on a storage, for copy-on-write before an
        # in-place op. Built at the region's first mutation: most regions never mutate.
        self.leaves_by_storage: dict[int, list[LeafRef]] | None = None
        self.saved_by_storage: dict[int, list[OpNode]] | None = None
        self.handles: list[NodeOutput] = []
        # Nested regions created with allow_cache_entry_mutation=True (by id of frame).
        self.allowing_frames: set[int] = set()
        self.nodes_recorded = 0
        self.decisions: list[OpNode] = []
        self.suspended = False  # set through _suspend
        self.caller_dispatch_keys: Any = None
        self.kept_effects = False  # some collective/effectful op's outputs were kept
        self.budget_run = None  # a memory budget's plan for this call (.budget_run)
        if frame.budget is not None:
            from .budget_run import BudgetRun
            self.budget_run = BudgetRun(frame.budget, frame.name)
        # Not the fast path for any op: suspended, or under a memory budget (one test per op).
        self.general = self.budget_run is not None

    def __enter__(self) -> RegionRecorder:
        # Inside __torch_dispatch__ autograd's keys are excluded, so a detach there makes
        # an alias with a fresh version counter, blind to the program's later in-place
        # ops. Detaching under the caller's keys shares the counter, as autograd's does.
        self.caller_dispatch_keys = (dispatch_tls_local_include_set(),
                                     dispatch_tls_local_exclude_set())
        return super().__enter__()

    def _saved_alias(self, node: OpNode, t: torch.Tensor) -> torch.Tensor:
        """The alias kept for a saved output. A view op's output gets its base's version
        counter from autograd only after this mode returns, so it is kept as the same view
        of an alias of its base: an in-place op on the base after the region then shows."""
        if op_info(node.op).is_view and not t.is_inference():
            base = _input_sharing_storage(node, t)
            if base is not None:
                with ForceDispatchKeyGuard(*self.caller_dispatch_keys):
                    return self._alias(base, saving=False).as_strided(
                        t.size(), t.stride(), t.storage_offset())
        return self._alias(t, saving=True)

    def _alias(self, t: torch.Tensor, saving: bool) -> torch.Tensor:
        """A detached alias of ``t`` that shares its version counter."""
        if saving and not needs_detach(t):
            return t
        if not saving and not t.requires_grad:
            return t
        with ForceDispatchKeyGuard(*self.caller_dispatch_keys):
            return t.detach()

    @property
    def frames(self) -> tuple[RegionFrame, ...]:
        return self._frames

    @frames.setter
    def frames(self, frames: tuple[RegionFrame, ...]) -> None:
        self._frames = frames
        if not self.inert_check and may_warn_inert(frames):
            self.inert_check = True
        self.decider = make_decider(frames)
        self.fixed = fixed_decision(frames)  # every op's decision, or None: ask the decider

    # -- references ---------------------------------------------------------------

    def lookup(self, t: torch.Tensor) -> tuple[OpNode, int] | None:
        ref = self.producers.get(id(t))
        if ref is not None:
            facts = ref.outs[ref.index]
            if facts[0]() is t and t._version == facts[1]:
                return (ref, 0) if type(ref) is OpNode else (ref.node, ref.index)
        return None

    def leaf(self, t: torch.Tensor) -> LeafRef:
        entry = self.leaves.get(id(t))
        if entry is not None and entry[0]() is t and not entry[1].snapshot:
            return entry[1]  # a snapshot holds the value before a mutation, not this one
        ref = LeafRef(self._alias(t, saving=False), type(t) is torch.nn.Parameter)
        self.leaves[id(t)] = (weakref.ref(t), ref)
        if self.leaves_by_storage is not None:
            self.leaves_by_storage.setdefault(storage_key(t), []).append(ref)
        return ref

    def _ref(self, t: torch.Tensor) -> Any:
        """How a recorded argument refers to tensor ``t``: the output of the node that
        produced it (the node itself for its output 0, else one shared, never-written
        ``NodeOutput`` per output), or a leaf."""
        ref = self.producers.get(id(t))
        if ref is not None:
            facts = ref.outs[ref.index]
            if facts[0]() is t and t._version == facts[1]:
                return ref
        return self.leaf(t)

    def _convert(self, a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return self._ref(a)
        if isinstance(a, (list, tuple)) and a and any(isinstance(x, torch.Tensor) for x in a):
            converted = [self._ref(x) if isinstance(x, torch.Tensor) else x for x in a]
            return converted if isinstance(a, list) else tuple(converted)
        return a

    # -- the mode -------------------------------------------------------------------

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps every __torch_dispatch__ call in a dynamo-disable trampoline unless
        # told otherwise; that doubles the per-op cost, and this mode never runs while
        # dynamo traces (compiled regions use the compiler's tagging mode instead).
        return False

    def _suspend(self, on: bool) -> None:
        """Run ops unrecorded (``on``) or record them again."""
        self.suspended = on
        self.general = on or self.budget_run is not None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        info = _OP_INFO_get(id(func)) or op_info(func)
        if kwargs or not info.plain or self.general or _inference_mode():
            if self.suspended or _inference_mode():
                # An inference_mode block inside a region: its outputs can never be saved
                # for backward, so there is nothing to record; later ops read them as leaves.
                return func(*args, **(kwargs or {}))
            return self._record(func, info, args, kwargs or {})
        # The common op, inlined: positional arguments only, writes nothing, draws no
        # random numbers, no collective, no memory budget. No pytree walk; what it keeps
        # per op is the node (which also stands for its output in the arguments of the ops
        # that read it), its argument tuple and the output's facts.
        producers = self.producers
        rec = []
        for a in args:
            cls = type(a)
            if cls is Tensor:
                ref = producers.get(id(a))
                if ref is not None:
                    facts = ref.outs[ref.index]
                    if facts[0]() is a and a._version == facts[1]:
                        rec.append(ref)
                        continue
                rec.append(self.leaf(a))
            elif cls in _ATOMS:
                rec.append(a)
            else:
                rec.append(self._convert(a))
        out = info.call(*args)
        if type(out) is not Tensor:
            return self._add(self._node(func, tuple(rec), _NO_KWARGS), info, args, _NO_KWARGS,
                             out, ())
        wr = _weakref(out)
        seq = self.nodes_recorded
        self.nodes_recorded = seq + 1
        # The shape as a plain tuple: the collector stops tracking a tuple of ints.
        node = OpNode(func, tuple(rec), _NO_KWARGS, self._frames, self.ctx, seq,
                      ((wr, out._version, tuple(out.shape), out.dtype),))
        producers[id(out)] = node  # the node is the reference to its output 0
        fixed = self.fixed
        decision = fixed if fixed is not None else self.decider(func, args, _NO_KWARGS, out)
        if decision.saves:
            self._set_decision(node, decision)
        else:  # _set_decision's path for a first decision that saves nothing
            node.decision = decision
            self.decisions.append(node)
        return out

    def _node(self, func: Any, rec_args: tuple, rec_kwargs: dict) -> OpNode:
        node = OpNode(func, rec_args, rec_kwargs, self._frames, self.ctx, self.nodes_recorded, [])
        self.nodes_recorded += 1
        return node

    def _record(self, func: Any, info: Any, args: tuple, kwargs: dict) -> Any:
        """Any op: keyword arguments, in-place and random ops, collectives, budgets."""
        rec_args = tuple([self._convert(a) for a in args])
        rec_kwargs = {k: self._convert(v) for k, v in kwargs.items()} if kwargs else _NO_KWARGS
        mutated = mutated_tensors(args, kwargs, func, info) if info.mutated else ()
        prior = None
        for m in mutated:
            before_mutation(self, m, func)
        if mutated and not info.bumps_version:
            prior = [self.lookup(m) for m in mutated]
        node = self._node(func, rec_args, rec_kwargs)
        if info.random:
            node.rng = capture_rng(args, kwargs)
        out = info.call(*args, **kwargs)
        if info.bump_ourselves:
            torch.autograd.graph.increment_version(list({id(m): m for m in mutated}.values()))
        return self._add(node, info, args, kwargs, out, mutated, prior)

    def _add(self, node: OpNode, info: Any, args: tuple, kwargs: dict, out: Any,
             mutated: Sequence[torch.Tensor], prior: list | None = None) -> Any:
        """Register the op's outputs as produced by ``node``, then decide it."""
        producers = self.producers
        outs = node.outs
        bump = 1 if info.bumps_version and not info.bump_ourselves else 0
        if type(out) is Tensor and not mutated:
            outs.append((_weakref(out), out._version, tuple(out.shape), out.dtype))
            producers[id(out)] = node
        else:
            outputs = flat_outputs(out)
            # Arguments mutated but not returned are outputs too: later ops read them.
            for m in mutated:
                if not any(m is o for o in outputs):
                    outputs.append(m)
            for i, t in enumerate(outputs):
                if isinstance(t, torch.Tensor):
                    # An in-place op's version bump happens after the mode returns.
                    version = t._version + (bump if any(m is t for m in mutated) else 0)
                    outs.append((_weakref(t), version, tuple(t.shape), t.dtype))
                    producers[id(t)] = NodeOutput(node, i) if i else node
                else:
                    outs.append(None)
            if prior is not None:
                follow_unversioned_write(self, node, mutated, prior, outputs)

        fixed = self.fixed
        decision = fixed if fixed is not None else self.decider(node.op, args, kwargs, out)
        if info.effect is not None:
            decision = self._effect_rule(node, info, decision)
        if decision.saves:
            self._set_decision(node, decision)
        else:  # _set_decision's path for a first decision that saves nothing
            node.decision = decision
            self.decisions.append(node)
        if self.budget_run is not None:
            self.budget_run.on_op(node, out)
        return out

    def _effect_rule(self, node: OpNode, info: Any, decision: Decision) -> Decision:
        """Collectives and effectful ops are never replayed unless the policy says
        MUST_RECOMPUTE: their outputs are kept (see .effects)."""
        if decision.saves:
            return decision
        if decision.policy is CheckpointPolicy.MUST_RECOMPUTE:
            if info.process_group:
                raise CheckpointError(
                    f"{node.describe()} is a collective issued through a ProcessGroup, and "
                    f"region {decision.region or node.region!r} says MUST_RECOMPUTE; replaying "
                    f"it in backward would issue it again with a Work handle nobody waits on, "
                    f"so the runtime cannot. Use the functional collectives inside the region "
                    f"(torch.distributed._functional_collectives, e.g. all_gather_tensor), "
                    f"which replay as all_gather_into_tensor + wait_tensor, or let the policy "
                    f"return None for {op_name(node.op)} (its outputs are then kept)")
            return decision
        self.kept_effects = True
        return kept_decision(info.effect, node.region, decision)

    def _set_decision(self, node: OpNode, decision: Decision) -> None:
        first = node.decision is None
        was_saved = not first and node.decision.saves
        node.decision = decision
        if decision.saves:
            self.saving = True
        if decision.saves and not was_saved:
            values = []
            for facts in node.outs:
                t = facts[0]() if facts is not None else None
                if t is None and facts is not None:
                    # A tag/name decided to save after an output died (e.g. layer norm's
                    # mean, kept only as a handle by autograd): what is gone cannot be
                    # saved, so the op is recomputed when backward needs it.
                    values = []
                    break
                values.append(self._saved_alias(node, t) if t is not None else None)
            node.value = values or None
            # The versions the outputs have once the op returns (an in-place op's bump
            # comes after the mode).
            node.versions = [f[1] if f is not None else None
                             for f in node.outs] if values else None
            if values and op_info(node.op).is_view:  # aliases of the base: its counter now
                node.versions = [v._version if isinstance(v, torch.Tensor) and not
                                 v.is_inference() else None for v in values]
            index_saved(self, node)
        elif was_saved and not decision.saves:
            node.value = node.versions = None
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
        args, kwargs = forward_args(node)
        out = [f[0]() if f is not None else None for f in node.outs]
        output = out[0] if len(out) == 1 else tuple(out)
        self._suspend(True)
        try:
            decision = decide(node.frames, node.op, args, kwargs, output, names=node.names,
                              tag=node.tag, tag_region=node.region)
        finally:
            self._suspend(False)
        info = op_info(node.op)
        if info.effect is not None:
            decision = self._effect_rule(node, info, decision)
        self._set_decision(node, decision)
        return True

    # -- saved tensor hooks -------------------------------------------------------------

    def pack(self, t: torch.Tensor) -> Any:
        ref = self.producers.get(id(t))  # self.lookup(t), inlined: one call per saved tensor
        if ref is not None:
            facts = ref.outs[ref.index]
            if facts[0]() is t and t._version == facts[1]:
                # A handle of its own: follow_unversioned_write may move it.
                handle = NodeOutput(ref, 0) if type(ref) is OpNode else \
                    NodeOutput(ref.node, ref.index)
                self.handles.append(handle)
                return handle
        if t.grad_fn is not None:
            self._suspend(True)
            try:
                t = t.detach()  # a tensor with history: no cycle through our storage
            finally:
                self._suspend(False)
        return ForeignSaved(t, self.frames[-1].name)

    # -- region exit ----------------------------------------------------------------------

    def finish(self) -> None:
        """Keep only what some backward needs, then forget the forward bookkeeping."""
        # A memory budget's plan first: it decides what is saved (budget_run.py).
        try:
            records: list[SavedValueRecord] = \
                self.budget_run.apply(self) if self.budget_run is not None else []
        except BaseException:
            # (an unreachable budget): the region's outputs never reach the caller, so no
            # backward will unpack; drop every value, or autograd's nodes and ours would
            # hold each other through C++ (a cycle the collector cannot see).
            for node in self.decisions:
                node.value = node.versions = node.args = node.kwargs = None
            self.budget_run = None  # it held the forward's activations until the plan
            self._forget_forward()
            raise
        count_uses(self.handles, self.decisions)  # a node no handle needs has no uses
        seen: set[int] = set()
        saving = self.saving or self.budget_run is not None
        for node in self.decisions if saving else ():
            if not node.decision.saves:
                continue
            if not node.uses or node.value is None:
                # Saved by policy but no backward asks for it; or a late tag asked to save
                # an output that had already died, or a PREFER_SAVE value the region
                # mutated, so the op stays recomputable.
                node.value = node.versions = None
                continue
            records.extend(saved_records(node, seen))
            if all(v is not None for v in node.value):
                node.args = node.kwargs = None  # never recomputed: its inputs may go
            store_saved(node)
        if not self.inert_check:
            pass  # every policy a value, or one checked already: nothing to warn about
        elif self.kept_effects or self.budget_run is not None:  # judge what the policies said
            warn_inert_policies([DecidedOp(n.frames, n.op, n.decision.original)
                                 if getattr(n.decision, "original", None) is not None else n
                                 for n in self.decisions])
        else:
            warn_inert_policies(self.decisions)
        for stats in self.ctx.stats:
            stats.ops_recorded += self.nodes_recorded
            stats.saved.extend(records)
            stats.decisions.extend((op_name(n.op), n.decision) for n in self.decisions)
        self._forget_forward()

    def _forget_forward(self) -> None:
        self.producers.clear()
        self.leaves.clear()
        self.leaves_by_storage = self.saved_by_storage = None
        self.handles.clear()
        self.decisions.clear()


def _input_sharing_storage(node: OpNode, t: torch.Tensor) -> torch.Tensor | None:
    key = storage_key(t)
    for a in node.args:
        value = a.value if type(a) is LeafRef else (
            a.outs[a.index][0]() if type(a) in (OpNode, NodeOutput) and a.outs[a.index]
            else None)
        if isinstance(value, torch.Tensor) and storage_key(value) == key:
            return value
    return None
