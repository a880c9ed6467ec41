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

from collections.abc import Callable, Iterable
from typing import Any

import torch.fx as fx

from .. import graph_meta
from ..report import MemoryPeak
from ..cut import costs
from ..cut.roles import Role, node_role
from .inductor_alloc import not_allocated
from .products_apart import foldable
from .storage_walk import Key, Walk, storage_base

__all__ = ["estimate_peak", "cut_peak", "cut_peaks", "products_kept_apart"]

def _region(node: fx.Node | None) -> str:
    path = graph_meta.region_path(node) if node is not None else None
    return path[-1] if path else ""


def _counters(fw_walk: Walk, bw_walk: Walk, joint_of: Callable[[fx.Node], fx.Node | None]
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
                 ) -> tuple[Walk, Walk, Callable[[Key], bool], Callable[[Key], bool],
                            Callable[[Key], bool]]:
    """The walks of a split's final graphs and what each counts: the forward, the
    backward, and the backward with the gradients it hands back (see ``with_gradients``)."""
    fw_walk = Walk(list(fw.graph.nodes), given=fw.graph.find_nodes(op="placeholder"))
    bw_walk = Walk(list(bw.graph.nodes), given=bw.graph.find_nodes(op="placeholder"),
                    vals=graph_meta.replayed_vals(bw))
    fw_counted, bw_counted = _counters(fw_walk, bw_walk, lambda n: by_name.get(n.name))
    return fw_walk, bw_walk, fw_counted, bw_counted, _with_gradients(fw_walk, bw_walk,
                                                                     bw_counted)


def _temporary(k: Key) -> bool:
    """An op's own temporary (:meth:`Walk._operand_copies`), not a value."""
    return k[1] == -1


def _with_gradients(fw_walk: Walk, bw_walk: Walk, bw_counted: Callable[[Key], bool]
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


def _with_temporaries(walk: Walk, counted: Callable[[Key], bool]) -> Callable[[Key], bool]:
    """``counted`` and the ops' temporaries (the step's forward, as an allocator sees it)."""
    on_device = any(d != "cpu" for d in walk.device.values())
    return lambda k: counted(k) or (_temporary(k) and not (on_device and walk.device[k] == "cpu"))


def _fused_peak(fw: fx.GraphModule, bw: fx.GraphModule, by_name: dict[str, fx.Node]
                ) -> MemoryPeak:
    """The same walks as Inductor allocates: without the values it computes inside the
    kernels that read them, writes into a dying input or into a storage freed earlier
    (:func:`.inductor_alloc.not_allocated`)."""
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


def products_kept_apart(fw: fx.GraphModule, bw: fx.GraphModule, joint: fx.GraphModule
                        ) -> tuple[dict[str, str], dict[str, str]]:
    """The matrix products the fused model keeps apart from their adds in a split's forward
    and backward (:func:`.inductor_alloc.not_allocated`), by name: product -> the node right
    after which it runs (what :func:`.products_apart.keep_products_apart` applies)."""
    by_name = {n.name: n for n in joint.graph.nodes}
    fw_walk, bw_walk, fw_counted, _, grads_counted = _split_walks(fw, bw, by_name)
    if not foldable(fw_walk) and not foldable(bw_walk):
        return {}, {}  # (no product Inductor would fold: the allocation rules need not run)
    not_allocated(fw_walk, bw_walk, lambda n: by_name.get(n.name), fw_counted, grads_counted)
    fw_apart, bw_apart = ({p.name: a.name for p, a in w.apart.items()}
                          for w in (fw_walk, bw_walk))
    return fw_apart, bw_apart


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

    def label(walk: Walk, k: Key, phase: str) -> tuple[str, str]:
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
    fw_walk = Walk([n for n in fw_seq if n.op != "placeholder"],
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
    bw_walk = Walk(bw_seq, given=[*kept, *tangents],
                    outputs=[o for o in cls.bwd_outputs if isinstance(o, fx.Node)])
    fw_counted, bw_counted = _counters(fw_walk, bw_walk, lambda n: n)
    grads_counted = _with_gradients(fw_walk, bw_walk, bw_counted)
    if with_gradients:
        fw_counted, bw_counted = _with_temporaries(fw_walk, fw_counted), grads_counted
    if fused:  # reuse planned over every storage the backward allocates (as _fused_peak)
        fw_away, bw_away = not_allocated(fw_walk, bw_walk, lambda n: n, fw_counted,
                                         grads_counted)
        fw_all, bw_all = fw_counted, bw_counted
        fw_counted = lambda k: fw_all(k) and k not in fw_away  # noqa: E731
        bw_counted = lambda k: bw_all(k) and k not in bw_away  # noqa: E731
    return fw_walk.sweep(fw_counted)[0], bw_walk.sweep(bw_counted)[0]
