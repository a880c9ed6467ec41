"""Differential check of one generated program: no checkpointing vs our eager runtime vs
``torch.compile`` with our partitioner.

This module depends only on torch and sac_compile: a failing case is printed as this file's
source plus the program, so the repro runs on its own (``python repro.py``).

A *program* is Python source defining ``program(x, y, w, b, idx, buf, rm, rv)`` that
returns a tuple of tensors, and regions decorated with ``sac_region``. The source gets its
``sac_region``/``tag``/``name``/``HOOKS``/``table_policy``/``preset`` from the namespace it
is executed in:

* the *reference* namespace makes regions plain calls and tag/name no-ops, while an
  independent oracle (:class:`Oracle`, a dispatch mode) works out what each op's decision
  must be by the documented rules - outermost to innermost, tag innermost, MUST beats
  PREFER, two different MUSTs conflict, the innermost PREFER wins, no opinion is
  PREFER_RECOMPUTE - and which errors the program must raise;
* the *real* namespace uses sac_compile.

Checks (:func:`check`): outputs, gradients of x, y, w, b, in-place-updated buffers and the
RNG stream after backward equal the reference; eager decisions equal the oracle's, op by op;
SaveWithHooks' unpack never runs more often than pack; conflicting MUSTs raise CheckpointError
naming the op and both regions in both modes and nothing else raises (but for a compiled
program that torch.compile without regions fails the same way: a note "as torch.compile",
not ours); eager and compile agree on every MUST decision of the comparable ops.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import re
import sys
import types
import weakref
from typing import Any

import torch
import torch.nn.functional as F  # noqa: F401  (used by programs)
from torch.utils._python_dispatch import TorchDispatchMode

import sac_compile
from sac_compile import CheckpointError, CheckpointPolicy as CP, SaveWithHooks

aten = torch.ops.aten

MUSTS = ("MUST_SAVE", "MUST_RECOMPUTE", "MUST_CPU_OFFLOAD", "SaveWithHooks")
# The oracle's own list (not the library's) of what the "save_matmuls" preset saves.
MATMULS = {"aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default",
           "aten.mv.default", "aten.addmv.default"}


class FuzzFailure(AssertionError):
    pass


# --------------------------------------------------------------------------------------
# Policy specs: plain data the oracle interprets and the library gets as real policies
# --------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Spec:
    kind: str                      # table | preset | oplist | save_ops | offload_ops | names
    table: tuple = ()              # (op, opinion) pairs for table; ops for the op forms
    default: Any = None            # table: opinion for unlisted ops
    names: tuple = ()              # table: (label, opinion) pairs; names: labels
    preset: str = ""

    def opinion(self, op: Any, labels: frozenset) -> Any:
        op_s = str(op)
        if self.kind == "table":
            for label, opinion in self.names:
                if label in labels:
                    return opinion
            for key, opinion in self.table:
                if key is op:
                    return opinion
            return self.default
        if self.kind == "preset":
            return {"recompute_all": CP.PREFER_RECOMPUTE, "save_all": CP.PREFER_SAVE,
                    "save_matmuls": CP.MUST_SAVE if op_s in MATMULS else None}[self.preset]
        hit = any(_matches(k, op) for k in self.table)
        if self.kind == "oplist":
            return CP.MUST_SAVE if hit else CP.PREFER_RECOMPUTE
        if self.kind == "save_ops":
            return CP.MUST_SAVE if hit else None
        if self.kind == "offload_ops":
            return CP.MUST_CPU_OFFLOAD if hit else None
        if self.kind == "names":
            return CP.MUST_SAVE if labels & set(self.names) else None
        raise AssertionError(self.kind)


def _matches(key: Any, op: Any) -> bool:
    if isinstance(key, torch._ops.OpOverloadPacket):
        return getattr(op, "overloadpacket", None) is key
    return key is op


def _real_table_policy(spec: Spec) -> Any:
    table = dict(spec.table)
    names = spec.names
    default = spec.default

    def table_policy(ctx, op, *args, **kwargs):
        labels = getattr(ctx, "names", frozenset())
        for label, opinion in names:
            if label in labels:
                return opinion
        return table.get(op, default)

    return table_policy


def _real_policy(spec: Spec) -> Any:
    if spec.kind == "table":
        return _real_table_policy(spec)
    if spec.kind == "preset":
        return spec.preset
    if spec.kind == "oplist":
        return list(spec.table)
    if spec.kind == "save_ops":
        return sac_compile.policies.save_ops(*spec.table)
    if spec.kind == "offload_ops":
        return sac_compile.policies.offload_ops(*spec.table)
    if spec.kind == "names":
        return sac_compile.policies.save_only_these_names(*spec.names)
    raise AssertionError(spec.kind)


def table_policy(table: dict, default: Any = None, names: dict | None = None) -> Spec:
    return Spec("table", tuple(table.items()), default, tuple((names or {}).items()))


def preset(kind: str, *args: Any) -> Spec:
    if kind in ("recompute_all", "save_all", "save_matmuls"):
        return Spec("preset", preset=kind)
    if kind == "names":
        return Spec("names", names=tuple(args))
    return Spec(kind, tuple(args))


# --------------------------------------------------------------------------------------
# The oracle: what must be decided, and what must raise
# --------------------------------------------------------------------------------------

def _coerce(opinion: Any) -> Any:
    if opinion is True:
        return CP.MUST_SAVE
    if opinion is False:
        return CP.PREFER_RECOMPUTE
    return opinion


def _label(opinion: Any) -> str:
    return "SaveWithHooks" if isinstance(opinion, SaveWithHooks) else opinion.name


class Expected(Exception):
    """Raised inside the oracle where the real program must raise CheckpointError."""

    def __init__(self, kind: str, op: str = "", regions: tuple = ()) -> None:
        super().__init__(kind, op, regions)
        self.kind, self.op, self.regions = kind, op, regions


def resolve(op: str, votes: list[tuple[Any, str]]) -> str:
    """The rules, written independently of sac_compile.policy.resolve_decision."""
    must = None
    prefer = None
    for opinion, region in votes:
        label = _label(opinion)
        if label in MUSTS:
            if must is None or must[0] == label:
                must = (label, region)
            elif {must[0], label} == {"SaveWithHooks", "MUST_SAVE"}:
                # agree that it is saved; the hooks (and their region) say how
                must = must if must[0] == "SaveWithHooks" else (label, region)
            else:
                raise Expected("conflict", op, (must[1], region))
        else:
            prefer = label
    if must is not None:
        return "MUST_SAVE" if must[0] == "SaveWithHooks" else must[0]
    return prefer or "PREFER_RECOMPUTE"


class _Node:
    __slots__ = ("op", "frames", "labels", "tag", "decision", "__weakref__")

    def __init__(self, op: Any, frames: tuple) -> None:
        self.op, self.frames = op, frames
        self.labels: frozenset = frozenset()
        self.tag: Any = None
        self.decision = ""

    def decide(self) -> None:
        votes = []
        for name, spec in self.frames:
            opinion = _coerce(spec.opinion(self.op, self.labels))
            if opinion is not None:
                votes.append((opinion, name))
        if self.tag is not None:
            votes.append((_coerce(self.tag), self.frames[-1][0]))
        self.decision = resolve(str(self.op), votes)


class Oracle(TorchDispatchMode):
    """Records ops run inside (stub) regions of the reference run and decides them."""

    def __init__(self) -> None:
        super().__init__()
        self.frames: tuple = ()
        self.nodes: list[_Node] = []
        self.producers: dict[int, tuple[Any, _Node, int]] = {}
        self.expected: Expected | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.frames or self.expected is not None:
            return out
        node = _Node(func, self.frames)
        self.nodes.append(node)
        mutated = set()
        schema = func._schema
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                v = args[i] if i < len(args) else kwargs.get(arg.name)
                if isinstance(v, torch.Tensor):
                    mutated.add(id(v))
                    # the version bump comes after this mode returns
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        for t in outs:
            if isinstance(t, torch.Tensor):
                self.producers[id(t)] = (weakref.ref(t), node,
                                         t._version + (1 if id(t) in mutated else 0))
        try:
            node.decide()
        except Expected as e:
            self.expected = e
        return out

    def lookup(self, t: torch.Tensor) -> _Node | None:
        entry = self.producers.get(id(t))
        if entry is not None and entry[0]() is t and t._version == entry[2]:
            return entry[1]
        return None

    def retag(self, t: Any, *, tag: Any = None, label: str | None = None) -> None:
        if not self.frames or self.expected is not None:
            return  # outside any region tag()/name() are no-ops
        node = self.lookup(t)
        if node is None:
            self.expected = Expected("foreign", "tag()" if tag is not None else "name()",
                                     (self.frames[-1][0],))
            return
        if tag is not None:
            node.tag = tag
        if label is not None:
            node.labels = node.labels | {label}
        try:
            node.decide()
        except Expected as e:
            self.expected = e

    def enter(self, name: str, spec: Spec) -> None:
        if not self.frames:
            self.producers.clear()  # a new outermost region records afresh
        self.frames = self.frames + ((name, spec),)

    def exit(self) -> None:
        self.frames = self.frames[:-1]


def _reference_namespace(oracle: Oracle) -> dict:
    def sac_region(policy="recompute_all", *, name=None, allow_cache_entry_mutation=False):
        def deco(fn):
            @functools.wraps(fn)
            def region(*args, **kwargs):
                spec = policy if isinstance(policy, Spec) else \
                    Spec("oplist", tuple(policy)) if isinstance(policy, list) else preset(policy)
                oracle.enter(name or fn.__qualname__, spec)
                try:
                    return fn(*args, **kwargs)
                finally:
                    oracle.exit()
            return region
        return deco

    def tag(t, opinion):
        oracle.retag(t, tag=opinion)
        return t

    def name(t, label):
        oracle.retag(t, label=label)
        return t

    return dict(sac_region=sac_region, tag=tag, name=name, table_policy=table_policy,
                preset=preset, HOOKS=SaveWithHooks(_pack, _unpack))


class HookCounts:
    pack = 0
    unpack = 0


def _pack(t):
    # Torch code on tensors, branching only on the dtype: traceable, so under compile the
    # hooks are traced into the graphs as in a user's bf16/int8 hooks.
    HookCounts.pack += 1
    return (t * 2.0,) if t.is_floating_point() else (t.clone(),)


def _unpack(p):
    HookCounts.unpack += 1
    return p[0] / 2.0 if p[0].is_floating_point() else p[0]


def _real_namespace(force_allow_mutation: bool = False) -> dict:
    def sac_region(policy="recompute_all", *, name=None, allow_cache_entry_mutation=False):
        real = _real_policy(policy) if isinstance(policy, Spec) else policy
        return sac_compile.sac_region(
            real, name=name,
            allow_cache_entry_mutation=allow_cache_entry_mutation or force_allow_mutation)

    return dict(sac_region=sac_region, tag=sac_compile.tag, name=sac_compile.name,
                table_policy=table_policy, preset=preset, HOOKS=HOOKS)


HOOKS = SaveWithHooks(_pack, _unpack)


DETACH = "aten.detach.default"


def _pack_versioned(t):
    return t, t._version


def _unpack_versioned(packed):
    t, version = packed
    if t._version != version:
        raise RuntimeError("one of the variables needed for gradient computation has been "
                           "modified by an inplace operation (reference run)")
    return t


_program_ids = itertools.count()


def _program_globals(namespace: dict) -> dict:
    """The globals of a new module ``fuzz_program_<n>`` (in ``sys.modules``) holding
    ``namespace``: torch 2.11's Dynamo imports an inlined function's module by its
    ``__name__``."""
    name = f"fuzz_program_{next(_program_ids)}"
    module = types.ModuleType(name)
    module.__dict__.update(namespace)
    module.__dict__["__name__"] = name
    sys.modules[name] = module
    _LIVE.append(name)
    while len(_LIVE) > _KEEP:  # older programs are done: do not keep their objects alive
        sys.modules.pop(_LIVE.pop(0), None)
    return module.__dict__


_LIVE: list[str] = []
_KEEP = 4  # a check runs at most a few programs side by side


def load(source: str, namespace: dict) -> Any:
    ns = _program_globals(namespace)
    exec(compile(source, "<fuzz program>", "exec"), ns)
    return ns["program"]


# --------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------

def make_inputs(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return dict(
        x=torch.randn(4, 8, generator=g).requires_grad_(),
        y=torch.randn(4, 8, generator=g).requires_grad_(),
        w=(torch.randn(8, 8, generator=g) / 3).requires_grad_(),
        b=torch.randn(8, generator=g).requires_grad_(),
        idx=torch.randint(0, 8, (4,), generator=g),
        buf=torch.zeros(8),
        rm=torch.zeros(8),
        rv=torch.ones(8),
    )


GRAD_INPUTS = ("x", "y", "w", "b")
BUFFERS = ("buf", "rm", "rv")


@dataclasses.dataclass
class RunResult:
    outs: list
    grads: dict
    buffers: dict
    rng_after: torch.Tensor


def run(fn: Any, seed: int = 0) -> RunResult:
    inputs = make_inputs(seed)
    torch.manual_seed(seed + 1)
    outs = fn(**inputs)
    floats = [o for o in outs if o.is_floating_point()]
    loss = sum((o * (0.5 + 0.25 * i)).sum() for i, o in enumerate(floats))
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        loss.backward()
    rng_after = torch.rand(4)
    return RunResult([o.detach() for o in outs],
                     {k: inputs[k].grad for k in GRAD_INPUTS},
                     {k: inputs[k].clone() for k in BUFFERS}, rng_after)


def _assert_same(a: Any, b: Any, what: str, where: str, *, rtol: float, atol: float,
                 cls: type | None = None, first_line: bool = False) -> None:
    """``b`` (got) equals ``a`` (reference) within tolerance, or ``cls`` (FuzzFailure by
    default) naming ``where``; None and an all-zero gradient mean the same."""
    cls = cls or FuzzFailure
    if a is None or b is None:
        other = b if a is None else a
        if other is not None and other.any():
            raise cls(f"{what}: {where} is None on one side only")
        return
    try:
        torch.testing.assert_close(b, a, rtol=rtol, atol=atol, equal_nan=True)
    except AssertionError as e:
        if first_line:
            first = str(e).strip().split("\n")[0]
            raise cls(f"{what}: {where} differs from the reference\n{first}") from None
        raise cls(f"{what}: {where} differs from the reference: {e}") from None


def _compare(what: str, ref: RunResult, got: RunResult, *, rtol: float, atol: float) -> None:
    def close(a: Any, b: Any, where: str) -> None:
        _assert_same(a, b, what, where, rtol=rtol, atol=atol)

    if len(ref.outs) != len(got.outs):
        raise FuzzFailure(f"{what}: {len(got.outs)} outputs, reference has {len(ref.outs)}")
    for i, (a, b) in enumerate(zip(ref.outs, got.outs)):
        close(a, b, f"output {i}")
    for k in GRAD_INPUTS:
        close(ref.grads[k], got.grads[k], f"grad of {k}")
    for k in BUFFERS:
        close(ref.buffers[k], got.buffers[k], f"buffer {k}")
    if what == "eager":
        close(ref.rng_after, got.rng_after, "the RNG stream after backward")


def _norm_op(op: str) -> str:
    # functionalisation turns add_ into add: compare the out-of-place name
    parts = op.split(".")
    if len(parts) == 3 and parts[1].endswith("_") and not parts[1].startswith("_"):
        parts[1] = parts[1][:-1]
    return ".".join(parts)


# Ops whose MUST decisions eager and compile must agree on: compute ops that dispatch the
# same in both modes (views and random ops are normalised or decomposed differently).
COMPARABLE = {
    "aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.sin.default",
    "aten.cos.default", "aten.tanh.default", "aten.sigmoid.default", "aten.relu.default",
    "aten.gelu.default", "aten.silu.default", "aten.exp.default", "aten.mul.Tensor",
    "aten.add.Tensor", "aten.sub.Tensor", "aten.div.Tensor", "aten.maximum.default",
    "aten.sum.dim_IntList", "aten.mean.dim", "aten._softmax.default", "aten.amax.default",
    "aten.cat.default", "aten.topk.default", "aten.native_layer_norm.default",
    "aten.index_select.default", "aten.embedding.default", "aten.gather.default",
    "aten.where.self", "aten.gt.Scalar", "aten.argmax.default", "aten.neg.default",
    "aten.clamp.default", "aten.sort.default", "aten.max.dim", "aten.var_mean.correction",
}


@contextlib.contextmanager
def _capture_decisions(decisions: list):
    """Record each op's final decision (after the partitioner's normalisation pass)."""
    from sac_compile.compiler import partition
    normalize = partition.normalize_tags

    def capturing(gm):
        counts = normalize(gm)
        decisions.append(PARTITIONED)
        for n in gm.graph.nodes:
            d = n.meta.get("sac_decision")
            if n.op == "call_function" and d is not None and \
                    " on its view " not in str(d.source):
                # (skipped: hooks or an offload decided for a view op, carried to its base
                # under compile as documented - eager keeps them on the view op)
                # The op the policy was asked about: under Inductor, gelu's decomposition
                # nodes (mul, add, erf, ...) all carry gelu's decision.
                decisions.append((str(n.meta.get("sac_op", n.target)), d.policy.name))
        return counts

    partition.normalize_tags = capturing
    try:
        yield
    finally:
        partition.normalize_tags = normalize


# Marks one call of the partitioner in the captured compile decisions.
PARTITIONED = ("<partitioned>", "")


def _must_pairs(pairs: Any, skip: set) -> set:
    return {(_norm_op(op), p) for op, p in pairs if (op, p) != PARTITIONED
            if p in MUSTS and _norm_op(op) in COMPARABLE and _norm_op(op) not in skip}


@contextlib.contextmanager
def _quiet():
    import logging
    logger = logging.getLogger("torch._dynamo")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@dataclasses.dataclass
class Outcome:
    status: str                    # "ok" | "invalid" (reference raised) | "conflict" | ...
    notes: list = dataclasses.field(default_factory=list)


def _expect_error(mode: str, exc: BaseException | None, expected: Expected, *,
                  name_op: bool = True) -> None:
    if exc is None:
        raise FuzzFailure(f"{mode}: expected CheckpointError ({expected.kind} on "
                          f"{expected.op} in {expected.regions}), nothing was raised")
    if not isinstance(exc, CheckpointError):
        raise FuzzFailure(f"{mode}: expected CheckpointError ({expected.kind}), got "
                          f"{type(exc).__name__}: {exc}") from exc
    msg = str(exc)
    needles = [expected.op if name_op else "", *expected.regions]
    if expected.kind == "conflict":
        needles.append("conflicting")
    missing = [n for n in needles if n and n not in msg]
    if missing:
        raise FuzzFailure(f"{mode}: CheckpointError does not name {missing}: {msg}")


def check(source: str, *, modes: tuple = ("eager", "compile"), compiler: str = "aot_eager",
          memory_budget: float | None = None, seed: int = 0, has_inplace: bool = True,
          compile_skip: str = "", comparable_skip: tuple = (), dropout: bool = False,
          on_partition: Any = None) -> Outcome:
    """Check one program; raise FuzzFailure on any disagreement. ``on_partition``: given
    each compiled split's PartitionReport (``make_backend``'s)."""
    outcome = Outcome("ok")
    oracle = Oracle()
    try:
        # saved-tensor hooks, as under the eager runtime (without hooks autograd dispatches
        # other detach ops); they keep autograd's check that a saved tensor is not modified
        with oracle, torch.autograd.graph.saved_tensors_hooks(_pack_versioned,
                                                              _unpack_versioned):
            ref = run(load(source, _reference_namespace(oracle)), seed)
    except Exception as e:  # not a valid program (autograd itself refuses it)
        outcome.status = "invalid"
        outcome.notes.append(f"reference raised {type(e).__name__}: {e}")
        return outcome
    expected = oracle.expected
    # detach: autograd's own plumbing when it saves tensors (which side dispatches one
    # depends on saved-tensor hooks); its decision is immaterial
    oracle_decisions = [(str(n.op), n.decision) for n in oracle.nodes if str(n.op) != DETACH]
    eager_pairs: list = []

    if "eager" in modes:
        HookCounts.pack = HookCounts.unpack = 0
        exc = None
        from sac_compile.runtime import collect_stats
        try:
            with collect_stats() as stats:
                got = run(load(source, _real_namespace()), seed)
        except Exception as e:
            exc = e
        if expected is not None:
            _expect_error("eager", exc, expected)
            outcome.status = expected.kind
        else:
            if exc is not None and isinstance(exc, CheckpointError) and \
                    "mutated in place" in str(exc) and has_inplace:
                # A saved value mutated in place: the documented error. The same program
                # with allow_cache_entry_mutation=True must then be right.
                outcome.notes.append("cache-entry mutation error; rerun allowing it")
                HookCounts.pack = HookCounts.unpack = 0
                with collect_stats() as stats:
                    try:
                        got = run(load(source, _real_namespace(True)), seed)
                    except Exception as e:
                        raise FuzzFailure(f"eager (allow_cache_entry_mutation=True) raised "
                                          f"{type(e).__name__}: {e}") from e
            elif exc is not None:
                raise FuzzFailure(f"eager raised {type(exc).__name__}: {exc}") from exc
            _compare("eager", ref, got, rtol=0, atol=0)
            ours = [(op, d.policy.name if d.hooks is None else "MUST_SAVE")
                    for op, d in stats.decisions if op != DETACH]
            if ours != oracle_decisions:
                diff = next((i, a, b) for i, (a, b) in enumerate(
                    zip(ours + [None] * len(oracle_decisions),
                        oracle_decisions + [None] * len(ours))) if a != b)
                raise FuzzFailure(f"eager decisions differ from the rules at op #{diff[0]}: "
                                  f"runtime {diff[1]}, expected {diff[2]}")
            # unpack may run less often: a value whose recompute is served by a forward
            # output still alive is never unpacked
            if HookCounts.unpack > HookCounts.pack:
                raise FuzzFailure(f"SaveWithHooks: pack ran {HookCounts.pack} times, unpack "
                                  f"{HookCounts.unpack} times")
            eager_pairs = [(op, d.policy.name) for op, d in stats.decisions]

    if "compile" in modes and compile_skip:
        outcome.notes.append(f"compile skipped: {compile_skip}")
    elif "compile" in modes:
        torch._dynamo.reset()
        decisions: list = []
        exc = None
        try:
            from sac_compile.compiler import make_backend
            backend = make_backend(compiler=compiler, memory_budget=memory_budget,
                                   on_partition=on_partition)
            # Inductor's own RNG differs from eager's; with fallback_random it draws from the
            # eager generator, so random ops compare with the reference from the same seed.
            import torch._inductor.config as inductor_config
            with _quiet(), _capture_decisions(decisions), \
                    inductor_config.patch(fallback_random=True):
                got = run(torch.compile(load(source, _real_namespace(True)), backend=backend),
                          seed)
        except Exception as e:
            exc = e
        if expected is not None and expected.kind == "foreign":
            _expect_error("compile", exc, expected)
            if "no op of the region produced" not in str(exc):
                raise FuzzFailure(f"compile: expected the foreign-tag error, got: {exc}")
        elif expected is not None and expected.kind == "conflict":
            # F.dropout is bernoulli_/div_/mul in eager and native_dropout under compile: the
            # conflict is reported on a different op
            _expect_error("compile", exc, expected, name_op=not dropout)
        elif exc is not None and memory_budget is not None and \
                isinstance(exc, CheckpointError) and "cannot be met" in str(exc):
            # The documented outcome of a budget below what the MUST_SAVE values need.
            outcome.notes.append("memory budget cannot be met (CheckpointError)")
        elif exc is not None and isinstance(exc, CheckpointError) and \
                "reads a graph input the forward mutates" in str(exc):
            # Documented (docs/errors.md row 14): MUST_RECOMPUTE on an op that reads a
            # mutated input (training batch_norm) has no valid split under compile.
            outcome.notes.append("MUST_RECOMPUTE on an op reading a mutated input "
                                 "(CheckpointError)")
        elif exc is not None and not isinstance(exc, CheckpointError) and \
                _upstream_raises(source, seed, compiler, exc):
            # torch.compile raises the same without regions (aot_eager's backward of a
            # training batch_norm over a transposed view calls view on a non-contiguous
            # gradient): not ours, counted apart.
            outcome.notes.append(f"as torch.compile: {type(exc).__name__}")
        elif exc is not None:
            raise FuzzFailure(f"compile raised {type(exc).__name__}: {exc}") from exc
        else:
            _compare("compile", ref, got, rtol=1e-4, atol=1e-5)
            if "eager" in modes and expected is None and PARTITIONED not in decisions:
                # No output of the compiled graph needs a gradient: AOTAutograd traces no
                # joint graph and nothing is partitioned, so there are no decisions to compare
                # (eager still records them; they keep nothing either).
                outcome.notes.append("compile: no joint graph (no output needs a gradient)")
            elif "eager" in modes and expected is None:
                skip = set(comparable_skip)
                if dropout:
                    skip |= {"aten.mul.Tensor", "aten.div.Tensor"}
                a, b = _must_pairs(eager_pairs, skip), _must_pairs(decisions, skip)
                if a != b:
                    raise FuzzFailure(f"MUST decisions differ: eager only {sorted(a - b)}, "
                                      f"compile only {sorted(b - a)}")
    return outcome


def _plain_namespace() -> dict:
    """Regions as plain calls, tag()/name() as no-ops: the program as torch.compile sees it
    without sac_compile."""
    def sac_region(policy="recompute_all", *, name=None, allow_cache_entry_mutation=False):
        return lambda fn: fn

    return dict(sac_region=sac_region, tag=lambda t, opinion: t, name=lambda t, label: t,
                table_policy=table_policy, preset=preset, HOOKS=HOOKS)


def _first_line_of(exc: BaseException) -> str:
    lines = str(exc).strip().split("\n")
    return lines[0] if lines else ""


def _upstream_raises(source: str, seed: int, compiler: str, exc: BaseException) -> bool:
    """Whether torch.compile with ``compiler`` and no regions raises what we raised (the
    same exception type and first line)."""
    torch._dynamo.reset()
    import torch._inductor.config as inductor_config
    try:
        with _quiet(), inductor_config.patch(fallback_random=True):
            run(torch.compile(load(source, _plain_namespace()), backend=compiler), seed)
    except Exception as e:
        return type(e) is type(exc) and _first_line_of(e) == _first_line_of(exc)
    return False


def budget_supported() -> bool:
    """Whether make_backend(memory_budget=...) is implemented yet."""
    from sac_compile.compiler import make_backend
    try:
        make_backend(compiler="aot_eager", memory_budget=0.5)
    except NotImplementedError:
        return False
    return True


def repro(source: str, **kwargs: Any) -> str:
    """A standalone script: this module's code, the program, and the failing call."""
    import inspect
    import sys
    harness = inspect.getsource(sys.modules[__name__])
    args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    harness = harness.replace("from __future__ import annotations\n", "", 1)
    return ("from __future__ import annotations\n\n"
            f"# Standalone repro of a sac_compile fuzz failure: the program, then the fuzz\n"
            f"# harness (tests/fuzzlib/harness.py) that checks it. Run from the repo root.\n"
            f"PROGRAM = '''\n{source}'''\n\n{harness}\n\n"
            f"if __name__ == '__main__':\n"
            f"    print(check(PROGRAM{', ' if args else ''}{args}))\n")


