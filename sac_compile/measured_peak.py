"""The measured peak of a step: the most bytes the allocator held at once during it, above
what it held when the step began. The figure an out-of-memory error is about, measured,
against which every modelled figure (``compiler.peak``, Inductor's estimates,
``LiveBytes``) is an explanation.

``with measured_peak() as m: loss = model(x).sum(); m.mark("backward"); loss.backward()``,
then ``m.bytes`` is the step's peak, ``m.peak("backward")`` the backward's, ``m.at("backward")``
what was allocated above the start when the backward began and ``m.end`` what the step left
allocated (the gradients, typically). On the CPU, ``m.working`` is the peak of what the step
both allocates and frees (its working set: activations, recomputed values, temporaries;
gradients it leaves allocated are not in it), the figure to hold an activation model to.
``measure_peak(fn, *args)`` is the same around one call.

How, by device:

* **CUDA**: ``torch.cuda.reset_peak_memory_stats`` at the start and at each mark,
  ``max_memory_allocated`` minus ``memory_allocated`` at the start (the caching allocator's
  allocated bytes, not what it reserves). Other accelerators: the same through
  ``torch.accelerator`` where this torch has its memory functions.
* **CPU** (no allocator statistics): ``torch.profiler.profile(profile_memory=True)``
  records every allocation and free of torch's CPU allocator as a ``[memory]`` event with
  a signed byte count, Inductor's generated code included (its buffers come from the same
  allocator). Replayed in time order from the step's start, the running sum's maximum is
  the peak; a mark is a ``record_function`` range whose start splits the replay.

Both count what torch's allocator hands out, with every tensor the step makes (activations,
recomputed values, the loss, gradients, optimizer state if the step makes it); neither
counts memory outside it (oneDNN scratch, Python objects) or, on the CPU, the allocator's
rounding. Storages freed by Python's cycle collector are freed when it runs: collect
garbage before the step if the peak must not depend on it. On the CPU the profiler cannot be
nested (no ``measured_peak`` inside another, nor inside a user's profiler) and adds time,
never bytes. A free of a block allocated before the step began is not counted, so a step
that frees earlier memory (last step's gradients) reads as if it still held it: clear those
before the step. (The profiler reports such a free only where an earlier profiled run saw
the address allocated, with that run's size even when the address has been reused since:
counted, the figure would depend on what was measured before.) Imports nothing of sac_compile but
``torch_internals``.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .torch_internals import TORCH_VERSION, profiler_memory_events

__all__ = ["MeasuredPeak", "measured_peak", "measure_peak"]

_MARK = "sac_compile.measured_peak:"


@dataclasses.dataclass
class MeasuredPeak:
    """What :func:`measured_peak` measured; bytes are above the allocation at the start."""

    device: str
    #: "profiler" (the CPU's allocation events) or "allocator" (the device's statistics).
    source: str
    bytes: int = 0
    #: Allocated at the end (what the step left: gradients, the loss), may be negative.
    end: int = 0
    #: phase -> the most allocated during it; the first phase is "step".
    phases: dict[str, int] = dataclasses.field(default_factory=dict)
    #: phase -> allocated when it began.
    starts: dict[str, int] = dataclasses.field(default_factory=dict)
    #: CPU only (None on a device): the peak of what the step allocates *and frees* - its
    #: activations, recomputed values and temporaries, without what it leaves allocated
    #: (gradients) - the figure an activation-only model predicts; and per phase.
    working: int | None = None
    working_phases: dict[str, int] | None = None
    _mark: Callable[[str], None] | None = dataclasses.field(default=None, repr=False)

    def mark(self, phase: str) -> None:
        """Start ``phase`` now (it lasts until the next mark or the end)."""
        if self._mark is None:
            raise RuntimeError("mark() is for inside `with measured_peak()`")
        if phase in self.starts or phase in self.phases:
            raise ValueError(f"phase {phase!r} was already marked")
        self._mark(phase)

    def peak(self, phase: str | None = None) -> int:
        """The most bytes allocated at once during ``phase`` (None: the whole step)."""
        return self.bytes if phase is None else self.phases[phase]

    def at(self, phase: str) -> int:
        """Bytes allocated when ``phase`` began."""
        return self.starts[phase]


@contextlib.contextmanager
def measured_peak(device: str | torch.device = "cpu") -> Iterator[MeasuredPeak]:
    """Measure the peak of what runs inside the ``with`` on ``device`` (see the module)."""
    device = torch.device(device)
    if device.type == "cpu":
        with _profiled() as result:
            yield result
    else:
        with _allocator_stats(device) as result:
            yield result


def measure_peak(fn: Callable[..., Any], *args: Any, device: str | torch.device = "cpu",
                 **kwargs: Any) -> MeasuredPeak:
    """:func:`measured_peak` around ``fn(*args, **kwargs)``; its result is dropped before
    the measurement ends (a tensor it returns counts at the peak, not in ``end``)."""
    with measured_peak(device) as result:
        fn(*args, **kwargs)
    return result


# -- CPU: the profiler's allocation events ---------------------------------------------------

@contextlib.contextmanager
def _profiled() -> Iterator[MeasuredPeak]:
    result = MeasuredPeak("cpu", "profiler", starts={"step": 0})

    def mark(phase: str) -> None:
        # An empty range: its start is the phase's start in the profiler's clock.
        with torch.profiler.record_function(_MARK + phase):
            pass
        result.starts[phase] = -1  # filled in at the end; reserves the name

    result._mark = mark
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                  profile_memory=True, record_shapes=False, with_stack=False)
    with prof:
        with torch.profiler.record_function(_MARK + "step"):
            pass
        yield result
    result._mark = None
    _replay(result, profiler_memory_events(prof))


def _replay(result: MeasuredPeak, events: list[tuple[int, int, str, str, int]]) -> None:
    """Fill ``result`` from ``(start_ns, nbytes, device, name, address)`` events (any
    order; ties keep the order given)."""
    events = sorted(events, key=lambda e: e[0])
    marks = [(t, name[len(_MARK):]) for t, _, _, name, _ in events if name.startswith(_MARK)]
    memory = [(t, n, addr) for t, n, dev, name, addr in events
              if name == "[memory]" and dev == "cpu"]
    # Which allocations the step also frees (an address's allocation ends at its next free);
    # the others it leaves allocated (gradients). A free of a block allocated before the
    # step is dropped (the module's note: its size may be another block's).
    transient, open_at = [False] * len(memory), {}
    for i, (_, n, addr) in enumerate(memory):
        if n > 0:
            open_at[addr] = i
        elif addr in open_at:
            transient[open_at.pop(addr)] = transient[i] = True
    kept = [i for i, (_, n, _) in enumerate(memory) if n > 0 or transient[i]]
    memory, transient = [memory[i] for i in kept], [transient[i] for i in kept]
    start = marks[0][0] if marks else (memory[0][0] if memory else 0)
    phases = [("step", start)] + [(p, t) for t, p in marks if p != "step"]
    # Events before the step's own mark (none, unless the clock ties) belong to it.
    total = working = i = 0
    result.phases, result.starts, result.working_phases = {}, {}, {}
    for k, (phase, _) in enumerate(phases):
        until = phases[k + 1][1] if k + 1 < len(phases) else None
        result.starts[phase] = total
        top, top_working = total, working
        while i < len(memory) and (until is None or memory[i][0] < until):
            total += memory[i][1]
            if transient[i]:
                working += memory[i][1]
            top, top_working = max(top, total), max(top_working, working)
            i += 1
        result.phases[phase] = top
        result.working_phases[phase] = top_working
    result.bytes = max(result.phases.values())
    result.working = max(result.working_phases.values())
    result.end = total


# -- CUDA and other accelerators: the allocator's statistics -------------------------------

def _stats_module(device: torch.device) -> Any:
    if device.type == "cuda":
        return torch.cuda
    acc = getattr(torch, "accelerator", None)
    if all(hasattr(acc, f) for f in ("memory_allocated", "max_memory_allocated",
                                     "reset_peak_memory_stats", "synchronize")):
        return acc
    raise ValueError(f"measured_peak: no allocator statistics for {device.type!r} on torch "
                     f"{TORCH_VERSION} (CUDA, the CPU, or torch.accelerator's memory "
                     f"functions)")


@contextlib.contextmanager
def _allocator_stats(device: torch.device) -> Iterator[MeasuredPeak]:
    stats = _stats_module(device)
    index = device.index
    if index is None:
        index = torch.cuda.current_device() if stats is torch.cuda else \
            stats.current_device_index()
    args = (index,)
    result = MeasuredPeak(str(device), "allocator")
    stats.synchronize(*args)
    base = stats.memory_allocated(*args)
    stats.reset_peak_memory_stats(*args)
    current = ["step"]
    result.starts["step"] = 0

    def close_phase() -> None:
        stats.synchronize(*args)
        result.phases[current[0]] = stats.max_memory_allocated(*args) - base

    def mark(phase: str) -> None:
        close_phase()
        result.starts[phase] = stats.memory_allocated(*args) - base
        stats.reset_peak_memory_stats(*args)
        current[0] = phase

    result._mark = mark
    try:
        yield result
    finally:
        result._mark = None
        close_phase()
        result.end = stats.memory_allocated(*args) - base
        result.bytes = max(result.phases.values())
