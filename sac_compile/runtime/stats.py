"""What the runtime kept and replayed, for explain/report and for tests (all deterministic)."""
from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from ..policy import Decision

class SavedValueRecord:
    """One value the runtime keeps for backward."""

    __slots__ = ("name", "op", "nbytes", "reason", "region", "decision", "must")

    def __init__(self, name: str, op: str, nbytes: int, reason: str, region: str,
                 decision: str, must: bool = False) -> None:
        self.name, self.op, self.nbytes, self.reason = name, op, nbytes, reason
        self.region, self.decision = region, decision
        self.must = must  # a MUST decision (not hooks) keeps it: what its reason names

    def __repr__(self) -> str:
        return f"SavedValueRecord({self.name}, {self.op}, {self.nbytes} B, {self.reason!r})"


class EagerStats:
    """Counts gathered by :func:`collect_stats`: deterministic, so tests can assert them."""

    def __init__(self) -> None:
        self.saved: list[SavedValueRecord] = []
        self.recomputed_ops: list[str] = []
        self.recomputed_regions: list[str] = []  # per replayed op: its innermost region
        self.recomputed_flops = 0  # the replayed ops' FLOPs (op_costs.op_flops, as compiled)
        self.ops_recorded = 0
        self.decisions: list[tuple[str, Decision]] = []
        # Memory budgets (sac_region/apply_regions memory_budget): one line per plan, and
        # the values the policy saved that a budget's cut recomputes instead.
        self.budget_notes: list[str] = []
        self.evicted: list[SavedValueRecord] = []
        # Values replay allocated (tensor outputs that are not views) whose memory is still
        # alive, counted by weak references to their storages: what backward holds of
        # recomputed values at one time (peak since collection began or reset_peak()).
        self.replayed_alive = 0
        self.replayed_peak = 0
        self.replayed_bytes_alive = 0
        self.replayed_bytes_peak = 0
        self._alive: dict[int, tuple[Any, int]] = {}  # id(weakref) -> (weakref, bytes)

    def track_replayed(self, outputs: list[Any]) -> None:
        for t in outputs:
            if type(t) is not torch.Tensor or t._is_view():
                continue
            try:
                # The storage, not the tensor: an alias (autograd's, a compiled graph's)
                # keeps the memory alive after the tensor object is gone. Storages keep
                # their Python object while the memory lives, so the weak reference dies
                # exactly when the memory is freed.
                storage: Any = t.untyped_storage()
                size = storage.nbytes()
            except (RuntimeError, NotImplementedError):
                storage, size = t, t.numel() * t.element_size()
            ref = weakref.ref(storage, self._dead)
            self._alive[id(ref)] = (ref, size)
            self.replayed_alive += 1
            self.replayed_bytes_alive += size
            self.replayed_peak = max(self.replayed_peak, self.replayed_alive)
            self.replayed_bytes_peak = max(self.replayed_bytes_peak, self.replayed_bytes_alive)

    def _dead(self, ref: Any) -> None:
        entry = self._alive.pop(id(ref), None)
        if entry is None:
            return
        size = entry[1]
        self.replayed_alive -= 1
        self.replayed_bytes_alive -= size

    def reset_peak(self) -> None:
        """Start a new peak from what is alive now (e.g. before a second backward)."""
        self.replayed_peak = self.replayed_alive
        self.replayed_bytes_peak = self.replayed_bytes_alive

    @property
    def saved_bytes(self) -> int:
        return sum(r.nbytes for r in self.saved)

    @property
    def ops_replayed(self) -> int:
        return len(self.recomputed_ops)


_STATS = threading.local()


def active_stats() -> list[EagerStats]:
    sinks = getattr(_STATS, "sinks", None)
    if sinks is None:
        sinks = _STATS.sinks = []
    return sinks


@contextlib.contextmanager
def collect_stats() -> Iterator[EagerStats]:
    """Collect what regions run inside this block save and, during backward, replay.

    Backward may run after the block ends: replays are still counted for regions whose
    forward ran inside it.
    """
    stats = EagerStats()
    sinks = active_stats()
    sinks.append(stats)
    try:
        yield stats
    finally:
        sinks.remove(stats)
