"""What the final forward/backward graphs do, for the report: the forward ops the backward
re-runs, read off the graphs that run (after RNG functionalisation, reordering and dead-code
erasure), never off an intermediate list: an op erased later (a dead ``wait_tensor``
chain, a random op's unused copy) is not recomputed, and the report must not say it is.
"""
from __future__ import annotations

import operator

import torch.fx as fx

from .. import graph_meta
from ..cut import costs

__all__ = ["recomputed_names", "rng_replays", "replayed_values", "rng_state_inputs"]


def _run_with_rng_state() -> object:
    from ..torch_internals import run_with_rng_state
    return run_with_rng_state


def rng_replays(bw: fx.GraphModule, random_names: list[str]) -> dict[tuple, str]:
    """Before torch's RNG functionalisation: a key for each random op the backward
    recomputes (its target and arguments), mapped to its name. The functionalised node
    (``run_with_rng_state(state, target, *args)``) has a name of its own and keeps those
    arguments, so :func:`recomputed_names` can name the op it replays."""
    wanted = set(random_names)
    return {_key(n.target, n.args): n.name for n in bw.graph.nodes
            if n.op == "call_function" and n.name in wanted}


def _key(target: object, args: tuple) -> tuple:
    return (target, tuple(a.name if isinstance(a, fx.Node) else repr(a) for a in args))


def recomputed_names(fw: fx.GraphModule, bw: fx.GraphModule,
                     replays: dict[tuple, str] | None = None) -> list[str]:
    """Names (joint-graph names) of the forward ops the final backward runs, in its order:
    a backward node named like a forward op (extraction copies names), or a functionalised
    random op (``replays`` from :func:`rng_replays`). Getitems and symbolic values are
    not ops."""
    fw_names = {n.name for n in fw.graph.nodes if n.op == "call_function"}
    replay_target = _run_with_rng_state()
    out: list[str] = []
    for n in bw.graph.nodes:
        if n.op != "call_function" or n.target is operator.getitem or costs.is_sym(n):
            continue
        if n.name in fw_names:
            out.append(n.name)
        elif replays and n.target is replay_target and len(n.args) >= 2:
            name = replays.get(_key(n.args[1], tuple(n.args[2:])))
            if name is not None:
                out.append(name)
    return out


def replayed_values(bw: fx.GraphModule, replays: dict[tuple, str],
                    joint: dict[str, fx.Node]) -> dict[str, object]:
    """The value (``meta["val"]`` of the joint op) of each ``run_with_rng_state`` node of
    the final backward, by its name: torch makes those nodes without one, and the peak
    model needs their bytes."""
    replay_target = _run_with_rng_state()
    out: dict[str, object] = {}
    for n in bw.graph.nodes:
        if n.op == "call_function" and n.target is replay_target and len(n.args) >= 2:
            name = replays.get(_key(n.args[1], tuple(n.args[2:])))
            if name is not None and name in joint:
                out[n.name] = graph_meta.val(joint[name])
    return out


def rng_state_inputs(bw: fx.GraphModule) -> list[fx.Node]:
    """The backward's placeholders that hold a generator state saved by the forward: the
    state each ``run_with_rng_state`` node of torch's RNG functionalisation replays from
    (graph order). Read off the graph's structure, so a placeholder of another kind (a
    value packed by hooks, say) is never taken for one."""
    replay_target = _run_with_rng_state()
    states = {n.args[0] for n in bw.graph.find_nodes(op="call_function", target=replay_target)
              if n.args and isinstance(n.args[0], fx.Node)}
    return [n for n in bw.graph.find_nodes(op="placeholder") if n in states]
