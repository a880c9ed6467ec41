"""Issue 27: the peak model as Inductor allocates (``compiler/inductor_alloc.py``), rule by
rule, on hand-built graphs; figures are bytes, no compiling, no clock. The rules are read
off Inductor's generated code (``benchmarks/peak_measured.py``, README "Measured, and the
model against it"); ``tests/test_measured_peak.py`` holds the whole model to the allocator.
"""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from fixtures.op_graph import OpGraph
from sac_compile.compiler import inductor_alloc as ia
from sac_compile.compiler.peak import cut_peaks
from sac_compile.compiler.storage_walk import Walk
from sac_compile.cut.network import classify

aten, prims = torch.ops.aten, torch.ops.prims
KIB = 1024


def _everything(walk: Walk):
    return lambda k: k[0] not in walk.given_names


def _graph_walk(graph: fx.Graph) -> Walk:
    """The walk of ``graph``'s nodes, its placeholders given."""
    nodes = list(graph.nodes)
    return Walk([n for n in nodes if n.op != "placeholder"],
                given=[n for n in nodes if n.op == "placeholder"])


def _fusible(n: fx.Node) -> bool:
    from sac_compile.torch_internals import get_default_op_list
    return get_default_op_list().is_fusible(n)


# -- written in place ------------------------------------------------------------------------

def _joint(read: str = "h", dtype=torch.float32) -> tuple[fx.GraphModule, list[fx.Node]]:
    """h = x @ w (256 KiB, kept) then relu; backward: d = tangent * h (``read="h"``), or
    tangent * h.T (``"transposed"``), or tangent * 2 (``"tangent"``); then w's gradient
    x.T @ d. Returns the joint graph and the cut's kept values (x, w, h)."""
    b = OpGraph()
    x, w = b.input("primals_1", 256, 64), b.input("primals_2", 64, 256)
    tangent = b.input("tangents_1", 256, 256, dtype=dtype)
    h = b.op(aten.mm.default, (x, w), 256, 256)
    out = b.op(aten.relu.default, (h,), 256, 256)
    if read == "tangent":
        d = b.op(aten.mul.Tensor, (tangent, 2.0), 256, 256, dtype=dtype)
    else:
        other = h
        if read == "transposed":
            other = b.g.call_function(aten.t.default, (h,))
            other.meta["val"] = torch.empty(256, 256).t()
        d = b.op(aten.mul.Tensor, (tangent, other), 256, 256, dtype=dtype)
    gw = b.op(aten.mm.default, (b.op(aten.t.default, (x,), 64, 256), d), 64, 256)
    b.g.output((out, gw))
    return fx.GraphModule({}, b.g), [x, w, h]


def _bw_peaks(gm: fx.GraphModule, kept: list[fx.Node]) -> tuple[int, int]:
    cls = classify(gm, 1)
    return cut_peaks(gm.graph, cls, kept)[1], cut_peaks(gm.graph, cls, kept, fused=True)[1]


def test_a_pointwise_gradient_is_written_into_the_kept_value_it_reads_last():
    """The backward's d = tangent * h: h (a kept value, donated by torch) dies in d's kernel,
    which writes d into it: the peak is h and the tangent, not those and d."""
    assert _bw_peaks(*_joint()) == (3 * 256 * KIB, 2 * 256 * KIB)


@pytest.mark.parametrize("read", ["tangent", "transposed"])
def test_nothing_is_written_into_a_tangent_or_through_a_transpose(read):
    """torch does not donate the tangent; h read through its transpose is read at another
    index than d is written: d is allocated."""
    plain, fused = _bw_peaks(*_joint(read))
    assert fused == plain


def test_nothing_is_written_into_a_storage_of_another_dtype():
    plain, fused = _bw_peaks(*_joint(dtype=torch.float64))
    assert fused == plain


# -- reuse of freed storages ------------------------------------------------------------------

