"""Untagged parts of a graph (what lies outside every region: an embedding before the
layers, a loss after them) are partitioned no worse than torch's own partitioner would.

Each test captures the joint graph AOTAutograd hands the partitioner, runs torch's
``min_cut_rematerialization_partition`` on a copy of it and ours on the graph itself, and
compares the bytes each forward keeps for backward (inputs and parameters excluded) from
nodes outside every region, and from those in the graph's tail: the last forward matmul (a
language model's head) and what follows it (its loss). Ours must be at most upstream's.

The case behind it (issue 10): HF's cross-entropy after a Llama model, under Inductor's
decompositions and joint-graph passes. ``nll_loss_backward`` becomes
``where(iota == expand(target), -1, 0)``: an ``eq`` that only the backward needs, with no
tangent among its inputs. Upstream computes such a node in backward. We banned its
recompute as a "reduction" (its output, N x V bools, is under a quarter of its expanded
int64 input), so the cut computed it in forward and kept it: 10,308 bytes kept outside the
layers where upstream keeps 8,724. Upstream's bans apply only to nodes the forward's
outputs need; a node only the backward needs is computed there at no extra cost.

No Inductor code generation: the slow part of Inductor is not needed to see a partition.
The HF case runs AOTAutograd with Inductor's decompositions and its joint-graph passes
(``torch._inductor.compile_fx.partition_fn``), and no-op compilers.
"""
from __future__ import annotations

import copy
import functools
import inspect

import pytest
import torch
import torch.nn as nn
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from sac_compile import policies, sac_region
from sac_compile.compiler import SACPartitioner
from sac_compile.cut import costs
from sac_compile.compiler.tagging import sac_partitioning

# --------------------------------------------------------------------------------------
# Both partitioners on one joint graph
# --------------------------------------------------------------------------------------

def _saved_nodes(joint: torch.fx.GraphModule, bw: torch.fx.GraphModule,
                 static_idx: set[int]) -> list[torch.fx.Node]:
    """The joint graph's nodes the backward receives from the forward: not tangents,
    parameters (static inputs), SymInts or other inputs."""
    nodes = {n.name: n for n in joint.graph.nodes}
    primals = [n.name for n in joint.graph.find_nodes(op="placeholder")
               if n.name.startswith("primals")]
    static = {primals[i] for i in static_idx if i < len(primals)}
    out = []
    for p in bw.graph.find_nodes(op="placeholder"):
        n = nodes.get(p.name)
        if n is None or n.op == "placeholder" or n.name in static or costs.is_sym(n):
            continue
        out.append(n)
    return out


class Split:
    """What one partitioner's forward keeps: per node, its op, bytes and region, and
    whether it lies in the graph's tail (the last forward matmul and what follows it: a
    language model's head and its loss)."""

    def __init__(self, nodes: list[torch.fx.Node], regions: dict[str, str],
                 tail: set[str]) -> None:
        self.kept = {n.name: (costs.op_label(n), costs.nbytes(n), regions.get(n.name, ""))
                     for n in nodes}
        self.tail = tail

    @property
    def outside(self) -> int:
        """Bytes kept from nodes outside every region."""
        return sum(b for _, b, region in self.kept.values() if not region)

    @property
    def tail_outside(self) -> int:
        """Bytes kept from the tail's nodes outside every region."""
        return sum(b for name, (_, b, region) in self.kept.items()
                   if not region and name in self.tail)

    @property
    def total(self) -> int:
        return sum(b for _, b, _ in self.kept.values())

    def __repr__(self) -> str:
        rows = [f"{name} {op} {b} {region or '-'}{' (tail)' if name in self.tail else ''}"
                for name, (op, b, region) in self.kept.items()]
        return (f"Split(outside={self.outside}, tail_outside={self.tail_outside}, "
                f"total={self.total}:\n  " + "\n  ".join(rows) + ")")


_MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
            torch.ops.aten.bmm.default)


