"""Issue 17, the forward graph's own peak under Inductor (``compiler/fused_saves.py``): the
cut keeps the values the forward allocates anyway (a matmul's logits) rather than one
Inductor would fuse away (their ``log_softmax``, which a fused cross-entropy never writes
out).

The quick tests split the joint graph Inductor's decompositions make (``aot_autograd`` with
Inductor's table, no code generation) with and without ``compiler="inductor"``, the
keyword Inductor passes the partitioner; figures are the partitioner's (bytes), no clock.
The slow test compiles Hugging Face GPT-2 with Inductor and measures its peaks (the allocator).
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import sac_compile as sc
from sac_compile.compiler.partition import SACPartitioner
from sac_compile.report import PartitionReport


class _Head(torch.nn.Module):
    """A region (``fc``, save_matmuls) then, outside every region, logits [128, 1024] and
    the cross-entropy of them; ``also_max``: plus the sum of the logits' column maxima (a
    second reader of the logits)."""

    def __init__(self, also_max: bool = False) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(64, 64)
        self.head = torch.nn.Linear(64, 1024, bias=False)
        self.also_max = also_max
        sc.sac_region("save_matmuls", name="block")(self.fc)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.fc(x)))
        loss = F.cross_entropy(logits, y)
        return loss + logits.amax(0).sum() if self.also_max else loss


def _split(compiler: str | None, also_max: bool = False
           ) -> tuple[PartitionReport, list[torch.Tensor]]:
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._inductor.decomposition import select_decomp_table

    from sac_compile.compiler.backend import _SACAotAutograd

    torch.manual_seed(0)
    model = _Head(also_max)
    x, y = torch.randn(128, 64), torch.randint(0, 1024, (128,))
    reports: list[PartitionReport] = []
    partitioner = SACPartitioner(on_partition=reports.append)
    partition = partitioner if compiler is None else \
        functools.partial(partitioner, compiler=compiler)
    backend = _SACAotAutograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop,
                              partition_fn=partition, decompositions=select_decomp_table())
    torch._dynamo.reset()
    torch.compile(model, backend=backend)(x, y).backward()
    return reports[-1], [p.grad for p in model.parameters()]


def test_under_inductor_the_logits_are_kept_not_their_log_softmax():
    """The logits have a second reader (the column maxima) after the cross-entropy's
    kernel in the graph's order; Inductor's reordering for peak memory runs it first, so
    the kernel writes the log_softmax into the logits (its code for this forward:
    ``buf5 = buf1; del buf1  # reuse``). Keeping the log_softmax still holds more: the
    backward's 1.7 MiB against 1.5 keeping the logits, so the cut keeps the logits.
    (Before the model walked that reordering it said the forward allocated 1.2 MiB.)"""
    plain, grads_plain = _split(None, also_max=True)
    fused, grads_fused = _split("inductor", also_max=True)
    kept = lambda r: {s.name: s.nbytes for s in r.saved if s.nbytes >= 4096}  # noqa: E731
    # aot_eager allocates every value: the cheapest cut, the log_softmax (512 KiB), as before
    assert kept(plain) == {"primals_1": 32768, "primals_4": 262144, "tanh": 32768,
                           "sub_1": 524288, "eq": 131072}
    assert not any("not kept under Inductor" in n for n in plain.notes)
    # under Inductor: the logits (allocated by the matmul anyway) and what the backward
    # needs to recompute the log_softmax and the maxima's gradient from them
    assert kept(fused) == {"primals_1": 32768, "primals_4": 262144, "tanh": 32768,
                           "mm": 524288, "amax_1": 4096}
    assert fused.recompute_flops == plain.recompute_flops  # (pointwise ops: no FLOPs)
    note = next(n for n in fused.notes if n.startswith("not kept under Inductor"))
    assert "1 values (512 KiB; sub_1)" in note
    assert "forward 677.0 KiB -> 549.0 KiB, backward 1.7 MiB -> 1.5 MiB" in note, note
    for g, r in zip(grads_fused, grads_plain):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-7)


def test_under_inductor_a_log_softmax_written_into_its_logits_stays_kept():
    """The cross-entropy alone: its kernel writes the log_softmax into the logits' storage
    (they die there; Inductor's in-place update, as its code for GPT-2 does), so keeping it
    allocates nothing more than keeping the logits: the cheapest cut stands (before issue
    27's in-place rule the model took the logits, for a forward 1.0 MiB -> 545 KiB that
    Inductor never allocated)."""
    plain, _ = _split(None)
    fused, _ = _split("inductor")
    kept = lambda r: {s.name: s.nbytes for s in r.saved if s.nbytes >= 4096}  # noqa: E731
    assert kept(plain) == kept(fused) == {"primals_1": 32768, "primals_4": 262144,
                                          "tanh": 32768, "sub_1": 524288}
    assert not any("not kept under Inductor" in n for n in fused.notes)


def test_fused_peak_model_counts_what_inductor_allocates():
    """``cut_peaks(fused=True)``: the pointwise chain of a log_softmax is not allocated, but
    the matmul output it reads lives until the fused kernel that reads it ran, which writes
    its output into it."""
    import torch.fx as fx

    from sac_compile.compiler.peak import cut_peaks
    from sac_compile.cut.network import classify

    aten = torch.ops.aten
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    tangent = g.placeholder("tangents_1")
    for n, v in ((x, torch.empty(128, 64)), (w, torch.empty(64, 1024)),
                 (tangent, torch.empty(128, 1024))):
        n.meta["val"] = v
    mm = g.call_function(aten.mm.default, (x, w))
    amax = g.call_function(aten.amax.default, (mm, [1], True))
    sub = g.call_function(aten.sub.Tensor, (mm, amax))
    exp = g.call_function(aten.exp.default, (sub,))
    out = g.call_function(aten.sub.Tensor, (sub, exp))
    grad = g.call_function(aten.mul.Tensor, (tangent, out))
    for n, v in ((mm, torch.empty(128, 1024)), (amax, torch.empty(128, 1)),
                 (sub, torch.empty(128, 1024)), (exp, torch.empty(128, 1024)),
                 (out, torch.empty(128, 1024)), (grad, torch.empty(128, 1024))):
        n.meta["val"] = v
    g.output((out, grad))
    gm = fx.GraphModule({}, g)
    cls = classify(gm, 1)
    mib = 512 * 1024
    # in graph order, every value allocated: sub, exp and out at once (mm died at sub)
    assert cut_peaks(gm.graph, cls, [x, w, out])[0] == 3 * mib
    # as Inductor allocates (torch's is_materialized rule): sub and exp never; mm lives
    # until out's kernel, which reads it, ran - and writes out into it (mm dies there; the
    # in-place update, issue 27): mm and amax (512 B) at once
    assert cut_peaks(gm.graph, cls, [x, w, out], fused=True)[0] == mib + 512


@pytest.mark.slow
def test_hf_gpt2_forward_peak_under_inductor_not_above_torchs():
    """Hugging Face GPT-2 (4 layers, width 256, 4x128 tokens), each decoder layer a
    save_matmuls region (torch: its SAC, the same op list), compiled with Inductor: the
    allocator's forward peak with our partitioner is no higher than with torch's, and the
    step's within 1% (Inductor's own estimate of the forward was 47,329,376 B against
    41,430,160 B when the log_softmax of the 8 MiB logits was kept beside them; measured
    now, 29,914 KiB: the log_softmax is written into the logits). Measured, not estimated:
    Inductor's estimate misses that in-place write."""
    pytest.importorskip("transformers")
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from peak_hf import tagged_model
    from sac_compile.compiler import make_backend
    from sac_compile.measured_peak import measured_peak

    def peaks(who: str) -> tuple[int, int]:
        model, inputs = tagged_model("gpt2", "bench", "layers save_matmuls", who)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=make_backend() if who == "ours" else "inductor")

        def step(m=None):
            loss = compiled(*inputs)
            if m is not None:
                m.mark("backward")
            loss.backward()
            model.zero_grad(set_to_none=True)

        torch.manual_seed(0)
        step()  # compiles
        torch.manual_seed(0)
        with measured_peak() as m:
            step(m)
        return m.peak("step"), m.peak()

    theirs, ours = peaks("torch"), peaks("ours")
    assert ours[0] <= theirs[0], (ours, theirs)
    assert ours[1] <= theirs[1] * 1.01, (ours, theirs)