def _chain(big: int) -> Walk:
    """a = x @ w1 (64 KiB); b = a @ w2 (``big`` KiB); c = b @ w3 (64 KiB); d = c @ w1: a
    dies at b, and c is of a's kind."""
    b = OpGraph()
    x = b.input("x", 128, 128)
    w1, w2, w3 = b.input("w1", 128, 128), b.input("w2", 128, big * 2), \
        b.input("w3", big * 2, 128)
    a = b.op(aten.mm.default, (x, w1), 128, 128)
    m = b.op(aten.mm.default, (a, w2), 128, big * 2)
    c = b.op(aten.mm.default, (m, w3), 128, 128)
    d = b.op(aten.mm.default, (c, w1), 128, 128)
    b.g.output((d,))
    nodes = list(b.g.nodes)
    return Walk([n for n in nodes if n.op != "placeholder"],
                 given=[n for n in nodes if n.op == "placeholder"])


def test_a_freed_storage_is_taken_by_the_next_allocation_of_its_kind():
    """c takes a's storage (freed when b ran, the node before): nothing new allocated, a's
    storage held until c's last use, the peak unchanged."""
    walk = _chain(1024)
    a, _, c, _ = (n.name for n in walk.nodes[:4])
    plain = walk.sweep(_everything(walk))[0]
    taken = ia.reused(walk, _everything(walk))
    assert taken == {(c, 0)}
    assert walk.sweep(lambda k: _everything(walk)(k) and k not in taken)[0] == plain
    assert walk.last[(a, 0)] == walk.last[(c, 0)]


def test_a_storage_is_not_held_across_a_gap_that_would_raise_the_peak():
    """d's kind is a's, freed two nodes before: holding it across b's allocation (the
    peak) would raise the peak, so d is allocated anew; with a higher estimate of the peak
    to weigh against (Inductor's own), it is held and the peak includes it."""
    b = OpGraph()
    x, w = b.input("x", 128, 128), b.input("w", 128, 128)
    wide = b.input("wide", 128, 2048)
    a = b.op(aten.mm.default, (x, w), 128, 128)           # 64 KiB
    s = b.op(aten.mm.default, (a, w), 128, 128)           # 64 KiB: a dies here
    big = b.op(aten.mm.default, (s, wide), 128, 2048)     # 1 MiB: the peak
    t = b.op(aten.sum.dim_IntList, (big, [1], True), 128, 1)
    d = b.op(aten.mul.Tensor, (x, t), 128, 128)           # 64 KiB, a's kind
    b.g.output((d, s))
    nodes = list(b.g.nodes)
    seq = [n for n in nodes if n.op != "placeholder"]
    given = [n for n in nodes if n.op == "placeholder"]
    walk = Walk(seq, given=given)
    plain = walk.sweep(_everything(walk))[0]
    assert ia.reused(walk, _everything(walk)) == set()
    walk = Walk(seq, given=given)
    taken = ia.reused(walk, _everything(walk), plain + 64 * KIB)
    assert taken == {(d.name, 0)}
    assert walk.sweep(lambda k: _everything(walk)(k) and k not in taken)[0] == \
        plain + 64 * KIB


@pytest.mark.parametrize("reads", ["an input", "a value it made"])
def test_a_fallback_kernels_outputs_read_from_a_cpu_input_are_never_taken(reads):
    """Attention's backward is a fallback kernel: on the CPU every graph input is unaligned
    (Inductor's ``should_assume_input_aligned``), and so is what a fallback makes from one;
    Inductor pools a freed storage by alignment and allocates aligned ones only. Its
    output freed, the next allocation of its size takes it only where the kernel read a
    storage the graph made (HF GPT-2's backward reads its saved q, k, v: none taken)."""
    b = OpGraph()
    kept = b.input("addmm_12", 1, 1, 128, 32)
    w = b.input("w", 32, 32)
    q = b.op(aten.mul.Tensor, (kept, 2.0), 1, 1, 128, 32) if reads == "a value it made" \
        else kept
    grads = b.g.call_function(aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                              (q, q, q, q, q, q))
    grads.meta["val"] = [torch.empty(1, 1, 128, 32) for _ in range(3)]
    gq = b.g.call_function(__import__("operator").getitem, (grads, 0))
    gq.meta["val"] = grads.meta["val"][0]
    flat = b.op(aten.view.default, (gq, [128, 32]), 128, 32)
    after = b.op(aten.mm.default, (flat, w), 128, 32)      # gq dies: its kind
    again = b.op(aten.mm.default, (after, w), 128, 32)     # the next of that kind
    b.g.output((again,))
    walk = _graph_walk(b.g)
    assert ia.unaligned(walk) == ({(grads.name, i) for i in range(3)}
                                  if reads == "an input" else set())
    taken = ia.reused(walk, _everything(walk))
    assert ((again.name, 0) in taken) == (reads == "a value it made")


