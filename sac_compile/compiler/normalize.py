"""FX passes that turn the raw tags of the joint graph into final decisions.

:mod:`.tagging` writes one decision per dispatched op while AOTAutograd traces. Before the
cut, :func:`normalize_tags` runs these passes, in this order (``PASSES``); each takes the
joint graph and returns it, rewritten in place, with the number of nodes it changed:

0. :func:`~.rewritten_nodes.adopt_rewritten_nodes` - nodes an Inductor joint-graph pass
   made from an op of our region (torch's keys only) join that region call.
1. :func:`adopt_torch_tags` - tags written by torch's own caching mode (plain
   ``torch.utils.checkpoint`` SAC) become decisions: region ``'checkpoint'``, source
   ``policy``. Before 2: a tag() in such a region folds into that decision.
2. :func:`fold_markers` - the ``sac_compile::tag_marker`` / ``name_marker`` nodes become
   the decision of the op that produced their input, asked again through
   :func:`sac_compile.policy.decide` (names are visible to policies, a tag is the innermost
   opinion), and are removed.
3. :func:`share_decisions_with_getitems` - a multi-output op and its ``getitem`` nodes
   share one decision. Before 4: decompositions read their inputs' decisions.
4. :func:`propagate_to_decompositions` - nodes a joint-graph pass created inside a region
   (no tag, every tagged neighbour in one region call) take their producers' decision.
5. :func:`carry_view_storage_to_bases` - CPU offload or ``SaveWithHooks`` decided for a
   view op (by a policy or a tag) applies to the value the view shares its storage with,
   its base (through views), which is what is kept: the base's decision takes it, by the
   rules of nested opinions (MUST beats PREFER). Where the base cannot take it (an input,
   a parameter, a value from outside every region, a different MUST of its own), hooks
   stay on the view, saved and packed by itself, and a MUST_CPU_OFFLOAD is a
   ``CheckpointError`` naming the view's op, its region and the fix.
6. :func:`tag_views_like_their_base` - a view follows its base unless it carries a MUST
   of its own; a view is kept as a plain save (PREFER_SAVE): a MUST save on a view, and the
   storage part (offload, hooks) of its decision, which pass 5 gave to its base (except
   the hooks pass 5 left on the view).
7. :func:`~.region_storage.keep_storage_in_region` - a value read outside the region that
   made it keeps its save but not its hooks or offload (they are the region's, for its own
   backward; the reader outside gets the value as the program without the region would).
8. :func:`drop_tracing_metadata` - what only the passes above needed.

Passes 4 and 6 write a node's decision to its ``getitem``s too, and passes 2 and 5 to all
nodes of the dispatched op (``sac_call``), so that a multi-output op never ends up split.

Random and effectful ops are left to the cut (:mod:`.network`): random ops are recomputed
only with torch's RNG functionalisation, collectives and effectful ops never unless
MUST_RECOMPUTE.
"""
from __future__ import annotations

import dataclasses
import operator
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from .. import graph_meta
from ..policy import CheckpointError, CheckpointPolicy, Decision, Opinion, Vote, decide, \
    resolve_decision
from ..cut.costs import is_view
from ..torch_internals import OpOverload
from ..markers import NAME_OP, TAG_OP, decode_opinion, marker_producer
from ..cut.roles import Role, node_role
from ..tensor_memory import is_view_op
from .region_storage import keep_storage_in_region
from .rewritten_nodes import adopt_rewritten_nodes
from .tagging import reraise_compiled, write_decision

__all__ = ["normalize_tags", "PASSES", "adopt_torch_tags", "fold_markers",
           "share_decisions_with_getitems", "propagate_to_decompositions",
           "carry_view_storage_to_bases", "tag_views_like_their_base",
           "drop_tracing_metadata", "remove_markers", "decision_of", "TORCH_REGION"]

#: The region name of torch's own ``checkpoint(..., context_fn=...)`` regions.
TORCH_REGION = "checkpoint"

