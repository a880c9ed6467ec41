"""``SACPartitioner``: the joint graph's forward/backward split from SAC decisions.

Pipeline: dead-code elimination (and CSE, as upstream) -> :func:`.normalize.normalize_tags`
-> :func:`.network.classify` -> :func:`.network.build_flow_network` -> :func:`.solvers.solve`
(or :func:`.budget.solve_with_budget`) ->
torch's ``_extract_fwd_bwd_modules`` (no graph surgery of our own) -> torch's RNG
functionalisation when a random op is recomputed -> the :class:`~sac_compile.report.PartitionReport`.

A joint graph without any region tag is handed to upstream's
``min_cut_rematerialization_partition`` unchanged: untagged code keeps upstream's behaviour.
"""
from __future__ import annotations

import gc
import hashlib
import inspect
import operator
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from ..policy import CheckpointPolicy
from ..logs import partition_log
from ..report import PartitionReport, SavedTensorRecord, fmt_bytes
from ..cut import costs
from .boundaries import BOUNDARY_KEY, solve_lowering_peak
from ..cut.budget import budget_label, solve_with_budget
from ..cut.network import CostModel, build_flow_network, classify
from ..cut.region_budgets import (region_budget_annotations, solve_with_region_budgets,
                             torch_global_budget)
from .final_graphs import recomputed_names, replayed_values, rng_replays
from .normalize import normalize_tags
from .options import OffloadOptions, PartitionerConfig
from .order import raise_getitems_in_place, reorder_like_autograd
from .peak import REPLAYED_VALS, estimate_peak
from ..cut.reasons import Reason, ReasonKind
from ..cut.roles import Role, node_role, static_inputs
from ..cut.solvers import default_solver, solve
from .tagging import META_KEYS
from .who_splits import register_partitioner

__all__ = ["SACPartitioner"]

P = CheckpointPolicy
# The code whose change changes a split: part of uuid(), so caches never serve a stale one.
# Every module of the compiler and cut packages (the flow network, its costs, the budget
# search: a change there changes the split), and the core modules it decides with.
# (policies: a policy that reads our presets' data, MATMUL_OPS say, is keyed by the module's
# name; effects: the ops the cut never recomputes; budgets: what a budget value means.)
_HASHED_CORE = ("policy", "policies", "op_names", "markers", "op_costs", "effects", "errors",
                "budgets")


