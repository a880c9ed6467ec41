"""The compiled half of sac_compile: tags on the joint graph, the SAC min-cut partitioner
and the ``torch.compile`` backends.

Modules, one concern each:

* :mod:`.tagging` - the dispatch mode that writes each op's decision into the joint graph.
* :mod:`sac_compile.markers` - the ``tag()``/``name()`` marker ops under compile (a ``SaveWithHooks``
  opinion registered and named in the marker's string).
* :mod:`.roles` - what a graph input is (forward input, parameter, tangent, RNG state).
* :mod:`.normalize` - the FX passes that turn the raw tags into final decisions.
* :mod:`.costs` - bytes, FLOPs and memory traffic of one node.
* :mod:`.network` - the flow network and its objective (the formulation, one screen).
* :mod:`.solvers` - scipy's and networkx's max-flow, and the minimum cut they give.
* :mod:`sac_compile.budgets` - what a memory budget is, and the search for the cut that
  meets it (shared with the eager engine); :mod:`.peak_budget` - a cap on the step's peak.
* :mod:`.exact` - the exact program (scipy's MILP) that makes a budgeted cut optimal.
* :mod:`.storage`, :mod:`.offload`, :mod:`.save_hooks` - how kept values are stored: on
  the host (torch's offload pass), packed by traced hooks.
* :mod:`.reasons` - why a value is saved or cannot be recomputed: a kind and a text.
* :mod:`.partition` - :class:`SACPartitioner`, torch's ``CustomPartitionerFn``.
* :mod:`.options` - :class:`PartitionerConfig` and :class:`OffloadOptions`: the
  partitioner's options, one validated, documented value.
* :mod:`.backend` - ``sac_backend`` and ``make_backend``.
* :mod:`.named_backends` - the same under names: ``backend="sac_inductor"``/``"sac_aot_eager"``.
* :mod:`.regions_compiled` - ``sac_region``/``checkpoint``/``tag``/``name`` under compile.
"""
from . import regions_compiled  # noqa: F401  (quiets torch's context_fn warning for our regions)
from .backend import make_backend, sac_backend
from ..cut.network import CostModel
from .named_backends import register as _register_backend_names
from .options import OffloadOptions, PartitionerConfig
from .partition import SACPartitioner

_register_backend_names()  # entry points cover installs; this covers a bare checkout

__all__ = ["CostModel", "OffloadOptions", "PartitionerConfig", "SACPartitioner", "make_backend",
           "sac_backend"]
