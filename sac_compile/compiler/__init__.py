"""The compiled half of sac_compile: tags on the joint graph, the SAC min-cut partitioner
and the ``torch.compile`` backends.

Modules, one concern each:

* :mod:`.tagging` - the dispatch mode that writes each op's decision into the joint graph;
  the ``sac_compile::tag`` / ``sac_compile::name`` marker ops.
* :mod:`.roles` - what a graph input is (forward input, parameter, tangent, RNG state).
* :mod:`.normalize` - the FX passes that turn the raw tags into final decisions.
* :mod:`.costs` - bytes, FLOPs and memory traffic of one node.
* :mod:`.network` - the flow network and its objective (the formulation, one screen).
* :mod:`.solvers` - scipy's and networkx's max-flow, and the minimum cut they give.
* :mod:`.budget` - what a memory budget is, and the search for the cut that meets it.
* :mod:`.reasons` - why a value is saved or cannot be recomputed: a kind and a text.
* :mod:`.partition` - :class:`SACPartitioner`, torch's ``CustomPartitionerFn``.
* :mod:`.backend` - ``sac_backend`` and ``make_backend``.
* :mod:`.regions_compiled` - ``sac_region``/``checkpoint``/``tag``/``name`` under compile.
"""
import torch

from . import regions_compiled  # noqa: F401  (quiets torch's context_fn warning for our regions)
from .backend import make_backend, sac_backend
from .partition import SACPartitioner

__all__ = ["SACPartitioner", "make_backend", "sac_backend"]


def _keep_dynamo_out_of_the_eager_runtime() -> None:
    """The eager runtime runs inside compiled code after a graph break (a region that
    graph-breaks, a ``with sac_region(...)`` block). Dynamo must not trace it: it cannot
    (dispatch modes, saved-tensor hooks), and trying costs recompiles and prints warnings
    about torch internals.

    * ``with sac_region(...)``: entering and leaving run outside Dynamo, so the block is a
      clean graph break whose ops go through the eager runtime (correct, not compiled).
    * The runtime's per-op and per-tensor frames (the recorder's ``__torch_dispatch__``,
      the pack and unpack hooks) are skipped with everything they call; a code flag,
      free per call (the dispatch mode opts out of torch's per-call disable trampoline).

    Done here because Dynamo is loaded by now: an eager-only user never imports it."""
    from ..eager import eager_region
    from ..regions import sac_region
    from ..runtime.record import RegionRecorder
    from ..runtime.replay import unpack
    for name in ("__enter__", "__exit__"):
        method = sac_region.__dict__[name]
        if not getattr(method, "_sac_compile_outside_dynamo", False):
            wrapped = torch._dynamo.disable(
                method, reason="`with sac_region(...)` runs through the eager runtime; "
                               "decorate the function or module to compile the region")
            wrapped._sac_compile_outside_dynamo = True  # type: ignore[attr-defined]
            setattr(sac_region, name, wrapped)
    try:
        from torch._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy
    except ImportError:  # pragma: no cover - older torch: Dynamo may try and fall back
        return
    skip_all = FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP)
    for fn in (RegionRecorder.__torch_dispatch__, RegionRecorder.pack, unpack,
               getattr(eager_region, "__wrapped__", eager_region)):
        set_code_exec_strategy(fn.__code__, skip_all)


_keep_dynamo_out_of_the_eager_runtime()
