"""Applying a cut: the forward and backward graphs, extracted from the joint graph.

:func:`extract` hands the chosen saved values to torch's ``_extract_fwd_bwd_modules``, then
makes three edits of our own to the graphs it returns: dead-code elimination of the
backward (random ops included), torch's RNG functionalisation where the backward recomputes
a random op, and the backward reordered as autograd runs it (:mod:`.order`).
:func:`split_upstream` hands an untagged joint graph to torch's partitioner instead.

Both return a :class:`Split`: the graphs, and what the report needs to know of them, read
off the graphs' structure (which forward ops the backward runs, which of its inputs are
generator states).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch.fx as fx

from .. import graph_meta
from ..cut import costs
from ..policy import CheckpointPolicy
from ..torch_internals import TorchAPIMissing
from .final_graphs import recomputed_names, replayed_values, rng_replays, rng_state_inputs
from .order import raise_getitems_in_place, reorder_like_autograd

__all__ = ["Split", "extract", "split_upstream"]

P = CheckpointPolicy


@dataclasses.dataclass
class Split:
    fw: fx.GraphModule
    bw: fx.GraphModule
    saved_names: list[str]     # the backward's inputs from the forward, as extracted
    recomputed: list[str]      # joint names of the forward ops the final backward runs
    rng_states: list[fx.Node]  # backward inputs holding a generator state (RNG replay)


def extract(gm: fx.GraphModule, saved: list[fx.Node], static: set[fx.Node],
            num_fwd_outputs: int, lap: Callable[[str], None]) -> Split:
    """The forward and backward that keep ``saved`` (``lap`` times each edit)."""
    from ..torch_internals import OrderedSet, extract_fwd_bwd_modules, functionalize_rng_ops
    from torch.fx.experimental.proxy_tensor import is_sym_node

    # As upstream: SymInts, then opaque objects, then tensors. A BackwardState
    # (compiled autograd, a hook on a region's output) goes in with the tensors:
    # torch's extraction hands it to the backward directly.
    saved_sym = [n for n in saved if is_sym_node(n) and not _is_assert_only_symbool(n)]
    saved_opaque = [n for n in saved if _is_opaque_object(n)]
    saved_values = [n for n in saved if not is_sym_node(n) and not _is_opaque_object(n)]
    # torch 2.11's extraction has no saved_opaque_nodes (nor is_opaque_node, so
    # saved_opaque is empty there): pass it only when there is something to pass.
    opaque = {"saved_opaque_nodes": saved_opaque} if saved_opaque else {}
    fw, bw = extract_fwd_bwd_modules(
        gm, saved_values, saved_sym_nodes=saved_sym, **opaque,
        num_fwd_outputs=num_fwd_outputs, static_lifetime_input_nodes=OrderedSet(static))
    # Under Inductor's fallback_random, FX's dead-code elimination keeps random-tagged ops
    # (SDPA carries the tag): a dead copy would count as recomputed in the report.
    try:
        bw.graph.eliminate_dead_code(is_impure_node=lambda n: n.is_impure(impure_random=False))
    except TypeError:  # pragma: no cover - a torch without impure_random
        pass
    lap("extract")
    saved_names = [n.name for n in bw.graph.find_nodes(op="placeholder")]
    joint = {n.name: n for n in gm.graph.nodes}
    random_recomputed = [joint[name] for name in recomputed_names(fw, bw)
                         if costs.is_random(joint[name])]
    replays = rng_replays(bw, [n.name for n in random_recomputed])
    rng_states: list[fx.Node] = []
    if random_recomputed:
        # torch functionalises only ops tagged *_RECOMPUTE; a random op the cut chose to
        # recompute against its tag (a PREFER_SAVE evicted by a memory budget, say)
        # would otherwise draw fresh numbers in backward: a silently wrong gradient.
        for node in random_recomputed:
            if graph_meta.recompute(node) not in (P.MUST_RECOMPUTE, P.PREFER_RECOMPUTE):
                graph_meta.set_recompute(node, P.PREFER_RECOMPUTE)
        fw, bw = functionalize_rng_ops(gm, fw, bw, len(saved_sym))
        rng_states = rng_state_inputs(bw)  # (before reordering erases an unused replay)
        lap("rng")
    reorder_like_autograd(bw)  # (erases what no backward op needs)
    raise_getitems_in_place(fw)
    lap("reorder")
    graph_meta.set_replayed_vals(bw, replayed_values(bw, replays, joint))  # for the peak
    # The report describes the backward that runs: read off the final graphs.
    return Split(fw, bw, saved_names, recomputed_names(fw, bw, replays), rng_states)


def split_upstream(gm: fx.GraphModule, joint_inputs: Sequence[object],
                   kwargs: dict[str, Any]) -> Split:
    """torch's ``min_cut_rematerialization_partition`` of ``gm``, unchanged."""
    from ..torch_internals import min_cut_rematerialization_partition
    kwargs.setdefault("compiler", "inductor")
    fw, bw = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
    return Split(fw, bw, [n.name for n in bw.graph.find_nodes(op="placeholder")],
                 recomputed_names(fw, bw), rng_state_inputs(bw))


def _is_opaque_object(node: fx.Node) -> bool:
    """What upstream passes as ``saved_opaque_nodes`` (script and opaque objects);
    a BackwardState is not one of them."""
    try:
        from ..torch_internals import is_opaque_node
    except TorchAPIMissing:  # pragma: no cover - older torch
        return False
    return bool(is_opaque_node(node))


def _is_assert_only_symbool(node: fx.Node) -> bool:
    try:
        from ..torch_internals import is_assert_only_symbool as upstream
    except TorchAPIMissing:  # pragma: no cover - older torch
        return False
    return bool(upstream(node))
