"""Warm compiles hit AOTAutograd's cache: each of our regions carries the ``cache_hash`` torch
reads (on the ``context_fn`` partial in Dynamo's graph), keyed by the region's name and its
policy's identity, so that a changed policy misses and a lambda policy bypasses."""
from __future__ import annotations

import os
import textwrap

import functools
import dataclasses
import pytest
import torch
from torch._functorch._aot_autograd.autograd_cache import (BypassAOTAutogradCache,
                                                           _collect_context_fn_hashes)

from sac_compile import CheckpointPolicy, checkpoint, policies, sac_region
from sac_compile import CheckpointPolicy as P
from sac_compile.compiler import make_backend
from sac_compile.compiler.cache_keys import policy_key
from fixtures.cache_process import run_with_cache

aten = torch.ops.aten


def _policy_saving_mm(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op is aten.mm.default else None


def _policy_reading_the_name(ctx, op, *args, **kwargs):
    if ctx.region.endswith("0") and op is aten.mm.default:
        return CheckpointPolicy.MUST_SAVE
    return None


def _policy_reading_the_environment(ctx, op, *args, **kwargs):
    if os.environ.get("SAC_TEST_SAVE_MM") and op is aten.mm.default:
        return CheckpointPolicy.MUST_SAVE
    return None


def _hashes_torch_reads(policy, name="Block", use_checkpoint=False, body=None):
    """Compile once (fresh Dynamo) and return what AOTAutograd's cache key reads from the
    regions of the graph our backend got: the list of hashes, or the bypass."""
    seen = []
    backend = make_backend(compiler="aot_eager")

    def recording(gm, example_inputs, **kwargs):
        compiled = backend(gm, example_inputs, **kwargs)
        try:
            seen.append(_collect_context_fn_hashes(gm))
        except BypassAOTAutogradCache as e:
            seen.append(e)
        return compiled

    if use_checkpoint:  # the region's name is its function's
        def f(x, w):
            return checkpoint(body, x, w, policy=policy).sum()
    else:
        @sac_region(policy, name=name)
        def block(x, w):
            return (x @ w).relu() @ w

        def f(x, w):
            return block(x, w).sum()

    torch._dynamo.reset()
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    torch.compile(f, backend=recording)(x, w).backward()
    assert len(seen) == 1
    return seen[0]


def test_region_hash_is_stable_and_follows_the_policy():
    first = _hashes_torch_reads("save_matmuls")
    assert isinstance(first, list) and len(first) == 1 and isinstance(first[0], str)
    assert _hashes_torch_reads("save_matmuls") == first            # warm: same key
    assert _hashes_torch_reads("recompute_all") != first           # changed policy: miss
    # A decorated function's region is keyed by its name (module regions share across
    # names: tests/test_region_groups.py)
    assert _hashes_torch_reads("save_matmuls", name="Other") != first
    ops = _hashes_torch_reads([aten.mm.default])
    assert ops != first and _hashes_torch_reads([aten.mm.default]) == ops
    assert _hashes_torch_reads([aten.mm.default, aten.relu.default]) != ops
    assert _hashes_torch_reads(_policy_saving_mm) not in (first, ops)


def _ck_body(x, w):
    return (x @ w).relu() @ w


def test_checkpoint_call_inside_compiled_code_is_keyed_too():
    def hashes(policy):
        return _hashes_torch_reads(policy, use_checkpoint=True, body=_ck_body)
    first = hashes([aten.mm.default])
    assert isinstance(first, list) and len(first) == 1
    assert hashes([aten.mm.default]) == first
    assert hashes([aten.relu.default]) != first


def test_reports_asked_for_bypass_the_cache():
    """A cache hit skips the partitioner: with an on_partition callback (explain(), the
    report's figures) the regions get no hash, so every compile partitions and reports."""
    seen = []
    backend = make_backend(compiler="aot_eager", on_partition=lambda report: None)

    def recording(gm, example_inputs, **kwargs):
        compiled = backend(gm, example_inputs, **kwargs)
        with pytest.raises(BypassAOTAutogradCache):
            _collect_context_fn_hashes(gm)
        seen.append(gm)
        return compiled

    @sac_region("save_matmuls", name="Block")
    def block(x, w):
        return (x @ w).relu() @ w

    torch._dynamo.reset()
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    torch.compile(lambda x, w: block(x, w).sum(), backend=recording)(x, w).backward()
    assert len(seen) == 1


def test_a_policy_without_a_proven_identity_bypasses_the_cache():
    assert isinstance(_hashes_torch_reads(_policy_reading_the_environment),
                      BypassAOTAutogradCache)
    # Code alone proves nothing (it may read a global, a class attribute, the environment)
    assert isinstance(_hashes_torch_reads(lambda ctx, op, *a, **k: None),
                      BypassAOTAutogradCache)
    declared = functools.partial(_policy_reading_the_environment)
    declared.cache_hash = "environment-v1"
    keyed = _hashes_torch_reads(declared)
    assert isinstance(keyed, list) and len(keyed) == 1


def test_policy_key_forms():
    assert policy_key([aten.relu.default, aten.mm.default]) == \
        policy_key((aten.mm.default, aten.relu.default))           # order does not matter
    assert policy_key([aten.mm.default]) != policy_key([aten.mm])    # packet vs overload
    assert policy_key("save_matmuls") is not None
    assert policy_key(policies.save_ops(aten.mm.default)) != \
        policy_key(policies.save_ops(aten.bmm.default))
    assert policy_key(policies.compose(policies.relaxed("save_matmuls"), "save_all")) \
        is not None
    # A user's code has no proven identity, however plain it looks, nor does a preset
    # that holds it
    assert policy_key(_policy_saving_mm) is None
    assert policy_key(lambda ctx, op, *a, **k: None) is None
    assert policy_key(policies.compose(lambda ctx, op, *a, **k: None)) is None
    assert policy_key(_policy_reading_the_environment) is None

    @dataclasses.dataclass(frozen=True)
    class Frozen:
        lossy: bool

        def __call__(self, ctx, op, *a, **k):
            return None
    assert policy_key(Frozen(True)) is None                         # a user's dataclass
    tampered = policies.save_ops(aten.mm.default)
    object.__setattr__(tampered, "lossy", True)                      # state outside fields
    assert policy_key(tampered) is None

    class Stateful:
        def __call__(self, ctx, op, *a, **k):
            return None
    assert policy_key(Stateful()) is None
    stated = Stateful()
    stated.cache_hash = "mine-v1"
    assert policy_key(stated) == "cache_hash:mine-v1"


# -- the real caches, cold and warm (Inductor: AOTAutograd's cache needs its compiler) ------

SCRIPT = textwrap.dedent("""
    import json, os, sys, torch
    import sac_compile as sc
    from torch._dynamo.utils import counters

    aten = torch.ops.aten
    policy = {"mm": [aten.mm.default], "mm_relu": [aten.mm.default, aten.relu.default],
              "lambda": lambda ctx, op, *a, **k: None,
              "environ": lambda ctx, op, *a, **k: (os.environ.get("SAC_X"), None)[1],
              "declared": lambda ctx, op, *a, **k: None}[sys.argv[1]]
    if sys.argv[1] == "declared":
        policy.cache_hash = "nothing-saved-v1"   # the user names what it decides

    @sc.sac_region(policy, name="Block")
    def block(x, w):
        return (x @ w).relu().sin() @ w

    torch._dynamo.reset()
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(16, 16, requires_grad=True)
    torch.compile(lambda x, w: block(x, w).sum(), backend=sc.sac_backend)(x, w).backward()
    aot = counters["aot_autograd"]
    print(json.dumps({k: aot.get("autograd_cache_" + k, 0) for k in ("hit", "miss", "bypass")}
                     | {"fx_" + k: counters["inductor"].get("fxgraph_cache_" + k, 0)
                        for k in ("hit", "miss")}))
""")


def _compile_in_a_fresh_process(policy: str, cache_dir) -> dict:
    return run_with_cache(SCRIPT, policy, cache_dir)


@pytest.mark.slow
def test_warm_compile_hits_the_caches_and_a_changed_policy_misses(tmp_path):
    cold = _compile_in_a_fresh_process("mm", tmp_path)
    assert cold["miss"] == 1 and cold["hit"] == 0 and cold["bypass"] == 0, cold
    warm = _compile_in_a_fresh_process("mm", tmp_path)
    assert warm["hit"] == 1 and warm["miss"] == 0 and warm["bypass"] == 0, warm
    changed = _compile_in_a_fresh_process("mm_relu", tmp_path)
    assert changed["miss"] == 1 and changed["hit"] == 0, changed
    # a user's function has no proven identity, however plain its code: bypassed
    for kind in ("lambda", "environ"):
        unnamed = _compile_in_a_fresh_process(kind, tmp_path)
        assert unnamed["bypass"] == 1 and unnamed["hit"] == 0, (kind, unnamed)
    declared = _compile_in_a_fresh_process("declared", tmp_path)   # cache_hash: keyed
    assert declared["miss"] == 1 and declared["bypass"] == 0, declared
    again = _compile_in_a_fresh_process("declared", tmp_path)
    assert again["hit"] == 1 and again["bypass"] == 0, again
