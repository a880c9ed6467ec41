"""One FX pass that turns the raw tags of the joint graph into final decisions.

In order:

1. ``sac_compile::tag_marker`` / ``sac_compile::name_marker`` marker nodes are folded into the decision of
   the op that produced their input - asked again through :func:`sac_compile.policy.decide`
   (names are visible to policies, a tag is the innermost opinion) - and removed.
2. Tags written by torch's own caching mode (plain ``torch.utils.checkpoint`` SAC) get our
   metadata: region ``'checkpoint'``, source ``policy``.
3. Decompositions inherit their op's decision: nodes a later pass created inside a region
   (no tag, but every tagged neighbour in one region call) take their producer's decision.
4. Multi-output ops and their ``getitem`` nodes share one decision.
5. Views follow their base unless they carry a MUST of their own.

Random and effectful ops are handled by the cut (:mod:`.flow`): random ops are recomputed
only with torch's RNG functionalisation, collectives and effectful ops never unless
MUST_RECOMPUTE.
"""
from __future__ import annotations

import dataclasses
import operator
from collections import defaultdict
from typing import Any

import torch
import torch.fx as fx

from ..policy import (CheckpointError, CheckpointPolicy, Decision, Opinion, Vote, decide,
                      op_name, resolve_decision)
from .costs import is_view
from .tagging import (NAME_OP, TAG_OP, decode_opinion, marker_producer, reraise_compiled,
                      write_decision)

__all__ = ["normalize_tags", "remove_markers", "decision_of", "TORCH_REGION"]

TORCH_REGION = "checkpoint"


def decision_of(node: fx.Node) -> Decision | None:
    return node.meta.get("sac_decision")


def _group(node: fx.Node, by_call: dict[int, list[fx.Node]]) -> list[fx.Node]:
    call = node.meta.get("sac_call")
    if call is not None:
        return by_call[call]
    return [node, *(u for u in node.users if u.target is operator.getitem)]


def normalize_tags(gm: fx.GraphModule) -> dict[str, int]:
    """Normalise the tags of ``gm`` in place. Returns counts of what was changed."""
    try:
        return _normalize(gm)
    except CheckpointError as e:
        reraise_compiled(e)
        raise  # unreachable


def _normalize(gm: fx.GraphModule) -> dict[str, int]:
    graph = gm.graph
    counts: dict[str, int] = defaultdict(int)
    by_call: dict[int, list[fx.Node]] = defaultdict(list)
    tags: dict[fx.Node, Opinion] = {}
    names: dict[fx.Node, set[str]] = defaultdict(set)

    # 1a. Torch's own tags become ours; collect the marker nodes.
    for node in list(graph.nodes):
        call = node.meta.get("sac_call")
        if call is not None:
            by_call[call].append(node)
        if node.target is TAG_OP or node.target is NAME_OP:
            src = node.args[0]
            producer = marker_producer(node)
            if "sac_marker_region" not in node.meta:
                # Outside every region of ours nothing is checkpointed: a no-op, as in eager.
                # (A marker on a tensor from outside its region already raised while
                # tracing, in tagging._check_marker.)
                pass
            elif node.target is TAG_OP:
                tags[producer] = decode_opinion(node.args[1])
            else:
                names[producer].add(node.args[1])
            node.replace_all_uses_with(src)
            graph.erase_node(node)
            counts["markers"] += 1
        elif "recompute" in node.meta and "sac_decision" not in node.meta:
            policy = node.meta["recompute"]
            if isinstance(policy, bool):
                policy = CheckpointPolicy.MUST_SAVE if policy else CheckpointPolicy.PREFER_RECOMPUTE
            write_decision(node, Decision(policy, region=TORCH_REGION, source="policy"),
                           (TORCH_REGION,))
            counts["torch_tags"] += 1

    # 1b. Fold tags and names into the producer's decision.
    for producer in list(dict.fromkeys([*tags, *names])):
        what = "tag()" if producer in tags else "name()"
        old = decision_of(producer)
        if old is None or producer.op != "call_function":
            raise CheckpointError(
                f"{what} got a tensor that no op of a region produced (an input, a parameter, "
                f"or a value from outside every region); apply it to the output of the op "
                f"you mean, inside the region")
        tag = tags.get(producer)
        label_set = frozenset(names.get(producer, ()))
        path = producer.meta["sac_region_path"]
        ask = producer.meta.get("sac_ask")
        if ask is not None:
            frames, func, args, kwargs, out = ask
            decision = decide(frames, func, args, kwargs, out, names=label_set, tag=tag,
                              tag_region=path[-1])
        else:  # torch's regions: its policy's opinion, then the tag
            votes = [Vote(old.policy, old.region or TORCH_REGION, "policy")]
            if tag is not None:
                votes.append(Vote(tag, old.region or TORCH_REGION, "tag"))
            decision = resolve_decision(producer.target, votes)
        for n in _group(producer, by_call):
            write_decision(n, decision, path)
        counts["redecided"] += 1

    # 3-5. Decompositions, multi-output consistency, views.
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        dec = decision_of(node)
        if node.target is operator.getitem:
            base = node.args[0]
            base_dec = decision_of(base) if isinstance(base, fx.Node) else None
            if base_dec is not None and dec is not base_dec:
                write_decision(node, base_dec, base.meta["sac_region_path"])
                counts["getitems"] += 1
            continue
        if dec is None:
            inherited = _inherit(node)
            if inherited is not None:
                write_decision(node, *inherited)
                counts["inherited"] += 1
            continue
        if is_view(node) and dec.policy is not CheckpointPolicy.MUST_RECOMPUTE:
            base = node.args[0] if node.args else None
            base_dec = decision_of(base) if isinstance(base, fx.Node) else None
            if base_dec is not None and not dec.is_must:
                dec = base_dec
            if dec.saves and dec.is_must:
                # Recomputing a view of its base is free and gives the same tensor: a MUST
                # save on a view is a PREFER, so the cut keeps one copy of the storage.
                dec = dataclasses.replace(dec, policy=CheckpointPolicy.PREFER_SAVE, hooks=None)
            if dec is not decision_of(node):
                path = base.meta["sac_region_path"] if base_dec is not None \
                    else node.meta["sac_region_path"]
                write_decision(node, dec, path)
                if base_dec is not None:
                    node.meta["sac_view_of"] = base.meta.get("sac_view_of", base.name)
                counts["views"] += 1

    for node in graph.nodes:
        node.meta.pop("sac_ask", None)
        node.meta.pop("sac_marked", None)
    return dict(counts)


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


def _inherit(node: fx.Node) -> tuple[Decision, tuple[str, ...]] | None:
    """A node a joint-graph pass created inside a region: the decision of its producers,
    when all its tagged producers come from the same region instance."""
    regions: set[Any] = set()
    chosen: fx.Node | None = None
    for a in node.all_input_nodes:
        if a.op == "placeholder":
            if "tangents" in str(a.target):
                return None
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
    return decision_of(chosen), chosen.meta["sac_region_path"]


def describe_conflict(node: fx.Node) -> str:  # pragma: no cover - debugging helper
    return f"{op_name(node.target)} ({node.name})"


_ = torch  # keep the import for type checkers