# ======================================================================================
# The boundary family (gen.boundary_programs): in-place updates across the region boundary
# ======================================================================================
#
# The oracle is plain autograd on the same program with every region a plain call (same
# seed). Per program and mode, exactly one of:
#   exact          our gradients, outputs and buffers equal plain autograd's (bitwise in
#                  eager mode; compiled runs with the tolerances above)
#   both-raised    plain autograd raised, and so did we
#   CheckpointError  we raised sac_compile.CheckpointError naming one of the program's
#                  regions, where plain autograd ran
#   forward-values plain autograd raised (a value it saved was modified in place), we ran,
#                  and our results equal plain autograd's with every saved tensor
#                  snapshotted when saved: the gradient of the forward as it ran. (Also
#                  where plain autograd ran but used a saved value an op updated without a
#                  version bump - training batch_norm's running stats - and we did not.)
#   unverified     plain autograd raised, with and without snapshots; we ran
#   as-torch.compile  (compiled runs) none of the above, but torch.compile (aot_eager) of
#                  the same program without regions does exactly what we did: the same
#                  results or the same exception type. Not ours; counted apart.
# and failures:
#   silent mismatch  we ran without an error and differ from the reference
#   other failure    any other exception (or a CheckpointError naming no region) where plain
#                  autograd ran


