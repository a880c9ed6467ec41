"""What the runtime kept and replayed, for explain/report and for tests (all deterministic)."""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from ..policy import Decision

class SavedValueRecord:
    """One value the runtime keeps for backward."""

    __slots__ = ("name", "op", "nbytes", "reason", "region", "decision")

    def __init__(self, name: str, op: str, nbytes: int, reason: str, region: str,
                 decision: str) -> None:
        self.name, self.op, self.nbytes, self.reason = name, op, nbytes, reason
        self.region, self.decision = region, decision

    def __repr__(self) -> str:
        return f"SavedValueRecord({self.name}, {self.op}, {self.nbytes} B, {self.reason!r})"


class EagerStats:
    """Counts gathered by :func:`collect_stats`: deterministic, so tests can assert them."""

    def __init__(self) -> None:
        self.saved: list[SavedValueRecord] = []
        self.recomputed_ops: list[str] = []
        self.ops_recorded = 0
        self.decisions: list[tuple[str, Decision]] = []

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
