"""Every private torch API sac_compile uses, under a stable name, and every torch version gate.

No other module of the package imports a private torch module (``torch._*``,
``torch.utils._pytree``, ...) or reads a private attribute of a torch module
(``torch._C._...``, ``torch.utils.checkpoint._...``): ``tests/test_torch_internals.py`` walks
the package's syntax trees and fails on one. The frame peeks and the rebinding of torch's
``warning_once`` live apart, in :mod:`sac_compile.torch_patches`.

Each name below says what we use it for, the torch versions it was verified on (2.11 and
2.13 unless said) and what breaks if it changes. Two kinds:

* **Bound at import**: modules that ``import torch`` has already loaded (``torch._ops``,
  ``torch._C``, ``torch.utils._pytree``, ...), which exist on every supported torch. Free.
* **Lazy** (:data:`_LAZY`): the rest, and every API some supported torch lacks. Imported
  when first asked for (``from sac_compile.torch_internals import compile_fx`` inside the
  function that uses it, as before), so importing ``sac_compile`` loads no Inductor, no
  partitioner and no Dynamo it did not load before. A name this torch lacks raises
  :class:`TorchAPIMissing` naming the torch version that has it, at use, never at import.
  Unless its comment says what its caller falls back to (the names a supported torch lacks:
  ``needs`` above 2.11), that is what breaks if torch renames one: the feature using it
  fails loudly, naming it, instead of misbehaving.

This module imports nothing from ``sac_compile``: it is the bottom of the package.
"""
from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
import torch.utils.checkpoint as _checkpoint
from torch._functorch._aot_autograd.utils import is_with_effects
from torch._library.fake_class_registry import FakeScriptObject
from torch._ops import HigherOrderOperator, OpOverload, OpOverloadPacket
from torch._ops import _OpNamespace as OpNamespace
from torch.fx.experimental._backward_state import BackwardState
from torch.utils import _pytree as pytree
from torch.utils._ordered_set import OrderedSet
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["TorchAPIMissing", "TORCH_VERSION", "ID_GUARDS_FUNCTIONS",
           "CONSTANT_RESULT_TAKES_OBJECTS", "OpOverload", "OpOverloadPacket",
           "HigherOrderOperator", "OpNamespace", "pytree", "TorchDispatchMode",
           "is_with_effects", "FakeScriptObject", "BackwardState", "OrderedSet",
           "get_dispatch_mode", "TorchDispatchModeKey", "dispatch_tls_local_include_set",
           "dispatch_tls_local_exclude_set", "ForceDispatchKeyGuard", "current_autograd_node",
           "peek_interpreter_stack", "SAC_RECOMPUTE_MARKER", "sac_storage_key",
           "config_default", "dynamo_backend_registered", "register_dynamo_backend",
           "dynamo_recompile_limits", "offload_ops", "symbolic_hint", "mark_dynamo_opaque",
           "profiler_memory_events", "aot_mutated_inputs",
           "queue_backward_callback"]  # and the lazy names of _LAZY, which
# ``import *`` leaves out: it would import them all


class TorchAPIMissing(RuntimeError):
    """This torch lacks a private API sac_compile uses: ``where`` (the module and name),
    ``needs`` (the oldest torch that has it), ``error`` (what the import raised)."""

    def __init__(self, where: str, needs: str, error: BaseException,
                 message: str | None = None) -> None:
        super().__init__(message or f"sac_compile: torch {TORCH_VERSION} lacks {where} (it "
                         f"needs torch >= {needs}; {type(error).__name__}: {error})")
        self.where, self.needs, self.error = where, needs, error


# -- version gates ----------------------------------------------------------------------
# Gate on features where a feature can be probed; these are behaviours of Dynamo that no
# attribute shows, so they are gated on the version that changed them.

TORCH_VERSION: str = torch.__version__
_VERSION = torch.torch_version.TorchVersion(torch.__version__)

