"""FX passes that turn the raw tags of the joint graph into final decisions.

:mod:`.tagging` writes one decision per dispatched op while AOTAutograd traces. Before the
cut, :func:`normalize_tags` runs these passes, in this order (``PASSES``); each takes the
joint graph and returns it, rewritten in place, with the number of nodes it changed:

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
5. :func:`tag_views_like_their_base` - a view follows its base unless it carries a MUST
   of its own; a MUST save on a view becomes PREFER_SAVE.
6. :func:`drop_tracing_metadata` - what only the passes above needed.

Passes 4 and 5 write a node's decision to its ``getitem``s too, and pass 2 to all nodes
of the dispatched op (``sac_call``), so that a multi-output op never ends up split.

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

import torch.fx as fx

from ..policy import CheckpointError, CheckpointPolicy, Decision, Opinion, Vote, decide, \
    resolve_decision
from .costs import is_view
from .markers import NAME_OP, TAG_OP, decode_opinion, marker_producer
from .roles import Role, node_role
from .tagging import reraise_compiled, write_decision

__all__ = ["normalize_tags", "PASSES", "adopt_torch_tags", "fold_markers",
           "share_decisions_with_getitems", "propagate_to_decompositions",
           "tag_views_like_their_base", "drop_tracing_metadata", "remove_markers",
           "decision_of", "TORCH_REGION"]

#: The region name of torch's own ``checkpoint(..., context_fn=...)`` regions.
TORCH_REGION = "checkpoint"

PassResult = tuple[fx.GraphModule, int]  # the graph, and how many nodes the pass changed


def decision_of(node: fx.Node) -> Decision | None:
    return node.meta.get("sac_decision")


# -- 1 ------------------------------------------------------------------------------------

def adopt_torch_tags(gm: fx.GraphModule) -> PassResult:
    """``node.meta["recompute"]`` written by torch's SAC, not by us, becomes a decision."""
    changed = 0
    for node in gm.graph.nodes:
        if "recompute" in node.meta and "sac_decision" not in node.meta:
            policy = node.meta["recompute"]
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
        if "sac_marker_region" in node.meta:
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
        call = producer.meta.get("sac_call")
        for node in by_call[call] if call is not None else _with_getitems(producer):
            write_decision(node, decision, producer.meta["sac_region_path"])
    return gm, removed


def _redecide(producer: fx.Node, tag: Opinion | None, labels: frozenset[str]) -> Decision:
    what = "tag()" if tag is not None else "name()"
    old = decision_of(producer)
    if old is None or producer.op != "call_function":
        raise CheckpointError(
            f"{what} got a tensor that no op of a region produced (an input, a parameter, "
            f"or a value from outside every region); apply it to the output of the op "
            f"you mean, inside the region")
    ask = producer.meta.get("sac_ask")
    if ask is not None:  # our region: ask its policies again, with the names and the tag
        frames, func, args, kwargs, out = ask
        return decide(frames, func, args, kwargs, out, names=labels, tag=tag,
                      tag_region=producer.meta["sac_region_path"][-1])
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
            write_decision(node, base_dec, base.meta["sac_region_path"])
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
                write_decision(n, decision_of(producer), producer.meta["sac_region_path"])
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
        regions.add(a.meta.get("sac_region_id", a.meta.get("ac_graph_id")))
        chosen = a
    if chosen is None or len(regions) != 1:
        return None
    users = list(node.users)
    if not users or any(u.op != "call_function" or decision_of(u) is None for u in users):
        return None
    return chosen


# -- 5 ------------------------------------------------------------------------------------

def tag_views_like_their_base(gm: fx.GraphModule) -> PassResult:
    """A view takes its base's decision unless it has a MUST of its own; a view saved by a
    MUST is PREFER_SAVE, since recomputing a view from its base is free."""
    changed = 0
    for node in _call_functions(gm.graph):
        dec = decision_of(node)
        if dec is None or node.target is operator.getitem or not is_view(node) or \
                dec.policy is CheckpointPolicy.MUST_RECOMPUTE:
            continue
        base = node.args[0] if node.args else None
        base_dec = decision_of(base) if isinstance(base, fx.Node) else None
        if base_dec is not None and not dec.is_must:
            dec = base_dec
        if dec.saves and dec.is_must:
            # One copy of the storage: the cut keeps the base, or the view, not both.
            dec = dataclasses.replace(dec, policy=CheckpointPolicy.PREFER_SAVE, hooks=None)
        if dec is decision_of(node):
            continue
        path = base.meta["sac_region_path"] if base_dec is not None \
            else node.meta["sac_region_path"]
        for n in _with_getitems(node):  # a multi-output view (split): its getitems too
            write_decision(n, dec, path)
        if base_dec is not None:
            node.meta["sac_view_of"] = base.meta.get("sac_view_of", base.name)
        changed += 1
    return gm, changed


# -- 6 ------------------------------------------------------------------------------------

def drop_tracing_metadata(gm: fx.GraphModule) -> PassResult:
    """What the policies were asked (``sac_ask``, which holds fake tensors) and the markers
    seen while tracing (``sac_marked``): nothing after these passes reads them."""
    changed = 0
    for node in gm.graph.nodes:
        asked = node.meta.pop("sac_ask", None) is not None
        marked = node.meta.pop("sac_marked", None) is not None
        changed += asked or marked
    return gm, changed


PASSES: tuple[Callable[[fx.GraphModule], PassResult], ...] = (
    adopt_torch_tags, fold_markers, share_decisions_with_getitems,
    propagate_to_decompositions, tag_views_like_their_base, drop_tracing_metadata)


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
        call = node.meta.get("sac_call")
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