PassResult = tuple[fx.GraphModule, int]  # the graph, and how many nodes the pass changed


def decision_of(node: fx.Node) -> Decision | None:
    return graph_meta.decision(node)


# -- 1 ------------------------------------------------------------------------------------

def adopt_torch_tags(gm: fx.GraphModule) -> PassResult:
    """Torch's ``recompute`` key, written by torch's SAC, not by us, becomes a decision."""
    changed = 0
    for node in gm.graph.nodes:
        if graph_meta.has_recompute(node) and graph_meta.decision(node) is None:
            policy = graph_meta.recompute(node)
            if isinstance(policy, bool):  # torch's full AC marks nodes with True/False
                policy = CheckpointPolicy.MUST_SAVE if policy else CheckpointPolicy.PREFER_RECOMPUTE
            write_decision(node, Decision(policy, region=TORCH_REGION, source="policy"),
                           (TORCH_REGION,))
            changed += 1
    return gm, changed


# -- 2 ------------------------------------------------------------------------------------

def fold_markers(gm: fx.GraphModule) -> PassResult:
    """Remove every tag()/name() marker; each one inside a region re-decides its producer."""
    graph = gm.graph
    tags: dict[fx.Node, Opinion] = {}
    names: dict[fx.Node, set[str]] = defaultdict(set)
    removed = 0
    for node in list(graph.nodes):  # graph order: of two tags on one value the later wins
        if node.op != "call_function" or node.target not in (TAG_OP, NAME_OP):
            continue
        # A marker traced outside every region carries no sac_marker_region: a no-op, as in
        # eager. (One on a tensor from outside its region already raised while tracing.)
        if graph_meta.marker_region(node) is not None:
            producer = marker_producer(node)
            if node.target is TAG_OP:
                tags[producer] = decode_opinion(node.args[1])
            else:
                names[producer].add(node.args[1])
        node.replace_all_uses_with(node.args[0])
        graph.erase_node(node)
        removed += 1
    by_call = _nodes_by_call(graph)
    for producer in dict.fromkeys([*tags, *names]):
        decision = _redecide(producer, tags.get(producer), frozenset(names.get(producer, ())))
        call = graph_meta.call(producer)
        for node in by_call[call] if call is not None else _with_getitems(producer):
            write_decision(node, decision, graph_meta.region_path(producer))
    return gm, removed


def _redecide(producer: fx.Node, tag: Opinion | None, labels: frozenset[str]) -> Decision:
    what = "tag()" if tag is not None else "name()"
    old = decision_of(producer)
    if old is None or producer.op != "call_function":
        raise CheckpointError(
            f"{what} got a tensor that no op of a region produced (an input, a parameter, "
            f"or a value from outside every region); apply it to the output of the op "
            f"you mean, inside the region")
    ask = graph_meta.ask(producer)
    if ask is not None:  # our region: ask its policies again, with the names and the tag
        frames, func, args, kwargs, out = ask
        return decide(frames, func, args, kwargs, out, names=labels, tag=tag,
                      tag_region=graph_meta.region_path(producer)[-1])
    # torch's region: its policy's opinion, then the tag
    votes = [Vote(old.policy, old.region or TORCH_REGION, "policy")]
    if tag is not None:
        votes.append(Vote(tag, old.region or TORCH_REGION, "tag"))
    return resolve_decision(producer.target, votes)


# -- 3 ------------------------------------------------------------------------------------

def share_decisions_with_getitems(gm: fx.GraphModule) -> PassResult:
    """Each ``getitem`` takes the decision of the multi-output op it reads."""
    changed = 0
    for node in gm.graph.find_nodes(op="call_function", target=operator.getitem):
        base = node.args[0]
        base_dec = decision_of(base) if isinstance(base, fx.Node) else None
        if base_dec is not None and decision_of(node) is not base_dec:
            write_decision(node, base_dec, graph_meta.region_path(base))
            changed += 1
    return gm, changed


