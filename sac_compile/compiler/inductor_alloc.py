"""What Inductor allocates for a walk of our graphs (:mod:`.peak`'s ``fused`` model): the
rules by which its generated code holds fewer storages than an eager run of the same
graph, read off the FX graph alone (the model chooses cuts before Inductor runs). Each was
found comparing, buffer by buffer, the code Inductor generates for the bench models
(``empty_strided``, ``# reuse`` and ``del`` lines; replayed, they give the allocator's
measured peak to the byte) with the walk; :func:`not_allocated` applies them in order.

* **Fused away** (torch's partitioner's ``is_materialized`` rule): a fusible value whose
  every reader is fusible is computed inside the kernels that read it, never allocated;
  those kernels read its inputs instead, which live until then. Inductor also draws
  random numbers inside the kernel (``inductor_random``) and computes a concatenation's
  fusible inputs into its slices. Not fused away: a reduction (always a buffer), and what
  Inductor's lowering realizes, a value read twice whose expression reads more than 4
  storages, or one reading more than 12 (without this the chain of a residual stream's
  gradients is one expression, and every layer's matmul outputs lived to the end).
* **addmm** (Inductor's post-grad pattern): a matrix product read only by an ``add`` is
  computed by it, where the add runs, unless the partitioner keeps the two apart
  (:mod:`.products_apart`: where the fold would hold more, GPT-2's tied embedding).
* **Written in place** (Inductor's ``decide_inplace_update``, ``config.inplace_buffers``):
  a kernel whose input storage dies in it writes its output into that storage when the
  two have the dtype and (within 5%, the output not larger) the size, and it reads the
  input at the index it writes (a pointwise chain, no transposing or broadcasting view).
  The forward's inputs are never written; the backward's saved activations are (torch
  donates them, ``donated_buffer``), its tangents and parameters are not. Llama's loss
  backward writes the logits' gradient (8 MiB) into the logits, not next to them; a
  forward's log_softmax is written into its logits.
* **Reused** (the wrapper's memory planning, ``config.allow_buffer_reuse``): a freed
  storage waits for the next allocation of its device, dtype and size, which takes it
  (no new allocation) unless holding it across the gap would raise Inductor's estimate of
  the peak; held, it counts from its last use until then. Never taken: what a
  fallback kernel (attention's backward) makes from an unaligned storage, as every graph
  input on the CPU is: the pool is kept by alignment too, and allocations are aligned.

Under our backend's fusion veto (:mod:`.near_fusion`: no fusion of kernels with anything
between them that keeps more bytes alive) the walk is in the graph's order: Llama's and
GPT-2's step within 1% (every block recomputed), to the byte with ``save_matmuls``. A torch
without the veto's hooks fuses horizontally as :mod:`.inductor_order` models. Before the
veto tightened, walked in Inductor's order (its scheduler's, read from the generated code),
these rules gave the allocator's step peak: Llama to the byte, GPT-2 -0.7%; in the graph's
order what was left was Inductor's order - it fused kernels that read the same storage, so
a layer's recomputed attention scores were made during the next layer's backward, and what
a fused kernel read waited for it. Its reordering for its own estimate of the peak, which
runs after fusion, is walked too (:mod:`.peak_memory_order`): a kernel that frees what it
reads runs first, and what is then written in place differs (issue 17's stack, the cut
keeping the least: 1,649,664 B modelled in the graph's order, 1,457,664 reordered,
measured 1,457,928).
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Container
from typing import Any

import torch
import torch.fx as fx

from .. import graph_meta
from .near_fusion import veto_available
from .peak_memory_order import peak_memory_order, reorders_for_peak_memory
from .products_apart import candidates, foldable, moved
from .storage_walk import Key, Walk, alias_source, read_only_by_fusible, storage_base

__all__ = ["not_allocated", "fused_away", "written_in_place", "folded_into_addmm", "reused"]

_aten, _prims = torch.ops.aten, torch.ops.prims
#: Computed inside the kernels that read them, as the partitioner's fusible ops (Inductor
#: draws random numbers in the kernel from a seed; the partitioner's list predates that).
_ALSO_FUSIBLE = frozenset({_prims.inductor_random.default, _prims.inductor_randint.default,
                           _prims.add.default})  # (an add kept apart from its product)
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


def folded_into_addmm(walk: Walk, fusible: Callable[[fx.Node], bool],
                      apart: Container[fx.Node] = ()) -> dict[Key, fx.Node]:
    """Inductor's ``addmm`` pattern: a matrix product read only by an ``add`` with a tensor
    of its dtype that broadcasts to it is computed by that add (one ``addmm``, where the
    add runs); its storage is never allocated and its inputs live until then. On the
    accelerators Inductor keeps the two apart when the add's readers are all pointwise
    (here: ``fusible``). Of two products added, the second is folded (Inductor's pattern
    with the product second matches first); not the products in ``apart`` (the partitioner
    keeps them apart, :mod:`.products_apart`). Returns each folded product's storage -> the
    add."""
    out: dict[Key, fx.Node] = {}
    for n, add, other in foldable(walk):
        if add not in walk.keys:
            continue
        val, inp = graph_meta.val(n), graph_meta.val(other)
        if inp.dtype != val.dtype or not _expandable(tuple(inp.shape), tuple(val.shape)):
            continue
        if val.device.type != "cpu" and all(fusible(u) for u in add.users):
            continue
        if n in apart:
            continue
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


#: Inductor's lowering realizes (allocates) a pointwise value it would otherwise inline
#: (``StorageBox.should_realize_on_reuse``, ``has_exceeded_max_reads``; torch 2.13
#: defaults, CPU / other): read by more than one op and reading more than 4 storages;
#: reading more than 12 / 8; more than 50 / 30 ops inlined. (It also realizes a value read
#: twice that calls exp, tanh...: on the CPU; but its readers then fuse into one kernel,
#: which drops the buffer - GPT-2's GELU - so that rule is left out.)
_REUSE_READS = 4
_ACC_READS = {"cpu": 12}, 8
_OPS = {"cpu": 50}, 30


def _threshold(table: tuple[dict[str, int], int], device: str) -> int:
    return table[0].get(device, table[1])


def fused_away(walk: Walk, fusible: Callable[[fx.Node], bool],
               reads: Callable[[fx.Node], bool] | None = None) -> set[Key]:
    """The storages of ``walk`` computed inside the kernels that read them: neither given
    nor an output, made by a fusible op (not a reduction) whose every reader in the walk
    (through views) is fusible (``reads``, when given: read inside the kernel), unless
    Inductor's lowering realizes it (``_REUSE_READS``...: counted over what its inlined
    expression reads). Extends the last uses of their inputs in ``walk`` to those
    kernels."""
    in_walk = set(walk.nodes)
    # what each inlined value's expression reads, and its ops (each once, as Inductor's
    # count of a kernel's ops)
    inline: dict[fx.Node, tuple[frozenset[Key], frozenset[fx.Node]]] = {}

    def expression(n: fx.Node) -> tuple[frozenset[Key], frozenset[fx.Node]]:
        read: set[Key] = set()
        ops = {n}
        for a in n.all_input_nodes:
            if a in inline:
                r, o = inline[a]
                read |= r
                ops |= o
            else:
                read.update(k for k in walk.keys.get(a, ()) if k is not None)
        return frozenset(read), frozenset(ops)

    for n in walk.nodes:
        if n.op != "call_function" or n.name in walk.given_names:
            continue
        keys = [k for k in walk.keys.get(n, ()) if k is not None]
        if alias_source(n) is not None:  # a view of an inlined value is inlined too
            if keys and all(walk.maker[k] in inline for k in keys):
                inline[n] = inline[walk.maker[keys[0]]]
            continue
        if not keys or any(k in walk.outputs or k[0] != n.name for k in keys) or \
                not fusible(n) or _reduces(n) or \
                not read_only_by_fusible(n, in_walk, reads or fusible):
            continue
        read, ops = expression(n)
        device = walk.device[keys[0]]
        readers = len(n.users)
        if (readers > 1 and len(read) > _REUSE_READS) or \
                len(read) > _threshold(_ACC_READS, device) or \
                len(ops) > _threshold(_OPS, device):
            continue
        inline[n] = read, ops
    out = {k for n in inline if alias_source(n) is None
           for k in walk.keys.get(n, ()) if k is not None}
    for n in reversed(walk.nodes):  # readers after makers: a chain extends transitively
        for k in walk.keys.get(n, ()):
            if k in out and k[0] == n.name:
                for a in n.all_input_nodes:
                    for ka in walk.keys.get(a, ()):
                        if ka is not None:
                            walk.last[ka] = max(walk.last.get(ka, -1), walk.last[k])
    return out


def _reduces(n: fx.Node) -> bool:
    """A reduction (its value fewer elements than an input's): Inductor allocates it."""
    val = graph_meta.val(n) if graph_meta.has_val(n) else None
    if isinstance(val, (list, tuple)) and val:  # var_mean's mean and variance
        val = val[0]
    if not isinstance(val, torch.Tensor):
        return False
    numel = val.numel()
    return any(isinstance(v := graph_meta.val(a) if graph_meta.has_val(a) else None,
                          torch.Tensor) and v.numel() > numel for a in n.all_input_nodes)


def _layout(node: fx.Node) -> tuple[int, torch.dtype, bool] | None:
    val = graph_meta.val(node) if graph_meta.has_val(node) else None
    if not isinstance(val, torch.Tensor):
        return None
    return val.numel(), val.dtype, val.is_contiguous()


def written_in_place(walk: Walk, away: set[Key], fusible: Callable[[fx.Node], bool],
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
        # in the order the kernel loads them (Inductor takes the first that qualifies)
        found, stack, seen = [], list(reversed(n.all_input_nodes)), set()
        while stack:
            a = stack.pop()
            if a in seen or not same_index(a, numel):
                continue
            seen.add(a)
            for k in walk.keys.get(a, ()):
                if k is None or not same_index(walk.maker[k], numel):
                    continue
                if k in away:  # computed in this kernel: it reads what k's maker reads
                    stack.extend(reversed(walk.maker[k].all_input_nodes))
                else:
                    found.append(k)
        return found

    out: set[Key] = set()
    for pos, n in enumerate(walk.nodes):
        if n.op != "call_function" or not fusible(n) or alias_source(n) is not None or \
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


def unaligned(walk: Walk) -> set[Key]:
    """The storages of ``walk`` Inductor marks unaligned: the outputs of an op it runs as a
    fallback kernel that reads an unaligned storage, which on the CPU every graph input is
    (its ``should_assume_input_aligned``). Its wrapper pools a freed storage by alignment
    too, and allocates only aligned ones: an unaligned storage is never taken."""
    from ..torch_internals import inductor_fallbacks
    out: set[Key] = set()
    for n in walk.nodes:
        if n.op != "call_function" or n.target not in inductor_fallbacks:
            continue
        read = [k for a in n.all_input_nodes for k in walk.keys.get(a, ()) if k is not None]
        if any(k in out or (walk.maker[k].name in walk.given_names and
                            walk.device[k] == "cpu") for k in read):
            out.update(k for k in walk.keys.get(n, ()) if k is not None and k[0] == n.name)
    return out


def reused(walk: Walk, counted: Callable[[Key], bool], peak: int | None = None) -> set[Key]:
    """The storages of ``walk`` Inductor's generated code does not allocate but takes from
    a storage freed earlier (its wrapper's memory planning, ``config.allow_buffer_reuse``):
    a freed storage waits in a pool, by device, dtype and bytes, for the next allocation
    of its kind, which takes the latest freed when holding it across the gap does not
    raise the peak (Inductor's own estimate of the graph: here the walk's, ``counted``
    storages), and otherwise allocates anew. A storage taken is held from its last use
    until the allocation that takes it: the walk's last uses are extended to match. Given
    storages (graph inputs) are never taken."""
    n = len(walk.nodes)
    born: list[list[Key]] = [[] for _ in range(n + 1)]
    freed: list[list[Key]] = [[] for _ in range(n + 1)]
    change = [0] * (n + 2)  # live bytes by position, as index (position -1 is index 0)
    for k, pos in walk.made_at.items():
        if not counted(k):
            continue
        last = walk.last.get(k, pos)
        change[pos + 1] += walk.size[k]
        change[min(last, n - 1) + 2] -= walk.size[k]
        if walk.maker[k].name in walk.given_names or pos < 0:
            continue
        born[pos].append(k)
        if k not in walk.outputs and last < n:
            freed[last].append(k)
    live = list(itertools.accumulate(change[:n + 1]))
    peak = max(live, default=0) if peak is None else peak
    never = unaligned(walk)
    pool: dict[tuple[str, Any, int], list[tuple[Key, int]]] = {}
    into: dict[Key, Key] = {}
    for pos in range(n):
        for k in sorted(born[pos]):
            kind = (walk.device[k], walk.dtype.get(k), walk.size[k])
            if not pool.get(kind) or isinstance(graph_meta.val(walk.maker[k])
                                                if graph_meta.has_val(walk.maker[k])
                                                else None, (list, tuple)):
                continue
            r, at = pool[kind].pop()
            gap = slice(at + 2, pos + 1)  # positions at+1 .. pos-1, as indices
            if at + 1 < pos and max(live[gap]) + walk.size[k] > peak:
                pool[kind].append((r, at))
                continue
            live[gap] = [b + walk.size[k] for b in live[gap]]
            into[k] = r
            while r in into:
                r = into[r]
            walk.last[r] = max(walk.last[r], walk.last.get(k, pos))
        for k in (k for k in freed[pos] if k not in never):
            pool.setdefault((walk.device[k], walk.dtype.get(k), walk.size[k]), []).append(
                (k, pos))
    return set(into)


REORDER = True
PEAK_MEMORY_ORDER = True  # walk in the order of Inductor's reordering for peak memory


def not_allocated(fw_walk: Walk, bw_walk: Walk, joint_of: Callable[[fx.Node], fx.Node | None],
                  fw_counted: Callable[[Key], bool], bw_counted: Callable[[Key], bool]
                  ) -> tuple[set[Key], set[Key]]:
    """The storages of a split's forward and backward walks Inductor does not allocate
    (the module docstring's rules, in the order Inductor applies them), the walks' last
    uses extended to match; ``joint_of``: a walked node's joint-graph node; ``*_counted``:
    the storages each walk counts (reuse is planned over them). The backward may write into
    a kept value (torch donates the saved activations), not into a tangent, a parameter,
    or what the forward also returns to the user."""
    from ..torch_internals import get_default_op_list
    made, read = inductor_fusible(get_default_op_list().is_fusible)

    def donated(k: Key) -> bool:
        j = joint_of(bw_walk.maker[k])
        base = storage_base(j) if j is not None else None
        return base is not None and base.op != "placeholder" and \
            not any(u.op == "output" for u in base.users)

    result = []
    for walk, counted, may_write in ((fw_walk, fw_counted, lambda k: False),
                                     (bw_walk, bw_counted, donated)):
        reorder = REORDER and walk is bw_walk and not veto_available()
        seq, maybe = list(walk.nodes), candidates(walk)
        away = _allocated_away(walk, counted, may_write, made, read, (), reorder)
        apart = _lowering(walk, counted, away, maybe)
        if apart:  # (the walk again, with those products apart)
            walk.reorder(moved(seq, apart))
            away = _allocated_away(walk, counted, may_write, made, read, apart, reorder)
        walk.apart = apart
        result.append(away)
    return result[0], result[1]


def _allocated_away(walk: Walk, counted: Callable[[Key], bool],
                    may_write: Callable[[Key], bool], made: Callable[[fx.Node], bool],
                    read: Callable[[fx.Node], bool], apart: Container[fx.Node],
                    reorder: bool) -> set[Key]:
    """One walk's storages Inductor does not allocate (:func:`not_allocated`); ``reorder``:
    walked in Inductor's order (the backward)."""
    from .inductor_order import inductor_order
    folded = folded_into_addmm(walk, made, apart)
    away = fused_away(walk, made, read) | set(folded)
    # Inductor's orders, as it applies them: its horizontal fusions, then its reordering
    # for its own peak estimate (each asked of the walk as the one before left it)
    orders: list[Callable[[], list[fx.Node]]] = []
    if reorder:
        orders.append(lambda: inductor_order(walk, away, made))
    if PEAK_MEMORY_ORDER and reorders_for_peak_memory():
        orders.append(lambda: peak_memory_order(walk, away, counted))
    for order in orders:
        seq = order()
        if seq is not walk.nodes:
            walk.reorder(seq)
            folded = folded_into_addmm(walk, made, apart)
            away = fused_away(walk, made, read) | set(folded)
    # Inductor weighs a reuse against its estimate of the graph's peak, made over its
    # kernels' outputs before it writes any in place or reuses any
    estimate = walk.sweep(lambda k: counted(k) and k not in away)[0]
    not_in_place = set(folded.values())
    away |= written_in_place(walk, away, lambda n: made(n) and n not in not_in_place,
                             may_write)
    away |= reused(walk, lambda k: counted(k) and k not in away, estimate)
    return away


def _lowering(walk: Walk, counted: Callable[[Key], bool], away: set[Key],
              maybe: dict[fx.Node, fx.Node]) -> dict[fx.Node, fx.Node]:
    """Of the products that could be kept apart (``maybe``: product -> the node after which
    it would run), those whose fold holds the walk's peak (between that node and the add)
    and whose own run apart (its storage beside what is live then) stays below it."""
    if not maybe:
        return {}
    peak, at, _ = walk.sweep(lambda k: counted(k) and k not in away)
    pos = {n: i for i, n in enumerate(walk.nodes)}
    out = {}
    for product, after in maybe.items():
        (add,) = product.users
        if after not in pos or add not in pos or not pos[after] < at <= pos[add]:
            continue
        t = pos[after]
        live = sum(walk.size[k] for k in walk.made_at if counted(k) and k not in away and
                   walk.made_at[k] <= t <= walk.last.get(k, -1))
        if live + walk.size[walk.keys[product][0]] < peak:
            out[product] = after
    return out