def _code_hash() -> str:
    import importlib
    from pathlib import Path

    from torch._inductor.custom_graph_pass import get_hash_for_files

    here = Path(__file__).parent
    files = sorted(str(p) for d in (here, here.parent / "cut") for p in d.glob("*.py"))
    files += [inspect.getfile(importlib.import_module(f"sac_compile.{name}"))
              for name in _HASHED_CORE]
    return get_hash_for_files(tuple(files)).hex()


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

    # -- CustomPartitionerFn -----------------------------------------------------------
    def uuid(self) -> str:
        options = repr((self.solver, self.config, type(self.memory_budget).__name__))
        return hashlib.sha256((_code_hash() + options).encode()).hexdigest()

    def __getstate__(self) -> dict[str, Any]:
        # Inductor's caches pickle the partitioner (its config patches are part of their
        # key): a callback that does not pickle (a local function, a lambda) is dropped
        # rather than making that pickling warn with a traceback.
        state = dict(self.__dict__)
        state["last_report"] = None
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
        from torch.fx._lazy_graph_module import _use_lazy_graph_module

        enabled = gc.isenabled()
        gc.disable()
        try:
            # As under dynamo: modules generate their Python code when first called.
            with _use_lazy_graph_module(True):
                return self._partition(gm, joint_inputs, **kwargs)
        finally:
            if enabled:
                gc.enable()

    def _partition(self, gm: fx.GraphModule, joint_inputs: Sequence[object],
                   **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
        num_fwd_outputs: int = kwargs["num_fwd_outputs"]
        static_idx = kwargs.get("static_lifetime_input_indices") or []
        timings: dict[str, float] = {}
        t = time.perf_counter()

        def lap(name: str) -> None:
            nonlocal t
            now = time.perf_counter()
            timings[name] = timings.get(name, 0.0) + now - t
            t = now

        gm.graph.eliminate_dead_code()
        if self.cse:
            from torch._functorch.compile_utils import fx_graph_cse
            gm.graph = fx_graph_cse(gm.graph)
        lap("dce")
        counts = normalize_tags(gm)
        lap("normalize")
        report = PartitionReport(mode="compile", solver=self.solver)
        static = static_inputs(gm.graph, static_idx)
        tagged = any("sac_decision" in n.meta for n in gm.graph.nodes)
        if not tagged and self.delegate_untagged:
            from torch._functorch.partitioners import min_cut_rematerialization_partition
            kwargs.setdefault("compiler", "inductor")
            fw, bw = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
            lap("upstream")
            report.solver = "upstream"
            static = static_inputs(gm.graph, static_idx)  # its CSE replaced gm.graph's nodes
            recomputed = recomputed_names(fw, bw)
            saved_names = [n.name for n in bw.graph.find_nodes(op="placeholder")]
            self._finish(report, gm, fw, bw, saved_names, recomputed, timings, static=static)
            return fw, bw

        from .storage import packed_sizes
        cls = classify(gm, num_fwd_outputs)
        net = build_flow_network(gm, cls, self.cost_model, static_inputs=static,
                                 rng_functionalized=True, packed_bytes=packed_sizes(gm),
                                 can_offload=_offload_pass_available(gm))
        from ..cut.stand_ins import keep_stand_ins_off_device  # offloaded: nor what stands in
        stand_ins = keep_stand_ins_off_device(net)
        if stand_ins:
            report.notes.append(
                f"{len(stand_ins)} values computed from values the policy offloads may not "
                f"be kept on the device in their place (recomputed from the reloaded value, "
                f"or offloaded): {', '.join(v.name for v in list(stand_ins)[:4])}"
                f"{', ...' if len(stand_ins) > 4 else ''}")
        lap("network")
        host, host_reason = [], ""
        # torch's budgets, honoured (torch ignores them once a region is in the graph)
        torch_budget = torch_global_budget()
        regions = region_budget_annotations(
            cls.nodes, torch_budget if self.memory_budget is None else None)
        if torch_budget is not None and self.memory_budget is not None:
            report.notes.append(
                f"torch._functorch.config.activation_memory_budget={torch_budget:g} not "
                f"applied: memory_budget={self.memory_budget!r} given to the partitioner")
        # Each solve below goes through the region-boundary floor where that lowers the peak.
        if self.memory_budget is None and not regions:
            (saved, _), lines = solve_lowering_peak(gm, net, lambda n: solve(n, self.solver),
                                                    lambda r: r[0])
            report.notes.extend(lines)
            host = [v for v in net.offloaded(saved) if not _marked_offload(v)]
            host_reason = "kept on the host by the cut: transferring it costs less than " \
                          "keeping it on the device or recomputing it"
        else:
            if regions:
                (res, lines), floor = solve_lowering_peak(
                    gm, net, lambda n: solve_with_region_budgets(n, regions, self.memory_budget,
                                                                 self.solver),
                    lambda r: r[0].saved)
                report.notes.extend(lines + floor)
            else:
                res, floor = solve_lowering_peak(
                    gm, net, lambda n: solve_with_budget(n, self.memory_budget, self.solver),
                    lambda r: r.saved)
                report.notes.extend(floor)
            saved = res.saved
            label = budget_label(self.memory_budget) if self.memory_budget is not None \
                else "(per group above)"
            if self.memory_budget is not None:
                report.memory_budget = self.memory_budget
                report.budget_bytes = int(res.budget_bytes)
            cap = f"cap {fmt_bytes(res.budget_bytes)}, " if self.memory_budget is not None \
                else ""
            report.notes.append(
                f"memory budget {label}: {fmt_bytes(res.activation_bytes)} of activations "
                f"saved ({cap}unconstrained {fmt_bytes(res.unconstrained_bytes)}, least "
                f"reachable {fmt_bytes(res.min_bytes)}); {res.method}, {res.solves} solves"
                + (f"; {len(res.offloaded)} values offloaded" if res.offloaded else ""))
            for v in res.evicted:
                dec = v.meta.get("sac_decision")
                what = dec.label if dec is not None else "min-cut save"
                report.evicted.append(SavedTensorRecord(
                    v.name, costs.op_label(v), costs.nbytes(v),
                    Reason(ReasonKind.EVICTED_BY_BUDGET,
                           f"{what} overridden by memory budget {label}: recomputed in "
                           f"backward (saving it would exceed {fmt_bytes(res.budget_bytes)})"),
                    region=_region(v)))
            if res.lifted:
                ops = sorted({costs.op_label(v) for v in res.lifted})
                report.notes.append(
                    f"memory budget {label}: {len(res.lifted)} untagged ops recomputed that "
                    f"torch's partitioner would keep ({', '.join(ops[:4])}"
                    f"{', ...' if len(ops) > 4 else ''}; CostModel("
                    f"budget_lifts_upstream_bans=False) keeps them)")
            host = [v for v in res.offloaded if not _marked_offload(v)]
            host_reason = (f"offloaded to meet memory budget {label}: transferring it costs "
                           f"less than recomputing it")
        lap("solve")
        from .storage import extract_with_storage  # + CPU offload and SaveWithHooks
        fw, bw, saved_names, recomputed = extract_with_storage(
            self._extract, gm, saved, static, num_fwd_outputs, lap, host=host,
            host_reason=host_reason, offload_options=self.offload_options)
        if counts.get("fold_markers"):
            report.notes.append(f"{counts['fold_markers']} tag()/name() markers folded")
        self._finish(report, gm, fw, bw, saved_names, recomputed, timings, static=static)
        lap("report")
        return fw, bw

    # -- steps --------------------------------------------------------------------------
    def _extract(self, gm: fx.GraphModule, saved: list[fx.Node], static: set[fx.Node],
                 num_fwd_outputs: int, lap: Callable[[str], None]):
        from torch._functorch.partitioners import _extract_fwd_bwd_modules, functionalize_rng_ops
        from torch.fx.experimental.proxy_tensor import is_sym_node
        from torch.utils._ordered_set import OrderedSet

        # As upstream: SymInts, then opaque objects, then tensors. A BackwardState
        # (compiled autograd, a hook on a region's output) goes in with the tensors:
        # torch's extraction hands it to the backward directly.
        saved_sym = [n for n in saved if is_sym_node(n) and not _is_assert_only_symbool(n)]
        saved_opaque = [n for n in saved if _is_opaque_object(n)]
        saved_values = [n for n in saved if not is_sym_node(n) and not _is_opaque_object(n)]
        # torch 2.11's extraction has no saved_opaque_nodes (nor is_opaque_node, so
        # saved_opaque is empty there): pass it only when there is something to pass.
        opaque = {"saved_opaque_nodes": saved_opaque} if saved_opaque else {}
        fw, bw = _extract_fwd_bwd_modules(
            gm, saved_values, saved_sym_nodes=saved_sym, **opaque,
            num_fwd_outputs=num_fwd_outputs, static_lifetime_input_nodes=OrderedSet(static))
        # Under Inductor's fallback_random, FX's dead-code elimination keeps random-tagged ops
        # (SDPA carries the tag): a dead copy would count as recomputed in the report.
        try:
            bw.graph.eliminate_dead_code(is_impure_node=lambda n: n.is_impure(impure_random=False))
        except TypeError:  # pragma: no cover - a torch without impure_random
            pass
        lap("extract")
        fw_names = {n.name for n in fw.graph.nodes if n.op == "call_function"}
        recomputed = [n.name for n in bw.graph.nodes if n.op == "call_function"
                      and n.name in fw_names and n.target is not operator.getitem
                      and not costs.is_sym(n)]
        saved_names = [n.name for n in bw.graph.find_nodes(op="placeholder")]
        joint = {n.name: n for n in gm.graph.nodes}
        random_recomputed = [joint[name] for name in recomputed if costs.is_random(joint[name])]
        replays = rng_replays(bw, [n.name for n in random_recomputed])
        if random_recomputed:
            # torch functionalises only ops tagged *_RECOMPUTE; a random op the cut chose to
            # recompute against its tag (a PREFER_SAVE evicted by a memory budget, say)
            # would otherwise draw fresh numbers in backward: a silently wrong gradient.
            for node in random_recomputed:
                if node.meta.get("recompute") not in (P.MUST_RECOMPUTE, P.PREFER_RECOMPUTE):
                    node.meta["recompute"] = P.PREFER_RECOMPUTE
            fw, bw = functionalize_rng_ops(gm, fw, bw, len(saved_sym))
            lap("rng")
        reorder_like_autograd(bw)  # (erases what no backward op needs)
        raise_getitems_in_place(fw)
        lap("reorder")
        bw.meta[REPLAYED_VALS] = replayed_values(bw, replays, joint)  # for the peak model
        # The report describes the backward that runs: read off the final graphs.
        return fw, bw, saved_names, recomputed_names(fw, bw, replays)

    def _finish(self, report: PartitionReport, gm: fx.GraphModule, fw: fx.GraphModule,
                bw: fx.GraphModule, saved_names: list[str], recomputed: list[str],
                timings: dict[str, float], *, static: set[fx.Node] = frozenset()) -> None:
        joint = {n.name: n for n in gm.graph.nodes}
        saved = [joint[name] for name in saved_names
                 if name in joint and node_role(joint[name]) is not Role.TANGENT
                 and not costs.is_sym(joint[name])
                 and not costs.is_opaque(joint[name])]
        names = set(saved_names)
        rng_states = [n for n in bw.graph.find_nodes(op="placeholder")
                      if n.name not in joint and n.name.startswith("rng_state")]
        for node in rng_states:  # added by torch's RNG functionalisation
            val = node.meta.get("val")
            on_cpu = isinstance(val, torch.Tensor) and val.device.type == "cpu"
            report.saved.append(SavedTensorRecord(
                node.name, "RNG state", int(torch.get_rng_state().numel()) if on_cpu else 16,
                Reason(ReasonKind.RNG_STATE, "generator state saved so that a recomputed "
                                             "random op draws the same numbers")))
        for node in saved:
            report.saved.append(SavedTensorRecord(
                node.name, costs.op_label(node), costs.nbytes(node),
                _reason(node, node in static, names), is_input=node.op == "placeholder",
                region=_region(node)))
        report.recomputed = [costs.op_label(joint[name]) for name in recomputed]
        report.recomputed_regions = [_region(joint[name]) for name in recomputed]
        report.recompute_flops = sum(costs.flops(joint[name]) for name in recomputed)
        report.peak = estimate_peak(fw, bw, gm)
        bw.meta.pop(REPLAYED_VALS, None)
        report.timings = timings
        for mod in (fw, bw):
            for n in mod.graph.nodes:
                for key in (*META_KEYS, BOUNDARY_KEY):
                    n.meta.pop(key, None)
        from .storage import annotate_report  # bytes and reasons of offloaded/packed values
        annotate_report(report, gm)
        self.last_report = report
        if self.on_partition is not None:
            self.on_partition(report)
        partition_log.debug("%s", report)


def _marked_offload(node: fx.Node) -> bool:
    dec = node.meta.get("sac_decision")
    return dec is not None and dec.offloads


def _offload_pass_available(gm: fx.GraphModule) -> bool:
    """Whether values of this graph can leave the device: some are on an accelerator, and
    this torch has the offload pass (without it, MUST_CPU_OFFLOAD is an error and the rest
    stays on the device: see :mod:`.storage`)."""
    if not any(isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].device.type
               != "cpu" for n in gm.graph.nodes):
        return False
    from .offload import TorchAPIMissing, torch_api
    try:
        torch_api()
    except TorchAPIMissing:
        return False
    return True


