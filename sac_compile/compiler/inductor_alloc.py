"""What Inductor allocates for a walk of our graphs (:mod:`.peak`'s ``fused`` model): the
rules by which its generated code holds fewer storages than an eager run of the same
graph, read off the FX graph alone (the model chooses cuts before Inductor runs).

* **Fused away** (torch's partitioner's ``is_materialized`` rule): a fusible value whose
  every reader is fusible is computed inside the kernels that read it, never allocated;
  those kernels read its inputs instead, which live until then.
* **Written in place** (Inductor's ``decide_inplace_update``, ``config.inplace_buffers``):
  a kernel whose input storage dies in it writes its output into that storage when the
  two have the dtype and (within 5%, the output not larger) the size, and it reads the
  input at the index it writes (a pointwise chain, no transposing or broadcasting view).
  The forward's inputs are never written; the backward's saved activations are (torch
  donates them, ``donated_buffer``), its tangents and parameters are not. On the bench
  models this is where the walk overcounted most: Llama's loss backward writes the
  logits' gradient (8 MiB) into the logits, not next to them.

Measured (``benchmarks/peak_measured.py``): simulating the wrapper code Inductor generates
(allocations, ``# reuse`` lines, ``del``) gives the allocator's peak to the byte; what is
left between these rules and it is Inductor's order (a kernel fused with a later one runs
later, and what reads it after it) - not modelled.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx as fx

from .. import graph_meta
from .peak import Key, _alias_source, _Walk, read_only_by_fusible

__all__ = ["fused_away", "written_in_place", "inductor_fusible", "folded_into_addmm"]

_aten, _prims = torch.ops.aten, torch.ops.prims
#: Computed inside the kernels that read them, as the partitioner's fusible ops (Inductor
#: draws random numbers in the kernel from a seed; the partitioner's list predates that).
_ALSO_FUSIBLE = frozenset({_prims.inductor_random.default, _prims.inductor_randint.default})
#: Read by a kernel that computes its fusible inputs into its output (a concatenation
#: writes each input's slice).
_FUSING_READERS = frozenset({_aten.cat.default})


def inductor_fusible(fusible: Callable[[fx.Node], bool]) -> tuple[
        Callable[[fx.Node], bool], Callable[[fx.Node], bool]]:
    """(made inside a kernel, read inside a kernel): the partitioner's ``fusible`` with
    what Inductor also fuses."""
    def made(n: fx.Node) -> bool:
        return n.target in _ALSO_FUSIBLE or fusible(n)

    def read(n: fx.Node) -> bool:
        return n.target in _FUSING_READERS or made(n)
    return made, read


def folded_into_addmm(walk: _Walk, fusible: Callable[[fx.Node], bool]) -> dict[Key, fx.Node]:
    """Inductor's ``addmm`` pattern: a matrix product read only by an ``add`` with a tensor
    of its dtype that broadcasts to it is computed by that add (one ``addmm``, where the
    add runs); its storage is never allocated and its inputs live until then. On the
    accelerators Inductor keeps the two apart when the add's readers are all pointwise
    (here: ``fusible``). Of two products added, the second is folded. Returns each folded product's storage -> the
    add. (GPT-2's tied embedding: its gradient from the logits, 4 MiB, is made at the
    backward's end with the embedding's, the logits' gradient, 8 MiB, alive until then.)"""
    out: dict[Key, fx.Node] = {}
    for n in walk.nodes:
        if n.target is not _aten.mm.default or len(n.users) != 1 or \
                n.name in walk.given_names or not graph_meta.has_val(n):
            continue
        (add,) = n.users
        if add.target is not _aten.add.Tensor or add.kwargs or len(add.args) != 2 or \
                add not in walk.keys:
            continue
        other = add.args[1] if add.args[0] is n else add.args[0]
        if other is n or not isinstance(other, fx.Node) or not graph_meta.has_val(other):
            continue
        val, inp = graph_meta.val(n), graph_meta.val(other)
        if not isinstance(inp, torch.Tensor) or inp.dtype != val.dtype or \
                not _expandable(tuple(inp.shape), tuple(val.shape)):
            continue
        if val.device.type != "cpu" and all(fusible(u) for u in add.users):
            continue
        if add.args[0] is n and other.target is _aten.mm.default and len(other.users) == 1:
            continue  # Inductor's pattern with the product second matches first
        for k in walk.keys.get(n, ()):
            if k is not None and k[0] == n.name:
                out[k] = add
    for k, add in out.items():  # the product's inputs are read where the add runs
        for a in walk.maker[k].all_input_nodes:
            for ka in walk.keys.get(a, ()):
                if ka is not None:
                    walk.last[ka] = max(walk.last.get(ka, -1), walk.last[k])
    return out


def _expandable(shape: tuple[int, ...], to: tuple[int, ...]) -> bool:
    if len(shape) > len(to):
        return False
    return all(s in (1, t) for s, t in zip(reversed(shape), reversed(to)))


def fused_away(walk: _Walk, fusible: Callable[[fx.Node], bool],
               reads: Callable[[fx.Node], bool] | None = None) -> set[Key]:
    """The storages of ``walk`` computed inside the kernels that read them: neither given
    nor an output, made by a fusible op whose every reader in the walk (through views) is
    fusible (``reads``, when given: read inside the kernel). Extends the last uses of their
    inputs in ``walk`` to those kernels."""
    in_walk = set(walk.nodes)

    def away(k: Key) -> bool:
        n = walk.maker[k]
        if k in walk.outputs or n.name in walk.given_names or n.op != "call_function" or \
                not fusible(n):
            return False
        return read_only_by_fusible(n, in_walk, reads or fusible)

    out = {k for k in walk.made_at if away(k)}
    for n in reversed(walk.nodes):  # readers after makers: a chain extends transitively
        for k in walk.keys.get(n, ()):
            if k in out and k[0] == n.name:
                for a in n.all_input_nodes:
                    for ka in walk.keys.get(a, ()):
                        if ka is not None:
                            walk.last[ka] = max(walk.last.get(ka, -1), walk.last[k])
    return out


def _layout(node: fx.Node) -> tuple[int, torch.dtype, bool] | None:
    val = graph_meta.val(node) if graph_meta.has_val(node) else None
    if not isinstance(val, torch.Tensor):
        return None
    return val.numel(), val.dtype, val.is_contiguous()


def written_in_place(walk: _Walk, away: set[Key], fusible: Callable[[fx.Node], bool],
                     donated: Callable[[Key], bool]) -> set[Key]:
    """The storages of ``walk`` a kernel writes into one of its inputs' storages (see the
    module docstring) rather than allocating; ``away``: :func:`fused_away`'s storages (the
    kernel reads their inputs), ``donated``: whether a given storage may be written.
    Extends the last use of each storage written into to the last use of what is written
    (so a storage written twice lives as long as the last value in it)."""
    into: dict[Key, Key] = {}

    def root(k: Key) -> Key:
        while k in into:
            k = into[k]
        return k

    def same_index(node: fx.Node, numel: int) -> bool:
        layout = _layout(node)  # not: a reduction's input, a broadcast, a transpose
        return layout is not None and layout[0] == numel and layout[2]

    def candidates(n: fx.Node, numel: int) -> list[Key]:
        """The storages n's kernel reads at the index it writes (through fused values)."""
        found, stack, seen = [], list(n.all_input_nodes), set()
        while stack:
            a = stack.pop()
            if a in seen or not same_index(a, numel):
                continue
            seen.add(a)
            for k in walk.keys.get(a, ()):
                if k is None or not same_index(walk.maker[k], numel):
                    continue
                if k in away:  # computed in this kernel: it reads what k's maker reads
                    stack.extend(walk.maker[k].all_input_nodes)
                else:
                    found.append(k)
        return found

    out: set[Key] = set()
    for pos, n in enumerate(walk.nodes):
        if n.op != "call_function" or not fusible(n) or _alias_source(n) is not None or \
                n.name in walk.given_names:
            continue
        layout = _layout(n)
        if layout is None or not layout[2]:
            continue
        for k in walk.keys.get(n, ()):
            if k is None or k[0] != n.name or k in away or walk.made_at.get(k) != pos:
                continue
            for c in candidates(n, layout[0]):
                r = root(c)
                given = walk.maker[r].name in walk.given_names
                if r == k or walk.last.get(r) != pos or r in walk.outputs or \
                        (given and not donated(r)) or \
                        (not given and walk.maker[r].op != "call_function") or \
                        walk.dtype.get(r) != walk.dtype.get(k) or \
                        not 0.95 * walk.size[r] <= walk.size[k] <= walk.size[r]:
                    continue
                into[k] = r
                walk.last[r] = max(walk.last[r], walk.last.get(k, pos))
                if k in walk.outputs:
                    walk.outputs.add(r)
                out.add(k)
                break
    return out
