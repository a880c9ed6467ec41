"""``SaveWithHooks`` under compile: ``pack``/``unpack`` traced into the split graphs.

After the cut (rewriting the joint graph before it does not work: the forward's other users
would keep reading the full value, and decompositions leave nothing to rewrite), for each
saved value whose decision has hooks:

* ``pack`` is traced on the value's fake tensor with ``make_fx`` and Inductor's
  decomposition table (torch's ``fwd_only``), and its nodes go into the forward graph after
  the value's last forward use (views of it extend that use). The forward hands the packed
  tensors to the backward instead of the value.
* ``unpack`` is traced on the packed fake tensors and goes into the backward graph right
  before the value's first use there.

A pack returning several tensors (an int8 payload and its scale) hands all of them on, in
order, in the value's place. Traceable hooks are torch code on tensors: dtype casts,
quantize/dequantize, ``.to(device)``. Hooks that cannot be traced - data-dependent control
flow, ``.item()``, non-tensor packed values, an in-place op on the value, an unpack that
does not give back the value's shape, dtype and device - raise a ``CheckpointError`` naming
the op, its region and the fix (a region cannot fall back to the eager runtime from inside
the partitioner: its graph is already traced). Python side effects in the hooks (a print,
appending to a list) run once, while tracing, not per step.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any

import torch
import torch.fx as fx

from .. import graph_meta
from ..policy import SaveWithHooks
from ..torch_internals import OpOverload, pytree
from .offload import hooks_api

__all__ = ["UntraceableHooks", "TracedHooks", "trace_hooks", "apply_hooks", "reachable_hooks",
           "untraceable_hooks"]


class UntraceableHooks(Exception):
    """The hooks cannot be traced into the graphs; the message says why."""


@dataclasses.dataclass
class TracedHooks:
    pack: fx.GraphModule             # value -> packed leaves (flat)
    unpack: fx.GraphModule           # packed leaves (flat) -> value
    packed_vals: list[torch.Tensor]  # fake tensors of the packed leaves
    packed_bytes: int


def _bytes(t: torch.Tensor) -> int:
    from ..cut import costs
    return costs._tensor_bytes(t)


def _check_graph(gm: fx.GraphModule, what: str) -> None:
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        if isinstance(target, OpOverload) and target._schema.is_mutable:
            mutated = [a for a, arg in zip(node.args, target._schema.arguments)
                       if arg.alias_info is not None and arg.alias_info.is_write]
            if any(isinstance(a, fx.Node) and a.op == "placeholder" for a in mutated):
                raise UntraceableHooks(f"{what} changes its input in place ({target})")
        for a in pytree.tree_leaves((node.args, node.kwargs)):
            if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                raise UntraceableHooks(
                    f"{what} depends on a symbolic size (dynamic shapes) through {target}")


def trace_hooks(hooks: SaveWithHooks, val: torch.Tensor) -> TracedHooks:
    """Trace ``hooks`` on the fake value ``val``; :class:`UntraceableHooks` says why not."""
    api = hooks_api()
    spec: list[Any] = []

    def pack_flat(t: torch.Tensor) -> list[torch.Tensor]:
        packed = hooks.pack(t)
        leaves, tree = pytree.tree_flatten(packed)
        bad = [type(x).__name__ for x in leaves if not isinstance(x, torch.Tensor)]
        if bad or not leaves:
            raise UntraceableHooks(
                f"pack returned {type(packed).__name__} with non-tensor values "
                f"({', '.join(bad) or 'no tensor'}); it must return tensors (a tensor, or a "
                f"tuple/list/dict of tensors)")
        spec[:] = [tree]
        return list(leaves)

    def unpack_flat(*leaves: torch.Tensor) -> torch.Tensor:
        return hooks.unpack(pytree.tree_unflatten(list(leaves), spec[0]))

    def trace(fn: Any, args: list[Any], what: str) -> fx.GraphModule:
        try:
            gm = api.fwd_only(fn, args, get_decomp_fn=api.select_decomp_table)
        except UntraceableHooks:
            raise
        except Exception as e:  # data-dependent control flow, .item(), numpy, ...
            msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise UntraceableHooks(f"{what} could not be traced ({type(e).__name__}: "
                                   f"{msg[:200]})") from None
        _check_graph(gm, what)
        return gm

    pack_gm = trace(pack_flat, [val], f"pack {_name(hooks.pack)}")
    packed_vals = _output_vals(pack_gm)
    if not all(isinstance(v, torch.Tensor) for v in packed_vals):
        raise UntraceableHooks(f"pack {_name(hooks.pack)} did not return tensors")
    unpack_gm = trace(unpack_flat, packed_vals, f"unpack {_name(hooks.unpack)}")
    out = _output_vals(unpack_gm)
    got = out[0] if len(out) == 1 else None
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(val.shape) or \
            got.dtype != val.dtype or got.device != val.device:
        desc = (f"{tuple(got.shape)} {got.dtype} on {got.device}"
                if isinstance(got, torch.Tensor) else f"{len(out)} values")
        raise UntraceableHooks(
            f"unpack {_name(hooks.unpack)} returned {desc}, expected the saved value's "
            f"{tuple(val.shape)} {val.dtype} on {val.device}")
    return TracedHooks(pack_gm, unpack_gm, packed_vals,
                       sum(_bytes(v) for v in packed_vals))


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def _output_vals(gm: fx.GraphModule) -> list[Any]:
    out = gm.graph.find_nodes(op="output")[0]
    return [graph_meta.val(a) if isinstance(a, fx.Node) else a
            for a in pytree.tree_leaves(out.args[0])]


def _effective_users(node: fx.Node) -> list[fx.Node]:
    """Users of ``node`` in its graph, views standing for their own users."""
    from ..cut import costs
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        for u in n.users:
            if u.op == "output":
                continue
            out.append(u)
            if costs.is_view(u):
                stack.append(u)
    return out


_counter = itertools.count()


def _copy_into(graph: fx.Graph, owner: fx.GraphModule, sub: fx.GraphModule,
               inputs: list[fx.Node], prefix: str) -> list[fx.Node]:
    """Copy ``sub``'s nodes into ``graph`` at the current insertion point, its placeholders
    bound to ``inputs``; returns the nodes of its outputs (flat)."""
    api = hooks_api()
    env: dict[fx.Node, Any] = {}
    placeholders = sub.graph.find_nodes(op="placeholder")
    for p, node in zip(placeholders, inputs):
        env[p] = node
    for n in sub.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        if n.op == "get_attr":
            attr = f"_sac_hook_const_{next(_counter)}"
            setattr(owner, attr, getattr(sub, n.target))
            new = graph.get_attr(attr)
            new.meta.update(n.meta)
        else:
            new = graph.node_copy(n, lambda a: env[a])
            new.name = graph._graph_namespace.create_name(f"{prefix}_{n.name}", None)
        val = graph_meta.val(new)
        if isinstance(val, torch.Tensor) and not graph_meta.has_tensor_meta(new):
            graph_meta.set_tensor_meta(new, api.extract_tensor_metadata(val))
        env[n] = new
    out = sub.graph.find_nodes(op="output")[0]
    return [env[a] if isinstance(a, fx.Node) else a for a in pytree.tree_leaves(out.args[0])]


def apply_hooks(fw: fx.GraphModule, bw: fx.GraphModule, traced: dict[str, TracedHooks],
                num_fwd_outputs: int) -> dict[str, tuple[str, str]]:
    """Put each saved value's traced pack into ``fw`` and unpack into ``bw`` (``traced``:
    saved value name -> its traced hooks). Returns name -> (first pack node, first unpack
    node) names."""
    api = hooks_api()
    fgraph, bgraph = fw.graph, bw.graph
    output = fgraph.find_nodes(op="output")[0]
    outs = list(output.args[0])
    fw_nodes = {n.name: n for n in fgraph.nodes}
    bw_inputs = {n.name: n for n in bgraph.find_nodes(op="placeholder")}
    order = {n: i for i, n in enumerate(fgraph.nodes)}
    border = {n: i for i, n in enumerate(bgraph.nodes)}
    placed: dict[str, tuple[str, str]] = {}
    new_outs: list[Any] = outs[:num_fwd_outputs]
    for pos, node in enumerate(outs[num_fwd_outputs:], start=num_fwd_outputs):
        hooks = traced.get(node.name) if isinstance(node, fx.Node) else None
        if hooks is None or node.name not in bw_inputs:
            new_outs.append(node)
            continue
        users = _effective_users(fw_nodes[node.name])
        last = max(users, key=order.__getitem__) if users else node
        with fgraph.inserting_before(last.next):  # in order, right after ``last``
            packed = _copy_into(fgraph, fw, hooks.pack, [node], f"sac_pack_{node.name}")
        new_outs.extend(packed)
        # backward: placeholders for the packed leaves where the value's was, unpack
        # right before the value's first use.
        ph = bw_inputs[node.name]
        cursor = ph
        leaves = []
        for i, (src, val) in enumerate(zip(packed, hooks.packed_vals)):
            with bgraph.inserting_after(cursor):
                leaf = bgraph.placeholder(f"{node.name}_packed" + (f"_{i}" if i else ""))
            leaf.meta.update({k: v for k, v in ph.meta.items()
                              if k in ("saved_tensor_with_no_vc_check",)})
            graph_meta.set_val(leaf, val)
            graph_meta.set_tensor_meta(leaf, api.extract_tensor_metadata(val))
            leaves.append(leaf)
            cursor = leaf
        first = min(ph.users, key=border.__getitem__)
        with bgraph.inserting_before(first):
            restored = _copy_into(bgraph, bw, hooks.unpack, leaves, f"sac_unpack_{node.name}")
        ph.replace_all_uses_with(restored[0])
        bgraph.erase_node(ph)
        placed[node.name] = (packed[0].name, restored[0].name)
    output.update_arg(0, tuple(new_outs))
    fgraph.lint()
    bgraph.lint()
    fw.recompile()
    bw.recompile()
    return placed


# --------------------------------------------------------------------------------------
# Before tracing: hooks a region's policy can return that cannot be traced
# --------------------------------------------------------------------------------------

def reachable_hooks(policy: Any, depth: int = 4) -> list[SaveWithHooks]:
    """The ``SaveWithHooks`` objects a policy can return, as far as can be seen without
    calling it: in its closure, the globals its code reads, the policies it wraps
    (``NamedPolicy.fn``, ``functools.partial``, ``compose``'s list), a few levels deep."""
    found: dict[int, SaveWithHooks] = {}
    seen: set[int] = set()

    def visit(obj: Any, level: int) -> None:
        if id(obj) in seen or level > depth:
            return
        seen.add(id(obj))
        if isinstance(obj, SaveWithHooks):
            found.setdefault(id(obj), obj)
            return
        if isinstance(obj, (list, tuple, set, frozenset)):
            for item in obj:
                visit(item, level + 1)
            return
        if isinstance(obj, dict):
            for item in obj.values():
                visit(item, level + 1)
            return
        for attr in ("fn", "func", "__wrapped__"):
            inner = getattr(obj, attr, None)
            if inner is not None and inner is not obj:
                visit(inner, level + 1)
        if isinstance(obj, functools.partial):
            for item in obj.args:
                visit(item, level + 1)
        code = getattr(obj, "__code__", None)
        if code is None:
            return
        for cell in getattr(obj, "__closure__", None) or ():
            try:
                visit(cell.cell_contents, level + 1)
            except ValueError:  # an empty cell
                pass
        globals_ = getattr(obj, "__globals__", {})
        for name in code.co_names:
            if name in globals_:
                value = globals_[name]
                if isinstance(value, (SaveWithHooks, list, tuple, set, frozenset, dict)) or \
                        callable(value) and getattr(value, "__module__", None) == \
                        getattr(obj, "__module__", None):
                    visit(value, level + 1)

    visit(policy, 0)
    return list(found.values())


PROBE_SHAPE = (8, 8)  # the float32 fake value the hooks are tried on before tracing


def untraceable_hooks(policy: Any) -> str | None:
    """Why one of the hooks a policy can return cannot be traced into compiled graphs
    (tried on a small float32 fake tensor: pack's Python runs once more, on it), or None. Hooks that trace on this probe but not
    on a region's real values still raise the partitioner's ``CheckpointError``."""
    from ..torch_internals import FakeTensorMode

    for hooks in reachable_hooks(policy):
        try:
            with FakeTensorMode():
                probe = torch.empty(PROBE_SHAPE)
            trace_hooks(hooks, probe)
        except UntraceableHooks as e:
            return f"{hooks!r}: {e}"
        except Exception:  # the probe itself is not representative (a dtype check, say)
            continue
    return None