class SilentMismatch(FuzzFailure):
    category = "silent mismatch"


class OtherFailure(FuzzFailure):
    category = "other failure"


class OracleError(FuzzFailure):
    category = "harness"


def _stub_sac_region(policy: Any = "recompute_all", *, name: Any = None,
                     allow_cache_entry_mutation: bool = False) -> Any:
    return lambda target: target


B_HOOKS = SaveWithHooks(torch.clone, lambda t: t)


def boundary_namespace(checkpointing: bool) -> dict:
    """What a boundary program gets: real regions, or plain calls (the reference)."""
    return dict(sac_region=sac_compile.sac_region if checkpointing else _stub_sac_region,
                tag=sac_compile.tag, name=sac_compile.name, HOOKS=B_HOOKS)


class _Held:
    __slots__ = ("value", "version", "early")

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value
        try:
            self.version = value._version
        except RuntimeError:  # an inference tensor
            self.version = None
        self.early = value.detach().clone()


class _Snapshots(torch.overrides.TorchFunctionMode):
    """The snapshot reference: every tensor autograd saves is copied as it was when the op
    that saved it ran, at the version autograd recorded. Autograd packs an op's inputs
    before its kernel runs. A kernel may write a saved input without a version bump (rrelu
    fills its noise): that value is copied when the Python-level call returns. One that
    bumps the version of a tensor it saved (``_foreach_mul_([v], [v])`` saves ``v`` as
    ``other``) is copied as it was when packed."""

    def __init__(self) -> None:
        super().__init__()
        self.pending: list[_Held] = []

    def pack(self, t: torch.Tensor) -> _Held:
        held = _Held(t)
        self.pending.append(held)
        return held

    @staticmethod
    def unpack(held: _Held) -> torch.Tensor:
        return held.value

    def flush(self) -> None:
        pending, self.pending = self.pending, []
        for held in pending:  # a detached copy saves nothing itself
            try:
                same = held.value._version == held.version
            except RuntimeError:
                same = True
            held.value = held.value.detach().clone() if same else held.early
            held.early = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.flush()
        return out


