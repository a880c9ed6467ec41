"""Check a region group's claim that its members decide alike.

Regions share a compiled graph when they are in one group (:mod:`sac_compile.region_groups`):
the graph is traced once, its policy asked under one member's name, and every member runs
that split. That is right only if the policy answers the same for every member. Whether it
reads the name cannot be told from its code (``vars(ctx)``, a helper, a table keyed by
name...), so it is checked on the answers themselves: when a region of a group has been
traced, its policy is asked again, op by op, the questions it was just asked, under each
member's name. Members that answer differently leave for a group of their own answers.

The cost is one policy call per op per member, once per trace. A ``per_call`` policy is
built afresh for each member, as it would be for that member's own call.
"""
from __future__ import annotations

from typing import Any

from ..markers import encode_opinion
from ..per_call import fresh_frame
from ..policy import PolicyContext, RegionFrame, coerce_opinion
from ..region_groups import RegionGroup, regroup_by_decisions

__all__ = ["check_group", "answers_of"]

#: (op, args, kwargs, output, path of region names, the index of the group's region in it)
Ask = tuple[Any, tuple, dict, Any, tuple[str, ...], int]


def check_group(group: RegionGroup, traced: str, asks: list[Ask],
                skip: frozenset[str] = frozenset()) -> list[str]:
    """Regroup ``group``'s members by what its policy answers to ``asks`` (the ops of the
    region just traced under member ``traced``). ``skip``: members traced in the same graph,
    each under its own name (a model compiled whole), which need no check. Returns the
    names that moved."""
    members = [name for name in group.members if name not in skip or name == traced]
    if len(set(members)) < 2 or not asks:
        return []
    answers = {name: answers_of(group.policy, name, asks)
               for name in dict.fromkeys([traced, *members])}
    return regroup_by_decisions(group, traced, answers)


def answers_of(policy: Any, name: str, asks: list[Ask]) -> tuple[str, ...]:
    """What ``policy`` answers, as text, to each of ``asks`` when asked for region ``name``
    (the group's region in each ask's path is renamed ``name``)."""
    frame = fresh_frame(RegionFrame(name, policy))
    out: list[str] = []
    for op, args, kwargs, output, path, index in asks:
        ctx = PolicyContext(op_output=output, region=name,
                            region_path=(*path[:index], name, *path[index + 1:]))
        try:
            opinion = coerce_opinion(frame.policy(ctx, op, *args, **kwargs), op, name)
        except Exception as e:  # (a CheckpointError too) that member's own trace raises it
            out.append(f"raised {type(e).__name__}")
            continue
        out.append("None" if opinion is None else encode_opinion(opinion))
    return tuple(out)
