"""The memory budget: the cheapest cut whose activation bytes fit a cap.

What a budget is - one meaning in Python and on the command line (:func:`check_budget`):

* a float in (0, 1]: a fraction of the activation bytes the unconstrained cut saves
  (``1.0`` = 100%, no eviction);
* an int >= 2, or a string with a unit (``"64MiB"``, ``"2k"``): a byte count;
* anything else is a ``ValueError`` that says what to write instead: ``1`` (100% or one
  byte?), 0, negatives, ``inf``/``nan``, a float above 1, ``True``.

The search
----------
``B`` = the budget above, per forward/backward split. Activation bytes ``A(cut)`` are the
*device* bytes of the kept non-input values (inputs and parameters are excluded: they are
alive anyway; a value kept on the host takes none; a ``SaveWithHooks`` value takes its
packed bytes). With ``K(cut)`` = kept input bytes + recompute cost + offload cost (the rest
of :mod:`.network`'s objective), each solve minimises the Lagrangian::

    A(cut)  +  w * K(cut),        0 < w <= 1

so a budget is met by recomputing or by offloading, whichever costs less per byte freed.
``w = 1`` is the unconstrained cut. Lowering ``w`` makes recomputing, offloading (and keeping inputs)
cheaper than keeping activations; ``A`` of an optimal cut is monotone in ``w`` (if ``w1 < w2``
then ``A1 <= A2``). :func:`solve_with_budget` solves ``w = 1`` (done when ``A <= B``), then
``w_min`` (``w_min * K`` below one byte: the least ``A`` reachable; above ``B`` ->
:class:`~sac_compile.CheckpointError` naming the values that cannot be recomputed), then
bisects ``log w`` (18 solves) for the largest ``w`` with ``A <= B``. Below ``w = 1``, recompute
costs are tilted by up to 5% in graph order, so that identical blocks give way one at a
time. Infinite capacities (MUST decisions, bans) stay infinite at every ``w``: a budget
never breaks a MUST.
"""
from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Any

import torch.fx as fx

from . import costs
from .network import INF, FlowNetwork
from .reasons import ReasonKind, kind_of
from .solvers import solve

__all__ = ["check_budget", "parse_budget_text", "budget_label", "solve_with_budget",
           "BudgetResult"]

BISECT_STEPS = 18


@dataclasses.dataclass
class BudgetResult:
    saved: list[fx.Node]                 # the chosen cut's saved nodes, graph order
    budget: float | int                  # as given
    budget_bytes: float                  # the cap on activation bytes for this split
    activation_bytes: int                # what the chosen cut saves (inputs excluded)
    unconstrained_bytes: int             # what the cut without a budget saves
    min_bytes: int                       # the least reachable
    weight: float                        # the chosen w (1.0: the unconstrained cut)
    evicted: list[fx.Node]               # saved without the budget, not with it
    solves: int
    seconds: float
    offloaded: list[fx.Node] = dataclasses.field(default_factory=list)  # kept on the host


def budget_label(budget: float | int) -> str:
    """``0.5`` -> ``"50%"``, ``65536`` -> ``"64 KiB"``."""
    from ..report import fmt_bytes
    if isinstance(budget, float):
        return f"{budget * 100:g}%"
    return fmt_bytes(budget)


_HINT = ("a fraction in (0, 1] as a float (0.5 = half of the activation bytes saved "
         "without a budget, 1.0 = all of them), or bytes as an int >= 2 or a string such as "
         "'64MiB'")


def check_budget(budget: Any, *, what: str = "memory_budget") -> float | int | None:
    """``None``; a float in (0, 1] (a fraction); an int >= 2 or a string with a unit
    (bytes). Anything else: a ``ValueError`` whose message starts with ``what`` and says
    what to pass instead."""
    if budget is None:
        return None
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


def _is_activation(net: FlowNetwork, i: int) -> bool:
    v = net.cls.nodes[i]
    return v.op != "placeholder" and (net.save_cost[i] != INF or net.offload_cost[i] != INF)


# Identical blocks would all switch at the same ``w`` (the budget then met with much room to
# spare): recompute costs get a graph-order tilt of up to this much, later values cheaper.
TILT = 0.05


