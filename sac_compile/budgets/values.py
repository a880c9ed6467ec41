"""What a memory budget value is: one meaning everywhere (:func:`check_budget`, the same
for ``sac_region``, ``apply_regions``, ``make_backend`` and the CLI's ``--budget``).

A float in (0, 1] is a fraction of the activation bytes kept without a budget (the cut of
the same flow network at no budget); an int >= 2 or a string such as ``"64MiB"`` is bytes.
A :class:`PeakBudget` is the other kind of budget, for a compiled split
(``make_backend(memory_budget=PeakBudget("2GiB"))``) or a model's regions in eager mode
(``apply_regions(..., memory_budget=PeakBudget("2GiB"))``, :mod:`.step_peak`): it caps the
*step's peak*, the most
bytes the step allocates at once above what it began with, gradients included (modelled
by :mod:`sac_compile.compiler.peak`, as Inductor allocates under Inductor), rather than the
bytes kept at the end of forward.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Union

__all__ = ["PeakBudget", "check_budget", "parse_budget_text", "budget_label",
           "proposed_budget"]


@dataclasses.dataclass(frozen=True)
class PeakBudget:
    """A cap on the *step's peak*, not on the bytes a split keeps:
    ``make_backend(memory_budget=PeakBudget("2GiB"))`` (or ``SACPartitioner``,
    ``PartitionerConfig``). ``value`` takes ``memory_budget``'s forms (:func:`check_budget`):
    bytes (an int >= 2, or a string such as ``"2GiB"``, stored as its bytes) or a float in
    (0, 1], a fraction of the modelled step peak of the split without a budget.

    The step's peak is the most bytes the step allocates at once above what was allocated
    when it began - what ``sac_compile.measured_peak`` measures, and what a device of N
    GiB minus its parameters, optimizer state and inputs leaves: the forward's values
    (kept ones, the outputs), the backward's working set (recomputed values, gradients of
    activations) and the gradients the backward makes, which outlive it. Modelled by
    :mod:`sac_compile.compiler.peak` (as Inductor allocates, under Inductor) for the model
    compiled whole: one split, the forward then its backward. The cut chosen is the
    cheapest to recompute among the kept-byte budgets searched whose modelled step peak
    fits (:mod:`sac_compile.compiler.peak_budget`). Several splits (graph breaks) each get
    the whole cap. In eager mode ``apply_regions(..., memory_budget=PeakBudget(n))``
    (bytes) holds it by measuring steps (:mod:`.step_peak`); a region's own
    ``sac_region(memory_budget=...)`` caps kept bytes. Frozen, hashable and picklable; its ``repr`` is part of the partitioner's cache
    key."""

    value: Union[float, int, str]

    def __post_init__(self) -> None:
        object.__setattr__(self, "value", check_budget(self.value, what="PeakBudget"))
        if self.value is None:
            raise ValueError("PeakBudget(None) is no budget: pass memory_budget=None instead")

    def cap(self, unconstrained_peak: int) -> int:
        """The cap in bytes, given the modelled step peak of the split without a budget."""
        if isinstance(self.value, float):
            return int(self.value * unconstrained_peak)
        return int(self.value)

    def label(self) -> str:
        """``"peak 1 MiB"``, ``"peak 80%"``."""
        return f"peak {budget_label(self.value)}"


# -- what a budget value is (one meaning everywhere) -------------------------------------

def budget_label(budget: float | int) -> str:
    """``0.5`` -> ``"50%"``, ``65536`` -> ``"64 KiB"``."""
    from ..report import fmt_bytes
    if isinstance(budget, PeakBudget):
        return budget.label()
    if isinstance(budget, float):
        return f"{budget * 100:g}%"
    return fmt_bytes(budget)


def proposed_budget(given: float | int, least: float, unconstrained: float) -> float | int:
    """The budget to propose when ``given`` cannot be met: valid (:func:`check_budget`
    accepts it), of the same kind (a fraction, or bytes), and met, since it allows at
    least the ``least`` bytes reachable. A fraction is rounded up (4 decimals), never past
    1.0, which the unconstrained cut always meets (as does ``unconstrained`` bytes: when
    keeping everything takes fewer bytes than the least found, it is the least)."""
    least = min(least, unconstrained) if unconstrained > 0 else least
    if not isinstance(given, float):
        return max(int(math.ceil(least)), 2)
    if unconstrained <= 0 or least >= unconstrained:
        return 1.0
    fraction = math.ceil(least / unconstrained * 10_000) / 10_000
    while fraction * unconstrained < least:  # (float rounding)
        fraction += 1e-4
    return min(max(fraction, 1e-4), 1.0)


_HINT = ("a fraction in (0, 1] as a float (0.5 = half of the activation bytes saved "
         "without a budget, 1.0 = all of them), or bytes as an int >= 2 or a string such as "
         "'64MiB'")


def check_budget(budget: Any, *, what: str = "memory_budget") -> float | int | None:
    """``None``; a float in (0, 1] (a fraction); an int >= 2 or a string with a unit
    (bytes). Anything else: a ``ValueError`` whose message starts with ``what`` and says
    what to pass instead."""
    if budget is None:
        return None
    if isinstance(budget, PeakBudget):
        raise ValueError(f"{what}={budget!r}: a PeakBudget caps the peak of a whole "
                         f"step, and is taken by apply_regions(model, ..., memory_budget=...) "
                         f"(eager: measured per step) and make_backend(memory_budget=...) "
                         f"(a compiled split); a region's own budget caps the bytes it keeps: "
                         f"here pass a kept-byte budget ({_HINT})")
    if isinstance(budget, str):
        return parse_budget_text(budget, what=what)
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise ValueError(f"{what} must be {_HINT}; got {budget!r} of type "
                         f"{type(budget).__name__}")
    if isinstance(budget, float):
        if math.isnan(budget) or math.isinf(budget):
            raise ValueError(f"{what}={budget!r} is not a budget: pass {_HINT}")
        if budget > 1.0:
            fix = f"give bytes as an int (e.g. {what}={int(budget)})" if budget >= 2 else \
                f"pass 1.0 for 100%, or bytes as an int >= 2"
            raise ValueError(f"{what}={budget!r}: a float is a fraction and must lie in "
                             f"(0, 1]; {fix}")
        if budget <= 0.0:
            raise ValueError(f"{what}={budget!r}: a fraction must lie in (0, 1]; pass {_HINT}")
        return budget
    if budget == 1:
        raise ValueError(f"{what}=1 is ambiguous: did you mean 1.0 (100%) or 1 byte? pass "
                         f"1.0, or bytes as an int >= 2 / a string '64MiB'")
    if budget < 1:
        raise ValueError(f"{what}={budget!r}: a byte count must be >= 2 (pass {_HINT})")
    return budget


_UNITS = {"b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3,
          "gb": 1000**3, "kib": 1024, "mib": 1024**2, "gib": 1024**3}
_NUMBER = re.compile(r"\s*([-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*")


def parse_budget_text(text: str, *, what: str = "memory_budget") -> float | int:
    """A budget written as text (the CLI's ``--budget``, or a string in Python), read as
    the Python literal it looks like: ``"0.5"``, ``"1.0"`` -> a fraction; ``"65536"`` ->
    bytes; a unit makes bytes (``"64MiB"``, ``"2k"``); then :func:`check_budget`'s rules."""
    m = _NUMBER.fullmatch(text)
    if not m:
        raise ValueError(f"{what} {text!r} is not a number: pass {_HINT}")
    number, unit = m.group(1), m.group(2).lower()
    if unit not in _UNITS and unit:
        raise ValueError(f"{what} {text!r}: unknown unit {m.group(2)!r}; pass {_HINT} "
                         f"(units: B, k, M, G, KiB, MiB, GiB)")
    value = float(number)
    if unit:
        nbytes = value * _UNITS[unit]
        if not math.isfinite(nbytes) or nbytes < 1 or nbytes != int(nbytes):
            raise ValueError(f"{what} {text!r} is not a whole number of bytes >= 1; "
                             f"pass {_HINT}")
        return int(nbytes)
    is_int = re.fullmatch(r"[-+]?[0-9]+", number) is not None
    return check_budget(int(number) if is_int else value, what=what)