def _tail(gm: torch.fx.GraphModule) -> set[str]:
    """Names of the nodes from the last matmul before the backward's first op on."""
    nodes = list(gm.graph.nodes)
    tangents = {n for n in gm.graph.find_nodes(op="placeholder") if "tangents" in n.name}
    first_bw = next(i for i, n in enumerate(nodes) if tangents & set(n.all_input_nodes))
    last_mm = max(i for i, n in enumerate(nodes[:first_bw]) if n.target in _MATMULS)
    return {n.name for n in nodes[last_mm:] if n.op != "placeholder"}


class BothPartitioners(SACPartitioner):
    """Ours, after running upstream's ``min_cut_rematerialization_partition`` on a copy of
    the same joint graph; ``self.pairs`` holds ``(upstream, ours)`` per split."""

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.pairs: list[tuple[Split, Split]] = []

    def __call__(self, gm, joint_inputs, **kwargs):
        from torch._functorch.partitioners import min_cut_rematerialization_partition
        static_idx = set(kwargs.get("static_lifetime_input_indices") or ())
        regions = {n.name: n.meta["sac_region_path"][-1] for n in gm.graph.nodes
                   if n.meta.get("sac_region_path")}
        tail = _tail(gm)
        theirs = copy.deepcopy(gm)
        _, up_bw = min_cut_rematerialization_partition(
            theirs, joint_inputs, **{"compiler": "inductor", **kwargs})
        fw, bw = super().__call__(gm, joint_inputs, **kwargs)
        self.pairs.append((Split(_saved_nodes(theirs, up_bw, static_idx), regions, tail),
                           Split(_saved_nodes(gm, bw, static_idx), regions, tail)))
        return fw, bw


def _boxed(gm, example_inputs):
    return make_boxed_func(gm.forward)


def capture_backend(partitioner: BothPartitioners, *, inductor_passes: bool = False):
    """AOTAutograd with no-op compilers and ``partitioner``; with ``inductor_passes``,
    Inductor's decompositions and joint-graph passes run first, as in ``compile_fx``."""
    kwargs = {}
    partition_fn = partitioner
    if inductor_passes:
        from torch._inductor import compile_fx
        from torch._inductor.decomposition import select_decomp_table
        if "partitioner_fn_override" not in inspect.signature(compile_fx.partition_fn).parameters:
            pytest.skip("this torch's compile_fx.partition_fn takes no partitioner override")
        partition_fn = functools.partial(compile_fx.partition_fn,
                                         partitioner_fn_override=partitioner)
        kwargs["decompositions"] = select_decomp_table()
    backend = aot_autograd(fw_compiler=_boxed, bw_compiler=_boxed, partition_fn=partition_fn,
                           **kwargs)

    def sac_capture(gm, example_inputs):
        with sac_partitioning():
            return backend(gm, example_inputs)
    return sac_capture


@pytest.fixture
def no_autograd_cache():
    with torch._functorch.config.patch(enable_autograd_cache=False):
        yield


def assert_no_worse(pairs: list[tuple[Split, Split]], what: str = "outside") -> None:
    assert pairs, "nothing was partitioned"
    for upstream, ours in pairs:
        assert getattr(ours, what) <= getattr(upstream, what), \
            f"{what}: upstream {upstream}\nours {ours}"


# --------------------------------------------------------------------------------------
# Pure torch: a cross-entropy whose backward builds a one-hot from an expanded target
# --------------------------------------------------------------------------------------

N, D, V = 32, 16, 64


class OneHotCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``logits[N, V]``, with the backward of Inductor's form of
    HF's loss: ``nll_loss_backward`` as a one-hot, ``expand(target) == arange(V)``, scaled
    by the incoming gradient on its own. The one-hot needs no incoming gradient: in
    AOTAutograd's joint graph it is on neither side (upstream's "unclaimed" nodes)."""

    @staticmethod
    def forward(ctx, logits, target):
        lse = logits.logsumexp(-1)
        ctx.save_for_backward(logits, target, lse)
        return (lse - logits.gather(1, target[:, None]).squeeze(1)).mean()

    @staticmethod
    def backward(ctx, grad):
        logits, target, lse = ctx.saved_tensors
        n, v = logits.shape
        onehot = target[:, None].expand(n, v) == torch.arange(v, device=logits.device)
        probs = (logits - lse[:, None]).exp()
        scale = grad / n
        return probs * scale - onehot.to(probs.dtype) * scale, None


class Head(nn.Module):
    """A region (``block``), then an untagged projection and the loss."""

    def __init__(self, region: bool) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(D, D), nn.GELU(), nn.Linear(D, D))
        self.head = nn.Linear(D, V)
        if region:
            sac_region(policies.save_matmuls)(self.block)

    def forward(self, x, target):
        return OneHotCrossEntropy.apply(self.head(self.block(x)), target)


def _head_case(region: bool, **options) -> BothPartitioners:
    torch.manual_seed(0)
    model = Head(region)
    x = torch.randn(N, D, requires_grad=True)
    target = torch.randint(0, V, (N,))
    part = BothPartitioners(**options)
    torch.compile(model, backend=capture_backend(part))(x, target).backward()
    return part


def test_loss_outside_a_region_keeps_no_more_than_upstream(no_autograd_cache):
    part = _head_case(region=True)
    assert_no_worse(part.pairs)
    assert_no_worse(part.pairs, "tail_outside")
    ((upstream, ours),) = part.pairs
    # the one-hot (N x V bools) is made in backward, not kept
    assert not [op for op, _, _ in ours.kept.values() if op == "aten.eq.Tensor"], ours


def test_untagged_graph_through_our_min_cut_keeps_no_more_than_upstream(no_autograd_cache):
    """No region at all, and no delegation to upstream: our cut alone, on untagged nodes."""
    part = _head_case(region=False, delegate_untagged=False)
    assert_no_worse(part.pairs)
    assert_no_worse(part.pairs, "tail_outside")


def test_expanded_input_is_read_at_its_base_size():
    """``costs.traffic``: an op reading ``expand(t)`` reads ``t``'s memory (stride 0
    repeats it), and the expand itself is free."""
    def f(target, ar):
        return target[:, None].expand(N, V) == ar

    gm = torch.fx.experimental.proxy_tensor.make_fx(f, tracing_mode="fake")(
        torch.randint(0, V, (N,)), torch.arange(V))
    eq = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.eq.Tensor)
    expand = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.expand.default)
    assert costs.traffic(expand) == 0
    assert costs.nbytes(expand) == N * V * 8            # what keeping it would cost
    # reads N int64 + V int64, writes N x V bools
    assert costs.traffic(eq) == N * 8 + V * 8 + N * V


# --------------------------------------------------------------------------------------
# Hugging Face Llama with HF's loss, as Inductor partitions it
# --------------------------------------------------------------------------------------

def test_hf_llama_loss_keeps_no_more_than_upstream(no_autograd_cache):
    transformers = pytest.importorskip(
        "transformers", minversion="4.40",
        reason="Hugging Face transformers is not installed (pip install -e '.[integrations]')")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=32, attn_implementation="sdpa",
                                   vocab_size=64, use_cache=False, bos_token_id=0,
                                   eos_token_id=0)
    model = transformers.LlamaForCausalLM(cfg).train()
    for layer in model.model.layers:
        sac_region(policies.save_matmuls)(layer)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    part = BothPartitioners()
    compiled = torch.compile(model, backend=capture_backend(part, inductor_passes=True))
    compiled(input_ids=ids, labels=ids).loss.backward()
    assert_no_worse(part.pairs, "tail_outside")     # HF's loss, after lm_head's matmul
    assert_no_worse(part.pairs, "outside")
    assert_no_worse(part.pairs, "total")
