"""The typed facts the partitioner's steps hand to :mod:`.describe`, which words them.

A step (choosing the cut, extracting the graphs, keeping the saved values) records *what*
it decided here, as enums and dataclass fields; only :mod:`.describe` turns them into the
:class:`~sac_compile.report.PartitionReport`'s sentences, and no code reads a meaning back
from a sentence. This module imports nothing of ours, so every step and the describing
module can share it without an import cycle.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any

__all__ = ["HostWhy", "Floor", "PeakFit", "Unfused", "Storage"]


class HostWhy(enum.Enum):
    """Why the cut keeps values on the host that no policy asked to offload."""

    CHEAPEST = "cheapest"  # no budget: transferring costs less than keeping or recomputing
    BUDGET = "budget"      # to meet a memory budget: transferring costs less than recomputing


@dataclasses.dataclass(frozen=True)
class Floor:
    """What the region-boundary floor (:mod:`.boundaries`) did to a cut: nothing (no value
    was recomputed across regions, or the floor did not lower the peak), kept ``held``
    boundary values (the estimated peak went from ``peak_before`` to ``peak_after``), or
    could not be applied (``refused``: the first line of the error the floored solve
    raised)."""

    held: tuple[Any, ...] = ()      # fx.Nodes kept by the floor
    held_bytes: int = 0
    peak_before: int = 0
    peak_after: int = 0
    refused: str | None = None


@dataclasses.dataclass(frozen=True)
class PeakFit:
    """How a peak budget (:class:`~sac_compile.budgets.PeakBudget`) was met
    (:mod:`.peak_budget`): the cap on the modelled peak, the peak of the cut chosen and of
    the cut without a budget, the kept-byte budget that gave the chosen cut (None: the
    cut without a budget fits), how many kept-byte budgets were tried and how many of
    their cuts fit, and the least modelled peak among them."""

    cap: int
    peak: int
    unconstrained_peak: int
    kept_cap: int | None
    tried: int
    fitting: int
    least_peak: int
    fused: bool = False  # the peaks are as Inductor allocates (fusion rule applied)


@dataclasses.dataclass(frozen=True)
class Unfused:
    """What :mod:`.fused_saves` did to a cut under Inductor: nothing, or no longer keeps
    ``dropped`` (values Inductor would otherwise not allocate in the forward; the backward
    recomputes them), the (forward, backward) peaks as Inductor allocates going from
    ``peaks_before`` to ``peaks_after``."""

    dropped: tuple[Any, ...] = ()   # fx.Nodes
    dropped_bytes: int = 0
    peaks_before: tuple[int, int] = (0, 0)
    peaks_after: tuple[int, int] = (0, 0)


class Storage(enum.Enum):
    """How a saved value is kept for the backward (:mod:`.storage`)."""

    OFFLOAD = "offload"  # torch's offload pass moves it to the host and back
    HOOKS = "hooks"      # packed by SaveWithHooks traced into both graphs
    DEVICE = "device"    # decided for CPU offload, kept on the device as is
