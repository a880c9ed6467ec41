"""What a partition (compile) or a region run (eager) keeps for backward, and why.

``PartitionReport`` has the same shape in both modes, so tests can diff them:

* ``saved``: one :class:`SavedTensorRecord` per saved value (``name``, ``op``, ``nbytes``,
  ``reason``);
* ``recomputed``: op names recomputed in backward, with repeats;
* ``saved_bytes`` (parameters excluded), ``activation_bytes`` (inputs excluded too) and
  ``recompute_flops`` (``torch.utils.flop_counter``'s rules, in both modes);
* ``coverage``: what part of the program the figures cover. Eager: the values the eager
  runtime keeps *inside* regions (``outside_bytes``: what autograd itself keeps outside every
  region, parameters excluded). Compile: the whole compiled graph, inside and outside
  regions (what each forward hands to its backward);
* ``cost_estimated``: ops whose FLOPs were estimated from shapes (custom ops, matmuls with no
  ``flop_counter`` formula, see ``sac_compile.compiler.costs.op_flops``);
* with a memory budget (compile): ``memory_budget`` as given, ``budget_bytes`` (the cap on
  ``activation_bytes``) and ``evicted``: values saved without the budget and recomputed
  with it, with the reason;
* ``snapshot()``: deterministic text for expecttest; ``str(report)``: a readable table.

``explain(fn, *args, mode="eager" | "compile")`` runs ``fn`` once, forward and backward,
and returns the report.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from .policy import op_name

__all__ = ["PartitionReport", "SavedTensorRecord", "explain", "fmt_bytes"]


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" or n == int(n) else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


@dataclasses.dataclass(frozen=True)
class SavedTensorRecord:
    name: str
    op: str
    nbytes: int
    reason: str
    is_input: bool = False
    region: str = ""  # the innermost region that decided it; "" outside every region


@dataclasses.dataclass
class PartitionReport:
    mode: str = "compile"
    saved: list[SavedTensorRecord] = dataclasses.field(default_factory=list)
    recomputed: list[str] = dataclasses.field(default_factory=list)
    recomputed_regions: list[str] = dataclasses.field(default_factory=list)  # per recomputed op
    recompute_flops: int = 0
    solver: str = ""
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)
    memory_budget: float | int | None = None
    budget_bytes: int | None = None
    evicted: list[SavedTensorRecord] = dataclasses.field(default_factory=list)
    # eager explain: bytes autograd keeps outside every region (parameters excluded)
    outside_bytes: int | None = None

    @property
    def coverage(self) -> str:
        """Which part of the program the saved/recomputed figures cover."""
        if self.mode == "eager":
            text = ("region internals: the values the eager runtime keeps inside sac regions; "
                    "what autograd keeps outside regions is not in saved_bytes")
            if self.outside_bytes is not None:
                text += f" (outside: {fmt_bytes(self.outside_bytes)})"
            return text
        return ("the whole compiled graph: every value each forward hands to its backward, "
                "inside and outside regions")

    @property
    def cost_estimated(self) -> list[str]:
        """Ops (labels, sorted) whose FLOPs the cost model estimated from shapes, among the
        recomputed ops and (compile: the partitioner weighed them) the saved ones."""
        labels = set(self.recomputed)
        if self.mode != "eager":
            labels.update(r.op for r in self.saved if not r.is_input)
            labels.update(r.op for r in self.evicted)
        return sorted(label for label in labels if _label_cost_estimated(label))

    @property
    def saved_bytes(self) -> int:
        """Bytes of saved activations and non-parameter inputs (parameters cost nothing)."""
        return sum(r.nbytes for r in self.saved if not r.reason.startswith("parameter"))

    @property
    def activation_bytes(self) -> int:
        """Bytes of saved values that are not graph inputs: what a memory budget caps."""
        return sum(r.nbytes for r in self.saved if not r.is_input)

    def _budget_line(self) -> str:
        b = self.memory_budget
        given = f"{b * 100:g}%" if isinstance(b, float) else fmt_bytes(b)
        return (f"memory budget {given} = {fmt_bytes(self.budget_bytes or 0)}: "
                f"{fmt_bytes(self.activation_bytes)} of activations saved")

    @property
    def saved_ops(self) -> Counter:
        return Counter(r.op for r in self.saved if not r.is_input)

    @property
    def recomputed_ops(self) -> Counter:
        return Counter(self.recomputed)

    def snapshot(self) -> str:
        """Deterministic text: saved values in graph order, recomputed ops counted."""
        lines = [f"saved {fmt_bytes(self.saved_bytes)}, recomputed {len(self.recomputed)} ops "
                 f"({self.recompute_flops} FLOPs)"]
        if self.memory_budget is not None:
            lines.append("  " + self._budget_line())
        params = [r for r in self.saved if r.reason.startswith("parameter")]
        if params:
            lines.append(f"  keep {len(params)} parameters ({fmt_bytes(sum(r.nbytes for r in params))}"
                         f", not counted)")
        for r in self.saved:
            if r not in params:
                lines.append(f"  save {r.op} {fmt_bytes(r.nbytes)}: {r.reason}")
        for r in self.evicted:
            lines.append(f"  evict {r.op} {fmt_bytes(r.nbytes)}: {r.reason}")
        for op, n in sorted(self.recomputed_ops.items()):
            lines.append(f"  recompute {op} x{n}")
        estimated = self.cost_estimated
        if estimated:
            lines.append(f"  cost estimated (no FLOP formula): {', '.join(estimated)}")
        return "\n".join(lines)

    def __str__(self) -> str:
        rows = [("name", "op", "bytes", "reason")]
        rows += [(r.name, r.op, fmt_bytes(r.nbytes), r.reason) for r in self.saved]
        widths = [max(len(row[i]) for row in rows) for i in range(3)]
        out = [f"PartitionReport ({self.mode}): saved {fmt_bytes(self.saved_bytes)} in "
               f"{len(self.saved)} values; recomputed {len(self.recomputed)} ops, "
               f"{self.recompute_flops:,} FLOPs"]
        if self.memory_budget is not None:
            out[0] += "; " + self._budget_line()
        for row in rows:
            out.append("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[3])
        for r in self.evicted:
            out.append(f"  evicted {r.name} ({r.op}, {fmt_bytes(r.nbytes)}): {r.reason}")
        if self.recomputed:
            counts = ", ".join(f"{op} x{n}" for op, n in sorted(self.recomputed_ops.items()))
            out.append(f"  recomputed: {counts}")
        estimated = self.cost_estimated
        if estimated:
            out.append(f"  cost estimated (no FLOP formula; from shapes): {', '.join(estimated)}")
        out.append(f"  covers {self.coverage}")
        if self.timings:
            out.append("  time: " + ", ".join(f"{k} {v * 1e3:.1f} ms"
                                              for k, v in self.timings.items()))
        out.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(out)


def _op_of_label(label: str) -> Any:
    """The OpOverload an op label names (``aten.mm.default``, ``ns.op.overload[1]``), or
    None (an input, a higher-order op, a name that no longer resolves)."""
    parts = label.split("[", 1)[0].split(".")
    if len(parts) < 3:
        return None
    try:
        return getattr(getattr(getattr(torch.ops, parts[0]), ".".join(parts[1:-1])), parts[-1])
    except (AttributeError, RuntimeError):
        return None


def _label_cost_estimated(label: str) -> bool:
    if label.startswith("aten.") and label.split("[", 1)[0].split(".")[1] not in _ESTIMABLE_ATEN:
        return False  # the common case, without importing the compiler
    op = _op_of_label(label)
    if op is None:
        return False
    from .compiler.costs import is_cost_estimated
    return is_cost_estimated(op)


def _estimable_aten() -> frozenset[str]:
    """Names of the ATen matmuls flop_counter has no formula for: the only ATen ops whose
    cost may be estimated (the others are decided here without importing the compiler)."""
    from torch.utils.flop_counter import flop_registry

    from .policies import MATMUL_OPS
    return frozenset(op._schema.name.split("::", 1)[-1] for op in MATMUL_OPS
                     if op.overloadpacket not in flop_registry)


_ESTIMABLE_ATEN = _estimable_aten()


def _backward_of(out: Any) -> None:
    """Run the whole backward of ``out`` (every saved tensor is unpacked, as in training),
    leaving the ``.grad`` of every leaf it reaches as it was."""
    outputs = [t for t in torch.utils._pytree.tree_leaves(out)
               if isinstance(t, torch.Tensor) and t.requires_grad]
    if not outputs:
        return
    leaves = _leaves_reached(outputs)
    grads_before = [t.grad for t in leaves]
    for t in leaves:  # autograd would accumulate into them in place
        t.grad = None
    try:
        torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])
    finally:
        for t, g in zip(leaves, grads_before):
            t.grad = g


def _leaves_reached(outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    leaves: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    for t in outputs:
        if t.grad_fn is None and t.is_leaf:
            leaves[id(t)] = t
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
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
    runtime replays (by :func:`sac_compile.compiler.costs.op_flops`, the partitioner's rule).

    The runtime appends each replayed op to ``stats.recomputed_ops`` right after running it,
    with no other op in between; an op this mode saw is a replay iff the list grew by one
    before the next op (backward's own ops leave it unchanged)."""

    def __init__(self, stats: Any) -> None:
        super().__init__()
        from .compiler.costs import op_flops
        self._op_flops = op_flops
        self.stats = stats
        self.seen = len(stats.recomputed_ops)
        self.last: tuple[str, int] | None = None
        self.flops = 0

    def settle(self) -> None:
        n = len(self.stats.recomputed_ops)
        if n != self.seen and self.last is not None and n == self.seen + 1 \
                and self.stats.recomputed_ops[-1] == self.last[0]:
            self.flops += self.last[1]
        self.seen, self.last = n, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.settle()
        out = func(*args, **(kwargs or {}))
        count, _ = self._op_flops(func, args, kwargs or {}, out)
        self.last = (op_name(func), int(count))
        return out