# -- 4 ------------------------------------------------------------------------------------

def propagate_to_decompositions(gm: fx.GraphModule) -> PassResult:
    """An untagged node between tagged ones of one region call (a decomposition, a pattern
    rewrite) takes the decision of its (last) tagged producer. Graph order, so a chain of
    new nodes inherits link by link."""
    changed = 0
    for node in _call_functions(gm.graph):
        if node.target is operator.getitem or decision_of(node) is not None:
            continue
        producer = _single_region_producer(node)
        if producer is not None:
            for n in _with_getitems(node):
                write_decision(n, decision_of(producer), graph_meta.region_path(producer))
            changed += 1
    return gm, changed


def _single_region_producer(node: fx.Node) -> fx.Node | None:
    """The last tagged input of ``node`` when every input is tagged (or a forward input),
    all from one region call, and every user is tagged; else None."""
    regions: set[Any] = set()
    chosen: fx.Node | None = None
    for a in node.all_input_nodes:
        if a.op == "placeholder":
            if node_role(a) is Role.TANGENT:
                return None  # backward code: outside every region
            continue
        if decision_of(a) is None:
            return None
        regions.add(graph_meta.region_id(a, graph_meta.ac_graph_id(a)))
        chosen = a
    if chosen is None or len(regions) != 1:
        return None
    users = list(node.users)
    if not users or any(u.op != "call_function" or decision_of(u) is None for u in users):
        return None
    return chosen


# -- 5 ------------------------------------------------------------------------------------

def carry_view_storage_to_bases(gm: fx.GraphModule) -> PassResult:
    """Offload or hooks decided for a view op go to its base (through views): a view shares
    its base's storage, so moving or packing the base is what was asked. The base's new
    decision resolves its own opinion with the view's (the view's last, as the innermost).

    Where the base cannot take it - an input, a parameter or a value from outside every
    region, or a base whose own MUST differs - hooks stay on the view, which is then saved
    and packed by itself (as the eager runtime packs the view op's output), and a
    MUST_CPU_OFFLOAD is a ``CheckpointError`` naming the view's op, its region and the fix.
    On the CPU an offload is a plain save: nothing to carry."""
    graph = gm.graph
    by_call: dict[int, list[fx.Node]] | None = None
    changed = 0
    for node in _call_functions(graph):
        dec = decision_of(node)
        if dec is None or not (dec.offloads or dec.hooks is not None) or \
                not _decided_as_view(node) or (dec.hooks is None and _on_cpu(node)):
            continue
        base = _storage_base(node)
        new = _base_with_storage(node, base, dec)
        if new is _KEEP_ON_VIEW:
            graph_meta.mark_view_keeps_storage(node)
            changed += 1
            continue
        if new is None or new == decision_of(base):
            continue
        if by_call is None:
            by_call = _nodes_by_call(graph)
        call = graph_meta.call(base)
        for n in by_call[call] if call is not None else _with_getitems(base):
            write_decision(n, new, graph_meta.region_path(base))
        changed += 1
    return gm, changed


_KEEP_ON_VIEW: Any = object()


def _on_cpu(node: fx.Node) -> bool:
    """Every tensor ``node`` produces is on the CPU (a multi-output view, ``split``, has a
    list of them)."""
    val = graph_meta.val(node)
    vals = [v for v in val if isinstance(v, torch.Tensor)] if isinstance(val, (list, tuple)) \
        else [val]
    return bool(vals) and all(isinstance(v, torch.Tensor) and v.device.type == "cpu"
                              for v in vals)


def _decided_as_view(node: fx.Node) -> bool:
    """The decision is about this view: the op the policies (or a tag) decided is a view -
    not a view node of another op's decomposition, which shares that op's decision."""
    if node.target is operator.getitem or not is_view(node) or \
            not isinstance(node.args[0] if node.args else None, fx.Node):
        return False
    op = graph_meta.op(node)
    if op is None:  # torch's own tags (pass 1) are per op: the node is the op decided
        return (decision_of(node).region or TORCH_REGION) == TORCH_REGION
    return op is node.target or is_view_op(op)