# -- addmm, random numbers, realized values --------------------------------------------------

def test_a_product_read_only_by_an_add_is_made_where_the_add_runs():
    """add(mm(a, b), c) on the CPU is one addmm: the product's storage is never allocated
    and a, b are read at the add. Of two products added, the second is folded."""
    g = OpGraph()
    a, bb, c = g.input("a", 128, 64), g.input("b", 64, 128), g.input("c", 128, 128)
    p = g.op(aten.mm.default, (a, bb), 128, 128)
    q = g.op(aten.mm.default, (a, bb), 128, 128)
    s = g.op(aten.add.Tensor, (p, q), 128, 128)
    late = g.op(aten.relu.default, (c,), 128, 128)
    s2 = g.op(aten.add.Tensor, (g.op(aten.mm.default, (a, bb), 128, 128), late), 128, 128)
    g.g.output((s, s2))
    nodes = list(g.g.nodes)
    walk = Walk([n for n in nodes if n.op != "placeholder"],
                 given=[n for n in nodes if n.op == "placeholder"])
    folded = ia.folded_into_addmm(walk, _fusible)
    assert {k[0]: add for k, add in folded.items()} == {q.name: s, s2.args[0].name: s2}
    assert walk.last[(a.name, 0)] == walk.nodes.index(s2)  # (its last reader, the addmm)


def _far_add(early: bool) -> tuple[Walk, fx.Node]:
    """g = x * 2 (256 KiB, made in the walk) dies at p = g^T @ h (32 KiB); p's add runs
    eight ops later. ``early``: another 256 KiB value alive while p runs (the walk's peak
    there, as a backward's start with every activation kept)."""
    g = OpGraph()
    x, h, other = g.input("x", 256, 256), g.input("h", 256, 32), g.input("o", 256, 32)
    grad = g.op(aten.mul.Tensor, (x, 2.0), 256, 256)
    big = g.op(aten.mul.Tensor, (x, 3.0), 256, 256) if early else None
    product = g.op(aten.mm.default, (g.op(aten.t.default, (grad,), 256, 256), h), 256, 32)
    outs = [g.op(aten.mm.default, (big, h), 256, 32)] if early else []
    y = h
    for _ in range(8):
        y = g.op(aten.sin.default, (y,), 256, 32)
    g.g.output((g.op(aten.add.Tensor, (other, product), 256, 32), y, *outs))
    walk = _graph_walk(g.g)
    return walk, product


@pytest.mark.parametrize("early", [False, True])
def test_a_product_is_kept_apart_where_its_fold_holds_the_peak(early):
    """Folded, g lives to the add: the walk's peak between. Kept apart, p runs after g's
    last other reader and g dies there (the model does not fold it); but not where p's
    own run, beside g, would be the new peak (``early``)."""
    walk, product = _far_add(early)
    everything = _everything(walk)
    ia.not_allocated(Walk([]), walk, lambda n: n, everything, everything)
    if early:
        assert walk.apart == {}
    else:
        assert list(walk.apart) == [product]
        grad = product.args[0].args[0]
        assert walk.last[(grad.name, 0)] == walk.nodes.index(product)

