"""``SACPartitioner``: the joint graph's forward/backward split from SAC decisions.

:meth:`SACPartitioner._partition` is the list of the steps, each a function of the module
that owns it - decide, apply, describe:

1. prune: dead-code elimination (and CSE, as upstream) of the joint graph;
2. :func:`.normalize.normalize_tags`: one decision per node;
3. :func:`.choose_cut.flow_network` and :func:`.choose_cut.choose_cut`: the cut (plain,
   under a memory budget, or under the regions' budgets);
4. :func:`.storage.save_bases_of_views`, then :func:`.extract.extract`: torch's
   ``_extract_fwd_bwd_modules``, RNG functionalisation, the backward in autograd's order;
5. :func:`.storage.plan_storage` and :func:`.storage.apply_storage`: CPU offload and
   ``SaveWithHooks``;
6. :func:`.describe.describe_partition`: the :class:`~sac_compile.report.PartitionReport`.

A joint graph without any region tag is handed to upstream's
``min_cut_rematerialization_partition`` unchanged (:func:`.extract.split_upstream`):
untagged code keeps upstream's behaviour.
"""
from __future__ import annotations

import gc
import hashlib
import inspect
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.fx as fx
from ..torch_internals import CustomPartitionerFn

from .. import graph_meta
from ..logs import log, partition_log
from ..report import PartitionReport

from ..cut.network import CostModel
from ..cut.roles import static_inputs
from ..cut.solvers import default_solver
from .choose_cut import choose_cut, flow_network
from .describe import describe_partition
from .extract import Split, extract, split_upstream
from .normalize import normalize_tags
from .storage import HookTraces, apply_storage, plan_storage, save_bases_of_views
from .options import OffloadOptions, PartitionerConfig
from .peak import products_kept_apart
from .products_apart import keep_products_apart
from .who_splits import register_partitioner

__all__ = ["SACPartitioner", "ops_key"]

# The code whose change changes a split: part of uuid(), so caches never serve a stale one.
# Every module of the compiler, cut and budgets packages (the flow network, its costs, the
# budget search, what a budget value means: a change there changes the split), and the core
# modules it decides with.
# (policies: a policy that reads our presets' data, MATMUL_OPS say, is keyed by the module's
# name; effects: the ops the cut never recomputes;
# tensor_memory: which ops are views, which the cut never saves on their own.)
_HASHED_CORE = ("policy", "policies", "op_names", "markers", "op_costs", "effects", "errors",
                "graph_meta", "torch_internals", "tensor_memory")


def _code_hash() -> str:
    import importlib
    from pathlib import Path

    from ..torch_internals import get_hash_for_files

    here = Path(__file__).parent
    files = sorted(str(p) for d in (here, here.parent / "cut", here.parent / "budgets")
                   for p in d.glob("*.py"))
    files += [inspect.getfile(importlib.import_module(f"sac_compile.{name}"))
              for name in _HASHED_CORE]
    return get_hash_for_files(tuple(files)).hex()


def ops_key(gm: fx.GraphModule) -> str:
    """Which graph ``gm`` is, for a PeakBudget's count of the graphs it caps: its ops and
    its subgraphs' (a recompile at another shape is the same graph). Addresses may be in
    it: never part of a cache key."""
    ops = "|".join(str(n.target) for m in gm.modules() if isinstance(m, fx.GraphModule)
                   for n in m.graph.nodes if n.op == "call_function")
    return hashlib.sha256(ops.encode()).hexdigest()[:16]


