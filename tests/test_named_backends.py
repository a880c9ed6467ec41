"""Our backends by name: ``torch.compile(fn, backend="sac_inductor" | "sac_aot_eager")``,
found by Dynamo through the ``torch_dynamo_backends`` entry point (pyproject.toml), split
by our partitioner (counted: one partition per compiled joint graph)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch._dynamo.backends import registry

import sac_compile as sc
from sac_compile import policies
from sac_compile.compiler import SACPartitioner
from sac_compile.compiler.named_backends import BACKEND_NAMES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def partitions(monkeypatch):
    """The reports of every split SACPartitioner makes while the test runs."""
    made = []
    original = SACPartitioner._partition

    def counting(self, gm, joint_inputs, **kwargs):
        out = original(self, gm, joint_inputs, **kwargs)
        made.append(self.last_report)
        return out

    monkeypatch.setattr(SACPartitioner, "_partition", counting)
    # a warm AOTAutograd cache would serve the split without partitioning: count real ones
    with torch._functorch.config.patch(enable_autograd_cache=False):
        yield made


@sc.sac_region(policies.save_matmuls, name="Block")
def block(x, w1, w2):
    return torch.tanh(x @ w1).sin() @ w2


def _inputs():
    torch.manual_seed(0)
    return [torch.randn(8, 16, requires_grad=True), torch.randn(16, 32, requires_grad=True),
            torch.randn(32, 16, requires_grad=True)]


def _grads(fn):
    args = _inputs()
    fn(*args).sum().backward()
    return [a.grad for a in args]


def test_names_are_listed():
    assert {"sac_inductor", "sac_aot_eager"} <= set(torch._dynamo.list_backends())
    for name, fn in BACKEND_NAMES.items():
        assert registry.lookup_backend(name) is fn


@pytest.mark.parametrize("name", ["sac_aot_eager", "sac_inductor"])
def test_string_backend_splits_with_our_partitioner(name, partitions):
    want = _grads(block)
    got = _grads(torch.compile(block, backend=name, fullgraph=True))
    assert len(partitions) == 1  # one joint graph, split by SACPartitioner
    report = partitions[0]
    assert report.solver != "upstream"  # our min-cut, not the delegate for untagged graphs
    assert set(report.recomputed_regions) == {"Block"}  # tanh and sin, recomputed
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_mode_and_options_reach_inductor(partitions):
    """torch wraps a string backend with ``mode``/``options`` and passes them on as keyword
    arguments; ``sac_inductor`` gives them to Inductor as ``sac_backend`` does."""
    got = _grads(torch.compile(block, backend="sac_inductor",
                               options={"fallback_random": True}))
    assert len(partitions) == 1
    for g, w in zip(got, _grads(block)):
        torch.testing.assert_close(g, w)


_ENTRY_POINT_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import sac_compile as sc
    from torch._dynamo.backends import registry

    # nothing registered our names yet: only the entry point can resolve them
    assert "sac_compile.compiler" not in sys.modules
    assert "sac_aot_eager" not in registry._COMPILER_FNS

    @sc.sac_region("save_matmuls", name="Block")
    def block(x, w):
        return torch.tanh(x @ w) @ w

    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    torch.compile(block, backend="sac_aot_eager", fullgraph=True)(x, w).sum().backward()
    from importlib.metadata import entry_points
    from sac_compile.compiler import named_backends
    ep = entry_points(group="torch_dynamo_backends")["sac_aot_eager"]
    assert registry._COMPILER_FNS["sac_aot_eager"] is ep.load() is named_backends.sac_aot_eager
    print("entry point:", ep.value)
    report = named_backends._aot_eager().partitioner.last_report
    print("split:", report.solver, sorted({r.region for r in report.saved} - {""}))
""")


def test_found_through_the_entry_point_in_a_fresh_process():
    """A process that never imported ``sac_compile.compiler``: Dynamo finds the name in the
    ``torch_dynamo_backends`` entry points (installed by ``pip install -e .``) and loads it;
    our own registration on import steps aside (no "duplicate name")."""
    out = subprocess.run([sys.executable, "-c", _ENTRY_POINT_SCRIPT], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "entry point: sac_compile.compiler.named_backends:sac_aot_eager" \
        in out.stdout, out.stdout
    assert "split: scipy ['Block']" in out.stdout or \
        "split: networkx ['Block']" in out.stdout, out.stdout
