"""How saved values are kept under compile: CPU offload and ``SaveWithHooks``.

Decided apart from applied, around the extraction of the graphs (:mod:`.extract`):

1. Before it, :func:`save_bases_of_views`: a saved view of a value whose decision offloads
   or has hooks is replaced by that value (the view is recomputed in backward for free; it
   shares the value's storage).
2. After it, :func:`plan_storage` decides, for every saved value (by graph order), how it
   is kept - a :class:`StoredValue` per value, no graph edits. Its decision is the value's
   own, or - when the cut keeps a later value in place of the one the policy named (the
   named value's only consumers lead to it, same bytes or fewer; for hooks, the same
   number of elements, dtype and device) - the named value's, carried over to the value
   actually saved. Nothing is carried onto a value with a save decision of its own. A
   value on the CPU is a plain save for an offload (as in eager mode). A value torch's
   pass will not offload (a view, a getitem, non-contiguous, a graph output):
   MUST_CPU_OFFLOAD is a ``CheckpointError`` naming the op, region and fix;
   PREFER_CPU_OFFLOAD stays on the device. Hooks that cannot be traced raise here too.
3. :func:`apply_storage` edits the graphs from the plan: hooks are traced into both graphs
   (:mod:`.save_hooks`); offloads go through torch's offload pass (:mod:`.offload`).

:mod:`.describe` words the plan in the report (bytes - packed bytes for hooks - and
reasons of the saved values, one note per kind of storage).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx

from .. import graph_meta
from ..errors import CompiledCheckpointError
from ..policy import CheckpointPolicy, Decision
from ..cut import costs
from .extract import Split
from .facts import Storage
from .region_storage import backward_nodes, read_outside

__all__ = ["HookTraces", "packed_sizes", "save_bases_of_views", "StoredValue", "StoragePlan",
           "plan_storage", "apply_storage"]

P = CheckpointPolicy


@dataclasses.dataclass(frozen=True)
class StoredValue:
    """How one saved value is kept for the backward."""

    node: fx.Node                  # the saved value (joint graph)
    storage: Storage
    decision: Decision | None      # the policy's; None: the cut chose the host by itself
    decided: fx.Node | None = None  # whose decision: ``node``, or the value it stands in for
    refusal: str | None = None     # DEVICE: why torch's offload pass would not take it
    traced: Any = None             # HOOKS: the traced hooks (their ``packed_bytes``)

    @property
    def stands_in(self) -> bool:
        return self.decided is not None and self.decided is not self.node


@dataclasses.dataclass
class StoragePlan:
    """Every saved value kept otherwise than as is on the device, in graph order; and the
    decided values the split does not keep, with what it keeps on the device in their
    place (``(value kept, decided value)``)."""

    values: list[StoredValue] = dataclasses.field(default_factory=list)
    unkept: list[fx.Node] = dataclasses.field(default_factory=list)
    in_place: list[tuple[fx.Node, fx.Node]] = dataclasses.field(default_factory=list)


def _storage_decision(node: fx.Node) -> Decision | None:
    dec = graph_meta.decision(node)
    if dec is not None and dec.stored_off_device:
        return dec
    return None


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(graph_meta.val(node), torch.Tensor)


def _error(msg: str) -> Exception:
    return CompiledCheckpointError(msg)


# --------------------------------------------------------------------------------------
# 1. Before extraction: save the decided value, not a view of it.
# --------------------------------------------------------------------------------------

def save_bases_of_views(gm: fx.GraphModule, saved: list[fx.Node]) -> list[fx.Node]:
    """``saved``, each view of a value stored off the device replaced by that value."""
    chosen = set(saved)
    out: list[fx.Node] = []
    changed = False
    for s in saved:
        base = s
        while base.op == "call_function" and costs.is_view(base) and base.args and \
                isinstance(base.args[0], fx.Node):
            base = base.args[0]
        # (a view shares its base's storage: the base is what leaves the device or is packed)
        if base is not s and base.op == "call_function" and _is_tensor(base) and \
                _storage_decision(base) is not None:
            changed = True
            if base not in chosen:
                chosen.add(base)
                out.append(base)
            continue
        out.append(s)
    if not changed:
        return saved
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return sorted(dict.fromkeys(out), key=order.__getitem__)


# --------------------------------------------------------------------------------------
# 2. Deciding: the value actually saved in place of a decided one, and how it is kept.
# --------------------------------------------------------------------------------------

def _stand_in(d: fx.Node, saved: set[str]) -> fx.Node | None:
    """The saved value that ``d``'s only consumers lead to (a chain of single users)."""
    n = d
    for _ in range(64):
        users = [u for u in n.users if u.op != "output"]
        if len(users) != 1 or len(n.users) != 1:
            return None
        n = users[0]
        if n.name in saved:
            return n
    return None


