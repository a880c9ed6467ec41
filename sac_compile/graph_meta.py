"""Every ``node.meta`` / ``GraphModule.meta`` key sac_compile reads or writes, with a typed
get/set function per key: the one place that knows the strings.

FX graphs carry facts between passes in ``node.meta``, a plain ``dict``; a mistyped key is
a silent ``None``. Here each key is a constant, and code elsewhere calls the accessors
(``tests/test_graph_meta.py`` walks the package and fails on a raw string key anywhere else).

Ours (written while tracing a region, :mod:`sac_compile.compiler.tagging`, and by the
compile passes; the eager budget planner writes the same keys on the graph it builds):

* :data:`DECISION`: the :class:`~sac_compile.policy.Decision` of the op that made the node;
* :data:`REGION_PATH`: the names of the regions active then, outermost first;
* :data:`CALL`: one id per dispatched op, shared by its decomposition and its getitems;
* :data:`OP`: that dispatched op (``aten.gelu.default`` on its decomposition's nodes);
* :data:`ASK`: what it takes to ask the policies again when ``name()`` labels the value;
* :data:`REGION_ID` / :data:`OUTER_REGION_ID`: the innermost / outermost region call;
* :data:`REGION_BUDGETS`: the memory budgets of the active regions;
* :data:`MARKER_REGION` (on a marker): (outermost region call, innermost region name);
* :data:`MARKED`: the tag and names the markers folded so far put on a producer;
* :data:`VIEW_OF`: the value a view whose decision is its base's was taken of;
* :data:`VIEW_KEEPS_STORAGE`: a view that is what keeps its base's storage alive;
* :data:`REGION_BOUNDARY`: a boundary value the region-boundary floor keeps
  (:class:`BoundaryFact`);
* :data:`REPLAYED_VALS` (on the backward ``GraphModule``): the values of the random ops
  torch's RNG functionalisation replays, by node name.

Torch's (read by torch's own passes, or written by torch and read here): :data:`VAL`,
:data:`TENSOR_META`, :data:`RECOMPUTE`, :data:`AC_GRAPH_ID`, :data:`PARTITIONER_TAG`,
:data:`AUTOGRAD_BACKWARD`, :data:`DESC`, :data:`NN_MODULE_STACK`, :data:`SHOULD_OFFLOAD`
and, on a region's subgraph module, :data:`CHECKPOINT_CONTEXT_FN`.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch.fx as fx

    from .policy import CheckpointPolicy, Decision

__all__ = [
    "DECISION", "REGION_PATH", "CALL", "OP", "ASK", "REGION_ID", "OUTER_REGION_ID",
    "REGION_BUDGETS", "MARKER_REGION", "MARKED", "VIEW_OF", "VIEW_KEEPS_STORAGE",
    "REGION_BOUNDARY", "REPLAYED_VALS", "OURS",
    "VAL", "TENSOR_META", "RECOMPUTE", "AC_GRAPH_ID", "PARTITIONER_TAG", "AUTOGRAD_BACKWARD",
    "DESC", "NN_MODULE_STACK", "SHOULD_OFFLOAD", "CHECKPOINT_CONTEXT_FN",
    "BoundaryFact", "strip_ours",
]

# -- ours --------------------------------------------------------------------------------
DECISION = "sac_decision"
REGION_PATH = "sac_region_path"
CALL = "sac_call"
OP = "sac_op"
ASK = "sac_ask"
REGION_ID = "sac_region_id"
OUTER_REGION_ID = "sac_outer_region_id"
REGION_BUDGETS = "sac_region_budgets"
MARKER_REGION = "sac_marker_region"
MARKED = "sac_marked"
VIEW_OF = "sac_view_of"
VIEW_KEEPS_STORAGE = "sac_view_keeps_storage"
REGION_BOUNDARY = "sac_region_boundary"
REPLAYED_VALS = "sac_replayed_vals"  # on the backward GraphModule's meta

#: Our node keys: none is left on the graphs handed to the compilers (:func:`strip_ours`).
OURS = (DECISION, REGION_PATH, CALL, OP, ASK, REGION_ID, OUTER_REGION_ID, MARKER_REGION,
        MARKED, REGION_BUDGETS, VIEW_OF, VIEW_KEEPS_STORAGE, REGION_BOUNDARY)

# -- torch's -----------------------------------------------------------------------------
VAL = "val"
TENSOR_META = "tensor_meta"
RECOMPUTE = "recompute"
AC_GRAPH_ID = "ac_graph_id"
PARTITIONER_TAG = "partitioner_tag"
AUTOGRAD_BACKWARD = "autograd_backward"
DESC = "desc"
NN_MODULE_STACK = "nn_module_stack"
SHOULD_OFFLOAD = "should_offload"
ORIGINAL_ATEN = "original_aten"  # the ATen op a decomposition or rewrite came from
# Where Dynamo leaves a checkpoint's ``context_fn`` on the region's body graph module
# (torch's own ``tag_activation_checkpoint`` reads it there; verified on torch 2.11 and 2.13).
# We read it to name regions and key caches. If renamed: regions share one name and the
# caches miss (no wrong split: the context_fn is not ours to call).
CHECKPOINT_CONTEXT_FN = "_checkpoint_context_fn"


@dataclasses.dataclass(frozen=True)
class BoundaryFact:
    """A value the region-boundary floor keeps: the innermost region that made it (None:
    outside every region) and the one whose recompute reads it."""

    made_in: str | None
    read_in: str | None


# -- decisions (ours) ----------------------------------------------------------------------

def decision(node: fx.Node) -> Decision | None:
    return node.meta.get(DECISION)


def set_decision(node: fx.Node, value: Decision) -> None:
    node.meta[DECISION] = value


def region_path(node: fx.Node) -> tuple[str, ...] | None:
    return node.meta.get(REGION_PATH)


def set_region_path(node: fx.Node, path: tuple[str, ...]) -> None:
    node.meta[REGION_PATH] = path


def region(node: fx.Node) -> str:
    """The innermost region that decided ``node``; ``""`` outside every region."""
    path = node.meta.get(REGION_PATH)
    return path[-1] if path else ""


def call(node: fx.Node) -> int | None:
    return node.meta.get(CALL)


def set_call(node: fx.Node, value: int) -> None:
    node.meta[CALL] = value


def op(node: fx.Node, default: Any = None) -> Any:
    return node.meta.get(OP, default)


def set_op(node: fx.Node, value: Any) -> None:
    node.meta[OP] = value


def ask(node: fx.Node) -> Any:
    return node.meta.get(ASK)


def set_ask(node: fx.Node, value: Any) -> None:
    node.meta[ASK] = value


def pop_ask(node: fx.Node) -> Any:
    return node.meta.pop(ASK, None)


def region_id(node: fx.Node, default: Any = None) -> int | None:
    return node.meta.get(REGION_ID, default)


def outer_region_id(node: fx.Node) -> int | None:
    return node.meta.get(OUTER_REGION_ID)


def has_outer_region_id(node: fx.Node) -> bool:
    return OUTER_REGION_ID in node.meta


def set_region_ids(node: fx.Node, inner: int, outer: int) -> None:
    node.meta[REGION_ID] = inner
    node.meta[OUTER_REGION_ID] = outer


def set_outer_region_id(node: fx.Node, outer: int) -> None:
    node.meta[OUTER_REGION_ID] = outer


def region_budgets(node: fx.Node) -> tuple[tuple[int, str, Any], ...]:
    """``(region call, region name, RegionBudget)`` of each active region with a budget."""
    return node.meta.get(REGION_BUDGETS, ())


def set_region_budgets(node: fx.Node, value: tuple[tuple[int, str, Any], ...]) -> None:
    node.meta[REGION_BUDGETS] = value


def marker_region(node: fx.Node) -> tuple[int, str] | None:
    return node.meta.get(MARKER_REGION)


def set_marker_region(node: fx.Node, outer: int, name: str) -> None:
    node.meta[MARKER_REGION] = (outer, name)


def marked(node: fx.Node) -> tuple[Any, frozenset[str]]:
    """The tag (an opinion, or None) and the names markers put on ``node`` so far."""
    return node.meta.get(MARKED, (None, frozenset()))


def set_marked(node: fx.Node, tag: Any, names: frozenset[str]) -> None:
    node.meta[MARKED] = (tag, names)


def pop_marked(node: fx.Node) -> Any:
    return node.meta.pop(MARKED, None)


def view_of(node: fx.Node) -> str | None:
    return node.meta.get(VIEW_OF)


def set_view_of(node: fx.Node, name: str) -> None:
    node.meta[VIEW_OF] = name


def mark_view_keeps_storage(node: fx.Node) -> None:
    node.meta[VIEW_KEEPS_STORAGE] = True


def view_keeps_storage(node: fx.Node) -> bool:
    return VIEW_KEEPS_STORAGE in node.meta


def pop_view_keeps_storage(node: fx.Node) -> bool:
    return node.meta.pop(VIEW_KEEPS_STORAGE, None) is not None


def boundary(node: fx.Node) -> BoundaryFact | None:
    return node.meta.get(REGION_BOUNDARY)


def set_boundary(node: fx.Node, fact: BoundaryFact) -> None:
    node.meta[REGION_BOUNDARY] = fact


def pop_boundary(node: fx.Node) -> BoundaryFact | None:
    """Remove and return ``node``'s boundary fact (a candidate cut not chosen)."""
    return node.meta.pop(REGION_BOUNDARY, None)