def test_random_numbers_are_drawn_inside_the_kernel_that_reads_them():
    g = OpGraph()
    seed = g.input("seed", dtype=torch.int64)
    x = g.input("x", 256, 256)
    r = g.op(prims.inductor_random.default, ([256, 256], seed, "rand"), 256, 256)
    keep = g.op(aten.gt.Scalar, (r, 0.1), 256, 256, dtype=torch.bool)
    y = g.op(aten.mul.Tensor, (x, keep), 256, 256)
    g.g.output((y,))
    walk = _graph_walk(g.g)
    made, read = ia.inductor_fusible(_fusible)
    assert ia.fused_away(walk, made, read) == {(r.name, 0), (keep.name, 0)}


@pytest.mark.parametrize("inputs,allocated", [(4, False), (5, True)])
def test_a_value_read_twice_is_allocated_when_it_reads_more_than_four_storages(inputs,
                                                                             allocated):
    """Inductor's lowering realizes a pointwise value with two readers whose inlined
    expression reads more than 4 storages (``realize_reads_threshold``); fewer, and it is
    computed in both readers' kernels."""
    g = OpGraph()
    xs = [g.input(f"x{i}", 64, 64) for i in range(inputs)]
    s = xs[0]
    for x in xs[1:]:
        s = g.op(aten.add.Tensor, (s, x), 64, 64)
    r1 = g.op(aten.relu.default, (s,), 64, 64)
    r2 = g.op(aten.neg.default, (s,), 64, 64)
    w = g.input("w", 64, 64)
    o1, o2 = g.op(aten.mm.default, (r1, w), 64, 64), g.op(aten.mm.default, (r2, w), 64, 64)
    g.g.output((o1, o2))
    walk = _graph_walk(g.g)
    away = ia.fused_away(walk, _fusible)
    assert ((s.name, 0) not in away) is allocated
    assert (r1.name, 0) not in away  # read by a matrix product: allocated


# -- Inductor's order: horizontal fusion -----------------------------------------------------

def test_kernels_reading_the_same_storage_run_together_where_the_first_ran():
    """Two softmax-like kernels read the mask (as two layers' recomputed attention does):
    fused, the second runs with the first, so the product it reads (b2, 64 KiB) is made
    before it - and alive across what ran between them."""
    from sac_compile.compiler.inductor_order import inductor_order
    g = OpGraph()
    mask, x, w = g.input("mask", 128, 128), g.input("x", 128, 128), g.input("w", 128, 128)
    b1 = g.op(aten.mm.default, (x, w), 128, 128)
    k1 = g.op(aten.mul.Tensor, (b1, mask), 128, 128)
    o1 = g.op(aten.mm.default, (k1, w), 128, 128)
    b2 = g.op(aten.mm.default, (o1, w), 128, 128)  # between: depends on neither kernel's...
    b2.args = (x, w)                                # ...output (read from the inputs)
    k2 = g.op(aten.mul.Tensor, (b2, mask), 128, 128)
    o2 = g.op(aten.mm.default, (k2, w), 128, 128)
    g.g.output((o1, o2))
    walk = _graph_walk(g.g)
    order = [n.name for n in inductor_order(walk, set(), _fusible) if n.op != "output"]
    assert order.index(b2.name) < order.index(k1.name) and \
        order.index(k2.name) == order.index(k1.name) + 1 and \
        order.index(o1.name) > order.index(k2.name)


# -- Inductor's order: its reordering for peak memory ----------------------------------------

