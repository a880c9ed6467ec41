"""Region groups: what a compiled region's graph is keyed by.

Dynamo guards every constant a compiled region passes to torch's checkpoint. Were that the
region's name (``layers.7``), each of N identical blocks compiled on its own (torchtitan's
``apply_compile``: one ``fullgraph=True`` compile per block) would compile its own graph,
and the 9th would hit Dynamo's recompile limit. Were it the policy function, Dynamo would
guard a closure by its code alone, and blocks whose policies differ only in a closure
value would share one split.

So a region passes one string, its group's **token**, and Dynamo guards that string. Regions
share a group when their policies have the same proven identity (:mod:`.policy_identity`:
our policy values by what they hold, an object with a ``cache_hash``; any other policy by
the object itself) and ``allow_cache_entry_mutation`` and the memory budget agree. The name
is data: the group keeps every member's name for reports and logs.

A group is a claim that its members decide alike; it is checked, not guessed. Each time a
region of a group is traced, its policy is asked again about the ops it was just asked
about, under every other member's name (:func:`regroup_by_decisions`, from the tagging
mode): members whose answers differ - a policy that reads ``ctx.region`` by any route - move
to a group of their own answers, one per distinct set of decisions (10 blocks with two
decision sets: two compiles). Their tokens change, so Dynamo compiles again for them.

Function regions (``@sac_region`` on a function) are grouped by their name as well: Dynamo
guards the decorated function anyway, so sharing gains nothing there, and errors and
reports keep naming the right function. Module regions leave the name out; their names are
recovered for each region of a graph that holds several (:func:`name_in_graph`).

More groups than Dynamo's recompile limit allows for one block's code would fail a
``fullgraph=True`` compile, or silently run the rest uncompiled: :func:`_allow_recompiles`
raises the limit to fit the groups, and says so once.
"""
from __future__ import annotations

import hashlib
import logging
import threading
import weakref
from typing import Any

import torch

from . import graph_meta
from .policy import RegionFrame
from .policy_identity import object_serial, policy_identity
from .torch_internals import dynamo_recompile_limits

__all__ = ["RegionGroup", "RegionSlot", "frame_in_group", "group_of_token", "regroup_by_decisions",
           "members_of", "rekey"]

log = logging.getLogger("sac_compile")


class RegionGroup:
    """Regions that share one compiled graph: ``token`` (what Dynamo guards), the policy,
    the name the policy is asked under, whether the name may matter, and the members."""

    __slots__ = ("token", "base", "policy", "first_name", "allow", "by_name", "_slots",
                 "why_no_key", "budget")

    def __init__(self, token: str, policy: Any, name: str, allow: bool, by_name: bool,
                 why_no_key: str | None, budget: Any = None) -> None:
        self.token = token
        self.base = token  # the token it was made with (rekey derives the others from it)
        self.budget = budget  # the members' memory budget (sac_compile.budgets), or None
        self.policy = policy
        self.first_name = name
        self.allow = allow
        self.by_name = by_name
        # Weak: a group outlives the models whose blocks were in it (the same policy in a
        # later model joins it again); their names must not stand for the new blocks.
        self._slots: list[weakref.ref[RegionSlot]] = []
        self.why_no_key = why_no_key

    @property
    def slots(self) -> list[RegionSlot]:
        """The live members' slots, in the order they joined."""
        live = [slot for slot in (ref() for ref in self._slots) if slot is not None]
        if len(live) != len(self._slots):
            self._slots = [weakref.ref(slot) for slot in live]
        return live

    def add(self, slot: RegionSlot) -> None:
        self._slots.append(weakref.ref(slot))

    @property
    def members(self) -> list[str]:
        return [slot.name for slot in self.slots]

    @property
    def name(self) -> str:
        """The name the policy is asked under when a graph does not say which member it
        is (a block compiled on its own): the first live member's."""
        slots = self.slots
        return slots[0].name if slots else self.first_name

    def __repr__(self) -> str:
        n = len(self.slots)
        more = f" (+{n - 1} more)" if n > 1 else ""
        return f"RegionGroup({self.name!r}{more}, policy={self.policy!r})"