def _carries(d: fx.Node, s: fx.Node, dec: Decision, backward: set[fx.Node]) -> bool:
    if _storage_decision(s) is not None:
        return False
    if graph_meta.outer_region_id(s) != graph_meta.outer_region_id(d) or \
            read_outside(s, backward):
        return False  # a region's storage decisions apply to its own saves only
    own = graph_meta.decision(s)
    if own is not None and own.saves:
        return False  # the policy said how to keep this one
    dv, sv = graph_meta.val(d), graph_meta.val(s)
    if dec.hooks is not None:
        return sv.numel() == dv.numel() and sv.dtype == dv.dtype and sv.device == dv.device
    return costs.nbytes(s) <= costs.nbytes(d)


class HookTraces:
    """``trace_hooks(hooks, val)``, once per hooks and value layout in a split (the hooks'
    Python side effects run once per split, as documented): the cut's packed sizes and the
    storage plan share one."""

    def __init__(self) -> None:
        self._cache: dict[tuple, Any] = {}

    def __call__(self, hooks: Any, val: torch.Tensor) -> Any:
        from .save_hooks import trace_hooks
        # Sizes as text: under dynamic shapes they are SymInts, which do not hash (the same
        # symbol is the same size within one graph)
        key = (id(hooks), tuple(map(str, val.shape)), tuple(map(str, val.stride())),
               val.dtype, val.device)
        if key not in self._cache:
            try:
                self._cache[key] = trace_hooks(hooks, val)
            except Exception as e:  # kept and raised where the hooks are applied
                self._cache[key] = e
        if isinstance(self._cache[key], Exception):
            raise self._cache[key]
        return self._cache[key]


def packed_sizes(gm: fx.GraphModule, traces: HookTraces) -> dict[fx.Node, int]:
    """The packed bytes of each value saved with ``SaveWithHooks`` (the hooks traced on its
    fake value), for the cut's save cost; hooks that cannot be traced are left out (their
    error comes when they are applied)."""
    sizes: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        dec = _storage_decision(node)
        if dec is None or dec.hooks is None or not _is_tensor(node):
            continue
        try:
            sizes[node] = traces(dec.hooks, graph_meta.val(node)).packed_bytes
        except Exception:
            continue
    return sizes


def plan_storage(gm: fx.GraphModule, split: Split, host: list[fx.Node], static: set[fx.Node],
                 num_fwd_outputs: int, traces: HookTraces) -> StoragePlan | None:
    """How each saved value of ``split`` is kept; None when no value has a storage decision
    and the cut keeps none on the host. ``host``: saved values the cut keeps on the host
    though the policy did not ask for it (a memory budget met by offloading)."""
    host_names = {n.name for n in host}
    if not host_names and all(_storage_decision(n) is None for n in gm.graph.nodes):
        return None
    fw, bw = split.fw, split.bw
    joint = {n.name: n for n in gm.graph.nodes}
    in_bw = {n.name for n in bw.graph.nodes}
    kept = [name for name in split.saved_names if name in joint and _is_tensor(joint[name])
            and joint[name].op != "placeholder"]
    kept_set = set(kept)
    # saved value name -> (decision, decided node)
    items: dict[str, tuple[Decision, fx.Node]] = {}
    for name in kept:
        dec = _storage_decision(joint[name])
        if dec is not None:
            items[name] = (dec, joint[name])
    fw_names = {n.name for n in fw.graph.nodes}
    backward = backward_nodes(gm.graph)
    plan = StoragePlan()
    for d in gm.graph.nodes:
        dec = _storage_decision(d)
        if dec is None or d.name in in_bw or d.op != "call_function" or not _is_tensor(d):
            continue
        s = _stand_in(d, kept_set)
        if s is not None and s.name not in items and _carries(d, s, dec, backward):
            items[s.name] = (dec, d)
        elif d.name in fw_names:
            plan.unkept.append(d)
    # What the split keeps on the device computed from a value it does not keep.
    from ..cut.stand_ins import kept_in_place
    on_device = {name for name in kept if name not in host_names and name not in items}
    plan.in_place = [(v, d) for d in plan.unkept for v in kept_in_place(d, on_device)]
    cut_offloads = {name for name in kept if name in host_names and name not in items}
    if not items and not cut_offloads:
        return plan

    from .offload import TorchAPIMissing, refusal
    fw_nodes = {n.name: n for n in fw.graph.nodes}
    fwd_outs = list(fw.graph.find_nodes(op="output")[0].args[0])
    static_names = {n.name for n in static}
    static_fw = {n for n in fw.graph.find_nodes(op="placeholder") if n.name in static_names}

    def why_not_offloaded(name: str) -> str | None:
        try:
            return refusal(fw_nodes[name], fwd_outs, num_fwd_outputs, static_fw)
        except TorchAPIMissing as e:
            return str(e)

    for name in kept:
        s = joint[name]
        if name in cut_offloads:
            # Chosen by the cut (network.can_leave_device checked what torch's pass checks).
            why = why_not_offloaded(name)
            plan.values.append(StoredValue(s, Storage.DEVICE if why is not None
                                           else Storage.OFFLOAD, None, refusal=why))
            continue
        if name not in items:
            continue
        dec, d = items[name]
        if dec.hooks is not None:
            from .save_hooks import UntraceableHooks
            try:
                traced = traces(dec.hooks, graph_meta.val(s))
            except (UntraceableHooks, TorchAPIMissing) as e:
                raise _error(_hooks_error(d, s, dec, str(e))) from None
            plan.values.append(StoredValue(s, Storage.HOOKS, dec, d, traced=traced))
            continue
        # offload
        if graph_meta.val(s).device.type == "cpu":
            plan.values.append(StoredValue(s, Storage.DEVICE, dec, d))
            continue
        why = why_not_offloaded(name)
        if why is not None and dec.policy is P.MUST_CPU_OFFLOAD:
            raise _error(_offload_error(d, s, why))
        plan.values.append(StoredValue(s, Storage.DEVICE if why is not None
                                       else Storage.OFFLOAD, dec, d, refusal=why))
    return plan