def _gelu_backward_graph() -> tuple[fx.Graph, dict[str, fx.Node]]:
    """A backward as issue 17's stack recomputes a block's GELU (256 KiB each value): ``m``
    the GELU output's gradient (a product), ``u`` the GELU recomputed from the kept ``a``,
    ``w1`` its weight's gradient (read from u), ``v`` the GELU's backward (reads m and a),
    ``x`` the input's gradient; in that order, as autograd runs them."""
    g = OpGraph()
    t, w = g.input("tangents_1", 256, 64), g.input("primals_2", 64, 256)
    a = g.input("addmm_10", 256, 256)  # a saved activation: Inductor may free it
    m = g.op(aten.mm.default, (t, w), 256, 256)
    u = g.op(aten.gelu.default, (a,), 256, 256)
    w1 = g.op(aten.mm.default, (t, u), 64, 256)
    v = g.op(aten.mul.Tensor, (m, a), 256, 256)
    x = g.op(aten.mm.default, (v, w), 256, 64)
    g.g.output((w1, x))
    return g.g, dict(m=m, u=u, w1=w1, v=v, x=x, a=a)


def test_kernels_run_in_the_order_inductor_finds_for_its_peak_estimate():
    """Inductor reorders its kernels greedily for its own peak estimate (least peak memory
    first): the GELU's backward runs before the GELU's recompute (it frees the product it
    reads), and each is then written into a storage that dies in it - v into m, u into the
    kept a - where in autograd's order u was allocated beside a (issue 17's stack: the step
    measured 1,457,928 B, modelled 1,649,664 in autograd's order, 1,457,664 in this)."""
    from sac_compile.compiler.peak_memory_order import peak_memory_order
    graph, n = _gelu_backward_graph()
    walk = _graph_walk(graph)
    counted = _everything(walk)
    assert ia.written_in_place(walk, set(), _fusible, lambda k: True) == {(n["v"].name, 0)}
    order = peak_memory_order(walk, set(), counted)
    assert [x.name for x in order if x.op == "call_function"] == \
        [n[k].name for k in ("m", "v", "x", "u", "w1")]
    walk.reorder(order)
    assert ia.written_in_place(walk, set(), _fusible, lambda k: True) == \
        {(n["v"].name, 0), (n["u"].name, 0)}


def test_the_graphs_order_is_kept_where_the_reordering_finds_no_lower_estimate():
    """A chain (each kernel reads the one before): nothing to reorder, the walk's own list
    comes back."""
    from sac_compile.compiler.peak_memory_order import peak_memory_order
    g = OpGraph()
    x = g.input("x", 128, 128)
    y = g.op(aten.relu.default, (g.op(aten.mm.default, (x, x), 128, 128),), 128, 128)
    g.g.output((g.op(aten.mm.default, (y, x), 128, 128),))
    nodes = list(g.g.nodes)
    walk = Walk([n for n in nodes if n.op != "placeholder"],
                given=[n for n in nodes if n.op == "placeholder"])
    assert peak_memory_order(walk, set(), _everything(walk)) is walk.nodes


def test_the_greedy_order_runs_each_kernel_after_the_kernels_it_reads():
    """Inductor's greedy order (least peak first) is an order of all the kernels in which
    every kernel runs after the kernels whose buffers it reads; its estimate is the
    graph's order's less the GELU's recompute held beside the product."""
    from sac_compile.compiler.peak_memory_order import _Kernels
    graph, n = _gelu_backward_graph()
    walk = _graph_walk(graph)
    kernels = _Kernels(walk, set(), lambda k: True)  # (the given values counted too)
    assert [k.name for k in kernels.order] == [n[k].name for k in ("m", "u", "w1", "v", "x")]
    assert [kernels.size(k) for k in kernels.freeable] == [256 * KIB]  # a, not t or w
    order = kernels.least_peak_first()
    assert sorted(order, key=str) == sorted(kernels.order, key=str)
    ran = {k: i for i, k in enumerate(order)}
    assert all(ran[kernels.maker[r]] < ran[k] for k in order for r in kernels.reads[k]
               if r in kernels.maker)
    # graph order: a, m, u and w1 at once (832 KiB); greedy: a, m and v (768 KiB)
    assert kernels.estimate(kernels.order) == 832 * KIB
    assert kernels.estimate(kernels.least_peak_first()) == 768 * KIB