#: Dynamo's ``id()`` guard on a function guards it by identity from torch 2.13 on; before,
#: only other objects (``markers.py`` then also guards the SaveWithHooks holding it). If
#: wrong: hooks with other functions but equal code share a compiled graph (< 2.13), or a
#: needless guard (>= 2.13).
ID_GUARDS_FUNCTIONS: bool = _VERSION >= (2, 13)

#: From torch 2.12, Dynamo calls an ``assume_constant_result`` function with an object
#: argument (a policy) as it is, guarded by identity; 2.11's asks the object for a Python
#: constant and fails. Gates probing a region's hooks while traced
#: (``compiler/regions_compiled.py``). If wrong: a trace error on 2.11, or on >= 2.12
#: untraceable hooks raise the partitioner's error instead of running eagerly.
CONSTANT_RESULT_TAKES_OBJECTS: bool = _VERSION >= (2, 12)


#: Dynamo's ``body.meta["_checkpoint_context_fn"]`` key is owned by ``graph_meta`` (every
#: node/module meta key is there): :data:`sac_compile.graph_meta.CHECKPOINT_CONTEXT_FN`.


# -- bound at import (loaded by ``import torch``, present on 2.11 and 2.13) ---------------
# torch._ops: the op classes every isinstance test on an op uses (OpOverload, its packet,
# higher-order ops; _OpNamespace is ``torch.ops.aten``'s type, for policy identity). A rename
# breaks every op test in both engines, loudly (an ImportError here).
# torch.utils._pytree: tree_leaves/tree_flatten/tree_map/tree_unflatten over op arguments
# and outputs (torch's own flattening, so nested outputs match what dispatch sees).
# torch.utils._python_dispatch.TorchDispatchMode: the base of the eager recorder, the
# compile-time tagging mode and the live-bytes meter (the same class torch's SAC uses).
# Asked per node of a joint graph, so bound here rather than lazy: is_with_effects (a
# with_effects node: never recomputed), BackwardState (compiled autograd's) and
# FakeScriptObject (values that cost nothing to keep), OrderedSet (the node sets torch's
# partitioner and offload pass take). A change: the cut's network or extraction fails.

# torch._C dispatch state. get_dispatch_mode/TorchDispatchModeKey: is a proxy (make_fx),
# fake or functional mode active (the tagging mode's "are we tracing?"). The TLS key sets
# and ForceDispatchKeyGuard: the eager recorder detaches saved values under its caller's
# dispatch keys, so they share the version counter (a wrong guard: in-place changes after
# a region go unseen). current_autograd_node: names the backward node in an in-place error.
# peek_interpreter_stack: is a torch.func transform active (regions refuse, with a message).
get_dispatch_mode = torch._C._get_dispatch_mode
TorchDispatchModeKey = torch._C._TorchDispatchModeKey
dispatch_tls_local_include_set = torch._C._dispatch_tls_local_include_set
dispatch_tls_local_exclude_set = torch._C._dispatch_tls_local_exclude_set
ForceDispatchKeyGuard = torch._C._ForceDispatchKeyGuard
current_autograd_node = torch._C._current_autograd_node
peek_interpreter_stack = torch._C._functorch.peek_interpreter_stack

# torch.utils.checkpoint internals, for the benchmark's instrumented torch SAC
# (``_bench/measure.py``; the mode, the bool -> policy rule and the cached-value wrapper are
# lazy names below). _RECOMPUTE (the marker a 2.13 forward leaves per recomputed call) and
# _sac_storage_key are 2.13's; None / the 2.11 rule before. If they change, the benchmark's
# "torch SAC" rows miscount recomputes.
SAC_RECOMPUTE_MARKER: Any = getattr(_checkpoint, "_RECOMPUTE", None)
sac_storage_key: Any = getattr(_checkpoint, "_sac_storage_key", lambda func, args: func)


# -- lazy -------------------------------------------------------------------------------
class _Entry(NamedTuple):
    module: str
    attr: str | None  # None: the module itself
    needs: str = "2.11"  # the oldest torch that has it