@dataclasses.dataclass
class BoundaryRun:
    values: dict       # outputs, gradients (inputs and module parameters), buffers
    rng_after: torch.Tensor


def run_boundary(source: str, *, checkpointing: bool, seed: int = 0, snapshot: bool = False,
                 backend: Any = None, namespace: dict | None = None) -> BoundaryRun:
    ns = _program_globals(namespace or boundary_namespace(checkpointing))
    exec(compile(source, "<fuzz program>", "exec"), ns)
    inputs = make_inputs(seed)
    mods = ns["setup"](inputs["w"], inputs["b"], inputs["buf"]) if "setup" in ns else {}
    fn = ns["program"]
    if backend is not None:
        fn = torch.compile(fn, backend=backend)
    dtype = torch.get_default_dtype()
    snapshots = _Snapshots() if snapshot else None
    torch.manual_seed(seed + 1)
    try:
        if snapshots is not None:
            with snapshots, torch.autograd.graph.saved_tensors_hooks(snapshots.pack,
                                                                     snapshots.unpack):
                outs = fn(mods, **inputs)
            snapshots.flush()
        else:
            outs = fn(mods, **inputs)
        floats = [o for o in outs if o.is_floating_point()]
        loss = sum((o * (0.5 + 0.25 * i)).sum() for i, o in enumerate(floats))
        if "after" in ns:
            ns["after"](outs, mods, **inputs)
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            loss.backward()
    finally:
        torch.set_default_dtype(dtype)
    rng_after = torch.rand(4)
    values: dict = {f"output {i}": o.detach().clone() for i, o in enumerate(outs)}
    values.update({f"grad of {k}": inputs[k].grad for k in GRAD_INPUTS})
    values.update({f"buffer {k}": inputs[k].clone() for k in BUFFERS})
    for m, mod in mods.items():
        values.update({f"grad of {m}.{n}": p.grad for n, p in mod.named_parameters()})
        values.update({f"buffer {m}.{n}": t.clone() for n, t in mod.named_buffers()})
    return BoundaryRun(values, rng_after)