class RegionSlot:
    """One region's place in a group: ``token`` is the one attribute compiled code reads
    (Dynamo guards its value); it changes only when the group is split by name."""

    __slots__ = ("token", "name", "__weakref__")

    def __init__(self, token: str, name: str) -> None:
        self.token = token
        self.name = name

    def __repr__(self) -> str:
        return f"RegionSlot({self.name!r}, {self.token})"


_GROUPS: dict[str, RegionGroup] = {}
_LOCK = threading.RLock()


def _identity_text(policy: Any) -> tuple[str, str | None]:
    """The policy's proven identity, else the object itself (:func:`object_serial`)."""
    identity = policy_identity(policy)
    if identity.key is not None:
        return identity.key, None
    return object_serial(policy), identity.why_not


def _token(identity_text: str, allow: bool, name: str | None, budget: Any = None) -> str:
    text = f"{identity_text}|allow={allow}|name={name!r}"
    if budget is not None:  # two regions with different budgets never share a split
        text += f"|budget={budget.key}"
    return "sac:" + hashlib.sha256(text.encode()).hexdigest()[:20]


def _join(slot: RegionSlot, policy: Any, allow: bool, by_name: bool = False,
          budget: Any = None) -> None:
    identity_text, why_not = _identity_text(policy)
    token = _token(identity_text, allow, slot.name if by_name else None, budget)
    with _LOCK:
        group = _GROUPS.get(token)
        if group is None:
            _drop_groups_without_members()
            group = _GROUPS[token] = RegionGroup(token, policy, slot.name, allow, by_name,
                                                 why_not, budget)
            _allow_recompiles()
        group.add(slot)
        slot.token = token


def _drop_groups_without_members() -> None:
    """Forget groups whose regions are all gone (the caller holds ``_LOCK``): a group holds
    its policy and budget, and a budget what its regions recorded. A later region of the
    same identity makes the group again, under the same token. Run when a group is made,
    never from a finalizer: a collection may run while the table is being iterated."""
    for token in [t for t, g in list(_GROUPS.items()) if not g.slots]:
        _GROUPS.pop(token, None)


def frame_in_group(name: str, policy: Any, allow: bool = False, *,
                   by_name: bool = False, budget: Any = None) -> RegionFrame:
    """The frame of a new region ``name`` with (normalised) ``policy``, its slot in the
    group of earlier regions with the same identity and memory ``budget`` (a
    :class:`~sac_compile.budgets.RegionBudget`: part of the key), or in a new one
    (``by_name``: only with regions of the same name)."""
    if torch.compiler.is_compiling():
        # sac_region applied inside compiled code: no group (the identity rule cannot run
        # in traced code); regions_compiled.run_region passes name and policy instead.
        return RegionFrame(name, policy, None, budget)
    slot = RegionSlot("", name)
    _join(slot, policy, allow, by_name, budget)
    return RegionFrame(name, policy, slot, budget)


_NAMES_BY_MODULE: dict[int, list[str]] = {}  # nested regions: several per module


def name_module(module: Any, name: str) -> None:
    """Remember the region name of a wrapped module, by the key Dynamo's
    ``nn_module_stack`` gives it (its ``id``), while it lives."""
    key = id(module)
    names = _NAMES_BY_MODULE.get(key)
    if names is None:
        names = _NAMES_BY_MODULE[key] = []
        weakref.finalize(module, _NAMES_BY_MODULE.pop, key, None)
    names.append(name)


def name_in_graph(group: RegionGroup, node: Any) -> str:
    """The name of the region that Dynamo's checkpoint node ``node`` calls: the group's
    member whose module is innermost in the node's ``nn_module_stack`` (a whole model
    compiled as one graph holds every block of a group), else the group's name."""
    stack = graph_meta.nn_module_stack(node)
    members = set(group.members)
    for key in reversed(list(stack)):
        try:
            names = _NAMES_BY_MODULE.get(int(key), ())
        except (TypeError, ValueError):
            continue
        for name in names:
            if name in members:
                return name
    return group.name


def group_of_token(token: str) -> RegionGroup:
    return _GROUPS[token]


def members_of(name: str) -> list[str]:
    """The names of the regions that share ``name``'s graph (the group's own name first)."""
    with _LOCK:
        groups = list(_GROUPS.values())
    for group in groups:
        members = group.members
        if name in members and len(members) > 1:
            return members
    return [name]