_LAZY: dict[str, _Entry] = {
    # What ``torch.compile(mode=, options=)`` turns into Inductor config patches, with
    # torch's own checks of names and types (``make_backend`` passes the same). If it
    # changes, ``make_backend(compiler="inductor", mode=...)`` fails at construction.
    "TorchCompileInductorWrapper": _Entry("torch", "_TorchCompileInductorWrapper"),
    # torch SAC's recompute-side mode, bool -> policy rule, cached-value wrapper (benchmark).
    "CachedTorchDispatchMode": _Entry("torch.utils.checkpoint", "_CachedTorchDispatchMode"),
    "policy_from_bool": _Entry("torch.utils.checkpoint", "_policy_from_bool"),
    "VersionWrapper": _Entry("torch.utils.checkpoint", "_VersionWrapper"),
    # Dynamo (loaded by ``import sac_compile`` today only through ShortenTraceback).
    # ShortenTraceback: base of CompiledCheckpointError, which Dynamo lets through unwrapped
    # (else users get BackendCompilerFailed instead of our CheckpointError).
    "ShortenTraceback": _Entry("torch._dynamo.exc", "ShortenTraceback"),
    # disable: keeps Dynamo out of the eager runtime's hooks and `with sac_region` blocks;
    # reset: the benchmark after a failed compile; graph_break: a region whose hooks cannot
    # be traced leaves the graph and runs eagerly.
    "dynamo_disable": _Entry("torch._dynamo", "disable"),
    "dynamo_reset": _Entry("torch._dynamo", "reset"),
    "dynamo_graph_break": _Entry("torch._dynamo", "graph_break"),
    # Dynamo's config: the recompile limit is raised to fit our region groups (see
    # dynamo_recompile_limits).
    "dynamo_config": _Entry("torch._dynamo.config", None),
    # compiled autograd's state: the eager runtime's unpack hook asks whether it traces.
    "compiled_autograd": _Entry("torch._dynamo.compiled_autograd", None),
    # Marks the eager runtime's per-op frames "skip" for Dynamo (free per call); without it
    # Dynamo tries to trace them, recompiles and warns.
    "set_code_exec_strategy": _Entry("torch._dynamo.eval_frame", "set_code_exec_strategy"),
    "FrameAction": _Entry("torch._dynamo.types", "FrameAction"),
    "FrameExecStrategy": _Entry("torch._dynamo.types", "FrameExecStrategy"),
    # Our aot_eager backend: AOTAutograd's backend class and torch's boxed no-op compiler
    # (frees each value after its last use).
    "AotAutograd": _Entry("torch._dynamo.backends.common", "AotAutograd"),
    "boxed_nop": _Entry("torch._dynamo.backends.debugging", "boxed_nop"),
    "dynamo_backend_registry": _Entry("torch._dynamo.backends.registry", None),
    # Configs we read or patch: functorch's (activation_memory_budget, offload flags,
    # enable_autograd_cache) and Inductor's (custom_partitioner_fn,
    # post_grad_custom_pre_pass, fallback_random).
    "functorch_config": _Entry("torch._functorch.config", None),
    # Dynamo's counters: AOTAutograd's cache counts its hits in them ("aot_autograd",
    # "autograd_cache_hit"); a graph it served was split in an earlier compile, which the
    # measured check of a PeakBudget measures again (compiler/measured_fit.py).
    "dynamo_counters": _Entry("torch._dynamo.utils", "counters"),
    # Whether a profiler is running: the measured check of a PeakBudget under Inductor
    # measures with one on the CPU, and does not start a second (2.11-2.13).
    "profiler_enabled": _Entry("torch._C._autograd", "_profiler_enabled"),
    "inductor_config": _Entry("torch._inductor.config", None),
    # Inductor: our inductor backend compiles with compile_fx; SACPartitioner is a
    # CustomPartitionerFn and RemoveMarkers a CustomGraphPass (their uuid() is how Inductor's
    # caches key us; get_hash_for_files makes it).
    "compile_fx": _Entry("torch._inductor.compile_fx", "compile_fx"),
    "CustomPartitionerFn": _Entry("torch._inductor.custom_graph_pass", "CustomPartitionerFn"),
    "CustomGraphPass": _Entry("torch._inductor.custom_graph_pass", "CustomGraphPass"),
    "get_hash_for_files": _Entry("torch._inductor.custom_graph_pass", "get_hash_for_files"),
    # The scheduler passes (CustomSchedulerPass, run before and after fusion) that put
    # compiler/near_fusion.py's fusion veto in front of Inductor's choices handler (V,
    # torch._inductor.virtualized) while one graph fuses. Verified on 2.13 only; a torch
    # without them compiles without the veto (near_fusion_patches returns the patches as
    # given), so a change costs Inductor's peak on traversals that share parameters.
    "CustomSchedulerPass": _Entry("torch._inductor.custom_graph_pass", "CustomSchedulerPass",
                                  "2.13"),
    "inductor_virtualized": _Entry("torch._inductor.virtualized", None),
    # The ops Inductor runs as fallback kernels (compiler/inductor_alloc.py: their outputs
    # read from a CPU graph input are unaligned, and Inductor never reuses those storages).
    "inductor_fallbacks": _Entry("torch._inductor.lowering", "fallbacks"),
    # Tracing SaveWithHooks into the graphs: make_fx with Inductor's decompositions, and
    # the fake tensor's metadata for the traced values.
    "fwd_only": _Entry("torch._inductor.pattern_matcher", "fwd_only"),
    "select_decomp_table": _Entry("torch._inductor.decomposition", "select_decomp_table"),
    "extract_tensor_metadata": _Entry("torch._subclasses.fake_tensor",
                                      "extract_tensor_metadata"),
    "FakeTensorMode": _Entry("torch._subclasses.fake_tensor", "FakeTensorMode"),
    # CPU offload under compile: torch's activation-offloading pass (the async ao ops it
    # emits are 2.12's: offload_ops).
    "enable_activation_offloading": _Entry(
        "torch._functorch._activation_offloading.activation_offloading",
        "enable_activation_offloading", "2.12"),
    "can_offload": _Entry("torch._functorch._activation_offloading.activation_offloading",
                          "can_offload", "2.12"),
    # The partitioner: torch's min-cut one (delegation, the benchmark's comparison), and the
    # pieces ours shares with it - which outputs are forward/backward, what must stay on
    # each side, the default recomputable ops, the module extraction and RNG
    # functionalisation. A signature change here breaks SACPartitioner's split.
    "min_cut_rematerialization_partition": _Entry("torch._functorch.partitioners",
                                                  "min_cut_rematerialization_partition"),
    "extract_fwd_bwd_modules": _Entry("torch._functorch.partitioners",
                                      "_extract_fwd_bwd_modules"),
    "extract_fwd_bwd_outputs": _Entry("torch._functorch.partitioners",
                                      "_extract_fwd_bwd_outputs"),
    "must_be_in_backward": _Entry("torch._functorch.partitioners", "_must_be_in_backward"),
    "must_be_in_forward": _Entry("torch._functorch.partitioners", "_must_be_in_forward"),
    "get_default_op_list": _Entry("torch._functorch.partitioners", "get_default_op_list"),
    "functionalize_rng_ops": _Entry("torch._functorch.partitioners", "functionalize_rng_ops"),
    # A symbolic bool used only by asserts is not saved (2.13; older: none are skipped).
    "is_assert_only_symbool": _Entry("torch._functorch.partitioners",
                                     "_is_assert_only_symbool", "2.13"),
    "fx_graph_cse": _Entry("torch._functorch.compile_utils", "fx_graph_cse"),
    # Opaque objects handed to the backward as torch does (2.13; 2.11 has none).
    "is_opaque_node": _Entry("torch._functorch._aot_autograd.graph_compile",
                             "is_opaque_node", "2.13"),
    # AOTAutograd's input/output descriptors: the roles of joint-graph placeholders
    # (tangent, parameter, RNG seed) and which forward outputs are input mutations.
    "aot_descriptors": _Entry("torch._functorch._aot_autograd.descriptors", None),
    "InputMutationAOTOutput": _Entry("torch._functorch._aot_autograd.descriptors",
                                     "InputMutationAOTOutput"),
    # Effectful ops (registered effects; is_with_effects, above): never recomputed.
    "has_effects": _Entry("torch._higher_order_ops.effects", "has_effects"),
    # torch's region_activation_memory_budget annotation on nodes (2.13).
    "get_memory_budget_annotation": _Entry("torch.fx.traceback",
                                           "_get_memory_budget_annotation", "2.13"),
    # As under Dynamo: graph modules generate their code when first called (partition time).
    "use_lazy_graph_module": _Entry("torch.fx._lazy_graph_module", "_use_lazy_graph_module"),
    # The functionalised random op of the backward: names the op a replay re-runs.
    "run_with_rng_state": _Entry("torch._prims.rng_prims", "run_with_rng_state"),
    # torch's logging registry: our log and the sac_partition artifact are registered like
    # torch's own (log_registry, register_log, register_artifact, getArtifactLogger,
    # log_state, configure_artifact_log, DEFAULT_FORMATTER). logs.py falls back to plain
    # loggers if any of it is gone.
    "torch_logging": _Entry("torch._logging._internal", None),
    # The module whose warning_once torch_patches rebinds (tag_activation_checkpoint).
    "checkpoint_hop_module": _Entry("torch._higher_order_ops.wrap", None),
}