# --------------------------------------------------------------------------------------
# 3. Applying the plan to the graphs.
# --------------------------------------------------------------------------------------

def apply_storage(split: Split, plan: StoragePlan | None, num_fwd_outputs: int,
                  static: set[fx.Node],
                  offload_options: dict[str, bool] | None = None) -> dict[str, bool]:
    """Trace the planned hooks into both graphs and offload the planned values (in place).
    Returns torch's offload flags the offload ran with (empty: nothing offloaded)."""
    if plan is None:
        return {}
    hooks = {v.node.name: v.traced for v in plan.values if v.storage is Storage.HOOKS}
    to_offload = [v.node.name for v in plan.values if v.storage is Storage.OFFLOAD]
    if hooks:
        from .save_hooks import apply_hooks
        apply_hooks(split.fw, split.bw, hooks, num_fwd_outputs)
    if not to_offload:
        return {}
    from .offload import apply_offload
    return apply_offload(split.fw, split.bw, to_offload, num_fwd_outputs,
                         {n.name for n in static}, offload_options)


# --------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------

def _where(node: fx.Node) -> str:
    region = graph_meta.region(node)
    return f" in region {region!r}" if region else " (outside every region)"


def _offload_error(d: fx.Node, s: fx.Node, why: str) -> str:
    kept = "" if d is s else (f"; the backward keeps {s.name} ({costs.op_label(s)}) in its "
                              f"place, and that value cannot be offloaded")
    return (f"MUST_CPU_OFFLOAD of {costs.op_label(d)} ({d.name}){_where(d)} cannot be honoured "
            f"under torch.compile{kept}: {why}. To fix: return PREFER_CPU_OFFLOAD for this op "
            f"(under compile it then stays on the device when it cannot be offloaded, with "
            f"the reason in the PartitionReport), or MUST_SAVE; or run this region through "
            f"the eager runtime (a `with sac_region(...)` block), which offloads it")


def _hooks_error(d: fx.Node, s: fx.Node, dec: Decision, why: str) -> str:
    kept = "" if d is s else f" (kept as {s.name}, {costs.op_label(s)})"
    return (f"{dec.hooks!r} on {costs.op_label(d)} ({d.name}){_where(d)}"
            f"{kept}: under torch.compile the hooks are traced into the compiled graphs, and "
            f"{why}. To fix: write pack/unpack as torch code on tensors (a dtype cast, "
            f"quantize/dequantize, .to(device)) that returns tensors and does not branch on "
            f"their values; or run this region through the eager runtime (a `with "
            f"sac_region(...)` block, or backend='eager'), where hooks run as Python"
            f"{_hooks_fallback_note()}")


def _hooks_fallback_note() -> str:
    from ..torch_internals import CONSTANT_RESULT_TAKES_OBJECTS, TORCH_VERSION
    if CONSTANT_RESULT_TAKES_OBJECTS:  # regions_compiled.hooks_fall_back_to_eager()
        return ""
    return (f" (torch >= 2.12 does that by itself for hooks a region's policy returns; this "
            f"is torch {TORCH_VERSION})")
