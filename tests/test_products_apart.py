"""Inductor's addmm fold kept apart where it would hold more (compiler.products_apart): a
product read only by an add far below it runs right after its operands' other readers,
and the add is one Inductor's pattern does not fold; the step's measured peak falls by
what the fold held (the tied head's logits' gradient), the gradients are eager's."""
from __future__ import annotations

import gc

import torch
import torch.fx as fx

import sac_compile as sc
from fixtures.op_graph import OpGraph
from fixtures.step_models import TiedLM
from sac_compile import policies
from sac_compile._bench.models import GPTBlock
from sac_compile.compiler import make_backend, partition
from sac_compile.compiler.products_apart import candidates, keep_products_apart
from sac_compile.compiler.storage_walk import Walk
from sac_compile.measured_peak import measured_peak
from sac_compile.torch_internals import dynamo_reset, functorch_config, inductor_config

aten, prims = torch.ops.aten, torch.ops.prims


def _graph(late_add: bool, operand_read_late: bool = False,
           bias: bool = False) -> fx.GraphModule:
    """g (64x256, made here) -> w_grad = g^T @ h (256x8); the add of another gradient to
    it right away or after eight more ops; ``operand_read_late``: g read after the add."""
    g = OpGraph()
    x, h = g.input("x", 64, 256), g.input("h", 64, 8)
    other = g.input("other", 8 if bias else 256, 8)
    grad = g.op(aten.mul.Tensor, (x, 2.0), 64, 256)
    product = g.op(aten.mm.default, (g.op(aten.t.default, (grad,), 256, 64), h), 256, 8)
    y = h
    for _ in range(8 if late_add else 0):
        y = g.op(aten.sin.default, (y,), 64, 8)
    outs = [g.op(aten.add.Tensor, (other, product), 256, 8), y]
    if operand_read_late:
        outs.append(g.op(aten.sum.default, (grad,)))
    g.g.output(tuple(outs))
    return fx.GraphModule(torch.nn.Module(), g.g)


def _candidates(gm: fx.GraphModule) -> dict[str, str]:
    nodes = list(gm.graph.nodes)
    walk = Walk([n for n in nodes if n.op != "placeholder"],
                given=[n for n in nodes if n.op == "placeholder"])
    return {p.name: after.name for p, after in candidates(walk).items()}


def test_a_product_added_far_below_can_run_after_its_operands_readers_and_add_apart():
    gm = _graph(late_add=True)
    apart = _candidates(gm)
    assert list(apart.values()) == ["t_default"]  # (right after g's last other reader, its view)
    assert keep_products_apart(gm, apart) == 1
    order = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert order[:3] == [aten.mul.Tensor, aten.t.default, aten.mm.default]
    assert prims.add.default in order and aten.add.Tensor not in order
    x, h, other = torch.randn(64, 256), torch.randn(64, 8), torch.randn(256, 8)
    assert torch.equal(gm(x, h, other)[0], other + (x * 2.0).t() @ h)


def test_a_fold_that_holds_nothing_more_is_no_candidate():
    cases = {"the add runs next": _graph(late_add=False),
             "its operand is read after the add": _graph(late_add=True, operand_read_late=True),
             "the add broadcasts (a bias)": _graph(late_add=True, bias=True)}
    assert {why: _candidates(gm) for why, gm in cases.items()} == dict.fromkeys(cases, {})


def _step(model: TiedLM, tokens: torch.Tensor, apart: bool, monkeypatch) -> tuple:
    """The measured peak of the second step of ``model`` compiled whole under Inductor,
    its report and the gradients; ``apart=False``: the pass switched off."""
    if not apart:
        monkeypatch.setattr(partition, "_keep_products_apart", lambda gm, split, fusing: 0)
    reports: list = []
    dynamo_reset()
    run = torch.compile(model, backend=make_backend(on_partition=reports.append))
    # no caches: each run partitions (the two share Dynamo's graph and our uuid)
    with functorch_config.patch(enable_autograd_cache=False), \
            inductor_config.patch(force_disable_caches=True):
        run(tokens).backward()
        model.zero_grad(set_to_none=True)
        gc.collect()
        with measured_peak() as m:
            run(tokens).backward()
    monkeypatch.undo()
    dynamo_reset()
    return m.bytes, reports[-1], [p.grad for p in model.parameters()]


def test_the_tied_heads_gradient_is_not_held_across_the_backward(monkeypatch):
    torch.manual_seed(0)
    model = TiedLM()
    tokens = torch.randint(0, 256, (4, 64))
    model(tokens).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    sc.apply_regions(model, policies.recompute_all, where=GPTBlock)
    folded, report_folded, _ = _step(model, tokens, False, monkeypatch)
    apart, report, grads = _step(model, tokens, True, monkeypatch)
    assert (report_folded.products_apart, report.products_apart) == (0, 1)
    logits_grad, weight_grad = 256 * 256 * 4, 256 * 64 * 4
    assert folded - apart >= logits_grad - weight_grad
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_without_regions_the_tied_heads_fold_stays(monkeypatch):
    """Every activation kept: the backward peaks at its start, where the head's product
    would run apart beside them; the model leaves the fold to Inductor."""
    torch.manual_seed(0)
    model = TiedLM()
    tokens = torch.randint(0, 256, (4, 64))
    _, report, _ = _step(model, tokens, True, monkeypatch)
    assert report.products_apart == 0