def strip_ours(node: fx.Node) -> None:
    """Remove our keys from ``node`` (the final graphs go to other compilers)."""
    for key in OURS:
        node.meta.pop(key, None)


def replayed_vals(module: fx.GraphModule) -> dict[str, Any] | None:
    return module.meta.get(REPLAYED_VALS)


def set_replayed_vals(module: fx.GraphModule, value: dict[str, Any]) -> None:
    module.meta[REPLAYED_VALS] = value


def pop_replayed_vals(module: fx.GraphModule) -> None:
    module.meta.pop(REPLAYED_VALS, None)


# -- torch's ---------------------------------------------------------------------------------

def val(node: fx.Node) -> Any:
    """The fake value (a FakeTensor, SymInt, tuple of them, ...) torch traced; None if none."""
    return node.meta.get(VAL)


def has_val(node: fx.Node) -> bool:
    return VAL in node.meta


def set_val(node: fx.Node, value: Any) -> None:
    node.meta[VAL] = value


def has_tensor_meta(node: fx.Node) -> bool:
    return TENSOR_META in node.meta


def set_tensor_meta(node: fx.Node, value: Any) -> None:
    node.meta[TENSOR_META] = value


def recompute(node: fx.Node) -> CheckpointPolicy | None:
    """Torch's SAC decision for ``node`` (its partitioner reads it)."""
    return node.meta.get(RECOMPUTE)