def regroup_by_decisions(group: RegionGroup, traced: str,
                         answers: dict[str, tuple[str, ...]]) -> list[str]:
    """``answers``: for members of ``group``, what its policy answered, op by op, for the
    ops of the region just traced under member ``traced``'s name. Members whose answers
    differ from ``traced``'s move to a group per distinct set of answers (new tokens:
    Dynamo compiles once more per set). Returns the names moved."""
    mine = answers.get(traced)
    moved: list[str] = []
    with _LOCK:
        for slot in group.slots:
            theirs = answers.get(slot.name)
            if slot.name == traced or theirs is None or theirs == mine:
                continue
            digest = hashlib.sha256("\n".join(theirs).encode()).hexdigest()[:20]
            token = "sac:" + hashlib.sha256(f"{group.token}|{digest}".encode()
                                            ).hexdigest()[:20]
            target = _GROUPS.get(token)
            if target is None:
                target = _GROUPS[token] = RegionGroup(token, group.policy, slot.name,
                                                      group.allow, group.by_name,
                                                      group.why_no_key, group.budget)
                _allow_recompiles()
            group._slots = [r for r in group._slots if r() is not slot]
            target.add(slot)
            slot.token = token
            moved.append(slot.name)
    if moved:
        log.info("sac_compile: the policy %r decides differently for %s than for %r (it "
                 "reads the region's name): they compile one graph per distinct set of "
                 "decisions", group.policy,
                 ", ".join(moved[:4]) + (", ..." if len(moved) > 4 else ""), traced)
    return moved


def rekey(model: Any) -> None:
    """New tokens for the groups of ``model``'s kinds in ``model.rekey``."""
    with model.lock:
        kinds = model.take_rekey()
    with _LOCK:
        groups = [g for g in dict.fromkeys(_GROUPS.values())
                  if g.budget is not None and g.budget.model is model
                  and g.budget.kind in kinds and g.slots]
        fresh: list[RegionGroup] = []
        for group in groups:
            # From what the split reads of the budget, not from the last token: a state
            # seen before (two batch sizes alternating, each with its own cap) finds its
            # graph in Dynamo's cache again instead of compiling at every step.
            calls = sorted(model.calls.items())
            token = "sac:" + hashlib.sha256(
                f"{group.base}|price={model.kind_share}|cap={model.nbytes}|calls={calls}"
                f"|margin={model.graph_margin}"
                .encode()).hexdigest()[:20]
            if token == group.token:
                continue
            if _GROUPS.get(token) is not group:
                fresh.append(group)  # (a token of its before: its graph is cached)
            _GROUPS[token] = group  # (the old token still finds it, for graphs that hold it)
            group.token = token
            for slot in group.slots:
                slot.token = token
        groups = fresh
        model.recompiled(len(groups))
        # each new token is a new cache entry of the regions' shared forward code, beside
        # the old ones (Dynamo keeps them): room for two more per group (a first block
        # whose input needs no gradient compiles a graph of its own)
        _allow_recompiles(extra=2 * model.recompiles)
    if groups:
        log.info("sac_compile: whole-model memory budget %r: %d kinds of block compiled "
                 "once more, at their shares (%s): %s", model, len(groups),
                 ", ".join(g.name for g in groups),
                 "the price per byte was found once every kind of block was compiled"
                 if model.kind_share is not None else "the calls per step changed")


_RAISED = [False]


def _allow_recompiles(extra: int = 0) -> None:
    """Dynamo compiles a block's code once per group its instances are in; keep its
    recompile limit above the number of groups (the caller holds ``_LOCK``)."""
    config, attr, total = dynamo_recompile_limits()
    limit = getattr(config, attr)
    live = sum(1 for group in list(_GROUPS.values()) if group.slots)
    needed = live + 1 + extra
    if needed > limit:
        setattr(config, attr, needed)
        if hasattr(config, total) and getattr(config, total) < needed:
            setattr(config, total, needed)
        if not _RAISED[0]:
            _RAISED[0] = True
            log.warning("sac_compile: %d groups of regions cannot share one compiled graph "
                        "(their policies differ, read the region's name or have no stable "
                        "identity); torch._dynamo.config.%s raised from %d to fit them (said "
                        "once)", live, attr, limit)