def _compare_boundary(what: str, ref: BoundaryRun, got: BoundaryRun, *, rtol: float,
                      atol: float, rng: bool, cls: type = SilentMismatch) -> None:
    if ref.values.keys() != got.values.keys():
        raise cls(f"{what}: results {sorted(got.values)}, reference {sorted(ref.values)}")
    for where, a in ref.values.items():
        _assert_same(a, got.values[where], what, where, rtol=rtol, atol=atol, cls=cls,
                     first_line=True)
    if rng:
        try:
            torch.testing.assert_close(got.rng_after, ref.rng_after, rtol=0, atol=0)
        except AssertionError:
            raise cls(f"{what}: the RNG stream after backward differs") from None


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().split("\n")
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def check_boundary(source: str, *, modes: tuple = ("eager",), compiler: str = "aot_eager",
                   seed: int = 0, namespace: dict | None = None) -> dict:
    """Check one boundary program; returns {mode: outcome} (see the table above) or raises
    SilentMismatch / OtherFailure. ``namespace`` replaces sac_compile's (to test the
    oracle)."""
    regions = set(re.findall(r"name='(R\d+)'", source))
    plain = plain_exc = snap = None
    try:
        plain = run_boundary(source, checkpointing=False, seed=seed)
    except Exception as e:
        plain_exc = e
    try:
        snap = run_boundary(source, checkpointing=False, seed=seed, snapshot=True)
    except Exception:
        snap = None
    if plain is not None:
        # The snapshot reference agrees wherever plain autograd runs, but for a tensor that
        # an op updates without bumping its version (training batch_norm's running stats):
        # plain autograd then silently uses the new value. Either answer is accepted.
        if snap is None:
            raise OracleError("harness: the snapshot reference raised where plain autograd "
                              "ran")
        try:
            _compare_boundary("", plain, snap, rtol=0, atol=0, rng=True, cls=OracleError)
        except OracleError:
            pass
        else:
            snap = None
    outcomes = {}
    for mode in modes:
        exc = got = None
        try:
            if mode == "eager":
                got = run_boundary(source, checkpointing=True, seed=seed, namespace=namespace)
            else:
                got = _run_compiled(source, True, seed, compiler, namespace)
        except Exception as e:
            exc = e
        try:
            outcomes[mode] = _judge(mode, exc, got, plain, plain_exc, snap, regions)
        except FuzzFailure:
            if mode == "eager":
                raise
            # Compiled: the same program compiled without regions (torch.compile on its
            # own) may already differ from plain autograd; then the difference is not ours.
            if _as_torch_compile(source, seed, exc, got):
                outcomes[mode] = "as-torch.compile"
            else:
                raise
    return outcomes


def _run_compiled(source: str, checkpointing: bool, seed: int, compiler: str,
                  namespace: dict | None = None) -> BoundaryRun:
    torch._dynamo.reset()
    import torch._inductor.config as inductor_config
    if checkpointing:
        from sac_compile.compiler import make_backend
        backend = make_backend(compiler=compiler)
    else:
        backend = compiler
    with _quiet(), inductor_config.patch(fallback_random=True):
        return run_boundary(source, checkpointing=checkpointing, seed=seed, backend=backend,
                            namespace=namespace)


def _as_torch_compile(source: str, seed: int, exc: BaseException | None,
                      got: BoundaryRun | None) -> bool:
    """Whether our compiled run did what torch.compile (aot_eager) does to the same program
    without regions: raised the same exception type, or gave the same results."""
    try:
        upstream = _run_compiled(source, False, seed, "aot_eager")
    except Exception as e:
        return exc is not None and type(e) is type(exc)
    if got is None:
        return False
    try:
        _compare_boundary("as torch.compile", upstream, got, rtol=1e-4, atol=1e-5, rng=False)
    except SilentMismatch:
        return False
    return True


def _judge(mode: str, exc: BaseException | None, got: BoundaryRun | None,
           plain: BoundaryRun | None, plain_exc: BaseException | None,
           snap: BoundaryRun | None, regions: set) -> str:
    rtol, atol = (0.0, 0.0) if mode == "eager" else (1e-4, 1e-5)
    if exc is not None:
        if plain_exc is not None:
            return "both-raised"
        if isinstance(exc, CheckpointError) and any(
                re.search(rf"\b{r}\b", str(exc)) for r in regions):
            return "CheckpointError"
        if isinstance(exc, CheckpointError):
            raise OtherFailure(f"{mode}: CheckpointError naming none of the regions "
                               f"{sorted(regions)}: {exc}") from exc
        raise OtherFailure(f"{mode} raised {_first_line(exc)} (plain autograd runs)") from exc
    if plain is not None:
        try:
            _compare_boundary(mode, plain, got, rtol=rtol, atol=atol, rng=mode == "eager")
        except SilentMismatch:
            if snap is None:  # (set where plain autograd missed a mutation, see above)
                raise
            _compare_boundary(f"{mode} (plain autograd used a value modified without a "
                              f"version bump; against forward-time values)", snap, got,
                              rtol=rtol, atol=atol, rng=mode == "eager")
            return "forward-values"
        return "exact"
    if snap is not None:
        try:
            _compare_boundary(f"{mode} (plain autograd raised; against forward-time values)",
                              snap, got, rtol=rtol, atol=atol, rng=mode == "eager")
        except SilentMismatch as e:
            raise SilentMismatch(f"{e}\nplain autograd raised {_first_line(plain_exc)}") \
                from None
        return "forward-values"
    return "unverified"


