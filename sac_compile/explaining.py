"""``explain(fn, *args, mode="eager" | "compile")``: run ``fn`` once, forward and backward,
and return the :class:`~sac_compile.report.PartitionReport` of what was kept for backward and
why: the eager runtime's decisions (``mode="eager"``), or the partition of each compiled
forward/backward split (``mode="compile"``, with :func:`sac_compile.make_backend`).

The user's state is left as it was: ``.grad`` of every leaf, the RNG state, a module's buffers.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .policy import op_name
from .report import MemoryPeak, PartitionReport, SavedTensorRecord
from .tensor_memory import param_storages, storage_key, storage_nbytes
from .torch_internals import TorchDispatchMode, pytree

__all__ = ["explain"]


def _backward_of(out: Any, on_grads: Callable[[list[Any]], None] | None = None) -> None:
    """Run the whole backward of ``out`` (every saved tensor is unpacked, as in training),
    leaving the ``.grad`` of every leaf it reaches as it was. ``on_grads(grads)`` sees the
    gradients the backward gave the leaves before they are put back."""
    outputs = [t for t in pytree.tree_leaves(out)
               if isinstance(t, torch.Tensor) and t.requires_grad]
    if not outputs:
        return
    leaves = _leaves_reached(outputs)
    grads_before = [t.grad for t in leaves]
    for t in leaves:  # autograd would accumulate into them in place
        t.grad = None
    try:
        torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])
        if on_grads is not None:
            on_grads([t.grad for t in leaves])
    finally:
        for t, g in zip(leaves, grads_before):
            t.grad = g


def _leaves_reached(outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    leaves: dict[int, torch.Tensor] = {}
    # id -> node: holding the node keeps its id. (torch 2.11 frees an autograd node's Python
    # object once nothing holds it, and the next one can reuse the id: with a set of ids,
    # the walk took unvisited nodes for seen ones and missed leaves.)
    seen: dict[int, Any] = {}
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    for t in outputs:
        if t.grad_fn is None and t.is_leaf:
            leaves[id(t)] = t
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        variable = getattr(node, "variable", None)  # AccumulateGrad: a leaf
        if isinstance(variable, torch.Tensor):
            leaves[id(variable)] = variable
        stack.extend(fn for fn, _ in node.next_functions)
    return list(leaves.values())


@contextlib.contextmanager
def _leaving_user_state_as_it_was(fn: Any) -> Iterator[None]:
    """``explain`` runs ``fn`` once more than the user did: its random draws and buffer
    updates (BatchNorm's running stats) must not change what the user's program sees."""
    buffers = [(b, b.detach().clone()) for b in fn.buffers()] \
        if isinstance(fn, torch.nn.Module) else []
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() \
        and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)


class _RecomputeFlops(TorchDispatchMode):
    """Active during the backward of ``explain(mode="eager")``: FLOPs of the ops the eager
    runtime replays (by :func:`sac_compile.op_costs.op_flops`, the partitioner's rule).

    The runtime appends each replayed op to ``stats.recomputed_ops`` right after running it,
    with no other op in between; an op this mode saw is a replay iff the list grew by one
    before the next op (backward's own ops leave it unchanged)."""

    def __init__(self, stats: Any, on_replay: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.on_replay = on_replay  # told right after a replayed op is found
        from .op_costs import is_cost_estimated, op_flops
        self._op_flops, self._is_cost_estimated = op_flops, is_cost_estimated
        self.stats = stats
        self.seen = len(stats.recomputed_ops)
        self.last: tuple[str, int, bool] | None = None
        self.flops = 0
        self.estimated: set[str] = set()  # replayed ops whose FLOPs are estimated

    def settle(self) -> None:
        n = len(self.stats.recomputed_ops)
        if n != self.seen and self.last is not None and n == self.seen + 1 \
                and self.stats.recomputed_ops[-1] == self.last[0]:
            self.flops += self.last[1]
            if self.last[2]:
                self.estimated.add(self.last[0])
            if self.on_replay is not None:
                self.on_replay()
        self.seen, self.last = n, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.settle()
        out = func(*args, **(kwargs or {}))
        count, _ = self._op_flops(func, args, kwargs or {}, out)
        self.last = (op_name(func), int(count), self._is_cost_estimated(func))
        return out


def _parameter_like(t: torch.Tensor, params: set[int]) -> bool:
    """A parameter, a view of one, a tensor in ``params``' storages, or a graph input dynamo
    marked static (the parameters and buffers of inlined modules)."""
    if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter) or \
            getattr(t, "_dynamo_static_input_type", None) is not None:
        return True
    return bool(params) and storage_key(t) in params


def _param_storages(fn: Any) -> set[int]:
    """The storages of the parameters and buffers of ``fn``'s module (``fn`` itself, or the
    module of a bound method)."""
    module = fn if isinstance(fn, nn.Module) else getattr(fn, "__self__", None)
    return param_storages(module) if isinstance(module, nn.Module) else set()


class _OutsideBytes:
    """Saved-tensor hooks around the whole ``fn``: a region installs its own inside, so these
    see only what autograd keeps outside every region (unique storages, parameters and
    buffers excluded). The tensor itself is packed: nothing changes."""

    def __init__(self, params: set[int]) -> None:
        self.params = params
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        # A storage at address 0 holds no memory (empty, meta or fake).
        if not _parameter_like(t, self.params) and t.untyped_storage().data_ptr() != 0:
            self.storages[storage_key(t)] = storage_nbytes(t)
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())


def _explain_eager(fn: Callable[..., Any], args: tuple, kwargs: dict) -> PartitionReport:
    from .live_bytes import LiveBytes
    from .runtime import active_recorder, collect_stats
    outside = _OutsideBytes(_param_storages(fn))

    def region_of() -> str:  # the innermost region running now (forward), else none
        recorder = active_recorder()
        return recorder.frames[-1].name if recorder is not None else ""

    # the peak: kept values, the replays' and the backward's own, by region
    meter = LiveBytes(region_of=region_of)
    with collect_stats() as stats, meter:
        with torch.autograd.graph.saved_tensors_hooks(outside.pack, outside.unpack):
            out = fn(*args, **kwargs)
        meter.mark("backward")
        counter = _RecomputeFlops(stats, on_replay=lambda: meter.relabel_last(
            "recomputed", stats.recomputed_regions[-1]))
        with counter:
            _backward_of(out, on_grads=meter.exclude)  # leaves' gradients are autograd's
        counter.settle()
        del out
    report = PartitionReport(mode="eager")
    report.saved = [SavedTensorRecord(r.name, r.op, r.nbytes, r.reason, region=r.region,
                                      must=r.must) for r in stats.saved]
    report.recomputed = list(stats.recomputed_ops)
    report.recomputed_regions = list(stats.recomputed_regions)
    report.recompute_flops = counter.flops
    report.estimated_labels = counter.estimated
    report.outside_bytes = outside.nbytes
    report.peak = _measured_peak(meter)
    # Memory budgets: each plan, and what the policy saved that a budget's cut recomputes.
    report.notes.extend(dict.fromkeys(stats.budget_notes))
    report.evicted = [SavedTensorRecord(r.name, r.op, r.nbytes, r.reason, region=r.region)
                      for r in stats.evicted]
    return report


def _measured_peak(meter: Any) -> MemoryPeak:
    """A run's :class:`MemoryPeak` from its :class:`~sac_compile.live_bytes.LiveBytes`: what
    is alive at the peak by kind and by the innermost region that made it (forward) or
    replayed it (``""``: outside every region, or the backward's own values), ordered as
    the compiled report orders them."""
    forward, backward = meter.peak("forward"), meter.peak("backward")
    phase = "backward" if backward >= forward else "forward"
    order = ("forward", "kept", "recomputed", "backward")
    groups = meter.at_peak_by_region(phase)
    return MemoryPeak(forward, backward, phase, "", tuple(
        (kind, region, n) for (kind, region), n in sorted(
            groups.items(), key=lambda kv: (order.index(kv[0][0]) if kv[0][0] in order
                                            else len(order), -kv[1], kv[0][1]))))


def _mark_parameters(report: PartitionReport, params: set[str]) -> PartitionReport:
    """Records of graph inputs that are parameters or buffers say so (``saved_bytes`` then
    leaves them out), whichever partitioner made the report."""
    report.saved = [dataclasses.replace(r, reason="parameter (input)", is_parameter=True)
                    if r.is_input and r.name in params and not r.is_parameter
                    else r for r in report.saved]
    return report


def explain(fn: Callable[..., Any], *args: Any, mode: str = "eager",
            compiler: str = "aot_eager", **kwargs: Any) -> PartitionReport:
    """Run ``fn(*args, **kwargs)`` and its backward once; report what was saved/recomputed.

    ``mode="eager"`` reports the eager runtime's decisions inside regions (recompute FLOPs
    by ``torch.utils.flop_counter``'s rules, as compiled; ``outside_bytes``: what autograd
    keeps outside regions); ``mode="compile"`` compiles ``fn`` with
    :func:`sac_compile.make_backend` (``compiler``, default ``"aot_eager"``) and reports the
    partition of each forward/backward split, merged: the whole graph. Parameters and
    buffers are never counted in ``saved_bytes``.

    >>> import torch
    >>> from sac_compile import explain, sac_region
    >>> block = sac_region("recompute_all", name="block")(lambda x, w: (x @ w).sin().sin())
    >>> x, w = torch.randn(4, 8), torch.randn(8, 8, requires_grad=True)
    >>> report = explain(block, x, w)  # eager: one forward and backward
    >>> report.saved_bytes, report.recomputed  # keeps only the region's input
    (0, ['aten.mm.default', 'aten.sin.default'])
    """
    if mode not in ("eager", "compile"):
        raise ValueError(f"explain(mode=...) takes 'eager' or 'compile', got {mode!r}")
    with _leaving_user_state_as_it_was(fn):
        if mode == "eager":
            return _explain_eager(fn, args, kwargs)
        return _explain_compiled(fn, args, kwargs, compiler)


def _explain_compiled(fn: Callable[..., Any], args: tuple, kwargs: dict,
                      compiler: str) -> PartitionReport:
    from .compiler.backend import make_backend

    reports: list[PartitionReport] = []
    params: set[str] = set()
    module_params = _param_storages(fn)
    backend = make_backend(compiler=compiler,
                           on_partition=lambda r: reports.append(_mark_parameters(r, params)))

    def backend_knowing_parameters(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        # AOTAutograd names the i-th graph input primals_{i+1}; dynamo passes parameters
        # (and buffers) as graph inputs. Our partitioner also knows them from the static
        # input indices; a graph it hands to torch's (no regions, no tags) does not.
        params.clear()
        params.update(f"primals_{i + 1}" for i, t in enumerate(example_inputs)
                      if isinstance(t, torch.Tensor) and _parameter_like(t, module_params))
        return backend(gm, example_inputs)

    out = torch.compile(fn, backend=backend_knowing_parameters)(*args, **kwargs)
    _backward_of(out)
    if not reports:
        raise RuntimeError("explain(mode='compile'): nothing was partitioned; does fn's output "
                           "require grad?")
    merged = PartitionReport(mode="compile")
    for r in reports:
        merged.saved += r.saved
        merged.recomputed += r.recomputed
        merged.recomputed_regions += r.recomputed_regions
        merged.recompute_flops += r.recompute_flops
        merged.notes += r.notes
        merged.estimated_labels |= r.estimated_labels
        for k, v in r.timings.items():
            merged.timings[k] = merged.timings.get(k, 0.0) + v
        merged.solver = r.solver
    peaks = [r.peak for r in reports if r.peak is not None]
    if peaks:  # splits run one after another: the largest is the step's (estimated) peak
        merged.peak = max(peaks, key=lambda p: p.bytes)
    return merged
