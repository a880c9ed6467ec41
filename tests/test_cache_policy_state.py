"""Two processes share a persistent compile cache: a policy whose behaviour depends on a
value that changed between them never gets the first process's split (issue 26).

For each way a policy may reach a value (a global dict, an enum, an object's attribute, a
helper function, ``os.environ``, a closure cell, a ``functools.partial`` argument, a callable
object's attribute, ``globals()[...]``, a frozen dataclass's method reading a global,
``os.environ`` in a staticmethod, a ``ClassVar`` set at run time, a ``__call__`` calling
another method, an enum member), process 1 compiles with the value "lossy" (bf16
``SaveWithHooks`` on the matmuls), process 2 with "exact" (``MUST_SAVE``), process 3 with
"exact" again. None of these has a proven identity, so every process bypasses the persistent
caches and process 2 trains exactly. Our presets, and a policy that declares its identity
(``cache_hash``), still hit when warm. A user's Inductor pass whose ``uuid()`` is None is
never served from the cache to a process without it.
"""
from __future__ import annotations

import textwrap

import pytest

from fixtures.cache_process import run_with_cache

SCRIPT = textwrap.dedent('''
    import dataclasses, enum, functools, json, os, sys, typing
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

    # The six routes issue 26 found past the inspecting rule
    globals()["MODE_FLAG"] = LOSSY

    def by_globals_call(ctx, op, *a, **k):
        return decide(globals()["MODE_FLAG"], op)

    _FLAG2 = LOSSY

    @dataclasses.dataclass(frozen=True)
    class Reader:
        def lossy(self):
            return _FLAG2

    READER = Reader()

    def by_dataclass_method(ctx, op, *a, **k):
        return decide(READER.lossy(), op)

    @dataclasses.dataclass(frozen=True)
    class Env:
        @staticmethod
        def lossy():
            return bool(os.environ.get("SAC_TEST_LOSSY"))

    def by_environ_staticmethod(ctx, op, *a, **k):
        return decide(Env.lossy(), op)

    @dataclasses.dataclass(frozen=True)
    class WithClassVar:
        lossy: typing.ClassVar[bool] = False

        def __call__(self, ctx, op, *a, **k):
            return decide(self.lossy, op)

    WithClassVar.lossy = LOSSY
    _FLAG3 = LOSSY

    @dataclasses.dataclass(frozen=True)
    class Delegating:
        def __call__(self, ctx, op, *a, **k):
            return self.pick(op)

        def pick(self, op):
            return decide(_FLAG3, op)

    _FLAG4 = LOSSY

    class Switch(enum.Enum):
        ON = 1

        def __call__(self, ctx, op, *a, **k):
            return decide(_FLAG4, op)

    def declared(ctx, op, *a, **k):
        return decide(LOSSY, op)

    declared.cache_hash = "lossy-v1" if LOSSY else "exact-v1"   # the user names it

    POLICIES = {
        "global dict": by_dict, "enum": by_enum, "object attribute": by_attribute,
        "helper function": by_helper, "os.environ": by_environ,
        "closure cell": closure_over(LOSSY),
        "functools.partial": functools.partial(by_argument, LOSSY),
        "class instance": ByInstance(LOSSY),
        "module function": pure, "globals() call": by_globals_call,
        "frozen dataclass method": by_dataclass_method,
        "os.environ in a staticmethod": by_environ_staticmethod,
        "ClassVar set at run time": WithClassVar(), "__call__ calling a method": Delegating(),
        "enum member": Switch.ON,
        "preset": policies.save_matmuls, "declared cache_hash": declared,
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

VARYING = ["global dict", "enum", "object attribute", "helper function", "os.environ",
           "closure cell", "functools.partial", "class instance", "globals() call",
           "frozen dataclass method", "os.environ in a staticmethod",
           "ClassVar set at run time", "__call__ calling a method", "enum member"]


def _run(variant: str, cache_dir) -> dict:
    return run_with_cache(SCRIPT, variant, cache_dir, timeout=1800)


@pytest.mark.slow
def test_a_changed_value_a_policy_reads_never_gets_the_old_split(tmp_path):
    lossy = _run("lossy", tmp_path)
    exact = _run("exact", tmp_path)
    warm = _run("exact", tmp_path)
    for kind in lossy:  # the figures, for `pytest -s`
        print(f"{kind:32s} process 2 {exact[kind]}  process 3 {warm[kind]}")
    for kind in VARYING + ["module function"]:
        # no proven identity: never a persistent cache entry, in any process
        assert exact[kind]["hit"] == 0 and warm[kind]["hit"] == 0, (kind, exact, warm)
        assert exact[kind]["bypass"] == 1 and warm[kind]["bypass"] == 1, (kind, exact, warm)
        assert exact[kind]["grad_diff"] <= 1e-4, (kind, exact[kind])
    for kind in VARYING:
        assert lossy[kind]["grad_diff"] > 1e-3, (kind, lossy[kind])   # bf16 was used
    # warm hits stay for our presets and for an identity the user declares
    assert exact["preset"]["hit"] == 1 and warm["preset"]["hit"] == 1, (exact, warm)
    assert exact["declared cache_hash"]["miss"] == 1, exact            # another name
    assert warm["declared cache_hash"]["hit"] == 1, warm
    assert exact["declared cache_hash"]["grad_diff"] <= 1e-4
    assert lossy["declared cache_hash"]["grad_diff"] > 1e-3


PASS_SCRIPT = textwrap.dedent('''
    import json, sys
    import torch
    import sac_compile as sc
    from torch._inductor import config
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class SinToCos(CustomGraphPass):
        """Rewrites sin to cos, and asks not to be cached (uuid None)."""
        def __call__(self, graph):
            for node in graph.nodes:
                if node.target is torch.ops.aten.sin.default:
                    node.target = torch.ops.aten.cos.default

        def uuid(self):
            return None

    if sys.argv[1] == "pass":
        config.post_grad_custom_pre_pass = SinToCos()
    region = sc.sac_region("save_matmuls", name="r")(lambda x, w: (x @ w).sin() @ w)
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(16, 16, requires_grad=True)
    loss = torch.compile(lambda x, w: region(x, w).sum(), backend=sc.sac_backend)(x, w)
    want = ((x @ w).sin() @ w).sum()
    print(json.dumps({"loss_diff": abs(loss.item() - want.item())}))
''')


@pytest.mark.slow
def test_a_pass_that_asks_not_to_be_cached_is_never_served_to_another_process(tmp_path):
    with_pass = run_with_cache(PASS_SCRIPT, "pass", tmp_path)
    without = run_with_cache(PASS_SCRIPT, "none", tmp_path)
    assert with_pass["loss_diff"] > 1e-2          # the pass ran (sin -> cos)
    assert without["loss_diff"] <= 1e-4           # was 2.19: the first process's graph