def _storage_base(node: fx.Node) -> fx.Node:
    """The value whose storage a view shares: through views, and the ``getitem``s of a
    multi-output view (``split``)."""
    base = node.args[0]
    while isinstance(base, fx.Node) and base.op == "call_function":
        src = base.args[0] if base.args else None
        if not isinstance(src, fx.Node):
            break
        if is_view(base) or (base.target is operator.getitem and is_view(src)):
            base = src
        else:
            break
    return base


def _base_with_storage(view: fx.Node, base: fx.Node, dec: Decision) -> Any:
    """The base's decision with the view's storage part; None when nothing changes (the
    base has it, or its MUST beats the view's PREFER); ``_KEEP_ON_VIEW`` for hooks the base
    cannot take. A MUST_CPU_OFFLOAD the base cannot take raises."""
    opinion: Opinion = dec.hooks if dec.hooks is not None else dec.policy
    base_dec = decision_of(base)
    if base.op != "call_function" or base_dec is None or \
            not isinstance(graph_meta.val(base), torch.Tensor):
        return _cannot_take(view, base, dec, "an input, a parameter or a value from outside "
                                             "every region")
    view_vote = Vote(opinion, dec.region or TORCH_REGION,
                     f"{dec.source} on its view {_op_label(view)} ({view.name})")
    votes = [view_vote]
    if base_dec.source != "default":
        own = base_dec.hooks if base_dec.hooks is not None else base_dec.policy
        votes.insert(0, Vote(own, base_dec.region or TORCH_REGION, base_dec.source))
    try:
        resolved = resolve_decision(base.target, votes)
    except CheckpointError:
        resolved = None
    if resolved is None or (resolved.hooks or resolved.policy) is not opinion:
        if not (dec.is_must or dec.hooks is not None):
            return None  # the base's MUST beats the view's PREFER
        return _cannot_take(view, base, dec, f"{_op_label(base)}, {base_dec.label} by "
                                             f"{base_dec.source} in region "
                                             f"{base_dec.region!r}")
    if resolved.policy is base_dec.policy and resolved.hooks is base_dec.hooks:
        return None  # the base has it already
    # The view's storage wins (over a PREFER, or adds hooks to a MUST_SAVE): reported as the
    # view's, which the reason names.
    return Decision(resolved.policy, resolved.hooks, view_vote.region, view_vote.source)


def _cannot_take(view: fx.Node, base: fx.Node, dec: Decision, base_is: str) -> Any:
    if dec.hooks is not None:
        return _KEEP_ON_VIEW  # packed as the view's own value
    if not dec.is_must:
        return None  # a PREFER: kept on the device
    raise CheckpointError(
        f"{dec.label} of {_op_label(view)} ({view.name}) in region {dec.region!r} cannot be "
        f"honoured under torch.compile: a view shares its base's storage, so the base is "
        f"what would leave the device, and this view's base {base.name} is {base_is}; "
        f"torch's offload pass does not offload a view itself. To fix: decide "
        f"MUST_CPU_OFFLOAD for the op that produced the base, inside the region (and "
        f"return None for the view op); or return PREFER_CPU_OFFLOAD for the view op (it "
        f"then stays on the device, with the reason in the PartitionReport) or MUST_SAVE; "
        f"or run this region through the eager runtime (a `with sac_region(...)` block), "
        f"which offloads the view")


def _op_label(node: fx.Node) -> str:
    op = graph_meta.op(node, node.target)
    return str(op) if isinstance(op, OpOverload) else getattr(op, "__name__", str(op))


# -- 6 ------------------------------------------------------------------------------------

