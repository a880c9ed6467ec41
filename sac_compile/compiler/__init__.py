"""The compiled half of sac_compile: tags on the joint graph, the SAC min-cut partitioner
and the ``torch.compile`` backends.

Modules, one concern each:

* :mod:`.tagging` - the dispatch mode that writes each op's decision into the joint graph;
  the ``sac_compile::tag`` / ``sac_compile::name`` marker ops.
* :mod:`.normalize` - the FX pass that turns the raw tags into final decisions.
* :mod:`.costs` - bytes, FLOPs and memory traffic of one node.
* :mod:`.flow` - the flow network, its objective, and the max-flow solvers.
* :mod:`.partition` - :class:`SACPartitioner`, torch's ``CustomPartitionerFn``.
* :mod:`.backend` - ``sac_backend`` and ``make_backend``.
* :mod:`.regions_compiled` - ``sac_region``/``checkpoint``/``tag``/``name`` under compile.
"""
from . import regions_compiled  # noqa: F401  (quiets torch's context_fn warning for our regions)
from .backend import make_backend, sac_backend
from .partition import SACPartitioner

__all__ = ["SACPartitioner", "make_backend", "sac_backend"]