def __getattr__(name: str) -> Any:
    """A lazy name of :data:`_LAZY`, imported now (not cached here: a module torch lacks,
    or one a test hides, is looked up again on every use)."""
    entry = _LAZY.get(name)
    if entry is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module_name, attr, needs = entry
    try:
        module = sys.modules.get(module_name) or importlib.import_module(module_name)
        return module if attr is None else getattr(module, attr)
    except (ImportError, AttributeError) as e:
        raise TorchAPIMissing(module_name + (f".{attr}" if attr else ""), needs, e) from e


def offload_ops() -> tuple[Any, Any, Any]:
    """``torch.ops.ao.offload/reload/wait_tensor.default`` (torch >= 2.12), the async copies
    torch's offload pass emits; :class:`TorchAPIMissing` before."""
    try:
        return (torch.ops.ao.offload.default, torch.ops.ao.reload.default,
                torch.ops.ao.wait_tensor.default)
    except (AttributeError, RuntimeError) as e:
        raise TorchAPIMissing("torch.ops.ao.offload / reload / wait_tensor", "2.12", e) from e


def mark_dynamo_opaque(fn: Any, reason: str) -> None:
    """Dynamo calls ``fn`` as an opaque function (a graph break), as for
    ``torch._dynamo.disable(fn)``, without its wrapper (a frame and two eval-frame swaps per
    call): the flag that wrapper carries, set on ``fn`` itself (``_torchdynamo_disable``,
    read by Dynamo's function variables, 2.11-2.13; its message only where read)."""
    fn._torchdynamo_disable = True
    fn._torchdynamo_disable_msg = reason


