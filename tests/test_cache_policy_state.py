"""Two processes share a persistent compile cache: a policy whose behaviour depends on a
value that changed between them never gets the first process's split.

For each kind of value a policy may read (a global dict, an enum, an object's attribute, a
helper function, ``os.environ``, a closure cell, a ``functools.partial`` argument, a callable
object's attribute), process 1 compiles with the value "lossy" (bf16 ``SaveWithHooks`` on the
matmuls), process 2 with "exact" (``MUST_SAVE``), process 3 with "exact" again. Process 2
must miss or bypass and give exact gradients; process 3 hits where the rule can name the
value, and bypasses where it cannot. Presets and pure module-level functions hit when warm.
"""
from __future__ import annotations

import textwrap

import pytest

from fixtures.cache_process import run_with_cache

SCRIPT = textwrap.dedent('''
    import enum, functools, json, os, sys
    import torch
    import sac_compile as sc
    from sac_compile import CheckpointPolicy as P, SaveWithHooks, policies
    from torch._dynamo.utils import counters

    aten = torch.ops.aten
    LOSSY = sys.argv[1] == "lossy"

    def to_bf16(t):
        return t.to(torch.bfloat16)

    def from_bf16(packed):
        return packed.float()

    BF16 = SaveWithHooks(to_bf16, from_bf16)

    def decide(lossy, op):
        if op is aten.mm.default:
            return BF16 if lossy else P.MUST_SAVE
        return None

    CFG = {"lossy": LOSSY}

    def by_dict(ctx, op, *a, **k):
        return decide(CFG["lossy"], op)

    class Mode(enum.Enum):
        LOSSY = 1
        EXACT = 2

    MODE = Mode.LOSSY if LOSSY else Mode.EXACT

    def by_enum(ctx, op, *a, **k):
        return decide(MODE is Mode.LOSSY, op)

    class Settings:
        pass

    SETTINGS = Settings()
    SETTINGS.lossy = LOSSY

    def by_attribute(ctx, op, *a, **k):
        return decide(SETTINGS.lossy, op)

    _FLAG = LOSSY

    def _flag():
        return _FLAG

    def by_helper(ctx, op, *a, **k):
        return decide(_flag(), op)

    os.environ["SAC_TEST_LOSSY"] = "1" if LOSSY else ""

    def by_environ(ctx, op, *a, **k):
        return decide(bool(os.environ.get("SAC_TEST_LOSSY")), op)

    def closure_over(lossy):
        def by_closure(ctx, op, *a, **k):
            return decide(lossy, op)
        return by_closure

    def by_argument(lossy, ctx, op, *a, **k):
        return decide(lossy, op)

    class ByInstance:
        def __init__(self, lossy):
            self.lossy = lossy

        def __call__(self, ctx, op, *a, **k):
            return decide(self.lossy, op)

    def pure(ctx, op, *a, **k):
        return P.MUST_SAVE if op is aten.mm.default else None

    POLICIES = {
        "global dict": by_dict, "enum": by_enum, "object attribute": by_attribute,
        "helper function": by_helper, "os.environ": by_environ,
        "closure cell": closure_over(LOSSY),
        "functools.partial": functools.partial(by_argument, LOSSY),
        "class instance": ByInstance(LOSSY),
        "preset": policies.save_matmuls, "module function": pure,
    }

    def body(x, w):
        return (x @ w).relu().sin() @ w

    out = {}
    for kind, policy in POLICIES.items():
        torch._dynamo.reset()
        torch.manual_seed(0)
        x = torch.randn(8, 16, requires_grad=True)
        w = torch.randn(16, 16, requires_grad=True)
        body(x, w).pow(2).sum().backward()
        expected = (x.grad.clone(), w.grad.clone())
        x.grad = w.grad = None
        region = sc.sac_region(policy, name=kind)(body)
        before = dict(counters["aot_autograd"])
        torch.compile(lambda x, w: region(x, w).pow(2).sum(),
                      backend=sc.sac_backend)(x, w).backward()
        delta = {k: counters["aot_autograd"].get("autograd_cache_" + k, 0)
                 - before.get("autograd_cache_" + k, 0) for k in ("hit", "miss", "bypass")}
        delta["grad_diff"] = max((x.grad - expected[0]).abs().max().item(),
                                 (w.grad - expected[1]).abs().max().item())
        out[kind] = delta
    print(json.dumps(out))
''')

VARYING_NAMED = ["global dict", "enum", "helper function", "closure cell", "functools.partial"]
VARYING_UNNAMED = ["object attribute", "os.environ", "class instance"]
CONSTANT = ["preset", "module function"]


def _run(variant: str, cache_dir) -> dict:
    return run_with_cache(SCRIPT, variant, cache_dir, timeout=1200)


@pytest.mark.slow
def test_a_changed_value_a_policy_reads_never_gets_the_old_split(tmp_path):
    lossy = _run("lossy", tmp_path)
    exact = _run("exact", tmp_path)
    warm = _run("exact", tmp_path)
    for kind in VARYING_NAMED + VARYING_UNNAMED:
        assert lossy[kind]["grad_diff"] > 1e-3, (kind, lossy[kind])   # bf16 was used
        assert exact[kind]["hit"] == 0, (kind, exact[kind])            # never the old split
        assert exact[kind]["grad_diff"] <= 1e-4, (kind, exact[kind])
    for kind in VARYING_NAMED:           # the rule names the value: a miss, then a hit
        assert exact[kind]["miss"] == 1 and warm[kind]["hit"] == 1, (kind, exact, warm)
    for kind in VARYING_UNNAMED:         # it cannot: the caches are bypassed, every time
        assert exact[kind]["bypass"] == 1 and warm[kind]["bypass"] == 1, (kind, exact, warm)
    for kind in CONSTANT:                # presets and pure functions hit when warm
        assert exact[kind]["hit"] == 1 and warm[kind]["hit"] == 1, (kind, exact, warm)
        assert exact[kind]["grad_diff"] <= 1e-4