def _is_opaque_object(node: fx.Node) -> bool:
    """What upstream passes as ``saved_opaque_nodes`` (script and opaque objects);
    a BackwardState is not one of them."""
    try:
        from torch._functorch._aot_autograd.graph_compile import is_opaque_node
    except ImportError:  # pragma: no cover - older torch
        return False
    return bool(is_opaque_node(node))


def _is_assert_only_symbool(node: fx.Node) -> bool:
    try:
        from torch._functorch.partitioners import _is_assert_only_symbool as upstream
    except ImportError:  # pragma: no cover - older torch
        return False
    return bool(upstream(node))


def _region(node: fx.Node) -> str:
    path = node.meta.get("sac_region_path")
    return path[-1] if path else ""


def _reason(node: fx.Node, is_static: bool, saved_names: set[str]) -> Reason:
    """Why the cut saved ``node``, for the report."""
    if node.op == "placeholder":
        if is_static or node_role(node) is Role.PARAMETER:
            return Reason(ReasonKind.PARAMETER, "parameter (input)")
        return Reason(ReasonKind.INPUT, "input")
    base = node.args[0] if node.target is operator.getitem else node
    dec = node.meta.get("sac_decision")
    if BOUNDARY_KEY in node.meta:
        return Reason(ReasonKind.REGION_BOUNDARY, node.meta[BOUNDARY_KEY])
    if dec is None:
        return Reason(ReasonKind.MIN_CUT, "min-cut")
    if dec.policy in (P.MUST_SAVE, P.MUST_CPU_OFFLOAD, P.PREFER_SAVE, P.PREFER_CPU_OFFLOAD):
        kind = ReasonKind.MUST_SAVE if dec.is_must else ReasonKind.PREFER_SAVE
        reason = dec.reason()
        if "sac_view_of" in node.meta:
            reason = f"view of {node.meta['sac_view_of']}: {reason}"
        if dec.hooks is not None:
            reason += " (hooks not applied under compile: saved as is)"
        if dec.offloads:
            reason += " (kept on device under compile)"
        return Reason(kind, reason)
    # A recompute decision overridden by the cut.
    inputs = [a for a in base.all_input_nodes if a.name not in saved_names]
    alt = sum(costs.nbytes(a) for a in inputs)
    size = fmt_bytes(costs.nbytes(node))
    if alt > costs.nbytes(node):
        text = (f"{dec.label} overridden: saving {size} is cheaper than recomputing from "
                f"{fmt_bytes(alt)}")
    elif alt:
        text = (f"{dec.label} overridden: saving {size} costs no more than recomputing from "
                f"{fmt_bytes(alt)}, and saves the recompute")
    else:
        text = f"{dec.label} overridden: saving {size} is cheaper than recomputing it"
    return Reason(ReasonKind.RECOMPUTE_OVERRIDDEN, text)