@contextlib.contextmanager
def aot_mutated_inputs(num_inputs: int) -> Iterator[list[frozenset[int] | None]]:
    """Around one AOTAutograd compile of a graph with ``num_inputs`` inputs: yields a list
    whose one item, after the ``with``, is the positions of the inputs the compiled graph
    writes (their data or their metadata), from AOTAutograd's own analysis (the tracing
    context's ``fw_metadata.input_info``, set for the compile and read by Inductor and
    DDP's backend the same way, 2.11-2.13); ``None`` where that is not known (no tracing
    context, no metadata, or an input list AOTAutograd changed: duplicate inputs removed,
    aliased ones merged), which the caller must read as "any input may be written"."""
    from torch._guards import TracingContext
    context = TracingContext.try_get()
    found: list[frozenset[int] | None] = [None]
    if context is None or not hasattr(context, "fw_metadata"):
        yield found
        return
    context.fw_metadata = None  # (this compile's, not an earlier graph's)
    yield found
    info = getattr(context.fw_metadata, "input_info", None)
    if info is not None and len(info) == num_inputs:
        found[0] = frozenset(i for i, a in enumerate(info)
                             if a.mutates_data or a.mutates_metadata)


def queue_backward_callback(fn: Any) -> None:
    """Run ``fn()`` when the backward now running is over (the autograd engine's final
    callbacks, ``Variable._execution_engine.queue_callback``, as FSDP uses them; 2.11-2.13).
    Only from inside a backward (a gradient hook); an exception ``fn`` raises leaves
    ``backward()`` with it."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def symbolic_hint(value: Any, *, fallback: int) -> Any:
    """The hint of a symbolic size (its example value) without guarding on it:
    ``symbolic_shapes.optimization_hint``, or on torch 2.11 (which lacks it) ``size_hint``,
    which reads the hint the same way (a feature probe, not a version)."""
    shapes = torch.fx.experimental.symbolic_shapes
    get_hint = getattr(shapes, "optimization_hint", None) or shapes.size_hint
    return get_hint(value, fallback=fallback)


def profiler_memory_events(prof: Any) -> list[tuple[int, int, str, str, int]]:
    """Every allocation and free a finished ``torch.profiler.profile(profile_memory=True)``
    recorded, and every op or ``record_function`` range: ``(start_ns, nbytes, device, name,
    address)``, ``nbytes`` signed (negative: freed) and 0 for a range, ``device`` the
    device type (``"cpu"``), ``address`` the block's (0 for a range). Read from the
    profiler's event tree (``prof.profiler.kineto_results.experimental_event_tree()``,
    events of ``torch._C._profiler._EventType.Allocation`` and their ``extra_fields``
    ``ptr``/``alloc_size``/``device``; what torch's own memory profiler reads; 2.11 and
    2.13), not ``prof.events()``: that attributes allocations to the op that made them and
    keeps as ``[memory]`` events only what no op owns (frees, mostly), without addresses.
    If they change, :mod:`sac_compile.measured_peak` fails loudly here."""
    from torch._C._profiler import _EventType
    # Pre-order (each list of children is in time order), so that events of one timestamp
    # keep the order they happened in when the caller sorts by time.
    out, stack = [], list(reversed(prof.profiler.kineto_results.experimental_event_tree()))
    while stack:
        e = stack.pop()
        stack.extend(reversed(e.children))
        if e.tag == _EventType.Allocation:
            f = e.extra_fields
            out.append((int(e.start_time_ns), int(f.alloc_size), str(f.device.type),
                        "[memory]", int(f.ptr)))
        else:
            out.append((int(e.start_time_ns), 0, "cpu", e.name, 0))
    return out


def config_default(config: Any, flag: str) -> Any:
    """torch's own default of a config module's ``flag`` (its ``_config`` entries). Not
    ``config._is_default``: a ``config.patch`` marks the flag overridden even after it
    restores the value. If ``_config`` goes, this returns None: every set flag then reads as
    the user's choice."""
    entry = getattr(config, "_config", {}).get(flag)
    return getattr(entry, "default", None)


def dynamo_backend_registered(name: str) -> bool:
    """Whether Dynamo's backend registry knows ``name``, registered or found as an entry
    point not yet loaded (its ``_COMPILER_FNS`` and ``_BACKENDS``)."""
    registry = __getattr__("dynamo_backend_registry")
    return name in registry._COMPILER_FNS or registry._BACKENDS.get(name) is not None


def register_dynamo_backend(name: str, fn: Any) -> None:
    __getattr__("dynamo_backend_registry").register_backend(compiler_fn=fn, name=name)


def dynamo_recompile_limits() -> tuple[Any, str, str]:
    """Dynamo's config and the names of its per-code and accumulated recompile limits:
    ``recompile_limit``/``accumulated_recompile_limit``, or the older
    ``cache_size_limit``/``accumulated_cache_size_limit`` (a feature probe, not a version).
    The accumulated one may be absent (check with ``hasattr``)."""
    config = __getattr__("dynamo_config")
    per_code = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    total = "accumulated_recompile_limit" if hasattr(config, "accumulated_recompile_limit") \
        else "accumulated_cache_size_limit"
    return config, per_code, total
