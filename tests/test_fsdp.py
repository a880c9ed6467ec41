"""Regions with FSDP2 (``torch.distributed.fsdp.fully_shard``) and collectives: the real
library, two ranks, gloo on CPU, spawned from pytest.

One spawn runs every check on both ranks (``CHECKS``, in order) and writes each rank's
results to a file as it goes; each test below asserts on one check. A failing check stops
its rank (the other then fails on its next collective, or is killed at the deadline), and
the later checks report that they did not run. The process group is destroyed in a
``finally`` and stragglers are killed after ``TIMEOUT_S``.

The contract: loss and gradients (``full_tensor()``) equal a single-process run without
checkpointing from the same seed, and backward issues exactly the collectives of the same
program without checkpointing: collectives are never replayed unless the policy says
MUST_RECOMPUTE (torchtitan's SimpleFSDP pattern re-gathers in backward on purpose).
"""
from __future__ import annotations

import collections
import copy
import functools

import pytest
import torch
import torch.distributed as dist

from fixtures import ranks
from fixtures.ranks import c10d_counter as _c10d_counter
import sac_compile as sc
from sac_compile import CheckpointError, CheckpointPolicy as P, policies

WORLD = 2
TIMEOUT_S = 300


# -- what runs on each rank -------------------------------------------------------------------

class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(8, 16)
        self.l2 = torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x)).sin()) + x


def _backward_counting(loss):
    counter = _c10d_counter()
    with counter:
        loss.backward()
    return dict(counter.counts)


def _fsdp_run(wrap_block, *, compile_backend=None, steps=2, region_around_call=False):
    """Two SGD steps of a 2-block model under FSDP2 against the same model unsharded,
    without checkpointing, in this process. Returns losses, gradients of the last step and
    the collectives each step's backward issued."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from sac_compile.runtime import collect_stats

    mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(), Block())
    ref = copy.deepcopy(model)
    x = torch.randn(4, 8)  # the same on every rank: the averaged gradient is exact
    for block in model:
        wrap_block(block, mesh)
    fully_shard(model, mesh=mesh)
    forward = model
    if compile_backend is not None:
        forward = torch.compile(model, backend=compile_backend)
    if region_around_call:
        forward = functools.partial(sc.checkpoint, model, policy=policies.save_matmuls)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    out = {"loss": [], "ref_loss": [], "c10d": [], "ops_recorded": 0, "replayed": 0}
    for _ in range(steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        with collect_stats() as st:
            loss = forward(x).sum()
        out["c10d"].append(_backward_counting(loss))
        ref_loss = ref(x).sum()
        ref_loss.backward()
        out["loss"].append(loss.detach())
        out["ref_loss"].append(ref_loss.detach())
        out["ops_recorded"] += st.ops_recorded
        out["replayed"] += st.ops_replayed
        out["grads"] = [(n, p.grad.full_tensor(), q.grad) for (n, p), (_, q) in
                        zip(model.named_parameters(), ref.named_parameters())]
        opt.step()
        ref_opt.step()
    return out


def _inner(block, mesh):  # fully_shard(sac_region(p)(block))
    from torch.distributed.fsdp import fully_shard
    fully_shard(sc.sac_region(policies.save_matmuls)(block), mesh=mesh)


def _outer(block, mesh):  # sac_region(p)(fully_shard(block))
    from torch.distributed.fsdp import fully_shard
    sc.sac_region(policies.save_matmuls)(fully_shard(block, mesh=mesh))


def _plain(block, mesh):  # FSDP without checkpointing: the collectives to expect
    from torch.distributed.fsdp import fully_shard
    fully_shard(block, mesh=mesh)


def check_fsdp_baseline(rank):
    return _fsdp_run(_plain)


def check_fsdp_inner_eager(rank):
    return _fsdp_run(_inner)


def check_fsdp_outer_eager(rank):
    return _fsdp_run(_outer)


def check_fsdp_region_around_fsdp_call(rank):
    """The region records FSDP's all-gathers (c10d._allgather_base_): never replayed."""
    return _fsdp_run(_plain, region_around_call=True)


def check_fsdp_compiled(rank):
    from torch._dynamo.utils import counters

    from sac_compile.compiler import make_backend
    torch._dynamo.reset()
    out = _fsdp_run(_inner, compile_backend=make_backend(compiler="aot_eager"))
    out["graphs"] = counters["stats"]["unique_graphs"]
    return out


def check_fsdp_inductor(rank):
    from torch._dynamo.utils import counters

    from sac_compile.compiler import make_backend
    torch._dynamo.reset()
    out = _fsdp_run(_inner, compile_backend=make_backend())
    out["graphs"] = counters["stats"]["unique_graphs"]
    return out