@register_partitioner
class SACPartitioner(CustomPartitionerFn):
    """Partition a joint graph by its SAC tags with a min-cut.

    The options are one validated :class:`~.options.PartitionerConfig` (``config``), or
    built from the keywords (``memory_budget``, ``solver``, ``cost_model``, ``cse``,
    ``delegate_untagged``, ``offload_options``: see its fields); a wrong type or value
    raises naming the field. ``on_partition(report)``: called once per split; dropped when
    the partitioner is pickled if it does not pickle itself. Each report also goes to the
    ``sac_partition`` log artifact (see :mod:`sac_compile.logs`). A budget that cannot be
    met raises :class:`~sac_compile.errors.BudgetUnreachableError`.
    """

    def __init__(self, *, solver: str | None = None, cost_model: CostModel | None = None,
                 memory_budget: float | int | str | None = None,
                 on_partition: Callable[[PartitionReport], Any] | None = None,
                 cse: bool = False, delegate_untagged: bool = True,
                 offload_options: dict[str, bool] | OffloadOptions | None = None,
                 config: PartitionerConfig | None = None) -> None:
        if config is None:
            config = PartitionerConfig.from_kwargs(
                solver=solver, cost_model=cost_model, memory_budget=memory_budget, cse=cse,
                delegate_untagged=delegate_untagged, offload_options=offload_options)
        elif not isinstance(config, PartitionerConfig) or (
                solver, cost_model, memory_budget, cse, delegate_untagged, offload_options
        ) != (None, None, None, False, True, None):
            raise TypeError("SACPartitioner takes a PartitionerConfig as config= or the "
                            f"options as keywords, not both; got config={config!r}")
        self.config = config
        self.memory_budget = config.memory_budget
        self.solver = config.solver or default_solver()
        self.cost_model = config.cost_model
        self.on_partition = on_partition
        self.cse = config.cse
        self.delegate_untagged = config.delegate_untagged
        self.offload_options = config.offload.overrides()
        self.last_report: PartitionReport | None = None
        # Under a PeakBudget: the graphs split so far (op sequence -> modelled step peak):
        # each is held to the cap on its own (see _peak_over_graphs).
        self._peak_graphs: dict[str, int] = {}
        # Under a PeakBudget: bytes the cap is lowered by while a split is made again
        # because its measured step was above it (:mod:`.measured_fit`); part of uuid().
        self.peak_margin = 0
        # Under a PeakBudget, k > 0: split at the k-th cheapest cut keeping the least,
        # whatever its modelled peak (the measured trial's last tries, :mod:`.measured_fit`);
        # part of uuid().
        self.least_kept = 0
        # Under a PeakBudget: which Dynamo graph is being split (the backend's key for
        # _peak_over_graphs, so a graph AOTAutograd's cache serves counts as the same one).
        self.graph_key: str | None = None

    # -- CustomPartitionerFn -----------------------------------------------------------
    def uuid(self) -> str:
        options = repr((self.solver, self.config, type(self.memory_budget).__name__,
                        self.peak_margin) + ((self.least_kept,) if self.least_kept else ()))
        return hashlib.sha256((_code_hash() + options).encode()).hexdigest()

    def __getstate__(self) -> dict[str, Any]:
        # Inductor's caches pickle the partitioner (its config patches are part of their
        # key): a callback that does not pickle (a local function, a lambda) is dropped
        # rather than making that pickling warn with a traceback.
        state = dict(self.__dict__)
        state["last_report"] = state["graph_key"] = None  # (this compile's, not a key's)
        state["_peak_graphs"] = {}
        if state.get("on_partition") is not None:
            import pickle
            try:
                pickle.dumps(state["on_partition"])
            except Exception:
                state["on_partition"] = None
        return state

    def __call__(self, gm: fx.GraphModule, joint_inputs: Sequence[object],
                 **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
        # FX graph building allocates many small objects; the cyclic GC's full collections
        # were a large, variable part of partition time on big graphs. Nothing here needs it.
        from ..torch_internals import use_lazy_graph_module

        enabled = gc.isenabled()
        gc.disable()
        try:
            # As under dynamo: modules generate their Python code when first called.
            with use_lazy_graph_module(True):
                return self._partition(gm, joint_inputs, **kwargs)
        finally:
            if enabled:
                gc.enable()

    def _partition(self, gm: fx.GraphModule, joint_inputs: Sequence[object],
                   **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
        """The split's steps: decide -> apply -> describe."""
        num_fwd_outputs: int = kwargs["num_fwd_outputs"]
        static_idx = kwargs.get("static_lifetime_input_indices") or []
        clock = _Laps()
        _prune(gm, self.cse)
        clock.lap("dce")
        counts = normalize_tags(gm)
        clock.lap("normalize")
        fusing = kwargs.get("compiler") == "inductor"
        if self.delegate_untagged and not _has_decisions(gm):
            split = split_upstream(gm, joint_inputs, kwargs)
            clock.lap("upstream")
            apart = _keep_products_apart(gm, split, fusing)
            static = static_inputs(gm.graph, static_idx)  # its CSE replaced gm.graph's nodes
            return self._emit(describe_partition(gm, split, static, solver="upstream",
                                                 timings=clock.timings, apart=apart), split)
        static = static_inputs(gm.graph, static_idx)
        traces = HookTraces()
        net, stand_ins = flow_network(gm, num_fwd_outputs, static, self.cost_model, traces)
        clock.lap("network")
        cut = choose_cut(gm, net, stand_ins, self.memory_budget, self.solver,
                         fusing=fusing, peak_margin=self.peak_margin,
                         least_kept=self.least_kept)
        clock.lap("solve")
        split = extract(gm, save_bases_of_views(gm, cut.saved), static, num_fwd_outputs,
                        clock.lap)
        plan = plan_storage(gm, split, cut.host, static, num_fwd_outputs, traces)
        flags = apply_storage(split, plan, num_fwd_outputs, static, self.offload_options)
        if plan is not None:
            clock.lap("storage")
        apart = _keep_products_apart(gm, split, fusing)
        report = describe_partition(gm, split, static, solver=self.solver,
                                    timings=clock.timings, cut=cut, plan=plan,
                                    offload_flags=flags, counts=counts, apart=apart)
        if cut.peak_fit is not None and self.memory_budget is not None:
            # (not apply_regions' PeakBudget over a graph of a whole model: measured steps)
            self._peak_over_graphs(gm, report)
        out = self._emit(report, split)
        clock.lap("report")
        return out

    def _peak_over_graphs(self, gm: fx.GraphModule, report: PartitionReport) -> None:
        """A PeakBudget caps one graph's step (its forward, then its backward). A second
        graph split under it (a graph break, another block compiled on its own) may run
        in the same step, on top of the first's kept values: say so (a warning, once per
        new graph, and a note), never silently. The same graph again (a recompile at
        another shape) is not a second graph: keyed by Dynamo's graph where the backend
        says it (:attr:`graph_key`), else by this joint graph's ops."""
        key = self.graph_key or ops_key(gm)
        self.count_graph(key, report.budget_peak or 0, report.budget_bytes or 0, report)

    def count_graph(self, key: str, peak: int, cap: int,
                    report: PartitionReport | None = None) -> None:
        """A graph split under this PeakBudget (``key``: which), its step peak ``peak``
        (modelled; measured where AOTAutograd's cache served it, :mod:`.measured_fit`):
        the note and warning of :meth:`_peak_over_graphs` once several were."""
        new = key not in self._peak_graphs
        self._peak_graphs[key] = peak
        if len(self._peak_graphs) < 2:
            return
        from ..report import fmt_bytes
        total = sum(self._peak_graphs.values())
        text = (f"{self.memory_budget.label()} is held by each compiled graph on its own: "
                f"this partitioner has split {len(self._peak_graphs)} different graphs "
                f"(graph breaks, or modules compiled one by one); if they run in one step "
                f"the step can peak at up to the sum of their step peaks, "
                f"{fmt_bytes(total)}")
        notes = report.notes if report is not None else []
        if total <= cap:
            notes.append(f"{text}, within the cap")
            return
        text += (f", above the cap {fmt_bytes(cap)}. Compile the model whole "
                 f"(fullgraph=True) for one cap over the step, or lower the budget")
        notes.append(text)
        if new:
            log.warning("sac_compile: %s", text)

    def _emit(self, report: PartitionReport,
              split: Split) -> tuple[fx.GraphModule, fx.GraphModule]:
        """Hand the report out, and the graphs on without our metadata."""
        for mod in (split.fw, split.bw):
            for n in mod.graph.nodes:
                graph_meta.strip_ours(n)
        graph_meta.pop_replayed_vals(split.bw)
        self.last_report = report
        if self.on_partition is not None:
            self.on_partition(report)
        partition_log.debug("%s", report)
        return split.fw, split.bw


class _Laps:
    """Wall-clock time per step, for ``PartitionReport.timings``: each :meth:`lap` adds
    the time since the previous one to ``name``."""

    def __init__(self) -> None:
        self.timings: dict[str, float] = {}
        self._t = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.timings[name] = self.timings.get(name, 0.0) + now - self._t
        self._t = now


def _keep_products_apart(gm: fx.GraphModule, split: Split, fusing: bool) -> int:
    """Under Inductor, the matrix products whose ``addmm`` fold would hold the step's
    modelled peak, kept apart from their adds (:mod:`.products_apart`); how many."""
    if not fusing:
        return 0
    fw_apart, bw_apart = products_kept_apart(split.fw, split.bw, gm)
    return keep_products_apart(split.fw, fw_apart) + keep_products_apart(split.bw, bw_apart)


def _prune(gm: fx.GraphModule, cse: bool) -> None:
    gm.graph.eliminate_dead_code()
    if cse:
        from ..torch_internals import fx_graph_cse
        gm.graph = fx_graph_cse(gm.graph)


def _has_decisions(gm: fx.GraphModule) -> bool:
    return any(graph_meta.decision(n) is not None for n in gm.graph.nodes)
