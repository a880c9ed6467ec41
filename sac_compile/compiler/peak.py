"""The peak model: live activation bytes over a split's forward and backward graphs, node by
node in the order they run, and what is alive at the peak (:class:`~sac_compile.report.MemoryPeak`).

Users checkpoint to lower the peak, the figure that decides an out-of-memory error; the
bytes kept at the end of forward are only part of it (a backward that recomputes a whole
stack before its first gradient keeps nothing and peaks as high as no checkpointing).

The walk follows what an eager run of the graphs does (``aot_eager`` with torch's boxed
code, which frees each value after its last use and the backward's inputs as consumed):

* a value is alive from the node that makes it until its last use; one nobody uses dies
  at once; a graph output lives to the graph's end;
* a view (and an in-place or ``out=`` op) shares the storage of the value it aliases; a
  multi-output op makes one storage per tensor output (its ``getitem``s share them);
* bytes come from ``node.meta["val"]`` (a symbolic size by its hint), as the cut's costs;
* forward: every computed value (the forward's inputs and parameters are not counted);
  backward: the values the forward handed over (several saved views of one value count
  once; views of an input count nothing), the tangents, recomputed values and gradients
  of activations; the gradients the backward returns are autograd's, not counted;
* only device bytes: where the graph has values on an accelerator, host copies (offload)
  are not counted.

Inductor may reorder and fuse the backward further (and keeps fewer intermediates); the
model is the order of the graphs as extracted, the same for every compiler.
"""
from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..report import MemoryPeak
from . import costs
from .roles import Role, node_role

__all__ = ["estimate_peak", "storage_base"]

Key = tuple[str, int]  # (name of the node that made the storage, output index)


