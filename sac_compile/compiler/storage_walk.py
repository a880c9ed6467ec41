"""The storages of a node sequence run in order - who makes each, its bytes, its device,
its last use - and which node's storage a view or an in-place op shares: the walk the peak
model (:mod:`.peak`) sweeps and Inductor's allocation rules (:mod:`.inductor_alloc`,
:mod:`.inductor_order`) rewrite. One storage per tensor a node makes, keyed
``(maker's name, output index)``; an op's own temporary is keyed ``(name, -1)``.
"""
from __future__ import annotations

import operator
from collections.abc import Callable, Container, Iterable
from typing import Any

import torch
import torch.fx as fx

from .. import graph_meta
from ..cut import costs
from ..torch_internals import OpOverload, pytree
from .op_temporaries import operand_copy_bytes

__all__ = ["Key", "Walk", "alias_source", "storage_base", "read_only_by_fusible",
           "kernel_storages", "kernel_reads"]

Key = tuple[str, int]  # (name of the node that made the storage, output index)


def alias_source(node: fx.Node) -> fx.Node | None:
    """The argument whose storage ``node``'s output shares: a view's base, the tensor an
    in-place or ``out=`` op writes. None: a new storage (or not a tensor op)."""
    if node.op != "call_function":
        return None
    target = node.target
    first = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    if costs.is_view(node):
        return first
    if not isinstance(target, OpOverload):
        return None
    returns = target._schema.returns
    alias = returns[0].alias_info if returns else None
    if alias is None:
        return None
    for i, arg in enumerate(target._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.before_set & alias.before_set:
            value = node.kwargs.get(arg.name, node.args[i] if i < len(node.args) else None)
            return value if isinstance(value, fx.Node) else None
    return None


def storage_base(node: fx.Node) -> fx.Node:
    """The node whose storage ``node`` shares (itself when it makes its own)."""
    seen = 0
    while seen < 10_000:
        src = alias_source(node)
        if src is None:
            if node.target is operator.getitem and isinstance(node.args[0], fx.Node) and \
                    alias_source(node.args[0]) is not None:  # an item of split/unbind
                node = node.args[0]
                seen += 1
                continue
            return node
        node, seen = src, seen + 1
    return node  # pragma: no cover - a cycle cannot happen in an FX graph


def _tensors(val: Any) -> list[Any]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return list(val)
    return []


class Walk:
    """The storages of a node sequence that runs in order: who makes each, its bytes, its
    last use. ``given``: nodes whose values exist when the sequence starts (a graph's
    placeholders; the kept values of a candidate cut), each its own storage. ``outputs``:
    nodes whose values outlive the sequence."""

    def __init__(self, seq: list[fx.Node], *, given: Iterable[fx.Node] = (),
                 outputs: Iterable[fx.Node] = (), vals: dict[str, Any] | None = None) -> None:
        self._given, self._outputs = list(given), list(outputs)
        self.nodes = list(seq)
        # products kept apart from their adds (inductor_alloc.not_allocated): product -> the
        # node right after which it runs
        self.apart: dict[fx.Node, fx.Node] = {}
        self.vals = vals or {}  # values of nodes that carry none, by name
        self.made_by_producer: dict[fx.Node, list[Key | None]] = {}
        given = set(given)
        self.given_names = {g.name for g in given}
        self.keys: dict[fx.Node, list[Key | None]] = {}
        self.made_at: dict[Key, int] = {}
        self.size: dict[Key, int] = {}
        self.device: dict[Key, str] = {}
        self.dtype: dict[Key, torch.dtype] = {}
        self.last: dict[Key, int] = {}
        self.maker: dict[Key, fx.Node] = {}
        for g in sorted(given, key=lambda n: n.name):  # alive before the first node
            self.keys[g] = self._make(g, -1)
        end = len(self.nodes)
        for pos, n in enumerate(self.nodes):
            if n.op == "output":
                outputs = [*outputs, *(a for a in pytree.tree_leaves(n.args)
                                       if isinstance(a, fx.Node))]
                continue
            if n not in given:
                self.keys[n] = self._storages(n, pos)
                self._operand_copies(n, pos)
            for a in n.all_input_nodes:
                for k in self.keys.get(a, ()):
                    if k is not None:
                        self.last[k] = max(self.last.get(k, -1), pos)
        self.outputs: set[Key] = set()
        for o in outputs:
            for k in self.keys.get(o, ()):
                if k is not None:
                    self.last[k] = end
                    self.outputs.add(k)

    def reorder(self, seq: list[fx.Node]) -> None:
        """The same walk over ``seq``, the same nodes in another order (storages anew)."""
        self.__init__(seq, given=self._given, outputs=self._outputs, vals=self.vals)

    def _make(self, n: fx.Node, pos: int) -> list[Key | None]:
        out: list[Key | None] = []
        val = graph_meta.val(n) if graph_meta.has_val(n) else self.vals.get(n.name)
        for i, t in enumerate(_tensors(val)):
            if not isinstance(t, torch.Tensor):
                out.append(None)
                continue
            key = (n.name, i)
            self.made_at[key] = pos
            self.size[key] = costs._tensor_bytes(t)
            self.device[key] = t.device.type
            self.dtype[key] = t.dtype
            self.maker[key] = n
            self.last.setdefault(key, pos)
            out.append(key)
        return out

    def _operand_copies(self, n: fx.Node, pos: int) -> None:
        """The op's own temporaries (:mod:`.op_temporaries`): one storage made and freed
        at ``pos``, counted in the step only (:func:`.peak._temporary`)."""
        copies = operand_copy_bytes(n)
        if copies:
            key = (n.name, -1)
            self.made_at[key], self.size[key], self.last[key] = pos, copies, pos
            self.device[key] = graph_meta.val(n).device.type
            self.maker[key] = n

    def _storages(self, n: fx.Node, pos: int) -> list[Key | None]:
        src = alias_source(n)
        if src is not None:
            return list(self.keys.get(src, ()))
        if n in self.made_by_producer:
            return self.made_by_producer[n]
        if not graph_meta.has_val(n) and n.name not in self.vals and n.op == "call_function":
            # No value (torch's RNG functionalisation makes its run_and_save_rng_state
            # nodes without one): its outputs, the values of the getitems that read them,
            # exist from this node on.
            for u in n.users:
                if u.target is operator.getitem:
                    self.made_by_producer[u] = self._make(u, pos)
            return []
        if n.target is operator.getitem and isinstance(n.args[0], fx.Node):
            base = self.keys.get(n.args[0], [])
            i = n.args[1]
            if alias_source(n.args[0]) is not None:  # an item of a view list: the base's
                return base[:1]
            return [base[i]] if isinstance(i, int) and 0 <= i < len(base) else []
        return self._make(n, pos)

    def sweep(self, counted: Callable[[Key], bool]) -> tuple[int, int, list[Key]]:
        """(peak bytes, position of the peak (-1: before the first node), storages alive
        then)."""
        born: dict[int, list[Key]] = {}
        dies: dict[int, list[Key]] = {}
        for k, pos in self.made_at.items():
            if counted(k):
                born.setdefault(pos, []).append(k)
                dies.setdefault(self.last.get(k, pos), []).append(k)
        live: set[Key] = set()
        total = peak = 0
        peak_pos, peak_live = -1, []
        for pos in range(-1, len(self.nodes)):
            for k in born.get(pos, ()):
                live.add(k)
                total += self.size[k]
            if total > peak:
                peak, peak_pos, peak_live = total, pos, list(live)
            for k in dies.get(pos, ()):
                if k in live:
                    live.discard(k)
                    total -= self.size[k]
        return peak, peak_pos, peak_live


def read_only_by_fusible(node: fx.Node, within: Container[fx.Node],
                         fusible: Callable[[fx.Node], bool]) -> bool:
    """Every reader of ``node``'s storage among ``within`` is fusible, views followed
    through to their readers (a view reads nothing: its readers read the storage)."""
    stack = [node]
    while stack:
        m = stack.pop()
        for u in m.users:
            if u not in within:
                continue
            if alias_source(u) is m:
                stack.append(u)
            elif not fusible(u):
                return False
    return True


def kernel_storages(walk: Walk, n: fx.Node, away: Container[Key],
                    counted: Callable[[Key], bool] = lambda k: True) -> list[Key]:
    """The storages ``n`` allocates as a kernel of ``walk`` (empty: not a kernel): those it
    makes itself, ``counted``, not in ``away`` (computed inside their readers, folded);
    views, items of a list and given values are no kernels."""
    if n.op != "call_function" or alias_source(n) is not None or \
            n.target is operator.getitem or n.name in walk.given_names:
        return []
    return [k for k in walk.keys.get(n, ()) if k is not None and k[0] == n.name and
            k not in away and counted(k)]


def kernel_reads(walk: Walk, n: fx.Node, away: Container[Key]
                 ) -> tuple[dict[Key, None], set[fx.Node]]:
    """(the storages ``n``'s kernel reads, in the order found; the nodes visited): what it
    reads through the values it computes inside (``away``: their makers' inputs instead)."""
    found: dict[Key, None] = {}
    stack, seen = list(n.all_input_nodes), set()
    while stack:
        a = stack.pop()
        if a in seen:
            continue
        seen.add(a)
        for k in walk.keys.get(a, ()):
            if k is None:
                continue
            if k in away:
                stack.extend(walk.maker[k].all_input_nodes)
            else:
                found[k] = None
    return found, seen
