"""Live activation bytes at run time, on any device, without an allocator: a dispatch mode
that sees every storage an ATen op creates and a finalizer that sees it freed.

``with LiveBytes() as meter: loss = f(x); meter.mark("backward"); loss.backward()``, then
``meter.peak("backward")`` is the most bytes alive at once during the backward (what the
forward kept included), ``meter.at("backward")`` the bytes alive when it began, and
``meter.at_peak("backward")`` what was alive at that peak, by the phase that made it
(a storage made in an earlier phase is ``kept``; :meth:`LiveBytes.relabel_last` names the
storages of the latest op otherwise, e.g. ``recomputed``); ``meter.at_peak_by_region``
the same by (kind, region), where ``LiveBytes(region_of=...)`` names the region that makes
each storage (``""``: none) and ``relabel_last`` may rename it.

What counts: a storage is *new* when an op returns a tensor whose storage is none of the
op's inputs' storages (a view or an in-place op creates nothing); it counts from that op
until its Python storage object is collected (torch keeps one Python object per storage
while any tensor uses it, so the finalizer runs when the memory is released). Storages
that existed before the mode (parameters, inputs) are never counted, nor those given to
:meth:`LiveBytes.exclude` afterwards (e.g. the parameters' ``.grad``: gradients handed
back to autograd, not activations): their bytes leave the whole history.

The mode ignores compile internals (Dynamo compiles with it active); what a compiled
function runs is seen only where it dispatches ATen ops (``aot_eager``), not Inductor's
generated kernels, which allocate directly. Used by ``explain(mode="eager")`` and the
report's harness (``_bench``); it imports nothing of sac_compile but ``tensor_memory``.
"""
from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .torch_internals import TorchDispatchMode, pytree

from .tensor_memory import storage_key

__all__ = ["LiveBytes"]


class LiveBytes(TorchDispatchMode):
    """See the module docstring."""

    # Higher-order ops (RNG functionalisation's run_and_save_rng_state) come here too; they
    # run as a whole (the mode is off inside its own dispatch) and their outputs count.
    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(self, region_of: Callable[[], str] | None = None) -> None:
        super().__init__()
        self._region_of = region_of
        self._regions: dict[int, str] = {}         # serial -> the region that made it
        self._serials = itertools.count()
        self._live: dict[int, int] = {}            # storage_key -> serial
        self._sizes: dict[int, int] = {}           # serial -> bytes
        self._kinds: dict[int, str] = {}           # serial -> the phase (or kind) that made it
        self._phase = "forward"
        self._latest: list[int] = []               # serials the latest op made
        self._events: list[tuple[int, int]] = []   # (serial, +1 created / -1 freed)
        self._marks: dict[str, int] = {"forward": 0}  # phase -> index into _events
        self._excluded: set[int] = set()

    # -- recording ---------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {storage_key(t) for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and _has_storage(t)}
        self._latest = []
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and _has_storage(t):
                st, key = t.untyped_storage(), storage_key(t)
                if key not in inputs and key not in self._live and st.nbytes():
                    self._track(st, key)
        return out

    def _track(self, st: Any, key: int) -> None:
        serial = next(self._serials)
        self._live[key] = serial
        self._sizes[serial] = st.nbytes()
        self._kinds[serial] = self._phase
        if self._region_of is not None:
            self._regions[serial] = self._region_of()
        self._latest.append(serial)
        self._events.append((serial, 1))
        weakref.finalize(st, self._freed, key, serial)

    def _freed(self, key: int, serial: int) -> None:
        if self._live.get(key) == serial:
            del self._live[key]
        self._events.append((serial, -1))

    def mark(self, phase: str) -> None:
        """Start ``phase`` now (it lasts until the next mark)."""
        self._marks[phase] = len(self._events)
        self._phase = phase

    def relabel_last(self, kind: str, region: str | None = None) -> None:
        """The storages the latest op made are ``kind`` (a replayed op: ``recomputed``),
        and made by ``region`` when given."""
        for serial in self._latest:
            self._kinds[serial] = kind
            if region is not None:
                self._regions[serial] = region

    def exclude(self, tensors: Iterable[Any]) -> None:
        """Never count the storages of these tensors (still alive now), past or future."""
        for t in tensors:
            if isinstance(t, torch.Tensor) and _has_storage(t):
                serial = self._live.get(storage_key(t))
                if serial is not None:
                    self._excluded.add(serial)

    # -- reading -----------------------------------------------------------------------
    def _curve(self) -> list[int]:
        """Live bytes after each event (index 0: before any)."""
        total, out = 0, [0]
        for serial, sign in self._events:
            if serial not in self._excluded:
                total += sign * self._sizes[serial]
            out.append(total)
        return out

    def _span(self, phase: str | None) -> tuple[int, int]:
        if phase is None:
            return 0, len(self._events)
        start = self._marks[phase]
        later = [i for i in self._marks.values() if i > start]
        return start, min(later, default=len(self._events))

    def peak(self, phase: str | None = None) -> int:
        """Most bytes alive at once during ``phase`` (None: the whole run)."""
        lo, hi = self._span(phase)
        return max(self._curve()[lo:hi + 1])

    def at_peak(self, phase: str | None = None) -> dict[str, int]:
        """Bytes alive at ``phase``'s peak by kind: the phase that made each storage (made
        in an earlier phase: ``kept``), or what :meth:`relabel_last` named it."""
        out: dict[str, int] = {}
        for (kind, _), n in self.at_peak_by_region(phase).items():
            out[kind] = out.get(kind, 0) + n
        return out

    def at_peak_by_region(self, phase: str | None = None) -> dict[tuple[str, str], int]:
        """:meth:`at_peak` by (kind, region): the region ``region_of`` named when the
        storage was made, or :meth:`relabel_last`'s (``""``: none, or not asked)."""
        lo, hi = self._span(phase)
        curve = self._curve()
        at = max(range(lo, hi + 1), key=lambda i: (curve[i], -i))
        live: set[int] = set()
        for serial, sign in self._events[:at]:
            if serial not in self._excluded:
                (live.add if sign > 0 else live.discard)(serial)
        out: dict[tuple[str, str], int] = {}
        start = self._marks.get(phase, 0) if phase is not None else 0
        earlier = {serial for serial, sign in self._events[:start] if sign > 0}
        for serial in sorted(live):
            kind = "kept" if phase is not None and serial in earlier else self._kinds[serial]
            key = (kind, self._regions.get(serial, ""))
            out[key] = out.get(key, 0) + self._sizes[serial]
        return out

    def at(self, phase: str) -> int:
        """Bytes alive when ``phase`` began."""
        return self._curve()[self._marks[phase]]

    @property
    def now(self) -> int:
        return self._curve()[-1]


def _has_storage(t: torch.Tensor) -> bool:
    try:
        return t.layout is torch.strided and not t.is_nested and t.device.type != "meta" \
            and t.untyped_storage() is not None
    except (RuntimeError, NotImplementedError):  # a subclass or a sparse tensor
        return False
