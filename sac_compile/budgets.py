"""A region's memory budget, as ``sac_region(policy, memory_budget=...)`` and
``apply_regions(..., memory_budget=...)`` give it: the value and what the runtime learns.

One meaning everywhere, :func:`check_budget`'s (the same as
``make_backend(memory_budget=...)``): a float in (0, 1] is a fraction of the activation bytes
the region keeps without a budget (the cut of the same flow network at no budget); an int
>= 2 or a string such as ``"64MiB"`` is bytes. On ``sac_region`` the budget is the region's
own; on ``apply_regions`` a byte budget is one budget for all the regions it makes together
(a :class:`ModelBudget`: a single price per byte found over all of them, each region's cut
optimal for the total), and a fraction is each region's own.

A :class:`PeakBudget` is the other kind of budget, for a compiled split only
(``make_backend(memory_budget=PeakBudget("2GiB"))``): it caps the *step's peak*, the most
bytes the step allocates at once above what it began with, gradients included (modelled
by :mod:`sac_compile.compiler.peak`, as Inductor allocates under Inductor), rather than the
bytes kept at the end of forward.

A :class:`RegionBudget` is part of a region's frame (:class:`~sac_compile.policy.
RegionFrame`) and of its compiled group's key (:mod:`sac_compile.region_groups`): two
regions with different budgets never share a split.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import re
import threading
from typing import Any, Union

__all__ = ["PeakBudget", "RegionBudget", "ModelBudget", "region_budget", "budget_key",
           "proposed_budget", "budget_cache_text", "module_kind"]


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
    the whole cap. Compile only: a region's ``sac_region(memory_budget=...)`` caps kept
    bytes. Frozen, hashable and picklable; its ``repr`` is part of the partitioner's cache
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


class ModelBudget:
    """One byte budget shared by the regions ``apply_regions`` made: the price per byte
    (the Lagrange multiplier of :mod:`sac_compile.cut.budget`'s search) found once
    over all of them, and each region's share. ``members``: the regions' names;
    ``kinds``: each member's :func:`module_kind` (blocks of one kind share a compiled
    graph; under per-block compiles the price is found over the kinds,
    :mod:`sac_compile.cut.model_price`)."""

    def __init__(self, nbytes: int, members: tuple[str, ...] = (),
                 kinds: tuple[str, ...] | None = None) -> None:
        self.nbytes = nbytes
        self.members = members
        self.kinds = kinds if kinds is not None else ("",) * len(members)
        self.lock = threading.RLock()
        # Compiled graphs holding some of the members (cut/model_price.py): a kind's
        # recorded network, the per-member shares at the price (None: not found yet), the
        # kinds compiled at the even split before the price was known, and those to be
        # compiled again at the next call of the model (regions.BudgetStep).
        self.kind_nets: dict[str, Any] = {}
        self.kind_share: dict[str, float] | None = None
        self.provisional: set[str] = set()
        self.rekey: set[str] = set()
        self.recompiles = 0
        # Compiled blocks' region calls counted in this step (compiler/budget_runs.py), and
        # the most a step made of each kind once more than its blocks (a block run twice).
        self.graph_runs: collections.Counter = collections.Counter()
        self.calls: dict[str, int] = {}
        self.weight: float | None = None          # the price found (None: not yet)
        self.shares: dict[str, int] = {}          # region name -> bytes it keeps
        self.unconstrained: dict[str, int] = {}   # region name -> bytes without a budget
        self.eager: Any = None                    # eager steps and prices (runtime/model_budget.py)
        self.notes: list[str] = []

    def __repr__(self) -> str:
        return f"ModelBudget({budget_label(self.nbytes)} for {len(self.members)} regions)"

    def __reduce__(self) -> Any:  # what it learnt is found again after loading
        return (ModelBudget, (self.nbytes, self.members, self.kinds))

    def count(self, kind: str) -> int:
        """How many members are of ``kind``."""
        return sum(1 for k in self.kinds if k == kind)

    def calls_of(self, kind: str) -> int:
        """How many calls of ``kind`` a step makes, as far as known: its blocks, or more
        once a step ran more (compiled blocks; :mod:`sac_compile.cut.model_price`)."""
        return max(self.count(kind), self.calls.get(kind, 0))

    def step_calls(self) -> int:
        """All the calls a step makes of the members, as far as known."""
        return sum(self.calls_of(k) for k in set(self.kinds))

    def kind_of(self, name: str) -> str:
        return self.kinds[self.members.index(name)] if name in self.members else ""


class RegionBudget:
    """A region's budget (``value``, as given to :func:`check_budget`) and, in eager mode,
    its decisions per recorded signature (``plans``: one solve per shape, reused)."""

    def __init__(self, value: float | int, model: ModelBudget | None = None,
                 kind: str = "") -> None:
        self.value = value
        self.model = model
        self.kind = kind  # a whole-model budget: the block's module_kind
        self.lock = threading.RLock()
        self.plans: dict[Any, Any] = {}

    @property
    def key(self) -> str:
        """What a compiled region's group is keyed by."""
        return budget_key(self)

    def __repr__(self) -> str:
        shared = f", shared by {len(self.model.members)} regions" if self.model else ""
        return f"RegionBudget({budget_label(self.value)}{shared})"

    # Copies (copy.deepcopy of a module) share the budget: its plans depend on shapes only.
    def __copy__(self) -> RegionBudget:
        return self

    def __deepcopy__(self, memo: dict) -> RegionBudget:
        return self

    def __reduce__(self) -> Any:  # (a shared ModelBudget is pickled once: still shared)
        return (RegionBudget, (self.value, self.model, self.kind))