def repro_boundary(source: str, *, failure: str = "", mode: str = "eager",
                   compiler: str = "aot_eager") -> str:
    """A short standalone script: the program and a driver that runs it without regions
    (plain autograd) and with sac_compile's, and prints which results differ."""
    lines = [line for line in source.split("\n") if line.strip() and not line.startswith(
        ("import ", "from sac_compile import", "aten = "))]
    body = "\n".join(lines)
    ns = ("torch=torch, sc=sc, F=torch.nn.functional, aten=torch.ops.aten, "
          "CP=sc.CheckpointPolicy, tag=sc.tag, name=sc.name")
    if "copy." in body:
        ns = "copy=__import__('copy'), " + ns
    if "HOOKS" in body:
        ns += ", HOOKS=sc.SaveWithHooks(torch.clone, lambda t: t)"
    ns += ", sac_region=sc.sac_region if ck else lambda *a, **k: lambda f: f"
    call = 'ns["program"]'
    if mode == "compile":
        call = (f'(torch.compile({call}, backend=sc.make_backend(compiler={compiler!r})) '
                f'if ck else {call})')
    tol = "1e-5" if mode == "compile" else "0.0"
    loss = ("sum((o * (0.5 + 0.25 * i)).sum() for i, o in enumerate(o for o in outs if "
            "o.is_floating_point()))")
    setup = 'ns["setup"](t["w"], t["b"], t["buf"])' if "def setup(" in body else "{}"
    out = [f"import torch, sac_compile as sc  # boundary-fuzz repro ({mode}): "
           f"{failure.split(chr(10))[0][:100]}",
           'P = """' + body, '"""',
           "def run(ck):  # ck: sac_compile's regions, else plain calls (plain autograd)",
           f"    exec(P, ns := dict({ns}))",
           "    g = torch.Generator().manual_seed(0); t = dict(x=torch.randn(4, 8, generator=g)"
           ".requires_grad_(), y=torch.randn(4, 8, generator=g).requires_grad_(), w=(torch."
           "randn(8, 8, generator=g) / 3).requires_grad_(), b=torch.randn(8, generator=g)."
           "requires_grad_(), idx=torch.randint(0, 8, (4,), generator=g), buf=torch.zeros(8), "
           "rm=torch.zeros(8), rv=torch.ones(8))",
           f"    mods = {setup}; torch.manual_seed(1)"]
    if "plain autograd raised" in failure:
        # plain autograd raises: the reference copies each tensor autograd saves when it is
        # saved (the forward-time values; harness._Snapshots is the exact form)
        out[3] = ("def run(ck):  # ck: sac_compile's regions, else plain calls with every "
                  "saved tensor copied when saved")
        out += ["    with __import__('contextlib').nullcontext() if ck else torch.autograd."
                "graph.saved_tensors_hooks(lambda t: t.detach().clone(), lambda t: t):",
                f"        outs = {call}(mods, **t)"]
    else:
        out.append(f"    outs = {call}(mods, **t)")
    if "def after(" in body:
        out += [f"    loss = {loss}", '    ns["after"](outs, mods, **t)', "    loss.backward()"]
    else:
        out.append(f"    {loss}.backward()")
    if "set_default_dtype" in body:
        out[-1] += "; torch.set_default_dtype(torch.float32)"
    out += ["    return {**{f'output {i}': o for i, o in enumerate(outs)}, **{f'grad of {k}': "
            "v.grad for k, v in t.items()}, **{f'buffer {k}': t[k] for k in ('buf', 'rm', "
            "'rv')}, **{f'grad of {m}.{n}': p.grad for m in mods for n, p in "
            "mods[m].named_parameters()}}",
            "ref, got, z = run(False), run(True), lambda v: torch.zeros(()) if v is None else "
            "v.detach()",
            f"print([k for k in ref if not torch.allclose(z(ref[k]), z(got[k]), rtol={tol}, "
            f"atol={tol}, equal_nan=True)] or 'no difference')"]
    return "\n".join(out) + "\n"


# -- known failure kinds ---------------------------------------------------------------
# A failure is *explained* by a known kind when the same program passes once the runtime is
# kept away from the construct that kind is about (a policy transform). The kinds are the
# library bugs the boundary family found and tests/test_fuzz.py pins as strict xfails; the
# fixed-seed share there fails only on unexplained failures, make fuzz counts both.

def _offload_as_save(opinion: Any) -> Any:
    return {CP.MUST_CPU_OFFLOAD: CP.MUST_SAVE, CP.PREFER_CPU_OFFLOAD: CP.PREFER_SAVE}.get(
        opinion, opinion) if isinstance(opinion, CP) else opinion


def _never_save_views(fn: Any) -> Any:
    def policy(ctx, op, *args, **kwargs):
        if getattr(op, "is_view", False):
            return CP.MUST_RECOMPUTE
        return fn(ctx, op, *args, **kwargs)
    return policy


def _never_offload(fn: Any) -> Any:
    def policy(ctx, op, *args, **kwargs):
        return _offload_as_save(fn(ctx, op, *args, **kwargs))
    return policy


def _save_factories(fn: Any) -> Any:
    def policy(ctx, op, *args, **kwargs):
        if not any(isinstance(a, torch.Tensor) for a in
                   torch.utils._pytree.tree_leaves((args, kwargs))):
            return CP.MUST_SAVE  # a factory op (torch.full, linspace, ...): never recomputed
        return fn(ctx, op, *args, **kwargs)
    return policy


KNOWN_KINDS = {
    # compiled: a factory op without a dtype (torch.linspace, full, ...) recomputed in a
    # backward that runs under another default dtype (float64) makes float64 values there;
    # the backward raises (float != double) where plain autograd runs
    "factory-recomputed-under-another-default-dtype": (_save_factories, None),
}


def known_namespace(kind: str) -> dict:
    """sac_compile's namespace with the known kind's construct taken away."""
    policy_t, tag_t = KNOWN_KINDS[kind]
    from sac_compile.policy import normalize_policy

    def region(policy: Any = "recompute_all", *, name: Any = None,
               allow_cache_entry_mutation: bool = False) -> Any:
        return sac_compile.sac_region(policy_t(normalize_policy(policy)), name=name,
                                      allow_cache_entry_mutation=allow_cache_entry_mutation)

    ns = dict(boundary_namespace(True), sac_region=region)
    if tag_t is not None:
        ns["tag"] = lambda t, opinion: sac_compile.tag(t, tag_t(opinion))
    return ns


def explain_failure(source: str, modes: tuple = ("eager",)) -> str | None:
    """The known kind that explains a failing program, or None."""
    for kind in KNOWN_KINDS:
        try:
            check_boundary(source, modes=modes, namespace=known_namespace(kind))
        except FuzzFailure:
            continue
        return kind
    return None