def _activation_bytes(net: FlowNetwork, saved: list[fx.Node], w: float = 1.0) -> int:
    """Device bytes of the kept activations (an offloaded value takes none)."""
    idx = net.cls.index
    acts = [v for v in saved if _is_activation(net, idx[v])]
    return int(sum(net.device_bytes(acts, w)))


def solve_with_budget(net: FlowNetwork, budget: float | int,
                      solver: str | None = None) -> BudgetResult:
    """The cut with the largest ``w`` whose activation bytes fit ``budget`` (see the module
    docstring); :class:`~sac_compile.CheckpointError` when no cut fits."""
    t0 = time.perf_counter()
    solves = 0

    def at(w: float) -> tuple[list[fx.Node], int]:
        nonlocal solves
        solves += 1
        saved, _ = solve(net, solver, edges=None if w == 1.0 else net.capacities(w, TILT))
        return saved, _activation_bytes(net, saved, w)

    base, base_bytes = at(1.0)
    cap = budget * base_bytes if isinstance(budget, float) else float(budget)

    def result(saved: list[fx.Node], nbytes: int, w: float, min_bytes: int) -> BudgetResult:
        kept = set(saved)
        evicted = [v for v in base if v not in kept and _is_activation(net, net.cls.index[v])]
        return BudgetResult(saved, budget, cap, nbytes, base_bytes, min_bytes, w, evicted,
                            solves, time.perf_counter() - t0, net.offloaded(saved, w))

    if base_bytes <= cap:
        return result(base, base_bytes, 1.0, base_bytes)
    # Everything but activation bytes together worth less than one byte at w_min.
    other = sum(c for i, v in enumerate(net.cls.nodes)
                for c in (net.recompute_cost[i], net.offload_cost[i],
                          net.save_cost[i] if v.op == "placeholder" else 0.0)
                if c not in (0, INF))
    w_min = min(0.5 / other, 1e-3) if other > 0 else 1e-3
    low, low_bytes = at(w_min)
    if low_bytes > cap:
        # Keeps its type and message through Dynamo (a CheckpointError, not wrapped).
        from .tagging import CompiledCheckpointError
        raise CompiledCheckpointError(
            _explain_budget(net, low, budget, cap, low_bytes, base_bytes)) from None
    best, best_bytes, best_w = low, low_bytes, w_min
    lo, hi = math.log(w_min), 0.0
    for _ in range(BISECT_STEPS):
        mid = (lo + hi) / 2
        saved, nbytes = at(math.exp(mid))
        if nbytes <= cap:
            lo, best, best_bytes, best_w = mid, saved, nbytes, math.exp(mid)
        else:
            hi = mid
    return result(best, best_bytes, best_w, low_bytes)


def _explain_budget(net: FlowNetwork, saved: list[fx.Node], budget: float | int, cap: float,
                    min_bytes: int, base_bytes: int) -> str:
    from ..report import fmt_bytes
    idx = net.cls.index
    acts = sorted((v for v in saved if _is_activation(net, idx[v])),
                  key=lambda v: -net.save_cost[idx[v]])
    items = []
    for v in acts[:5]:
        path = v.meta.get("sac_region_path")
        where = f" in region {path[-1]!r}" if path else ""
        why = net.ban_reason.get(v, "kept so that others can be recomputed")
        items.append(f"{v.name} ({costs.op_label(v)}, {fmt_bytes(net.save_cost[idx[v]])}"
                     f"{where}: {why})")
    given = (f"{budget_label(budget)} of {fmt_bytes(base_bytes)} = {fmt_bytes(cap)}"
             if isinstance(budget, float) else fmt_bytes(cap))
    ratio = f"{min_bytes / base_bytes:.3g}" if base_bytes else ""
    need = f" (memory_budget={ratio if '.' in ratio else ratio + '.0'} or more)" if ratio else ""
    must = any(kind_of(net.ban_reason.get(v)) is ReasonKind.MUST_SAVE for v in acts)
    fix = ("raise the budget to at least " + fmt_bytes(min_bytes) + need +
           (", or relax those MUST_SAVE decisions to PREFER_SAVE so they may be recomputed"
            if must else ", or let more of these values be recomputed"))
    return (f"sac_compile: memory budget {given} cannot be met: even with everything "
            f"recomputed that may be recomputed, this forward/backward split saves "
            f"{fmt_bytes(min_bytes)} of activations. Largest values it must still save: "
            f"{'; '.join(items) or 'none'}. To fix: {fix}.")