def _alias_source(node: fx.Node) -> fx.Node | None:
    """The argument whose storage ``node``'s output shares: a view's base, the tensor an
    in-place or ``out=`` op writes. None: a new storage (or not a tensor op)."""
    if node.op != "call_function":
        return None
    target = node.target
    first = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    if costs.is_view(node):
        return first
    if not isinstance(target, torch._ops.OpOverload):
        return None
    returns = target._schema.returns
    alias = returns[0].alias_info if returns else None
    if alias is None:
        return None
    for i, arg in enumerate(target._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.before_set & alias.before_set:
            value = node.kwargs.get(arg.name, node.args[i] if i < len(node.args) else None)
            return value if isinstance(value, fx.Node) else None
    return None


def storage_base(node: fx.Node) -> fx.Node:
    """The node whose storage ``node`` shares (itself when it makes its own)."""
    seen = 0
    while seen < 10_000:
        src = _alias_source(node)
        if src is None:
            if node.target is operator.getitem and isinstance(node.args[0], fx.Node) and \
                    _alias_source(node.args[0]) is not None:  # an item of split/unbind
                node = node.args[0]
                seen += 1
                continue
            return node
        node, seen = src, seen + 1
    return node  # pragma: no cover - a cycle cannot happen in an FX graph


def _tensors(val: Any) -> list[Any]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return list(val)
    return []


class _Walk:
    """One graph's storages: who makes each, its bytes, its last use."""

    def __init__(self, graph: fx.Graph) -> None:
        self.nodes = [n for n in graph.nodes]
        self.keys: dict[fx.Node, list[Key | None]] = {}
        self.made_at: dict[Key, int] = {}
        self.size: dict[Key, int] = {}
        self.device: dict[Key, str] = {}
        self.last: dict[Key, int] = {}
        self.maker: dict[Key, fx.Node] = {}
        end = len(self.nodes)
        for pos, n in enumerate(self.nodes):
            if n.op == "output":
                for a in pytree.tree_leaves(n.args):
                    if isinstance(a, fx.Node):
                        for k in self.keys.get(a, ()):
                            if k is not None:
                                self.last[k] = end
                continue
            self.keys[n] = self._storages(n, pos)
            for a in n.all_input_nodes:
                for k in self.keys.get(a, ()):
                    if k is not None and self.last.get(k, -1) < end:
                        self.last[k] = max(self.last.get(k, -1), pos)

    def _storages(self, n: fx.Node, pos: int) -> list[Key | None]:
        src = _alias_source(n)
        if src is not None:
            return list(self.keys.get(src, ()))
        if n.target is operator.getitem and isinstance(n.args[0], fx.Node):
            base = self.keys.get(n.args[0], [])
            i = n.args[1]
            if _alias_source(n.args[0]) is not None:  # an item of a view list: the base's
                return base[:1]
            return [base[i]] if isinstance(i, int) and 0 <= i < len(base) else []
        val = n.meta.get("val")
        out: list[Key | None] = []
        for i, t in enumerate(_tensors(val)):
            if not isinstance(t, torch.Tensor):
                out.append(None)
                continue
            key = (n.name, i)
            self.made_at[key] = pos
            self.size[key] = costs._tensor_bytes(t)
            self.device[key] = t.device.type
            self.maker[key] = n
            self.last.setdefault(key, pos)
            out.append(key)
        return out

    def sweep(self, counted: Callable[[Key], bool]) -> tuple[int, int, list[Key], int]:
        """(peak bytes, position of the peak, storages alive then, bytes alive at the end)."""
        born: dict[int, list[Key]] = {}
        dies: dict[int, list[Key]] = {}
        for k, pos in self.made_at.items():
            if counted(k):
                born.setdefault(pos, []).append(k)
                dies.setdefault(self.last.get(k, pos), []).append(k)
        live: set[Key] = set()
        total = peak = 0
        peak_pos, peak_live = -1, []
        for pos in range(len(self.nodes)):
            for k in born.get(pos, ()):
                live.add(k)
                total += self.size[k]
            if total > peak:
                peak, peak_pos, peak_live = total, pos, list(live)
            for k in dies.get(pos, ()):
                if k in live:
                    live.discard(k)
                    total -= self.size[k]
        return peak, peak_pos, peak_live, total


def _region(node: fx.Node | None) -> str:
    path = node.meta.get("sac_region_path") if node is not None else None
    return path[-1] if path else ""


def estimate_peak(fw: fx.GraphModule, bw: fx.GraphModule, joint: fx.GraphModule) -> MemoryPeak:
    """The peak of live activation bytes over ``fw`` then ``bw`` (a split of ``joint``,
    whose nodes give names their regions); see the module docstring."""
    by_name = {n.name: n for n in joint.graph.nodes}
    fw_walk, bw_walk = _Walk(fw.graph), _Walk(bw.graph)
    on_device = any(d != "cpu" for d in fw_walk.device.values())

    def device_ok(walk: _Walk, k: Key) -> bool:
        return not on_device or walk.device[k] != "cpu"

    # forward: what its ops make
    def fw_counted(k: Key) -> bool:
        return fw_walk.maker[k].op != "placeholder" and device_ok(fw_walk, k)

    fw_peak, fw_pos, fw_live, _ = fw_walk.sweep(fw_counted)

    # backward: saved values (one storage per joint base), tangents, what its ops make
    fw_names = {n.name for n in fw.graph.nodes if n.op == "call_function"}
    outputs = set()
    for n in bw.graph.find_nodes(op="output"):
        for a in pytree.tree_leaves(n.args):
            if isinstance(a, fx.Node):
                outputs.update(k for k in bw_walk.keys.get(a, ()) if k is not None)
    shared: dict[str, Key] = {}  # joint storage base -> the first saved value on it

    def bw_counted(k: Key) -> bool:
        node = bw_walk.maker[k]
        if not device_ok(bw_walk, k):
            return False
        if node.op != "placeholder":
            return k not in outputs
        j = by_name.get(node.name)
        if j is None:  # added after the cut (an RNG state): an activation
            return True
        if j.op == "placeholder":
            return node_role(j) is Role.TANGENT
        base = storage_base(j)
        if base.op == "placeholder":
            return node_role(base) is Role.TANGENT  # a view of an input: the input's memory
        first = shared.setdefault(base.name, k)
        if first != k:
            return False
        if base is not j:  # a saved view keeps its base's whole storage
            bw_walk.size[k] = costs.nbytes(base)
        return True

    bw_peak, bw_pos, bw_live, _ = bw_walk.sweep(bw_counted)

    def label(walk: _Walk, k: Key, phase: str) -> tuple[str, str]:
        node = walk.maker[k]
        j = by_name.get(node.name)
        if phase == "forward":
            return "forward", _region(j)
        if node.op == "placeholder":
            if j is not None and node_role(j) is Role.TANGENT:
                return "backward", ""
            return "kept", _region(storage_base(j) if j is not None else None)
        if node.name in fw_names:
            return "recomputed", _region(j)
        return "backward", ""

    if bw_peak >= fw_peak:
        phase, walk, pos, live = "backward", bw_walk, bw_pos, bw_live
    else:
        phase, walk, pos, live = "forward", fw_walk, fw_pos, fw_live
    groups: dict[tuple[str, str], int] = {}
    for k in live:
        key = label(walk, k, phase)
        groups[key] = groups.get(key, 0) + walk.size[k]
    order = {"forward": 0, "kept": 1, "recomputed": 2, "backward": 3}
    at_peak = tuple((kind, region, n) for (kind, region), n in
                    sorted(groups.items(), key=lambda kv: (order[kv[0][0]], -kv[1], kv[0][1])))
    after = ""
    if 0 <= pos < len(walk.nodes):
        node = walk.nodes[pos]
        after = f"{node.name} ({costs.op_label(node)})" if node.op == "call_function" else node.name
    return MemoryPeak(fw_peak, bw_peak, phase, after, at_peak)