def _chunks(lines: list[str]) -> list[tuple[int, int]]:
    """Statement ranges [start, end) a reducer may delete: statements inside function
    bodies (a ``with`` block together with its body), never ``def``/``return`` lines."""
    out = []
    for i, line in enumerate(lines):
        stripped = line.lstrip()
        indent = len(line) - len(stripped)
        if indent < 4 or not stripped or stripped.startswith(("def ", "return ", "super()",
                                                              "@")):
            continue
        if re.match(r"\s*self\.", line) or stripped.startswith("w, b, buf = self."):
            continue
        end = i + 1
        if stripped.startswith("with "):
            while end < len(lines) and len(lines[end]) - len(lines[end].lstrip()) > indent:
                end += 1
        out.append((i, end))
    return out


def _drop_names(source: str, names: set) -> str:
    """Remove ``names`` from every tuple return and tuple unpacking (they are unique)."""
    def fix(m: re.Match) -> str:
        items = [x.strip() for x in m.group(2).split(",") if x.strip()]
        kept = [x for x in items if x not in names]
        return f"{m.group(1)}({', '.join(kept)}{',' if kept else ''})"

    def fix_target(m: re.Match) -> str:
        items = [x.strip() for x in m.group(2).split(",") if x.strip()]
        kept = [x for x in items if x not in names]
        if not kept:
            return m.group(1)
        return f"{m.group(1)}{', '.join(kept)}, = "

    source = re.sub(r"(return )\(([^()]*)\)", fix, source)
    return re.sub(r"(?m)^(\s*)((?:\w+, )*\w+),? = (?=\w+\(|mods\[|outs$)", fix_target, source)


def reduce_boundary(source: str, fails: Any, *, max_deletions: int = 60) -> str:
    """Delete statements (and the values they define from returns) while ``fails(source)``
    stays true: hypothesis shrinks draws, this shrinks the text."""
    for _ in range(max_deletions):
        changed = False
        lines = source.split("\n")
        for start, end in reversed(_chunks(lines)):
            chunk = lines[start:end]
            defined = set()
            m = re.match(r"\s*((?:\w+, )*\w+),? = ", chunk[0])
            if m:
                defined = {n.strip() for n in m.group(1).split(",")}
            candidate = "\n".join(lines[:start] + lines[end:])
            if defined:
                candidate = _drop_names(candidate, defined - {"x", "y", "w", "b", "idx",
                                                              "buf", "rm", "rv"})
            if candidate != source and fails(candidate):
                source, changed = candidate, True
                break
        if not changed:
            # drop returned values one by one (the loss weights shift; the failure may stay)
            m = re.search(r"def program\(.*\n(?:.*\n)*?    return \(([^()]*)\)", source)
            names = [x.strip() for x in m.group(1).split(",") if x.strip()] if m else []
            for n in names:
                candidate = _drop_names(source, {n})
                if candidate != source and fails(candidate):
                    source, changed = candidate, True
                    break
        if not changed:
            break
    # options no longer needed, then top-level blocks (regions, classes, policies) no
    # longer used
    for extra in (", allow_cache_entry_mutation=True",):
        candidate = source.replace(extra, "")
        if candidate != source and fails(candidate):
            source = candidate
    changed = True
    while changed:
        changed = False
        lines = source.split("\n")
        starts = [i for i, line in enumerate(lines) if line and not line[0].isspace()
                  and not (i and lines[i - 1].startswith("@"))]
        for a, z in zip(starts, starts[1:] + [len(lines)]):
            m = re.match(r"(?:@.*\n)?(?:def|class) (\w+)|(\w+) = ", "\n".join(lines[a:a + 2]))
            if not m:
                continue
            nm = m.group(1) or m.group(2)
            if nm in ("program", "after", "setup", "aten"):
                continue
            rest = "\n".join(lines[:a] + lines[z:])
            if re.search(rf"\b{nm}\b", rest):
                continue
            if fails(rest):
                source, changed = rest, True
                break
    return source


# ======================================================================================
# The cache family (gen.cache_programs): a persistent compile cache shared by processes
# ======================================================================================
#
# A batch of cache programs (module files) runs in three processes, each a fresh
# interpreter, all with one TORCHINDUCTOR_CACHE_DIR (AOTAutograd's and Inductor's
# persistent caches on; Inductor with our partitioner, sac_backend):
#
#   1. phase 0: each program compiled with its first value (fills the cache);
#   2. phase 1: each compiled with its second value ("warm"), then again with both caches
#      off ("cold");
#   3. phase 1 again ("again").
#
# Per program: warm must equal cold - the same tensors handed to backward (shapes and
# dtypes, in order: the split) and bitwise the same outputs and gradients - and warm never
# hits (the value changed). A policy whose value the identity rule names misses in 2 and
# hits in 3 (the key is stable across processes); one whose value it cannot name bypasses
# the caches in 2 and 3, and the sac_compile logger says so for its region. Cold gradients
# equal the program without regions (looser where the second value is bf16 hooks).

CACHE_PHASE_ENV = "SAC_FUZZ_CACHE_PHASE"
# set (by a test of the check itself): every policy gets one cache key, as a rule that
# ignored the values a policy reads would give - the check must then fail
CACHE_STALE_KEYS_ENV = "SAC_FUZZ_CACHE_STALE_KEYS"


def _break_policy_keys() -> None:
    from sac_compile.compiler import cache_keys
    cache_keys.policy_key = lambda policy: "one key for every policy"


def _fingerprint(t: torch.Tensor) -> str:
    import hashlib
    data = t.detach().contiguous().cpu().view(-1).view(torch.uint8)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()[:12]


