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
* bytes come from ``graph_meta.val(node)`` (a symbolic size by its hint), as the cut's costs;
* forward: every computed value (the forward's inputs and parameters are not counted);
  backward: the values the forward handed over (several saved views of one value count
  once; views of an input count nothing), the tangents, recomputed values and gradients
  of activations; the gradients the backward returns are autograd's, not counted;
* only device bytes: where the graph has values on an accelerator, host copies (offload)
  are not counted.

Inductor may reorder and fuse the backward further (and keeps fewer intermediates); the
model is the order of the graphs as extracted, the same for every compiler. ``peak.fused``
is the same walk as Inductor allocates (:mod:`.inductor_alloc`: values computed inside
the kernels that read them, written into a dying input, or into a storage freed earlier,
read off the graph alone). Walked in the order Inductor's code runs, those rules give the
allocator's step peak (Llama to the byte, GPT-2 -0.7%); the backward is walked in the order
of Inductor's horizontal fusion (:mod:`.inductor_order`); its other reordering is not
modelled (``benchmarks/peak_measured.py`` measures the rest against the allocator).
"""
from __future__ import annotations

import operator
from collections.abc import Callable, Container, Iterable
from typing import Any

import torch
import torch.fx as fx

from .. import graph_meta
from ..report import MemoryPeak
from ..cut import costs
from ..cut.roles import Role, node_role
from ..torch_internals import OpOverload, pytree
from .op_temporaries import operand_copy_bytes

__all__ = ["estimate_peak", "cut_peak", "cut_peaks", "read_only_by_fusible", "storage_base"]

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
    if not isinstance(target, OpOverload):
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
    """The storages of a node sequence that runs in order: who makes each, its bytes, its
    last use. ``given``: nodes whose values exist when the sequence starts (a graph's
    placeholders; the kept values of a candidate cut), each its own storage. ``outputs``:
    nodes whose values outlive the sequence."""

    def __init__(self, seq: list[fx.Node], *, given: Iterable[fx.Node] = (),
                 outputs: Iterable[fx.Node] = (), vals: dict[str, Any] | None = None) -> None:
        self._given, self._outputs = list(given), list(outputs)
        self.nodes = list(seq)
        self.vals = vals or {}  # values of nodes that carry none, by name
        self.made_by_producer: dict[fx.Node, list[Key | None]] = {}
        given = set(given)
        self.given_names = {g.name for g in given}
        self.keys: dict[fx.Node, list[Key | None]] = {}
        self.made_at: dict[Key, int] = {}
        self.size: dict[Key, int] = {}
        self.device: dict[Key, str] = {}
        self.dtype: dict[Key, torch.dtype] = {}
        self.last: dict[Key, int] = {}
        self.maker: dict[Key, fx.Node] = {}
        for g in sorted(given, key=lambda n: n.name):  # alive before the first node
            self.keys[g] = self._make(g, -1)
        end = len(self.nodes)
        for pos, n in enumerate(self.nodes):
            if n.op == "output":
                outputs = [*outputs, *(a for a in pytree.tree_leaves(n.args)
                                       if isinstance(a, fx.Node))]
                continue
            if n not in given:
                self.keys[n] = self._storages(n, pos)
                self._operand_copies(n, pos)
            for a in n.all_input_nodes:
                for k in self.keys.get(a, ()):
                    if k is not None:
                        self.last[k] = max(self.last.get(k, -1), pos)
        self.outputs: set[Key] = set()
        for o in outputs:
            for k in self.keys.get(o, ()):
                if k is not None:
                    self.last[k] = end
                    self.outputs.add(k)

    def reorder(self, seq: list[fx.Node]) -> None:
        """The same walk over ``seq``, the same nodes in another order (storages anew)."""
        self.__init__(seq, given=self._given, outputs=self._outputs, vals=self.vals)

    def _make(self, n: fx.Node, pos: int) -> list[Key | None]:
        out: list[Key | None] = []
        val = graph_meta.val(n) if graph_meta.has_val(n) else self.vals.get(n.name)
        for i, t in enumerate(_tensors(val)):
            if not isinstance(t, torch.Tensor):
                out.append(None)
                continue
            key = (n.name, i)
            self.made_at[key] = pos
            self.size[key] = costs._tensor_bytes(t)
            self.device[key] = t.device.type
            self.dtype[key] = t.dtype
            self.maker[key] = n
            self.last.setdefault(key, pos)
            out.append(key)
        return out

    def _operand_copies(self, n: fx.Node, pos: int) -> None:
        """The op's own temporaries (:mod:`.op_temporaries`): one storage made and freed
        at ``pos``, counted in the step only (:func:`_temporary`)."""
        copies = operand_copy_bytes(n)
        if copies:
            key = (n.name, -1)
            self.made_at[key], self.size[key], self.last[key] = pos, copies, pos
            self.device[key] = graph_meta.val(n).device.type
            self.maker[key] = n

    def _storages(self, n: fx.Node, pos: int) -> list[Key | None]:
        src = _alias_source(n)
        if src is not None:
            return list(self.keys.get(src, ()))
        if n in self.made_by_producer:
            return self.made_by_producer[n]
        if not graph_meta.has_val(n) and n.name not in self.vals and n.op == "call_function":
            # No value (torch's RNG functionalisation makes its run_and_save_rng_state
            # nodes without one): its outputs, the values of the getitems that read them,
            # exist from this node on.
            for u in n.users:
                if u.target is operator.getitem:
                    self.made_by_producer[u] = self._make(u, pos)
            return []
        if n.target is operator.getitem and isinstance(n.args[0], fx.Node):
            base = self.keys.get(n.args[0], [])
            i = n.args[1]
            if _alias_source(n.args[0]) is not None:  # an item of a view list: the base's
                return base[:1]
            return [base[i]] if isinstance(i, int) and 0 <= i < len(base) else []
        return self._make(n, pos)

    def sweep(self, counted: Callable[[Key], bool]) -> tuple[int, int, list[Key]]:
        """(peak bytes, position of the peak (-1: before the first node), storages alive
        then)."""
        born: dict[int, list[Key]] = {}
        dies: dict[int, list[Key]] = {}
        for k, pos in self.made_at.items():
            if counted(k):
                born.setdefault(pos, []).append(k)
                dies.setdefault(self.last.get(k, pos), []).append(k)
        live: set[Key] = set()
        total = peak = 0
        peak_pos, peak_live = -1, []
        for pos in range(-1, len(self.nodes)):
            for k in born.get(pos, ()):
                live.add(k)
                total += self.size[k]
            if total > peak:
                peak, peak_pos, peak_live = total, pos, list(live)
            for k in dies.get(pos, ()):
                if k in live:
                    live.discard(k)
                    total -= self.size[k]
        return peak, peak_pos, peak_live


def _region(node: fx.Node | None) -> str:
    path = graph_meta.region_path(node) if node is not None else None
    return path[-1] if path else ""


def _counters(fw_walk: _Walk, bw_walk: _Walk, joint_of: Callable[[fx.Node], fx.Node | None]
              ) -> tuple[Callable[[Key], bool], Callable[[Key], bool]]:
    """What each walk counts (see the module docstring); ``joint_of``: a walked node's
    joint-graph node (None: added after the cut, such as an RNG state)."""
    on_device = any(d != "cpu" for d in fw_walk.device.values())

    def fw_counted(k: Key) -> bool:
        return k[0] not in fw_walk.given_names and not _temporary(k) and \
            (not on_device or fw_walk.device[k] != "cpu")

    shared: dict[str, Key] = {}  # joint storage base -> the first kept value on it

    def bw_counted(k: Key) -> bool:
        node = bw_walk.maker[k]
        if _temporary(k) or (on_device and bw_walk.device[k] == "cpu"):
            return False
        if node.name not in bw_walk.given_names:
            return k not in bw_walk.outputs  # gradients handed back are autograd's
        j = joint_of(node)
        if j is None:
            return True
        base = storage_base(j)
        if base.op == "placeholder":  # an input (or a view of one): not an activation,
            return node_role(base) is Role.TANGENT  # but a tangent is the backward's own
        if shared.setdefault(base.name, k) != k:
            return False  # another kept view of the same storage counted it
        if base is not j:  # a kept view keeps its base's whole storage
            bw_walk.size[k] = costs.nbytes(base)
        return True

    return fw_counted, bw_counted


def _split_walks(fw: fx.GraphModule, bw: fx.GraphModule, by_name: dict[str, fx.Node]
                 ) -> tuple[_Walk, _Walk, Callable[[Key], bool], Callable[[Key], bool],
                            Callable[[Key], bool]]:
    """The walks of a split's final graphs and what each counts: the forward, the
    backward, and the backward with the gradients it hands back (see ``with_gradients``)."""
    fw_walk = _Walk(list(fw.graph.nodes), given=fw.graph.find_nodes(op="placeholder"))
    bw_walk = _Walk(list(bw.graph.nodes), given=bw.graph.find_nodes(op="placeholder"),
                    vals=graph_meta.replayed_vals(bw))
    fw_counted, bw_counted = _counters(fw_walk, bw_walk, lambda n: by_name.get(n.name))
    return fw_walk, bw_walk, fw_counted, bw_counted, _with_gradients(fw_walk, bw_walk,
                                                                     bw_counted)


def _temporary(k: Key) -> bool:
    """An op's own temporary (:meth:`_Walk._operand_copies`), not a value."""
    return k[1] == -1


def _with_gradients(fw_walk: _Walk, bw_walk: _Walk, bw_counted: Callable[[Key], bool]
                    ) -> Callable[[Key], bool]:
    """What the backward walk counts for the step as an allocator sees it: also the
    gradients it hands back, which the backward allocates and which outlive it (outputs
    live to the walk's end already), and ops' temporaries."""
    on_device = any(d != "cpu" for d in fw_walk.device.values())

    def counted(k: Key) -> bool:
        return bw_counted(k) or ((_temporary(k) or (
            k in bw_walk.outputs and bw_walk.maker[k].name not in bw_walk.given_names))
            and (not on_device or bw_walk.device[k] != "cpu"))

    return counted


def _with_temporaries(walk: _Walk, counted: Callable[[Key], bool]) -> Callable[[Key], bool]:
    """``counted`` and the ops' temporaries (the step's forward, as an allocator sees it)."""
    on_device = any(d != "cpu" for d in walk.device.values())
    return lambda k: counted(k) or (_temporary(k) and not (on_device and walk.device[k] == "cpu"))


def _fused_peak(fw: fx.GraphModule, bw: fx.GraphModule, by_name: dict[str, fx.Node]
                ) -> MemoryPeak:
    """The same walks as Inductor allocates: without the values it computes inside the
    kernels that read them, writes into a dying input or into a storage freed earlier
    (:func:`.inductor_alloc.not_allocated`)."""
    from .inductor_alloc import not_allocated
    fw_walk, bw_walk, fw_counted, bw_counted, grads_counted = _split_walks(fw, bw, by_name)
    # Inductor plans the backward's reuse with every storage it allocates, its gradients too
    fw_away, bw_away = not_allocated(fw_walk, bw_walk, lambda n: by_name.get(n.name),
                                     fw_counted, grads_counted)
    forward = fw_walk.sweep(lambda k: fw_counted(k) and k not in fw_away)[0]
    backward = bw_walk.sweep(lambda k: bw_counted(k) and k not in bw_away)[0]
    fw_step = _with_temporaries(fw_walk, fw_counted)
    step_counted = lambda k: grads_counted(k) and k not in bw_away  # noqa: E731
    step = max(fw_walk.sweep(lambda k: fw_step(k) and k not in fw_away)[0],
               bw_walk.sweep(step_counted)[0])
    return MemoryPeak(forward, backward, "backward" if backward >= forward else "forward",
                      with_gradients=step)


def estimate_peak(fw: fx.GraphModule, bw: fx.GraphModule, joint: fx.GraphModule) -> MemoryPeak:
    """The peak of live activation bytes over ``fw`` then ``bw`` (a split of ``joint``,
    whose nodes give names their regions); see the module docstring."""
    by_name = {n.name: n for n in joint.graph.nodes}
    fw_walk, bw_walk, fw_counted, bw_counted, grads_counted = _split_walks(fw, bw, by_name)
    fw_peak, fw_pos, fw_live = fw_walk.sweep(fw_counted)
    bw_peak, bw_pos, bw_live = bw_walk.sweep(bw_counted)
    with_grads = max(fw_walk.sweep(_with_temporaries(fw_walk, fw_counted))[0],
                     bw_walk.sweep(grads_counted)[0])
    fw_names = {n.name for n in fw.graph.nodes if n.op == "call_function"}

    def label(walk: _Walk, k: Key, phase: str) -> tuple[str, str]:
        node = walk.maker[k]
        j = by_name.get(node.name)
        if phase == "forward":
            return "forward", _region(j)
        if node.name in walk.given_names:
            if j is not None and node_role(j) is Role.TANGENT:
                return "backward", ""
            return "kept", _region(storage_base(j) if j is not None else None)
        if node.name in fw_names or node.name in walk.vals:  # (or a replayed random op)
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
        after = f"{node.name} ({costs.op_label(node)})" if node.op == "call_function" \
            else node.name
    return MemoryPeak(fw_peak, bw_peak, phase, after, at_peak, with_grads,
                      _fused_peak(fw, bw, by_name))


def read_only_by_fusible(node: fx.Node, within: Container[fx.Node],
                         fusible: Callable[[fx.Node], bool]) -> bool:
    """Every reader of ``node``'s storage among ``within`` is fusible, views followed
    through to their readers (a view reads nothing: its readers read the storage)."""
    stack = [node]
    while stack:
        m = stack.pop()
        for u in m.users:
            if u not in within:
                continue
            if _alias_source(u) is m:
                stack.append(u)
            elif not fusible(u):
                return False
    return True


def cut_peak(graph: fx.Graph, cls: Any, kept: Iterable[fx.Node]) -> int:
    """The peak (forward or backward, the larger) of the split a cut would give: the larger
    of :func:`cut_peaks`."""
    return max(cut_peaks(graph, cls, kept))


def cut_peaks(graph: fx.Graph, cls: Any, kept: Iterable[fx.Node], *, fused: bool = False,
              with_gradients: bool = False) -> tuple[int, int]:
    """The (forward, backward) peaks of the split a cut would give, without extracting it:
    ``cls`` the joint ``graph``'s :class:`~.network.Classification`, ``kept`` the values the
    cut keeps. The forward runs what the forward outputs and the kept values need, in graph
    order; the backward runs its ops in graph order, each preceded by the recomputed values
    it needs and has not yet (:func:`.order.reorder_like_autograd`'s order). ``fused``: as
    Inductor allocates (:func:`.inductor_alloc.not_allocated`). ``with_gradients``: the
    backward's peak counts the gradients it hands back from the node that makes each (the
    step's, ``MemoryPeak.with_gradients``)."""
    kept = set(kept)
    order = {n: i for i, n in enumerate(cls.nodes)}
    fw_outputs = [o for o in cls.fwd_outputs if isinstance(o, fx.Node)]
    need, stack = set(), [*fw_outputs, *kept]
    while stack:  # what the forward computes
        n = stack.pop()
        if n not in need and n in order:
            need.add(n)
            stack.extend(n.all_input_nodes)
    fw_seq = sorted(need, key=order.__getitem__)
    fw_walk = _Walk([n for n in fw_seq if n.op != "placeholder"],
                    given=[n for n in fw_seq if n.op == "placeholder"],
                    outputs=[*fw_outputs, *kept])
    position = {n: i for i, n in enumerate(graph.nodes)}
    in_bw = sorted(cls.backward, key=position.__getitem__)
    backward = [n for n in in_bw if n.op != "placeholder"]
    tangents = [n for n in in_bw if n.op == "placeholder"]
    placed: set[fx.Node] = set(kept)
    bw_seq: list[fx.Node] = []
    for b in backward:
        todo, stack = [], [a for a in b.all_input_nodes if a in order]
        while stack:  # the recomputed values b needs
            n = stack.pop()
            if n in placed or n.op == "placeholder":
                continue
            placed.add(n)
            todo.append(n)
            stack.extend(a for a in n.all_input_nodes if a in order)
        bw_seq.extend(sorted(todo, key=order.__getitem__))
        bw_seq.append(b)
    bw_walk = _Walk(bw_seq, given=[*kept, *tangents],
                    outputs=[o for o in cls.bwd_outputs if isinstance(o, fx.Node)])
    fw_counted, bw_counted = _counters(fw_walk, bw_walk, lambda n: n)
    grads_counted = _with_gradients(fw_walk, bw_walk, bw_counted)
    if with_gradients:
        fw_counted, bw_counted = _with_temporaries(fw_walk, fw_counted), grads_counted
    if fused:  # reuse planned over every storage the backward allocates (as _fused_peak)
        from .inductor_alloc import not_allocated
        fw_away, bw_away = not_allocated(fw_walk, bw_walk, lambda n: n, fw_counted,
                                         grads_counted)
        fw_all, bw_all = fw_counted, bw_counted
        fw_counted = lambda k: fw_all(k) and k not in fw_away  # noqa: E731
        bw_counted = lambda k: bw_all(k) and k not in bw_away  # noqa: E731
    return fw_walk.sweep(fw_counted)[0], bw_walk.sweep(bw_counted)[0]