def has_recompute(node: fx.Node) -> bool:
    return RECOMPUTE in node.meta


def set_recompute(node: fx.Node, policy: CheckpointPolicy) -> None:
    node.meta[RECOMPUTE] = policy


def ac_graph_id(node: fx.Node) -> int | None:
    return node.meta.get(AC_GRAPH_ID)


def has_ac_graph_id(node: fx.Node) -> bool:
    return AC_GRAPH_ID in node.meta


def set_ac_graph_id(node: fx.Node, value: int) -> None:
    node.meta[AC_GRAPH_ID] = value


def partitioner_tag(node: fx.Node) -> str | None:
    return node.meta.get(PARTITIONER_TAG)


def set_partitioner_tag(node: fx.Node, value: str) -> None:
    node.meta[PARTITIONER_TAG] = value


def autograd_backward(node: fx.Node) -> Any:
    return node.meta.get(AUTOGRAD_BACKWARD)


def desc(node: fx.Node) -> Any:
    """AOTAutograd's descriptor of a joint-graph input or output (an ``AOTInput``...)."""
    return node.meta.get(DESC)


def nn_module_stack(node: fx.Node) -> dict[str, Any]:
    return node.meta.get(NN_MODULE_STACK) or {}


def set_should_offload(node: fx.Node) -> None:
    node.meta[SHOULD_OFFLOAD] = True


def clear_should_offload(node: fx.Node) -> None:
    node.meta.pop(SHOULD_OFFLOAD, None)


def checkpoint_context_fn(module: Any) -> Any:
    """The ``context_fn`` torch's checkpoint op keeps on its subgraph module (None when
    ``module`` is none, or has no ``meta``)."""
    return getattr(module, "meta", {}).get(CHECKPOINT_CONTEXT_FN)


def set_checkpoint_context_fn(module: fx.GraphModule, value: Any) -> None:
    module.meta[CHECKPOINT_CONTEXT_FN] = value


def original_aten(node: fx.Node) -> Any:
    """The ATen op the node's decomposition or rewrite came from (None when unknown)."""
    return node.meta.get(ORIGINAL_ATEN)


def copy_call(node: fx.Node, source: fx.Node, *, same_op: bool) -> None:
    """Give ``node`` ``source``'s region call (its region ids) and, when it is part of the
    same dispatched op (``same_op``), its call and op keys too."""
    for key in (REGION_ID, OUTER_REGION_ID):
        node.meta[key] = source.meta[key]
    if same_op:
        node.meta.update((k, source.meta[k]) for k in (CALL, OP) if k in source.meta)
