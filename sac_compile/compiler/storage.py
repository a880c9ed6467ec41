"""How saved values are kept under compile: CPU offload and ``SaveWithHooks``.

:func:`extract_with_storage` wraps the partitioner's forward/backward extraction:

1. Before it: a saved view of a value whose decision offloads or has hooks is replaced by
   that value (the view is recomputed in backward for free; it shares the value's storage).
2. After it, for every saved value (by graph order), its storage decision: the value's own,
   or - when the cut keeps a later value in place of the one the policy named (the named
   value's only consumers lead to it, same bytes or fewer; for hooks, the same number of
   elements, dtype and device) - the named value's, carried over to the value actually saved. Nothing is carried
   onto a value with a save decision of its own.
3. Hooks are traced into both graphs (:mod:`.save_hooks`); offloads go through torch's
   offload pass (:mod:`.offload`). A value on the CPU is a plain save for an offload (as in
   eager mode). A value torch's pass will not offload (a view, a getitem, non-contiguous, a
   graph output): MUST_CPU_OFFLOAD is a ``CheckpointError`` naming the op, region and fix;
   PREFER_CPU_OFFLOAD stays on the device with the reason in the report.

Each kept value's note goes on its joint-graph node (``meta["sac_storage"]``) for
:func:`annotate_report`, which sets the report's bytes (packed bytes for hooks) and reasons.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from ..errors import CompiledCheckpointError
from ..policy import CheckpointPolicy, Decision
from ..report import fmt_bytes
from ..cut import costs

__all__ = ["extract_with_storage", "annotate_report", "StorageNote",
           "packed_sizes"]

P = CheckpointPolicy
NOTE_KEY = "sac_storage"
SUMMARY_KEY = "sac_storage_summary"


@dataclasses.dataclass(frozen=True)
class StorageNote:
    kind: str                  # "offload" | "hooks" | "device" (kept on the device as is)
    reason: str                # the report's reason for the saved value
    nbytes: int | None = None  # the bytes the report shows, when not the value's own
    stands_in_for: str = ""    # the decided node's name, when carried over


def _storage_decision(node: fx.Node) -> Decision | None:
    dec = node.meta.get("sac_decision")
    if dec is not None and dec.stored_off_device:
        return dec
    return None


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _region(node: fx.Node) -> str:
    path = node.meta.get("sac_region_path")
    return path[-1] if path else ""


def _error(msg: str) -> Exception:
    return CompiledCheckpointError(msg)


# --------------------------------------------------------------------------------------
# 1. Before extraction: save the decided value, not a view of it.
# --------------------------------------------------------------------------------------

def _save_bases_of_views(gm: fx.GraphModule, saved: list[fx.Node]) -> list[fx.Node]:
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
# 2. The value actually saved in place of a decided one.
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


def _carries(d: fx.Node, s: fx.Node, dec: Decision) -> bool:
    if _storage_decision(s) is not None:
        return False
    own = s.meta.get("sac_decision")
    if own is not None and own.saves:
        return False  # the policy said how to keep this one
    dv, sv = d.meta["val"], s.meta["val"]
    if dec.hooks is not None:
        return sv.numel() == dv.numel() and sv.dtype == dv.dtype and sv.device == dv.device
    return costs.nbytes(s) <= costs.nbytes(d)


# --------------------------------------------------------------------------------------
# The wrapper
# --------------------------------------------------------------------------------------

def extract_with_storage(extract: Callable[..., Any], gm: fx.GraphModule, saved: list[fx.Node],
                         static: set[fx.Node], num_fwd_outputs: int,
                         lap: Callable[[str], None], *, host: list[fx.Node] = (),
                         host_reason: str = "",
                         offload_options: dict[str, bool] | None = None) -> Any:
    """``extract(gm, saved, static, num_fwd_outputs, lap)`` with offload and hooks applied.
    ``host``: saved values the cut keeps on the host though the policy did not ask for it
    (a memory budget met by offloading); ``host_reason`` says why, for the report."""
    saved = _save_bases_of_views(gm, saved)
    fw, bw, saved_names, recomputed = extract(gm, saved, static, num_fwd_outputs, lap)
    host_names = {n.name for n in host}
    if host_names or any(_storage_decision(n) is not None for n in gm.graph.nodes):
        _apply(gm, fw, bw, saved_names, {n.name for n in static}, num_fwd_outputs,
               host_names, host_reason, offload_options)
        lap("storage")
    gm.meta.pop(TRACED_KEY, None)
    return fw, bw, saved_names, recomputed


TRACED_KEY = "sac_traced_hooks"


def _traced_hooks(gm: fx.GraphModule, hooks: Any, val: torch.Tensor) -> Any:
    """``trace_hooks(hooks, val)``, once per hooks and value layout in this graph (the
    hooks' Python side effects run once per split, as documented)."""
    from .save_hooks import trace_hooks
    cache = gm.meta.setdefault(TRACED_KEY, {})
    key = (id(hooks), tuple(val.shape), tuple(val.stride()), val.dtype, val.device)
    if key not in cache:
        try:
            cache[key] = trace_hooks(hooks, val)
        except Exception as e:  # kept and raised where the hooks are applied
            cache[key] = e
    if isinstance(cache[key], Exception):
        raise cache[key]
    return cache[key]


def packed_sizes(gm: fx.GraphModule) -> dict[fx.Node, int]:
    """The packed bytes of each value saved with ``SaveWithHooks`` (the hooks traced on its
    fake value), for the cut's save cost; hooks that cannot be traced are left out (their
    error comes when they are applied)."""
    gm.meta.pop(TRACED_KEY, None)
    sizes: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        dec = _storage_decision(node)
        if dec is None or dec.hooks is None or not _is_tensor(node):
            continue
        try:
            sizes[node] = _traced_hooks(gm, dec.hooks, node.meta["val"]).packed_bytes
        except Exception:
            continue
    return sizes


def _apply(gm: fx.GraphModule, fw: fx.GraphModule, bw: fx.GraphModule, saved_names: list[str],
           static_names: set[str], num_fwd_outputs: int, host: set[str] = frozenset(),
           host_reason: str = "", offload_options: dict[str, bool] | None = None) -> None:
    joint = {n.name: n for n in gm.graph.nodes}
    in_bw = {n.name for n in bw.graph.nodes}
    kept = [name for name in saved_names if name in joint and _is_tensor(joint[name])
            and joint[name].op != "placeholder"]
    kept_set = set(kept)
    # saved value name -> (decision, decided node)
    items: dict[str, tuple[Decision, fx.Node]] = {}
    for name in kept:
        dec = _storage_decision(joint[name])
        if dec is not None:
            items[name] = (dec, joint[name])
    unkept: list[fx.Node] = []
    for d in gm.graph.nodes:
        dec = _storage_decision(d)
        if dec is None or d.name in in_bw or d.op != "call_function" or not _is_tensor(d):
            continue
        s = _stand_in(d, kept_set)
        if s is not None and s.name not in items and _carries(d, s, dec):
            items[s.name] = (dec, d)
        elif d.name in {n.name for n in fw.graph.nodes}:
            unkept.append(d)
    # What the split keeps on the device computed from a value it does not keep.
    from ..cut.stand_ins import kept_in_place
    on_device = {name for name in kept if name not in host and name not in items}
    summary: dict[str, Any] = {"unkept": [
        f"{d.name} ({_decision_label(d)})" for d in unkept],
        "in_place": [f"{v.name} ({costs.op_label(v)}, {fmt_bytes(costs.nbytes(v))}, from "
                     f"{d.name})" for d in unkept for v in kept_in_place(d, on_device)]}
    gm.meta[SUMMARY_KEY] = summary
    cut_offloads = [name for name in kept if name in host and name not in items]
    from .offload import TorchAPIMissing, refusal
    if not items and not cut_offloads:
        return

    notes: dict[str, StorageNote] = {}
    hooks_traced: dict[str, Any] = {}
    to_offload: list[str] = []
    fw_nodes = {n.name: n for n in fw.graph.nodes}
    fwd_outs = list(fw.graph.find_nodes(op="output")[0].args[0])
    static_fw = {n for n in fw.graph.find_nodes(op="placeholder") if n.name in static_names}
    for name in kept:
        if name in cut_offloads:
            # Chosen by the cut (network.can_leave_device checked what torch's pass checks).
            try:
                why = refusal(fw_nodes[name], fwd_outs, num_fwd_outputs, static_fw)
            except TorchAPIMissing as e:
                why = str(e)
            if why is not None:
                notes[name] = StorageNote("device", f"{host_reason}; kept on the device after "
                                                    f"all: {why}")
                continue
            to_offload.append(name)
            notes[name] = StorageNote("offload", f"{host_reason}: offloaded to the CPU after "
                                                 f"its last forward use, reloaded before its "
                                                 f"first backward use")
            continue
        if name not in items:
            continue
        dec, d = items[name]
        s = joint[name]
        val = s.meta["val"]
        prefix = dec.reason()
        if d is not s:
            prefix = (f"stands in for {d.name} ({costs.op_label(d)}: {dec.reason()}; the cut "
                      f"keeps this later value of {fmt_bytes(costs.nbytes(s))} in its place)")
        if dec.hooks is not None:
            from .save_hooks import UntraceableHooks
            try:
                traced = _traced_hooks(gm, dec.hooks, val)
            except (UntraceableHooks, TorchAPIMissing) as e:
                raise _error(_hooks_error(d, s, dec, str(e))) from None
            hooks_traced[name] = traced
            notes[name] = StorageNote(
                "hooks", f"{prefix}: packed by {dec.hooks!r} after its last forward use "
                         f"({fmt_bytes(costs.nbytes(s))} -> {fmt_bytes(traced.packed_bytes)}), "
                         f"unpacked before its first backward use",
                traced.packed_bytes, d.name if d is not s else "")
            continue
        # offload
        if val.device.type == "cpu":
            notes[name] = StorageNote("device", f"{prefix} (the value is on the CPU: CPU "
                                                f"offload is a plain save)",
                                      stands_in_for=d.name if d is not s else "")
            continue
        try:
            why = refusal(fw_nodes[name], fwd_outs, num_fwd_outputs, static_fw)
        except TorchAPIMissing as e:
            why = str(e)
        if why is not None:
            if dec.policy is P.MUST_CPU_OFFLOAD:
                raise _error(_offload_error(d, s, why))
            notes[name] = StorageNote("device", f"{prefix} (kept on the device under compile: "
                                                f"{why})",
                                      stands_in_for=d.name if d is not s else "")
            continue
        to_offload.append(name)
        notes[name] = StorageNote(
            "offload", f"{prefix}: offloaded to the CPU after its last forward use, reloaded "
                       f"before its first backward use",
            stands_in_for=d.name if d is not s else "")
    if hooks_traced:
        from .save_hooks import apply_hooks
        apply_hooks(fw, bw, hooks_traced, num_fwd_outputs)
    if to_offload:
        from .offload import apply_offload
        summary["offload_options"] = apply_offload(fw, bw, to_offload, num_fwd_outputs,
                                                   static_names, offload_options)
    for name, note in notes.items():
        joint[name].meta[NOTE_KEY] = note


def _decision_label(node: fx.Node) -> str:
    dec = node.meta.get("sac_decision")
    region = _region(node)
    return f"{dec.label}" + (f" in region {region!r}" if region else "")


def _where(node: fx.Node) -> str:
    region = _region(node)
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


def annotate_report(report: Any, gm: fx.GraphModule) -> None:
    """Set the bytes and reasons of the report's saved values from their storage notes, and
    add one note per kind of storage."""
    joint = {n.name: n for n in gm.graph.nodes}
    counts: dict[str, list[int]] = {}
    for i, r in enumerate(report.saved):
        node = joint.get(r.name)
        note = node.meta.get(NOTE_KEY) if node is not None else None
        if note is None:
            continue
        counts.setdefault(note.kind, []).append(costs.nbytes(node))
        if note.nbytes is not None:
            counts.setdefault("packed", []).append(note.nbytes)
        kind = getattr(r.reason, "kind", None)  # a Reason keeps its kind, with the new text
        text = note.reason if kind is None else type(r.reason)(kind, note.reason)
        report.saved[i] = dataclasses.replace(
            r, reason=text, nbytes=r.nbytes if note.nbytes is None else note.nbytes,
            on_host=note.kind == "offload")
    summary = gm.meta.get(SUMMARY_KEY) or {}
    if "offload" in counts:
        opts = summary.get("offload_options", {})
        how = ", ".join(what for flag, what in (
            ("activation_offload_separate_stream", "async on a side stream"),
            ("activation_offload_sink_wait", "waits sunk to the end of the forward"),
            ("activation_reload_prefetch", "reloads prefetched")) if opts.get(flag))
        report.notes.append(
            f"CPU offload: {len(counts['offload'])} values, {fmt_bytes(sum(counts['offload']))} "
            f"leave the device (torch's activation offloading{': ' + how if how else ''})")
    if "hooks" in counts:
        report.notes.append(
            f"SaveWithHooks: {len(counts['hooks'])} values packed in the compiled graphs, "
            f"{fmt_bytes(sum(counts['hooks']))} -> {fmt_bytes(sum(counts.get('packed', [])))}")
    if "device" in counts:
        report.notes.append(f"{len(counts['device'])} values decided for CPU offload kept on "
                            f"the device (see their reasons)")
    if summary.get("unkept"):
        names = summary["unkept"]
        in_place = summary.get("in_place") or []
        what = (f"values computed from them are kept on the device in their place, "
                f"{len(in_place)}: {', '.join(in_place[:4])}{', ...' if len(in_place) > 4 else ''}"
                ) if in_place else "nor is any value computed from them"
        report.notes.append(
            f"{len(names)} values decided for offload/hooks are not kept for backward "
            f"({what}): {', '.join(names[:4])}{', ...' if len(names) > 4 else ''}")
