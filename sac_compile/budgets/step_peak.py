"""A step-peak budget in eager mode, held by the allocator's figure:
``apply_regions(model, policy, where=Block, memory_budget=PeakBudget("20GiB"))``.

``n`` is what :class:`~.values.PeakBudget` says everywhere: the most bytes the step (one
call of the model, then its backward) allocates at once above what was allocated when it
began, gradients included, as :mod:`sac_compile.measured_peak` measures it. Eager regions
are steered by a kept-byte cap over the step (a :class:`~.model.ModelBudget`: one price per
byte over every region call, blocks run twice counted twice); this controller sets that cap
from measured steps, per step signature (the shapes and dtypes the model is called with):

1. the first step at a signature keeps the least the regions can (the cap at 0: every value
   the policy lets be recomputed is), the plan of the least peak a kept-byte cap reaches,
   and is measured. Above ``n`` twice (a signature's first step also allocates what a
   program makes once: lazily built buffers, caches):
   :class:`~sac_compile.errors.BudgetUnreachableError` (raised by the next call of the
   model), proposing the least measured peak.
2. Within ``n``, the cap is raised by what the step left unused (``n`` minus its peak):
   a value kept rather than recomputed adds at most its bytes to any moment of the step,
   so the peak should rise by no more than the cap. Measured again; above ``n`` (the cut
   at the new price is not the old one plus values), the cap is lowered by the excess,
   never above a cap measured over, never below one measured within.
3. Done where a step measured within ``n`` uses at least :data:`USED` of it, keeps all the
   policy keeps without a budget, or after :data:`MAX_STEPS` measured steps (the cap of
   the best step measured within ``n`` is kept). Then nothing is measured at that
   signature until a step runs region calls its plans did not have (a block run once more,
   one skipped before: the whole-model budget prices that step again): the steps after it
   are measured again, from the cap it had. That step itself was not measured: a pattern
   is known only once it ran.

4. Placed in time (:mod:`.nested`, eager calls each run once per step): a measured step
   also marks each region call's forward and the backward's arrival at its outputs, so it
   says, per depth ``d`` (the first ``d`` calls holding their values), what the step held
   beside them; each prefix of the calls' kept bytes gets ``n`` less that as its cap, and the
   plan is the cheapest cut per call with every prefix within its cap. One cap over the
   step meets its tightest moment only: a step that peaks late in the backward (an
   embedding's gradient) has the last blocks' values freed by then, and they may be kept.
   Done when a step within ``n`` leaves no cap to raise. :data:`PLACED` False: one cap.

5. One compiled graph of every region call (the model compiled whole) is split under the
   step's PeakBudget itself (``compiler/choose_cut.py``): a step within ``n`` is done, one
   above lowers that graph's cap by the excess (``ModelBudget.lower_graph_peak``); split
   at its model's least, it is measured again, and raises above ``n`` a second time.

Why measured: the step's peak is every tensor the program holds (gradients as they are
made, the loss, each op's temporaries, what code around the regions keeps, a block run
twice or skipped); the measurement sees all of it, a model what it was told. The cost:
the calibration steps (at most :data:`MAX_STEPS` per signature) run under the measurement
(on the CPU the profiler: time, never bytes; a step begun under the user's own is not
measured), and the first recomputes all it may.

Several ranks: each measures its own steps (a warning says so). This module decides;
:mod:`sac_compile.region_steps` marks the step's start and end and applies the cap.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
import weakref
from typing import Any

from .model import ModelBudget
from .values import PeakBudget

__all__ = ["StepPeak", "MAX_STEPS", "USED", "stop_for_a_trial"]

MAX_STEPS = 6   # measured steps per signature at most
USED = 0.9      # done once a step within the budget uses this much of it
PLACED = True   # caps placed in time where the steps' marks allow (.nested); False: one cap
_END = "after the step"  # the measurement's mark at the end of the step's backward
_RUNNING: list[Any] = [None]  # a weak reference to the controller measuring now

log = logging.getLogger("sac_compile")


@dataclasses.dataclass
class _Fit:
    """What the measured steps at one signature found."""

    cap: int = 0                  # the kept-byte cap the regions get (0: their least)
    tries: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)
    #                             (cap, bytes kept, measured peak) per measured step
    done: bool = False
    # Placed in time (.nested): the region calls in the order they ran (each once), the
    # cap on each prefix of them, and per measured step the prefix caps it ran at (None:
    # one cap over the step); per depth the least prefix a step measured above n with.
    order: list[Any] | None = None
    prefix_caps: list[float] | None = None
    tried_caps: list[list[float] | None] = dataclasses.field(default_factory=list)
    over_prefix: dict[int, int] = dataclasses.field(default_factory=dict)
    least_over: int = 0  # steps of a whole graph split at its least measured above n

    def within(self, n: int) -> list[tuple[int, int, int]]:
        return [t for t in self.tries if t[2] <= n]


class StepPeak:
    """The controller of one ``apply_regions(..., memory_budget=PeakBudget(n))``: the
    kept-byte cap of its :class:`ModelBudget` per step signature, from measured steps."""

    def __init__(self, budget: PeakBudget, model: ModelBudget) -> None:
        if isinstance(budget.value, float):
            raise ValueError(
                f"apply_regions(memory_budget={budget!r}): in eager mode a PeakBudget is "
                f"bytes (PeakBudget('20GiB'), or an int): the step's peak is measured, and a "
                f"fraction would need a step measured without a budget first; compiled, "
                f"make_backend(memory_budget=PeakBudget(fraction)) takes one")
        self.budget = budget
        self.n = int(budget.value)
        self.model = model
        model.step_peak = budget  # the cap is this controller's: at 0, the regions' least
        self.fits: dict[Any, _Fit] = {}
        self.signature: Any = None
        self.step = 0                 # steps begun
        self._measuring: contextlib.ExitStack | None = None
        self._measured: Any = None    # the MeasuredPeak of the step being measured
        self._kept: int | None = None  # its regions' kept bytes, once its backward ended
        self._calls: list[tuple[Any, int]] = []  # its region calls, in order, and their bytes
        self._whole = False  # it ran one compiled graph of every region call
        self._pending: Exception | None = None  # decided while another model's step began
        self.notes: list[str] = []

    # -- the step's start and end (sac_compile.regions) ------------------------------------

    def begin(self, signature: Any, device: Any) -> int:
        """A step starts at ``signature`` on ``device``: the last step's measurement is
        read (and the cap at its signature decided), then the kept-byte cap this step's
        regions get; measured if its signature is still being fitted. Raises
        :class:`BudgetUnreachableError` where the last step, at the least the regions
        keep, measured above the budget."""
        pending, self._pending = self._pending, None
        if pending is not None:
            raise pending
        self._finish()
        self.step += 1
        with self.model.lock:
            self.model.steps_begun += 1
        if self.step == 1:
            _warn_if_ranks(self.budget)
        self.signature = signature
        fit = self.fits.setdefault(signature, _Fit())
        if not fit.done:
            self._start(device)
        return fit.cap

    def reopen(self, why: str = "ran calls its plans did not have") -> None:
        """The step that ended was priced again (a pattern of calls its plans did not
        have: a block run once more, one skipped before), or compiled a graph of the
        regions (``why``: a pattern the compiled graphs did not have, a branch taken or a
        block run for the first time): its signature is measured again from its cap, as
        in calibration."""
        fit = self.fits.get(self.signature)
        if fit is not None and fit.done:
            fit.done, fit.tries = False, []
            self._note(f"{self.budget.label()}: step {self.step} {why}; the next steps "
                       f"are measured again")

    def measuring(self) -> bool:
        """Whether the step begun is measured (its backward's end must be reported)."""
        return self._measured is not None and self._kept is None

    def mark(self, phase: str) -> None:
        """A region call's forward begins (``f<k>``, the step's k-th call) or the backward
        reaches its outputs (``b<k>``), in the step being measured: where the step held
        what, for the caps placed in time (:mod:`.nested`)."""
        if self._measured is not None and self._kept is None and \
                phase not in self._measured.starts:
            self._measured.mark(phase)

    def end(self, kept: int, *, compiled: bool = False,
            calls: list[tuple[Any, int]] | None = None, whole: bool = False) -> None:
        """The step's backward is over, its regions kept ``kept`` bytes: the measurement
        marks the step's end (what follows, an optimizer step, is not the step's); a step
        that ``compiled`` its blocks is not decided on (the next is measured). The
        measurement stops at the next step's start: stopped inside the backward, the CPU
        profiler would be switched back on by the autograd engine as it leaves the
        backward (it restores the thread's state it began with)."""
        if self._measured is not None and self._kept is None:
            self._kept = -1 if compiled else kept
            self._calls = list(calls or [])
            self._whole = whole
            self._measured.mark(_END)

    def _finish(self) -> None:
        """Stop measuring; a step whose backward ended is decided on."""
        m, kept, signature, calls = self._measured, self._kept, self.signature, self._calls
        self._stop()
        if m is not None and kept is not None and kept < 0:
            self._note(f"{self.budget.label()}: step {self.step} compiled blocks (not "
                       f"measured: compiling allocates what a step does not)")
        elif m is not None and kept is not None and (_END not in m.phases or m.bytes <= 0):
            # (a profiler of the user's started while this one ran: its events are lost)
            self._note(f"{self.budget.label()}: step {self.step}'s measurement was "
                       f"disturbed (another profiler started during it); measured again")
        elif m is not None and kept is not None:
            peak = max(top for phase, top in m.phases.items() if phase != _END)
            if self._whole:
                self._decide_whole(self.fits[signature], kept, peak)
            else:
                self._decide(self.fits[signature], kept, peak, m, calls)

    def unconstrained(self) -> int:
        """What the regions keep without a budget, as far as the last price knows."""
        with self.model.lock:
            return sum(self.model.unconstrained.values())

    def _note(self, text: str) -> None:
        self.notes.append(text)
        log.info("sac_compile: %s", text)

    # -- deciding ---------------------------------------------------------------------------

    def _decide(self, fit: _Fit, kept: int, peak: int, m: Any = None,
                calls: list[tuple[Any, int]] | None = None) -> None:
        least = fit.cap == 0 and fit.prefix_caps is None
        # (a step at the least above n bounds nothing: its first step at a signature also
        # allocates what a program makes once)
        caps = self._prefix_caps(fit, m, calls, bound=not least) \
            if m is not None and calls and PLACED else None
        if caps is None or (peak > self.n and least):
            # one cap over the step: no marks (blocks compiled), a call run twice; or the
            # regions' least measured above n (nothing placed in time lowers it)
            fit.order = fit.prefix_caps = None
            return self._decide_one_cap(fit, kept, peak)
        n = self.n
        fit.tries.append((fit.cap, kept, peak))
        fit.tried_caps.append(fit.prefix_caps)
        within = [(t, c) for t, c in zip(fit.tries, fit.tried_caps) if t[2] <= n]
        best = max(within, key=lambda tc: tc[0][1]) if within else None
        full = kept >= self.unconstrained() > 0
        grows = fit.prefix_caps is None or any(
            c > old + n * (1 - USED) / 20 for c, old in zip(caps, fit.prefix_caps))
        # (not done at USED of n: the depth that peaks is full, others may not be)
        if peak <= n and (full or not grows):
            fit.done = True
        elif len(fit.tries) >= MAX_STEPS:  # back to the best step within n
            fit.done = True
            if best is None:
                fit.cap, fit.order, fit.prefix_caps = 0, None, None
            else:
                fit.cap, fit.prefix_caps = best[0][0], best[1]
        else:
            fit.order, fit.prefix_caps = [k for k, _ in calls], caps
            fit.cap = int(caps[-1])  # (what all the calls keep together at most)
        tries = "; ".join(f"{p:,} B keeping {k:,} B" for _, k, p in fit.tries)
        state = ("done" if fit.done else "next step") + (
            f": the k-th region call's values and those before it within "
            f"{', '.join(f'{int(c):,}' for c in fit.prefix_caps)} B, where they are held"
            if fit.prefix_caps is not None else ": the regions keep their least")
        self._note(f"{self.budget.label()} (measured steps, placed in time): steps measured "
                   f"{tries}; {state}")

    def _prefix_caps(self, fit: _Fit, m: Any, calls: list[tuple[Any, int]], *,
                     bound: bool = True) -> list[float] | None:
        """Per depth ``d`` (the first ``d`` region calls of the step hold their values:
        their forwards began, the backward has not reached the d-th), the most the calls'
        first ``d`` may keep together: ``n`` less what the measured step held there
        beside its own first ``d``. None where the step cannot say (a call ran twice, a
        call's marks are missing)."""
        count = len(calls)
        forwards = sum(1 for p in m.phases if p[:1] == "f" and _call_of(p))
        if not count or forwards != count or len({k for k, _ in calls}) != count or any(
                f"{p}{k}" not in m.phases for k in range(1, count + 1) for p in "fb"):
            return None  # (a region call that recorded nothing: no_grad, a nested one)
        prefix = list(itertools.accumulate(b for _, b in calls))
        caps = [math.inf] * count
        for phase, top in m.phases.items():
            d = _call_of(phase)
            if not 0 < d <= count:
                continue
            caps[d - 1] = min(caps[d - 1], self.n - (top - prefix[d - 1]))
            if top > self.n and bound:  # never again at or above this prefix here
                fit.over_prefix[d] = min(fit.over_prefix.get(d, prefix[d - 1]), prefix[d - 1])
        for d, over in fit.over_prefix.items():
            if d <= count:
                caps[d - 1] = min(caps[d - 1], over - 1)
        return [max(c, 0.0) for c in caps]

    def _decide_whole(self, fit: _Fit, kept: int, peak: int) -> None:
        """The step ran one compiled graph of every region call (the model compiled
        whole), split under the step's PeakBudget itself (``compiler/choose_cut.py``):
        no cap to calibrate, only the peak model's error. Within ``n``: done. Above: that
        graph's cap is lowered by the excess (compiled again at the next step); split at
        the model's least, measured again. :class:`BudgetUnreachableError` after two steps
        at the least above ``n``, or :data:`MAX_STEPS` measured steps."""
        n, label = self.n, self.budget.label()
        fit.tries.append((fit.cap, kept, peak))
        fit.tried_caps.append(None)
        fit.least_over += peak > n and self.model.graph_least
        if peak > n and (len(fit.tries) >= MAX_STEPS or fit.least_over >= 2):
            raise self._unreachable(kept, min(t[2] for t in fit.tries), whole=True)
        lowered = peak > n and self.model.lower_graph_peak(peak - n)
        if peak > n:
            log.warning("sac_compile: %s: step %d measured %s B (above the budget by %s B); "
                        "%s", label, self.step, f"{peak:,}", f"{peak - n:,}",
                        "the graph's split is made again under a cap lowered by that much"
                        if lowered else "split at the least its model finds: measured again")
        fit.done = peak <= n
        tries = "; ".join(f"{p:,} B" for _, _, p in fit.tries)
        state = "done" if fit.done else (
            f"next: split under {self.model.graph_peak_budget().label()}" if lowered else
            "next: the same split (the least its model finds), measured again")
        self._note(f"{label} (measured steps, one graph of every region call split under "
                   f"the step's peak budget): steps measured {tries}; {state}")

    def _decide_one_cap(self, fit: _Fit, kept: int, peak: int) -> None:
        n = self.n
        fit.tries.append((fit.cap, kept, peak))
        fit.tried_caps.append(None)
        label = self.budget.label()
        if peak > n and fit.cap == 0:
            floor = [t[2] for t in fit.tries if t[0] == 0]
            if len(floor) >= 2:
                raise self._unreachable(kept, min(floor))
            # a signature's first step also makes what a process does once (lazily built
            # buffers, caches): measured again before the budget is called out of reach
            self._note(f"{label} (measured steps): step {self.step} measured {peak:,} B "
                       f"keeping the least, {kept:,} B; measured again")
            return
        within = fit.within(n)
        best = max(within, key=lambda t: t[1]) if within else None
        over = [t[1] for t in fit.tries if t[2] > n]
        if peak > n:
            log.warning("sac_compile: %s: step %d measured %s B at a kept-byte cap of %s B "
                        "(above the budget by %s B); the cap is lowered", label, self.step,
                        f"{peak:,}", f"{fit.cap:,}", f"{peak - n:,}")
            lowered = max(kept - (peak - n), 0)
            fit.cap = max(lowered, best[0]) if best else lowered
            if best is not None and fit.cap == best[0]:
                fit.done = True  # back to the best step measured within the budget
        else:
            full = kept >= self.unconstrained() > 0
            if peak >= USED * n or full or len(fit.tries) >= MAX_STEPS:
                fit.done = True
            else:
                raised = kept + (n - peak)
                if over:  # never to a cap a step measured over: halfway to it
                    raised = min(raised, (kept + min(over)) // 2)
                if raised <= fit.cap:
                    fit.done = True
                else:
                    fit.cap = raised
        if len(fit.tries) >= MAX_STEPS and not fit.done:
            fit.cap, fit.done = (best[0] if best else 0), True
        tries = "; ".join(f"{p:,} B keeping {k:,} B" for _, k, p in fit.tries)
        state = (f"done: each step keeps at most {fit.cap:,} B" if fit.done else
                 f"next step's cap {fit.cap:,} B")
        self._note(f"{label} (measured steps): steps measured {tries}; {state}")

    def _unreachable(self, kept: int, peak: int, whole: bool = False) -> Exception:
        from .unreachable import unreachable_error
        return unreachable_error(
            f"{self.budget.label()} for the step of apply_regions",
            "measured, " + ("the steps of the compiled graph of every region call, split "
                            "under the budget lowered by what each measured above it, "
                            f"down to the least its model finds, peaked at {peak:,} B at "
                            "least" if whole else
                            f"a step with its regions keeping the least they can ({kept:,} "
                            f"B: everything the policy lets be recomputed is) peaked at "
                            f"{peak:,} B"),
            ["recompute more (a policy whose MUST_SAVE decisions are PREFER_SAVE: "
             "policies.relaxed(policy)), or make the step smaller (batch, sequence)"],
            budget=self.budget, least=peak, unconstrained=max(peak, self.unconstrained()),
            note="the peak counts every tensor the step allocates, gradients included")

    def __reduce__(self) -> Any:  # (a running measurement does not pickle; what the
        return (StepPeak, (self.budget, self.model))  # steps found is found again)

    def close(self) -> None:
        """Stop a measurement left running (a calibration step whose model is not called
        again); the step is not decided on."""
        self._stop()

    def __del__(self) -> None:  # the model dropped mid-calibration: no profiler left on
        try:
            self._stop()
        except Exception:  # noqa: BLE001 - at interpreter exit torch may be gone
            pass

    # -- measuring --------------------------------------------------------------------------

    def _start(self, device: Any) -> None:
        from ..measured_peak import measured_peak
        from ..torch_internals import profiler_enabled
        other = _RUNNING[0]() if _RUNNING[0] is not None else None
        if other is not None and other is not self and other._measuring is not None:
            other._ended_by_another()
        if getattr(device, "type", "cpu") == "cpu" and profiler_enabled():
            self._note(f"{self.budget.label()}: step {self.step} not measured (a profiler "
                       f"is running, and the CPU measurement is one)")
            return
        stack = contextlib.ExitStack()
        self._measured = stack.enter_context(measured_peak(device))
        self._measuring = stack
        _RUNNING[0] = weakref.ref(self)

    def _ended_by_another(self) -> None:
        """Another model's step starts while this one's measurement runs (left running
        until this model's next call): a step whose backward ended is decided on now (an
        error it raises waits for this model's next call); one still running is not (it
        is measured again)."""
        if self._kept is None:
            self._stop()
            self._note(f"{self.budget.label()}: step {self.step}'s measurement was ended by "
                       f"another model's step; measured again")
            return
        try:
            self._finish()
        except Exception as e:  # noqa: BLE001 - this model's error, raised at its next call
            self._pending = e

    def _stop(self) -> None:
        stack, self._measuring = self._measuring, None
        self._measured, self._kept = None, None
        if stack is not None:
            stack.close()


def stop_for_a_trial() -> None:
    """A graph compiled inside the step being measured is about to be measured on its own
    before its first run (Inductor's trial, ``compiler/measured_fit.py``), and on the CPU
    that measurement is a profiler, which cannot nest: the step's is stopped. A step that
    compiles is never decided on (compiling allocates what a step does not); the next
    step at its signature is measured."""
    ctrl = _RUNNING[0]() if _RUNNING[0] is not None else None
    if ctrl is not None and ctrl._measuring is not None and ctrl._kept is None:
        ctrl._stop()
        ctrl._note(f"{ctrl.budget.label()}: step {ctrl.step} compiled a graph measured on "
                   f"its own before its first run (not measured)")


def _call_of(phase: str) -> int:
    """The region call a mark names (``f<k>``, ``b<k>``: k), else 0."""
    return int(phase[1:]) if phase[:1] in "fb" and phase[1:].isdigit() else 0


def _warn_if_ranks(budget: PeakBudget) -> None:
    """Several ranks: each measures its own steps and may settle on another cap, so the
    ranks' regions may recompute different values; said once, never assumed away."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        log.warning(
            "sac_compile: %s over apply_regions: each of the %d ranks measures its own "
            "steps and sets its own cap, so ranks may recompute different values. Where a "
            "region holds collectives (an FSDP gather inside a block), ranks recomputing "
            "differently would call different collectives: use a kept-byte budget "
            "(the same plan on every rank) there", budget.label(), dist.get_world_size())