# A SimpleFSDP-style layer: the weight is all-gathered inside the region with functional
# collectives (their backward is a reduce-scatter).
def _gathered_layer(x, shard):
    import torch.distributed._functional_collectives as funcol
    full = funcol.all_gather_tensor_autograd(shard, 0, dist.group.WORLD)
    return torch.tanh(x @ full.t()).sin()


def _recompute_gathers(ctx, op, *args, **kwargs):
    """torchtitan's reshard-after-forward: re-gather in backward instead of keeping it
    (all_gather_into_tensor, wait_tensor and the autograd variant's _wrap_tensor_autograd)."""
    if op.namespace == "_c10d_functional":
        return P.MUST_RECOMPUTE
    return None


def _torch_save_mm(ctx, op, *args, **kwargs):
    return P.MUST_SAVE if op is torch.ops.aten.mm.default else P.PREFER_RECOMPUTE


def _torch_sac(fn, policy):
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
    context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    return lambda *a: checkpoint(fn, *a, use_reentrant=False, context_fn=context_fn)


def _gathered_run(fn):
    from sac_compile.runtime import collect_stats
    torch.manual_seed(0)
    w = torch.randn(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    shard = w.chunk(WORLD)[dist.get_rank()].clone().requires_grad_()
    with collect_stats() as st:
        loss = fn(x, shard).sum()
    c10d = _backward_counting(loss)
    return {"loss": loss.detach(), "grads": [x.grad, shard.grad], "c10d": c10d,
            "saved": [(r.op, r.reason) for r in st.saved], "replayed": list(st.recomputed_ops)}


def check_collectives_eager(rank):
    return {
        "none": _gathered_run(_gathered_layer),
        "ours": _gathered_run(lambda x, s: sc.checkpoint(_gathered_layer, x, s,
                                                         policy=policies.save_matmuls)),
        "ours_must_recompute": _gathered_run(lambda x, s: sc.checkpoint(
            _gathered_layer, x, s,
            policy=policies.compose(_recompute_gathers, policies.save_matmuls))),
        "torch_sac": _gathered_run(_torch_sac(_gathered_layer, _torch_save_mm)),
    }


def check_collectives_compiled(rank):
    from sac_compile.compiler import make_backend
    torch._dynamo.reset()
    ours = torch.compile(lambda x, s: sc.checkpoint(_gathered_layer, x, s,
                                                    policy=policies.save_matmuls),
                         backend=make_backend(compiler="aot_eager"))
    theirs = torch.compile(_torch_sac(_gathered_layer, _torch_save_mm), backend="aot_eager")
    return {"none": _gathered_run(_gathered_layer), "ours": _gathered_run(ours),
            "torch_sac": _gathered_run(theirs)}


def check_process_group_collective_must_recompute(rank):
    """A ProcessGroup collective (c10d.allreduce_, with a Work handle) cannot be replayed:
    MUST_RECOMPUTE on it is a CheckpointError at the region (on every rank alike)."""
    def body(x):
        y = x * 2
        dist.all_reduce(y)
        return y.sin()

    def must_recompute_c10d(ctx, op, *args, **kwargs):
        return P.MUST_RECOMPUTE if op.namespace == "c10d" else None

    x = torch.randn(4, requires_grad=True)
    try:
        sc.checkpoint(body, x, policy=must_recompute_c10d)
    except CheckpointError as e:
        return {"error": str(e)}
    return {"error": None}


CHECKS = [check_fsdp_baseline, check_fsdp_inner_eager, check_fsdp_outer_eager,
          check_fsdp_region_around_fsdp_call, check_collectives_eager,
          check_process_group_collective_must_recompute, check_collectives_compiled,
          check_fsdp_compiled]


def _spawn(out_dir, names):
    return ranks.spawn(__name__, out_dir, names, world=WORLD, timeout_s=TIMEOUT_S)


def _result(spawned, name):
    return ranks.result(spawned, name, TIMEOUT_S)


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    return _spawn(str(tmp_path_factory.mktemp("fsdp")), [c.__name__ for c in CHECKS])


# -- the tests --------------------------------------------------------------------------------

def _assert_equal_to_unsharded(out, exact=True):
    tol = dict(rtol=0, atol=0) if exact else {}
    for got, want in zip(out["loss"], out["ref_loss"]):
        torch.testing.assert_close(got, want, **tol)
    for name, got, want in out["grads"]:
        torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{name}: {m}")


def test_fsdp_baseline_runs(fsdp):
    for out in _result(fsdp, "check_fsdp_baseline"):
        _assert_equal_to_unsharded(out)
        assert out["ops_recorded"] == 0


@pytest.mark.parametrize("order", ["inner", "outer"])
def test_fully_shard_and_region_in_either_order(fsdp, order):
    """``fully_shard(sac_region(p)(block))`` and ``sac_region(p)(fully_shard(block))``, then
    ``fully_shard(model)``: exact loss and gradients, the collectives of FSDP alone."""
    baseline = _result(fsdp, "check_fsdp_baseline")
    for rank, out in enumerate(_result(fsdp, f"check_fsdp_{order}_eager")):
        _assert_equal_to_unsharded(out)
        assert out["ops_recorded"] > 0 and out["replayed"] > 0  # the regions did run
        assert out["c10d"] == baseline[rank]["c10d"]


def test_region_around_an_fsdp_call_replays_no_collective(fsdp):
    """A region around the sharded model's call records FSDP's all-gathers; backward
    issues FSDP's own collectives only."""
    baseline = _result(fsdp, "check_fsdp_baseline")
    for rank, out in enumerate(_result(fsdp, "check_fsdp_region_around_fsdp_call")):
        _assert_equal_to_unsharded(out)
        assert out["ops_recorded"] > 0
        assert out["c10d"] == baseline[rank]["c10d"]


def test_fsdp_compiled_with_our_backend(fsdp):
    baseline = _result(fsdp, "check_fsdp_baseline")
    for rank, out in enumerate(_result(fsdp, "check_fsdp_compiled")):
        _assert_equal_to_unsharded(out, exact=False)
        assert out["graphs"] > 0 and out["ops_recorded"] == 0  # compiled, not eager regions
        assert out["c10d"] == baseline[rank]["c10d"]


def test_collectives_are_never_replayed_eager(fsdp):
    for out in _result(fsdp, "check_collectives_eager"):
        none, ours, must, theirs = (out[k] for k in
                                    ("none", "ours", "ours_must_recompute", "torch_sac"))
        for case in (ours, must, theirs):
            torch.testing.assert_close(case["loss"], none["loss"], rtol=0, atol=0)
            for g, w in zip(case["grads"], none["grads"]):
                torch.testing.assert_close(g, w, rtol=0, atol=0)
        # backward of the gather is a reduce-scatter (+ its wait): the same with our regions
        assert none["c10d"] == {"_c10d_functional.reduce_scatter_tensor.default": 1,
                                "_c10d_functional.wait_tensor.default": 1}
        assert ours["c10d"] == none["c10d"]
        kept = [op for op, reason in ours["saved"] if reason == "collective: not replayed"]
        assert kept and all(op.startswith("_c10d_functional.") for op in kept), ours["saved"]
        # MUST_RECOMPUTE on the gather (torchtitan's pattern): gathered again in backward
        # (its wait happens inside AsyncCollectiveTensor's dispatch, which a mode misses)
        rise = collections.Counter(must["c10d"]) - collections.Counter(none["c10d"])
        assert rise == {"_c10d_functional.all_gather_into_tensor.default": 1,
                        "_c10d_functional._wrap_tensor_autograd.default": 1}, rise
        assert "_c10d_functional.all_gather_into_tensor.default" in must["replayed"]
        # torch's eager SAC re-issues the gather under a policy that only saves the matmul
        assert theirs["c10d"].get("_c10d_functional.all_gather_into_tensor.default") == 1


def test_collectives_are_never_replayed_compiled(fsdp):
    for out in _result(fsdp, "check_collectives_compiled"):
        none, ours, theirs = out["none"], out["ours"], out["torch_sac"]
        for case in (ours, theirs):
            torch.testing.assert_close(case["loss"], none["loss"])
            for g, w in zip(case["grads"], none["grads"]):
                torch.testing.assert_close(g, w)
        assert ours["c10d"] == none["c10d"]


def test_process_group_collective_cannot_be_must_recompute(fsdp):
    for out in _result(fsdp, "check_process_group_collective_must_recompute"):
        msg = out["error"]
        assert msg is not None, "MUST_RECOMPUTE on c10d.allreduce_ was accepted"
        assert "c10d.allreduce_" in msg and "<locals>.body'" in msg
        assert "functional collectives" in msg


@pytest.mark.slow
def test_fsdp_inductor(tmp_path):
    results = _spawn(str(tmp_path), ["check_fsdp_baseline", "check_fsdp_inductor"])
    baseline = _result(results, "check_fsdp_baseline")
    for rank, out in enumerate(_result(results, "check_fsdp_inductor")):
        _assert_equal_to_unsharded(out, exact=False)
        assert out["graphs"] > 0 and out["ops_recorded"] == 0
        assert out["c10d"] == baseline[rank]["c10d"]