def _saved_signature(loss: torch.Tensor) -> list:
    """What the compiled forwards hand to their backward: (shape, dtype, a hash of the
    bytes) of each tensor the autograd nodes of compiled graphs saved, in graph order - the
    split (a saved input and a saved output of the same shape tell apart by their bytes)."""
    seen, stack, out = set(), [loss.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "CompiledFunction" in node.name():
            out.append([(tuple(t.shape), str(t.dtype), _fingerprint(t))
                        for t in node.saved_tensors])
        stack.extend(n for n, _ in node.next_functions)
    return out


def _cache_step(fn: Any) -> dict:
    inputs = make_inputs(0)
    args = [inputs[k] for k in ("x", "y", "w", "b")]
    torch.manual_seed(1)
    outs = fn(*args)
    floats = [o for o in outs if o.is_floating_point()]
    loss = sum((o * (0.5 + 0.25 * i)).sum() for i, o in enumerate(floats))
    saved = _saved_signature(loss)
    loss.backward()
    return {"outs": [o.detach() for o in outs], "saved": saved,
            "grads": [a.grad for a in args]}


class _Lines(logging.Handler):
    """Keeps the messages logged."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: Any) -> None:
        self.lines.append(record.getMessage())


def _cache_compile(module: Any, region_name: str) -> dict:
    """Compile ``module.region`` with sac_backend and run one step: the step, the
    AOTAutograd cache counters' change, and whether the bypass line named the region."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    logger = logging.getLogger("sac_compile")
    handler, level = _Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    before = dict(counters["aot_autograd"])
    try:
        with _quiet():
            step = _cache_step(torch.compile(module.region, backend=sac_compile.sac_backend))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    step["cache"] = {k: counters["aot_autograd"].get("autograd_cache_" + k, 0) -
                     before.get("autograd_cache_" + k, 0) for k in ("hit", "miss", "bypass")}
    step["bypass_said"] = any("bypassed" in line and repr(region_name) in line
                              for line in handler.lines)
    return step


def cache_process(module_dir: str, names: list, phase: int, out_path: str) -> None:
    """One process of the batch (run by :func:`check_cache_batch` in a fresh interpreter):
    import each program module, compile it (phase 1: warm, then cold) and save the
    results."""
    import importlib
    import os
    sys.path.insert(0, module_dir)
    os.environ[CACHE_PHASE_ENV] = str(phase)
    if os.environ.get(CACHE_STALE_KEYS_ENV):
        _break_policy_keys()
    results: dict = {}
    for name in names:
        try:
            module = importlib.import_module(name)
            res = {"ref": _cache_step(module.body)}
            res["warm"] = _cache_compile(module, module.REGION_NAME)
            if phase == 1:
                with torch._functorch.config.patch(enable_autograd_cache=False), \
                        torch._inductor.config.patch(fx_graph_cache=False):
                    res["cold"] = _cache_compile(module, module.REGION_NAME)
                if any(res["cold"]["cache"].values()):
                    raise RuntimeError(f"the cold compile used the caches: {res['cold']['cache']}")
            results[name] = ("ok", res)
        except Exception as e:  # reported per program by the parent
            import traceback
            results[name] = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        torch.save(results, out_path)  # as it goes: a crash still leaves the earlier ones


def _run_cache_process(workdir: str, cache_dir: str, names: list, phase: int, tag: str,
                       timeout: float, stale_keys: bool = False) -> dict:
    import os
    import subprocess
    out_path = os.path.join(workdir, f"results_{tag}.pt")
    # both persistent caches on by default; no variable that forces them (the cold compile
    # turns them off by config, which a forcing variable would override)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir, TORCHINDUCTOR_COMPILE_THREADS="1")
    for name in (CACHE_PHASE_ENV, "TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE",
                 "TORCHINDUCTOR_FORCE_DISABLE_CACHES", "TORCH_COMPILE_FORCE_DISABLE_CACHES"):
        env.pop(name, None)
    env.pop(CACHE_STALE_KEYS_ENV, None)
    if stale_keys:
        env[CACHE_STALE_KEYS_ENV] = "1"
    fuzz_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from fuzzlib import harness; "
            "harness.cache_process(sys.argv[2], sys.argv[5:], int(sys.argv[3]), sys.argv[4])")
    proc = subprocess.run([sys.executable, "-c", code, fuzz_root, workdir, str(phase), out_path,
                           *names], capture_output=True, text=True, timeout=timeout, env=env)
    results = torch.load(out_path, weights_only=False) if os.path.exists(out_path) else {}
    if proc.returncode != 0:
        for name in names:
            results.setdefault(name, ("error", f"process {tag} exited with "
                                               f"{proc.returncode}:\n{proc.stderr[-3000:]}"))
    return results


@dataclasses.dataclass
class CacheOutcome:
    """One program's outcome: ``status`` "ok" or "failed" (then ``failure`` says why);
    ``split_changed``: the two values give different splits or gradients (the check had
    something to catch); ``cache``: process -> the AOTAutograd cache counters' change."""
    status: str
    failure: str = ""
    split_changed: bool = False
    cache: dict = dataclasses.field(default_factory=dict)


def _same_step(a: dict, b: dict) -> str:
    """Why steps ``a`` and ``b`` differ ("" when the split, outputs and gradients agree)."""
    if a["saved"] != b["saved"]:
        return f"the split differs: {a['saved']} vs {b['saved']}"
    for what in ("outs", "grads"):
        for i, (x, y) in enumerate(zip(a[what], b[what])):
            if (x is None) != (y is None) or (x is not None and not torch.equal(x, y)):
                return f"{what}[{i}] differ"
    return ""


def judge_cache(program: Any, runs: dict) -> CacheOutcome:
    """The outcome of one program from its results in the three processes (``runs``:
    "first", "second", "again" -> the process's result for it)."""
    for tag in ("first", "second", "again"):
        status, value = runs[tag]
        if status != "ok":
            return CacheOutcome("failed", f"process {tag} raised: {value}")
    first, second, again = (runs[t][1] for t in ("first", "second", "again"))
    warm, cold, rerun = second["warm"], second["cold"], again["warm"]
    cache = {"first": first["warm"]["cache"], "warm": warm["cache"], "cold": cold["cache"],
             "again": rerun["cache"]}
    changed = bool(_same_step(first["warm"], cold))
    outcome = CacheOutcome("ok", split_changed=changed, cache=cache)

    def fail(why: str) -> CacheOutcome:
        outcome.status, outcome.failure = "failed", why
        return outcome

    why = _same_step(warm, cold)
    if why:
        return fail(f"process 2 (second value, warm cache) is not a cold compile: {why}; "
                    f"cache {warm['cache']}")
    why = _same_step(rerun, cold)
    if why:
        return fail(f"process 3 (second value again) is not a cold compile: {why}; "
                    f"cache {rerun['cache']}")
    if warm["cache"]["hit"]:
        return fail(f"process 2 hit the cache although the value changed: {warm['cache']}")
    if program.named:
        if warm["cache"]["miss"] != 1 or rerun["cache"]["hit"] != 1:
            return fail(f"a value the identity rule names: expected a miss then a hit, got "
                        f"{warm['cache']} then {rerun['cache']}")
    else:
        for tag, run_ in (("2", warm), ("3", rerun)):
            if run_["cache"]["bypass"] < 1 or run_["cache"]["hit"]:
                return fail(f"a value the identity rule cannot name: process {tag} should "
                            f"bypass the caches, got {run_['cache']}")
            if not run_["bypass_said"]:
                return fail(f"process {tag} bypassed the caches without the log line naming "
                            f"the region")
    tol = dict(rtol=5e-2, atol=5e-2) if program.values[1] == "bf16" else \
        dict(rtol=1e-4, atol=1e-5)
    ref = second["ref"]
    for what in ("outs", "grads"):
        for i, (x, y) in enumerate(zip(cold[what], ref[what])):
            if x is None and y is None:
                continue
            try:
                torch.testing.assert_close(x, y, **tol)
            except AssertionError as e:
                return fail(f"cold compile: {what}[{i}] differ from no checkpointing: {e}")
    return outcome


def check_cache_batch(programs: list, workdir: str, *, timeout: float = 1800,
                      stale_keys: bool = False) -> list:
    """Run ``programs`` (gen.CacheProgram, each with its own region name) through the
    three processes; returns their :class:`CacheOutcome` in order. ``stale_keys``: the
    processes key every policy alike (the check must catch it)."""
    import os
    names = []
    for i, program in enumerate(programs):
        name = f"sac_fuzz_cache_{i}"
        with open(os.path.join(workdir, name + ".py"), "w") as f:
            f.write(program.source)
        names.append(name)
    cache_dir = os.path.join(workdir, "inductor_cache")
    runs = {tag: _run_cache_process(workdir, cache_dir, names, phase, tag, timeout,
                                    stale_keys)
            for tag, phase in (("first", 0), ("second", 1), ("again", 1))}
    return [judge_cache(p, {tag: runs[tag].get(n, ("error", "no result"))
                            for tag in runs}) for p, n in zip(programs, names)]


def repro_cache(program: Any) -> str:
    """A script that reruns the three-process check of one cache program (from the repo
    root); the program's module source is in it."""
    return (f"# Rerun of a sac_compile cache-fuzz failure: kind {program.kind!r}, target "
            f"{program.target}, values {program.values}.\n"
            f"# Save as repro.py, run from the repo root: python repro.py\n"
            f"import sys, tempfile\nsys.path.insert(0, 'tests')\n"
            f"from fuzzlib import gen, harness\n\n"
            f"SOURCE = {program.source!r}\n\n"
            f"program = gen.CacheProgram(SOURCE, {program.kind!r}, {program.target!r}, "
            f"{program.values!r}, {program.via_helper!r})\n"
            f"with tempfile.TemporaryDirectory() as workdir:\n"
            f"    print(harness.check_cache_batch([program], workdir))\n")