def _parameter_like(t: torch.Tensor, params: set[tuple[str, int]]) -> bool:
    """A parameter, a view of one, a tensor in ``params``' storages, or a graph input dynamo
    marked static (the parameters and buffers of inlined modules)."""
    if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter) or \
            getattr(t, "_dynamo_static_input_type", None) is not None:
        return True
    return bool(params) and _storage_key(t) in params


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


def _param_storages(fn: Any) -> set[tuple[str, int]]:
    module = fn if isinstance(fn, nn.Module) else getattr(fn, "__self__", None)
    if not isinstance(module, nn.Module):
        return set()
    tensors = [*module.parameters(), *module.buffers()]
    return {_storage_key(t) for t in tensors}


class _OutsideBytes:
    """Saved-tensor hooks around the whole ``fn``: a region installs its own inside, so these
    see only what autograd keeps outside every region (unique storages, parameters and
    buffers excluded). The tensor itself is packed: nothing changes."""

    def __init__(self, params: set[tuple[str, int]]) -> None:
        self.params = params
        self.storages: dict[tuple[str, int], int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if not _parameter_like(t, self.params):
            key = _storage_key(t)
            if key[1] != 0:
                self.storages[key] = t.untyped_storage().nbytes()
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())


def _explain_eager(fn: Callable[..., Any], args: tuple, kwargs: dict) -> PartitionReport:
    from .eager import collect_stats
    outside = _OutsideBytes(_param_storages(fn))
    with collect_stats() as stats:
        with torch.autograd.graph.saved_tensors_hooks(outside.pack, outside.unpack):
            out = fn(*args, **kwargs)
        counter = _RecomputeFlops(stats)
        with counter:
            _backward_of(out)
        counter.settle()
    report = PartitionReport(mode="eager")
    report.saved = [SavedTensorRecord(r.name, r.op, r.nbytes, r.reason, region=r.region)
                    for r in stats.saved]
    report.recomputed = list(stats.recomputed_ops)
    report.recomputed_regions = ["?"] * len(report.recomputed)
    report.recompute_flops = counter.flops
    report.outside_bytes = outside.nbytes
    return report


def _mark_parameters(report: PartitionReport, params: set[str]) -> PartitionReport:
    """Records of graph inputs that are parameters or buffers say so (``saved_bytes`` then
    leaves them out), whichever partitioner made the report."""
    report.saved = [dataclasses.replace(r, reason="parameter (input)")
                    if r.is_input and r.name in params and not r.reason.startswith("parameter")
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
        for k, v in r.timings.items():
            merged.timings[k] = merged.timings.get(k, 0.0) + v
        merged.solver = r.solver
    return merged
