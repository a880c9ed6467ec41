"""``torch.compile`` backends that partition with :class:`SACPartitioner`.

* ``compiler="inductor"``: Inductor's ``compile_fx`` with ``custom_partitioner_fn`` set, so
  all of Inductor's joint-graph passes (RNG seeding, pattern matching) run first.
  ``mode=``/``options=`` mean what they mean for ``backend="inductor"`` (torch's own mode
  table and option checks), given to ``make_backend`` or to ``torch.compile`` (which
  passes them on as keyword arguments); ``torch.compile``'s ``mode`` replaces the
  backend's (torch passes no ``mode="default"`` on), its ``options`` are laid over the
  backend's.
* ``compiler="aot_eager"``: AOTAutograd with our partitioner and no code generation; like
  torch's ``aot_eager`` it ignores ``torch.compile``'s ``mode``/``options`` (with torch's
  log warning), and refuses them in ``make_backend``.

Both give each of our regions in Dynamo's graph the ``cache_hash`` AOTAutograd's cache
needs (:mod:`.cache_keys`), so a warm compile is a cache hit - unless an ``on_partition``
callback asks for reports: a cache hit skips the partitioner, hence its report, so then
those graphs bypass AOTAutograd's cache (Inductor's FX graph cache still applies); so do
those under a PeakBudget fraction (a split under a PeakBudget in bytes that the cache
serves is measured, :mod:`.measured_fit`).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from ..report import PartitionReport
from ..torch_internals import (AotAutograd, CustomGraphPass, TorchCompileInductorWrapper,
                               get_hash_for_files)
from .budget_runs import counted, whole_model_peak
from .measured_fit import cache_may_serve, fit_measured
from .cache_keys import annotate_regions
from .regions_compiled import name_regions
from .near_fusion import near_fusion_patches
from .normalize import remove_markers
from .partition import SACPartitioner, ops_key
from .tagging import sac_partitioning

__all__ = ["make_backend", "sac_backend"]


def make_backend(*, compiler: str = "inductor", mode: str | None = None,
                 options: dict[str, Any] | None = None,
                 memory_budget: float | int | str | None = None,
                 solver: str | None = None,
                 on_partition: Callable[[PartitionReport], Any] | None = None,
                 **partitioner_options: Any) -> Callable[..., Any]:
    """A backend for ``torch.compile(model, backend=...)``; see the module docstring.
    ``mode``/``options``: Inductor's, as ``torch.compile``'s (``compiler="inductor"``).
    Other keywords are :class:`SACPartitioner`'s (``cost_model``, ``cse``,
    ``delegate_untagged``, ``offload_options``), or its options as one value,
    ``config=PartitionerConfig(...)`` (:mod:`.options`); either way checked here, naming
    the field."""
    _check_partitioner_options(partitioner_options)
    partitioner = SACPartitioner(solver=solver, memory_budget=memory_budget,
                                 on_partition=on_partition, **partitioner_options)
    if compiler == "inductor":
        inductor_patches(partitioner, mode, options)  # torch's checks, now rather than later
        default_mode, default_options = mode, dict(options or {})

        def sac_inductor(gm: torch.fx.GraphModule, example_inputs: list[Any], *,
                         mode: str | None = None, options: dict[str, Any] | None = None) -> Any:
            from ..torch_internals import compile_fx
            patches = inductor_patches(partitioner, default_mode if mode is None else mode,
                                       {**default_options, **(options or {})} or None)
            _let_caches_serve(gm, partitioner)
            with sac_partitioning(), _closing_checkpoints_on_error():
                return counted(gm, fit_measured(
                    lambda: compile_fx(gm, example_inputs, config_patches=patches),
                    example_inputs, partitioner, whole_model_peak(gm), ops_key(gm)))

        backend = sac_inductor
    elif compiler == "aot_eager":
        if mode is not None or options is not None:
            raise ValueError(
                f"make_backend(compiler='aot_eager', mode={mode!r}, options={options!r}): "
                "aot_eager generates no code, so Inductor's mode and options would do "
                "nothing; use make_backend(compiler='inductor', mode=..., options=...)")
        # torch's aot_eager compiler: boxed code that clears its argument list and frees
        # each value after its last use. (make_boxed_func(gm.forward) kept every saved
        # activation alive until the backward returned: +22% peak without checkpointing.)
        from ..torch_internals import boxed_nop

        def _boxed(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
            remove_markers(gm.graph)  # an inference graph: never partitioned
            return boxed_nop(gm, example_inputs)  # (recompiles gm)

        backend = _SACAotAutograd(fw_compiler=_boxed, bw_compiler=_boxed,
                                  partition_fn=partitioner)
        backend.__name__ = "sac_aot_eager"  # type: ignore[attr-defined]
    else:
        raise ValueError(f"compiler must be 'inductor' or 'aot_eager', got {compiler!r}")
    backend.partitioner = partitioner  # type: ignore[attr-defined]
    return backend


def _check_partitioner_options(given: dict[str, Any]) -> None:
    """A keyword neither ``make_backend``'s nor the partitioner's: a ``TypeError`` that
    names ``make_backend`` and lists what it takes (not ``SACPartitioner.__init__``)."""
    import inspect
    known = [n for n in inspect.signature(SACPartitioner.__init__).parameters
             if n not in ("self", "solver", "memory_budget", "on_partition")]
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise TypeError(
            f"make_backend() got unexpected keyword argument(s) {unknown}; it takes "
            "compiler, mode, options (Inductor's, as torch.compile's), memory_budget, "
            f"solver, on_partition and the partitioner's {', '.join(known)}")


class _SACAotAutograd(AotAutograd):
    """``aot_autograd(...)`` whose joint graphs are known, while they are traced, to be
    split by our partitioner (regions then do not warn that they need it)."""

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        _let_caches_serve(gm, self.kwargs["partition_fn"])
        with sac_partitioning(), _closing_checkpoints_on_error():
            return counted(gm, super().__call__(gm, example_inputs, **kwargs))


@contextlib.contextmanager
def _closing_checkpoints_on_error() -> Any:
    """An error raised while a region's forward is traced leaves the region's tagging mode
    entered on torch < 2.13 (see :func:`.regions_compiled.close_checkpoints_left_open`)."""
    try:
        yield
    except BaseException as e:
        from .regions_compiled import close_checkpoints_left_open
        close_checkpoints_left_open(e)
        raise


def _let_caches_serve(gm: torch.fx.GraphModule, partitioner: Any) -> None:
    """Name each region of Dynamo's graph (regions of one group share a token); key our
    regions for AOTAutograd's cache, unless reports are asked for (a hit would skip the
    partitioner and its ``on_partition`` call), the partitioner is not ours, or its budget
    is a PeakBudget fraction (:func:`.measured_fit.cache_may_serve`: a split under a
    PeakBudget in bytes that the cache serves is measured as a fresh one is)."""
    name_regions(gm)
    if isinstance(partitioner, SACPartitioner) and partitioner.on_partition is None and \
            cache_may_serve(partitioner.memory_budget):
        annotate_regions(gm)


def inductor_patches(partitioner: SACPartitioner, mode: str | None,
                     options: dict[str, Any] | None) -> dict[str, Any]:
    """Inductor's config patches for ``torch.compile(mode=mode, options=options)`` - read
    by torch's own ``_TorchCompileInductorWrapper``, which checks names and types - plus our
    partitioner and marker-removal pass (chained before a ``post_grad_custom_pre_pass``
    the options or the config set)."""
    from ..torch_internals import inductor_config as config
    patches = dict(TorchCompileInductorWrapper(mode, options, dynamic=None).config)
    if "custom_partitioner_fn" in patches:
        raise ValueError("options={'custom_partitioner_fn': ...} replaces sac_compile's "
                         "partitioner; use backend='inductor' for that, or pass the "
                         "partitioner's options to sac_compile.make_backend(...)")
    then = patches.get("post_grad_custom_pre_pass", config.post_grad_custom_pre_pass)
    patches["custom_partitioner_fn"] = partitioner
    patches["post_grad_custom_pre_pass"] = RemoveMarkers(then)
    return near_fusion_patches(config, patches)


class RemoveMarkers(CustomGraphPass):
    """Inductor post-grad pass: drop tag()/name() markers left in graphs that were never
    partitioned (inference). Joint graphs lose them in the partitioner. Runs the pass the
    user configured, if any, afterwards."""

    def __init__(self, then: Any = None) -> None:
        self.then = then

    def __call__(self, graph: torch.fx.Graph) -> None:
        remove_markers(graph)
        if self.then is not None:
            self.then(graph)

    def uuid(self) -> Any:
        # None asks Inductor not to cache the graph: so it is when the user's pass asks it,
        # or has no uuid() to say what it does (a plain function)
        own = get_hash_for_files((__file__,)).hex()
        if self.then is None:
            return (own, None)
        then = self.then.uuid() if isinstance(self.then, CustomGraphPass) else None
        return None if then is None else (own, then)


def sac_backend(gm: torch.fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Any:
    """Inductor with the SAC partitioner: ``torch.compile(model, backend=sac_backend)``;
    ``mode=`` and ``options=`` of ``torch.compile`` are Inductor's."""
    return _default()(gm, example_inputs, **kwargs)


_DEFAULT: list[Callable[..., Any]] = []


def _default() -> Callable[..., Any]:
    if not _DEFAULT:
        _DEFAULT.append(make_backend())
    return _DEFAULT[0]