def budget_key(budget: RegionBudget | None) -> str:
    if budget is None:
        return "none"
    kind = type(budget.value).__name__
    model = f"|model={id(budget.model)}|kind={budget.kind}" if budget.model is not None \
        else ""
    return f"{kind}:{budget.value!r}{model}"


def budget_cache_text(budget: RegionBudget | None, *, whole: bool = False) -> str | None:
    """What a compiled region's split depends on of its budget, for the compile caches
    (the same in every process): the value; for a whole-model budget also the model's
    size, the block's kind and its share at the price (or the even split before it).
    None where the split must not come from a cache: a model of several kinds before its
    price is found, whose partitions record the kinds' networks for it. ``whole``: the
    graph holds all the model's regions (one cap over them, no share)."""
    if budget is None:
        return "none"
    text = f"{type(budget.value).__name__}:{budget.value!r}"
    model = budget.model
    if model is not None:
        if whole:
            return text + f"|model of {len(model.members)}|whole graph"
        with model.lock:
            shares = model.kind_share
            pending = budget.kind in model.rekey  # (until then: the even split)
        if shares is None and len(set(model.kinds)) > 1:
            return None
        share = "even" if shares is None or pending else repr(shares.get(budget.kind))
        text += f"|model of {len(model.members)}|kind={budget.kind}|share={share}"
        if model.calls:  # a step runs some blocks more than once: a smaller even split
            text += f"|calls={sorted(model.calls.items())!r}"
    return text


def module_kind(module: Any) -> str:
    """Blocks of one kind: the same class, parameters and buffers (names, shapes, dtypes)
    and submodule classes. Identical blocks (a transformer's layers) are one kind: they
    compile to one graph with one split. (Blocks whose ``forward`` branches on an
    attribute may still compile to different graphs; each keeps at most its share.)"""
    import hashlib
    parts = [f"{type(module).__module__}.{type(module).__qualname__}"]
    parts += [f"{n}:{type(m).__qualname__}" for n, m in module.named_modules()]
    parts += [f"{n}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad}"
              for n, p in module.named_parameters()]
    parts += [f"{n}:{tuple(b.shape)}:{b.dtype}" for n, b in module.named_buffers()]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:12]


def region_budget(value: Any, *, what: str = "memory_budget",
                  model: ModelBudget | None = None) -> RegionBudget | None:
    """``value`` checked (:func:`check_budget`'s rules and errors) as a region's budget."""
    if value is None:
        return None
    return RegionBudget(check_budget(value, what=what), model)


# -- what a budget value is (one meaning everywhere) -------------------------------------

def budget_label(budget: float | int) -> str:
    """``0.5`` -> ``"50%"``, ``65536`` -> ``"64 KiB"``."""
    from .report import fmt_bytes
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
        raise ValueError(f"{what}={budget!r}: a PeakBudget caps the modelled peak of a "
                         f"compiled split, and is taken by make_backend(memory_budget=...), "
                         f"SACPartitioner and PartitionerConfig only; here pass a kept-byte "
                         f"budget ({_HINT})")
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