def tag_views_like_their_base(gm: fx.GraphModule) -> PassResult:
    """A view takes its base's decision unless it has a MUST of its own; a view saved by a
    MUST is PREFER_SAVE, since recomputing a view from its base is free. A view keeps no
    storage decision (offload, hooks): that is its base's (pass 5)."""
    changed = 0
    for node in _call_functions(gm.graph):
        dec = decision_of(node)
        if dec is None or node.target is operator.getitem or not is_view(node) or \
                dec.policy is CheckpointPolicy.MUST_RECOMPUTE or \
                graph_meta.view_keeps_storage(node):
            continue
        base = node.args[0] if node.args else None
        base_dec = decision_of(base) if isinstance(base, fx.Node) else None
        if base_dec is not None and not dec.is_must:
            dec = base_dec
        if (dec.saves and dec.is_must) or dec.offloads or dec.hooks is not None:
            # One copy of the storage: the cut keeps the base, or the view, not both; how
            # the storage is kept (offload, hooks) is decided on the base.
            dec = dataclasses.replace(dec, policy=CheckpointPolicy.PREFER_SAVE, hooks=None)
        if dec is decision_of(node):
            continue
        path = graph_meta.region_path(base if base_dec is not None else node)
        for n in _with_getitems(node):  # a multi-output view (split): its getitems too
            write_decision(n, dec, path)
        if base_dec is not None:
            graph_meta.set_view_of(node, graph_meta.view_of(base) or base.name)
        changed += 1
    return gm, changed


# -- 8 ------------------------------------------------------------------------------------

def drop_tracing_metadata(gm: fx.GraphModule) -> PassResult:
    """What the policies were asked (``sac_ask``, which holds fake tensors), the markers
    seen while tracing (``sac_marked``) and pass 5's mark on views: nothing after these
    passes reads them."""
    changed = 0
    for node in gm.graph.nodes:
        asked = graph_meta.pop_ask(node) is not None
        marked = graph_meta.pop_marked(node) is not None
        kept = graph_meta.pop_view_keeps_storage(node)
        changed += asked or marked or kept
    return gm, changed


PASSES: tuple[Callable[[fx.GraphModule], PassResult], ...] = (
    adopt_rewritten_nodes, adopt_torch_tags, fold_markers, share_decisions_with_getitems,
    propagate_to_decompositions, carry_view_storage_to_bases, tag_views_like_their_base,
    keep_storage_in_region, drop_tracing_metadata)


def normalize_tags(gm: fx.GraphModule) -> dict[str, int]:
    """Run ``PASSES`` on ``gm`` (in place). Returns the nodes each pass changed, by name;
    a conflict a pass finds is the same :class:`~sac_compile.CheckpointError` as in eager."""
    counts: dict[str, int] = {}
    try:
        for normalize_pass in PASSES:
            gm, counts[normalize_pass.__name__] = normalize_pass(gm)
    except CheckpointError as e:
        reraise_compiled(e)
    return counts


# -- groups -------------------------------------------------------------------------------

def _nodes_by_call(graph: fx.Graph) -> dict[int, list[fx.Node]]:
    """The nodes of each dispatched op (``sac_call``): the op, its decomposition, its
    ``getitem``s. A re-decided op writes its new decision to all of them."""
    by_call: dict[int, list[fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        call = graph_meta.call(node)
        if call is not None:
            by_call[call].append(node)
    return by_call


def _call_functions(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function"]


def _with_getitems(node: fx.Node) -> list[fx.Node]:
    return [node, *(u for u in node.users if u.target is operator.getitem)]


def remove_markers(graph: fx.Graph) -> int:
    """Drop the tag()/name() marker nodes of a graph that is never partitioned (inference,
    no joint graph), where they would run as copies. Returns how many were removed."""
    removed = 0
    for node in list(graph.nodes):
        if node.op == "call_function" and (node.target is TAG_OP or node.target is NAME_OP):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            removed += 1
    return removed
