"""Why a value is saved, recomputed or cannot be recomputed: a kind to match on, a text to show.

A :class:`Reason` is a ``str`` (the text the :class:`~sac_compile.report.PartitionReport`
shows, unchanged), with a :class:`ReasonKind`: code that needs to know *why* compares
``reason.kind``, never the wording. Pickles and compares as its text.
"""
from __future__ import annotations

import enum
from typing import Any

__all__ = ["ReasonKind", "Reason", "kind_of"]


class ReasonKind(enum.Enum):
    # -- why a value is kept for the backward (PartitionReport.saved)
    INPUT = "input"                          # a graph input: alive anyway
    PARAMETER = "parameter"                  # a parameter or buffer: alive as long as the model
    MUST_SAVE = "must save"                  # a MUST_SAVE / MUST_CPU_OFFLOAD / SaveWithHooks decision
    PREFER_SAVE = "prefer save"              # a PREFER_SAVE / PREFER_CPU_OFFLOAD decision
    MIN_CUT = "min-cut"                      # no decision: the cut found saving it cheapest
    RECOMPUTE_OVERRIDDEN = "recompute overridden"  # a *_RECOMPUTE decision the cut overrode
    RNG_STATE = "rng state"                  # the generator state a recomputed random op replays
    # -- why a value is recomputed against its decision (PartitionReport.evicted)
    EVICTED_BY_BUDGET = "evicted by budget"
    # -- why a value cannot be recomputed (the flow network's bans)
    GRAPH_INPUT = "graph input"
    MUST_RUN_IN_FORWARD = "must run in forward"
    EFFECTFUL = "effectful"                  # a collective, an op with side effects
    RANDOM = "random"                        # a random op without RNG functionalisation
    UPSTREAM_BAN = "upstream ban"            # untagged: torch's partitioner would not recompute it
    REGION_BOUNDARY = "region boundary"      # read by another region's recompute (.boundaries)


class Reason(str):
    """A reason's text (``str(reason)``) with its ``kind``."""

    kind: ReasonKind

    def __new__(cls, kind: ReasonKind, text: str) -> Reason:
        self = super().__new__(cls, text)
        self.kind = kind
        return self

    def __reduce__(self) -> Any:
        return (Reason, (self.kind, str(self)))


def kind_of(reason: Any) -> ReasonKind | None:
    """The kind of a reason; None for a plain string (an eager-mode reason, say)."""
    return getattr(reason, "kind", None)
