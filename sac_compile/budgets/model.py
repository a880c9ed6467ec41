"""A whole-model byte budget (``apply_regions(..., memory_budget="2GiB")``): one budget
shared by the regions ``apply_regions`` made, and what both engines learn of it.

:class:`ModelBudget` owns its state: the engines read its fields, and change them only
through its methods (each under its lock), so that what a step learns is written in one
place:

* the compiled engine, blocks compiled one by one (:mod:`.kinds`): :meth:`record_kinds`
  (a kind's network, and the price over the kinds once every kind was recorded),
  :meth:`count_runs` (a compiled graph's region calls, :mod:`sac_compile.compiler.
  budget_runs`; :meth:`count_whole_run`: a graph of all of them ran), :meth:`count_step`
  (at the next call of the model: kinds that ran more calls than the split assumed),
  :meth:`take_rekey` and :meth:`recompiled` (:func:`sac_compile.region_groups.rekey`),
  :meth:`record_shares` (each region's share of a split, :mod:`.groups`);
* the eager engine (:mod:`sac_compile.runtime.model_budget`): :meth:`eager_state` (its
  bookkeeping of steps and prices) and :meth:`priced` (the price found over a step).
"""
from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Any

from .values import budget_label

__all__ = ["ModelBudget"]


class ModelBudget:
    """One byte budget shared by the regions ``apply_regions`` made: the price per byte
    (the Lagrange multiplier of :mod:`.search`) found once over all of them, and each
    region's share. ``members``: the regions' names; ``kinds``: each member's
    :func:`~.region.module_kind` (blocks of one kind share a compiled graph; under
    per-block compiles the price is found over the kinds, :mod:`.kinds`)."""

    def __init__(self, nbytes: int, members: tuple[str, ...] = (),
                 kinds: tuple[str, ...] | None = None) -> None:
        self.nbytes = nbytes
        self.members = members
        self.kinds = kinds if kinds is not None else ("",) * len(members)
        self.lock = threading.RLock()
        # Compiled graphs holding some of the members (.kinds): a kind's recorded network,
        # the per-member shares at the price (None: not found yet), the kinds compiled at
        # the even split before the price was known, and those to be compiled again at the
        # next call of the model (region_steps.BudgetStep).
        self.kind_nets: dict[str, Any] = {}
        self.kind_share: dict[str, float] | None = None
        self.provisional: set[str] = set()
        self.rekey: set[str] = set()
        self.recompiles = 0
        # Compiled blocks' region calls counted in this step (compiler/budget_runs.py), and
        # the most a step made of each kind once more than its blocks (a block run twice).
        self.graph_runs: collections.Counter = collections.Counter()
        self.whole_runs = 0  # runs of a graph holding every member (a step-peak budget's)
        # Such a graph is split under the step-peak budget itself, lowered by this: what
        # measured steps found above it (the peak model's error; budgets/step_peak.py).
        self.graph_margin = 0
        # That graph was last split at the least the model finds (lowered below it): a
        # lower cap would split it the same way.
        self.graph_least = False
        self.calls: dict[str, int] = {}
        self.weight: float | None = None          # the price found (None: not yet)
        self.shares: dict[str, int] = {}          # region name -> bytes it keeps
        self.unconstrained: dict[str, int] = {}   # region name -> bytes without a budget
        self.eager: Any = None                    # eager steps and prices (runtime/model_budget.py)
        # The PeakBudget of a step-peak controller (.step_peak), whose cap this is: below the
        # least the regions keep they keep their least (no error: the step is measured).
        self.step_peak: Any = None
        self.compiles = 0  # graphs holding some of its blocks compiled (budget_runs.counted)
        self.steps_begun = 0  # steps a step-peak controller began (its hooks ran eagerly)
        self.notes: list[str] = []

    def __repr__(self) -> str:
        return f"ModelBudget({budget_label(self.nbytes)} for {len(self.members)} regions)"

    def __reduce__(self) -> Any:  # what it learnt is found again after loading
        return (ModelBudget, (self.nbytes, self.members, self.kinds))

    # -- reading -------------------------------------------------------------------------

    def count(self, kind: str) -> int:
        """How many members are of ``kind``."""
        return sum(1 for k in self.kinds if k == kind)

    def calls_of(self, kind: str) -> int:
        """How many calls of ``kind`` a step makes, as far as known: its blocks, or more
        once a step ran more (compiled blocks; :mod:`.kinds`)."""
        return max(self.count(kind), self.calls.get(kind, 0))

    def step_calls(self) -> int:
        """All the calls a step makes of the members, as far as known."""
        return sum(self.calls_of(k) for k in set(self.kinds))

    def kind_of(self, name: str) -> str:
        return self.kinds[self.members.index(name)] if name in self.members else ""

    # -- blocks compiled one by one (.kinds) ----------------------------------------------

    def record_kinds(self, nets: dict[str, Any], price: Callable[[dict[str, Any]],
                                                                 dict[str, float]],
                     even: float) -> None:
        """A graph of some kinds was cut at the even split ``even`` before the price was
        known: record each kind's network (``nets``; the first one of a kind stays), and
        once every kind was recorded find the price over them (``price`` of the recorded
        networks: each kind's share per block); the kinds whose share is not the even
        split are compiled again at the next call of the model."""
        with self.lock:
            for kind, net in nets.items():
                self.kind_nets.setdefault(kind, net)
            self.provisional |= set(nets)
            if set(self.kind_nets) >= set(self.kinds):
                found = price(dict(self.kind_nets))
                self.kind_share = found
                self.kind_nets = {}  # (the networks hold their graphs)
                self.rekey |= {k for k in self.provisional if abs(found[k] - even) >= 1}

    def compiled_graph(self) -> None:
        """A graph holding some of its blocks was compiled (a step that compiles is not
        one a step-peak controller measures: compiling allocates what a step does not)."""
        with self.lock:
            self.compiles += 1

    def count_runs(self, kind: str, calls: int) -> None:
        """A compiled graph ran, holding ``calls`` region calls of ``kind``. Under a
        step-peak controller whose steps never began (the model's hooks never ran: its
        ``forward`` was compiled or called rather than the model): a
        :class:`~sac_compile.errors.CompiledCheckpointError`, since nothing measures."""
        with self.lock:
            if self.step_peak is not None and not self.steps_begun:
                raise self.hooks_traced_error(f"regions of {self.members[0]!r}...")
            self.graph_runs[kind] += calls

    def hooks_traced_error(self, regions: str) -> Exception:
        """The error for a step-peak budget whose step hooks never ran (the model's
        ``forward`` compiled, or called, instead of the model): nothing would measure a
        step."""
        from ..errors import CompiledCheckpointError
        return CompiledCheckpointError(
            f"{regions}: apply_regions(memory_budget={self.step_peak!r}) is held by measuring "
            f"steps, marked by the model's hooks, and a graph of its regions is compiled or run "
            f"with no step begun (the model's forward was compiled, or called, rather "
            f"than the model): nothing would measure a step. Compile and call the model "
            f"itself (torch.compile(model) or model.compile(): its hooks run eagerly around "
            f"the graphs), or its blocks one by one (block.compile(...)); or give the peak "
            f"budget to the backend: apply_regions(model, policy, where=...) without a "
            f"memory_budget, and torch.compile(model, backend=make_backend(memory_budget="
            f"{self.step_peak!r})) (its step is measured at compile time)")

    def count_whole_run(self) -> None:
        """A compiled graph holding every member ran (a step-peak budget's model compiled
        whole): that step is judged against the PeakBudget its graph was split under
        (:meth:`graph_peak_budget`), not a kept-byte cap."""
        with self.lock:
            self.whole_runs += 1

    def graph_peak_budget(self) -> Any:
        """The PeakBudget a graph holding every member is split under (a step-peak
        budget's model compiled whole): the step's, lowered by :attr:`graph_margin`."""
        from .values import PeakBudget
        with self.lock:
            return PeakBudget(max(int(self.step_peak.value) - self.graph_margin, 2))

    def lower_graph_peak(self, excess: int) -> bool:
        """A step of a graph holding every member measured ``excess`` bytes above the
        budget: its split is made again under a cap lowered by that much more (its kinds
        get new tokens at the next step's start). False where it was split at the model's
        least already (:attr:`graph_least`): nothing lower to compile."""
        with self.lock:
            if self.graph_least:
                return False
            self.graph_margin += excess
            self.rekey |= set(self.kinds)
            return True

    def count_step(self) -> set[str]:
        """A step is over (the model is called again): the kinds whose compiled graphs made
        more region calls in it than the split assumed. Their calls are learnt, a warning
        says the step kept more than the budget, and the kinds to compile again are
        returned (all of them when several kinds were priced: the price is found again over
        the new counts)."""
        with self.lock:
            runs, self.graph_runs = dict(self.graph_runs), type(self.graph_runs)()
            self.whole_runs = 0
            more = {k: n for k, n in runs.items() if n > self.calls_of(k)}
            if not more:
                return set()
            before = self.step_calls()
            self.calls.update(more)
            kinds = {k for k in set(self.kinds) if self.count(k)}
            if len(kinds) > 1:  # the price over the kinds is stale: the even split, then again
                self.kind_share, self.kind_nets, self.provisional = None, {}, set()
                again = kinds
            else:
                again = set(more)
            self.rekey |= again
            after = self.step_calls()
        logging.getLogger("sac_compile").warning(
            "sac_compile: whole-model memory budget %s: the step that ended made %s - more "
            "calls than the %d its compiled blocks' split assumed, each keeping a block's "
            "share: that step kept more than the budget (above the budget by up to the extra "
            "calls' shares). The blocks are compiled once more at the next call of the model, "
            "for %d calls per step", budget_label(self.nbytes),
            ", ".join(f"{n} calls of {self.count(k)} block{'s' if self.count(k) > 1 else ''} "
                      f"of one kind" for k, n in more.items()), before, after)
        return again

    def take_rekey(self) -> set[str]:
        """The kinds to compile again, now being given new tokens: no longer pending, nor
        at the even split."""
        with self.lock:
            kinds, self.rekey = set(self.rekey), set()
            self.provisional -= kinds
        return kinds

    def recompiled(self, groups: int) -> None:
        """``groups`` groups of regions got new tokens: Dynamo compiles each once more."""
        with self.lock:
            self.recompiles += groups

    def record_shares(self, shares: dict[str, int], *, whole_kind: bool = False) -> None:
        """Each region's bytes kept under a split's cut; ``whole_kind``: the graph serves
        every block of its regions' kinds, which keep as much."""
        with self.lock:
            self.shares.update(shares)
            if whole_kind:
                self.shares.update({m: shares[name] for name in shares
                                    for m, k in zip(self.members, self.kinds)
                                    if k == self.kind_of(name) and m not in shares})

    # -- eager mode (runtime/model_budget.py) ---------------------------------------------

    def eager_state(self, make: Callable[[], Any]) -> Any:
        """The eager engine's bookkeeping of steps and prices (``make()`` the first time)."""
        with self.lock:
            if self.eager is None:
                self.eager = make()
            return self.eager

    def set_cap(self, nbytes: int) -> bool:
        """A step-peak controller's new cap; whether it changed."""
        with self.lock:
            changed, self.nbytes = nbytes != self.nbytes, nbytes
        return changed

    def priced(self, weight: float, shares: dict[str, int], unconstrained: dict[str, int],
               note: str) -> None:
        """The price found over a step's calls: each region's share and its bytes without
        the budget."""
        with self.lock:
            self.weight, self.shares, self.unconstrained = weight, shares, unconstrained
            self.notes.append(note)
