"""Small API edges (issue 20), each as a new user meets it: the call that failed or misled,
now either working or refused with an error that names what to do."""
from __future__ import annotations

import functools

import pytest
import torch

import sac_compile as sc
import sac_compile.compiler  # noqa: F401  (sc.compiler)
from sac_compile import policies


@sc.sac_region(policies.save_matmuls, name="Block")
def block(x, w):
    return torch.tanh(x @ w).sin() @ w


def _inputs():
    torch.manual_seed(0)
    return torch.randn(4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)


# -- 1. make_backend(compiler="inductor", mode=..., options=...) ---------------------------

def _inductor_config_seen(backend_kwargs: dict, compile_kwargs: dict) -> list[tuple]:
    """Inductor's config while our partitioner splits the region: (cudagraphs, fallback_random)
    per split."""
    seen = []

    def on_partition(report):
        from torch._inductor import config
        seen.append((config.triton.cudagraphs, config.fallback_random,
                     sorted(set(report.recomputed_regions))))

    backend = sc.make_backend(compiler="inductor", on_partition=on_partition, **backend_kwargs)
    x, w = _inputs()
    torch.compile(block, backend=backend, **compile_kwargs)(x, w).sum().backward()
    return seen


def test_make_backend_takes_inductors_mode_and_options():
    """``make_backend(mode=...)`` failed in ``SACPartitioner.__init__``; mode and options now
    reach Inductor as ``torch.compile``'s do ("reduce-overhead" turns cudagraphs on)."""
    seen = _inductor_config_seen({"mode": "reduce-overhead",
                                  "options": {"fallback_random": True}}, {})
    assert seen == [(True, True, ["Block"])]


def test_torch_compiles_mode_is_laid_over_make_backends_options():
    seen = _inductor_config_seen({"options": {"fallback_random": True}},
                                 {"mode": "reduce-overhead"})
    assert seen == [(True, True, ["Block"])]


def test_make_backend_refuses_what_would_do_nothing_or_is_unknown():
    with pytest.raises(ValueError, match=r"aot_eager generates no code.*compiler='inductor'"):
        sc.make_backend(compiler="aot_eager", mode="max-autotune")
    with pytest.raises(TypeError, match=r"^make_backend\(\) got unexpected keyword argument"
                                        r"\(s\) \['modes'\].*cse"):
        sc.make_backend(modes="max-autotune")
    with pytest.raises(RuntimeError, match="Unrecognized mode"):   # torch's own check, early
        sc.make_backend(mode="fastest")


# -- 2. the CLI on a model whose .blocks are functions ------------------------------------

FUNCTION_BLOCKS = '''
import torch
from torch import nn


class FunctionBlocks(nn.Module):
    """Blocks that are not modules: a bound method, a closure over the model, a builtin."""

    def __init__(self):
        super().__init__()
        self.w = nn.ParameterList(nn.Parameter(torch.randn(8, 8) * 0.3) for _ in range(2))

        def second(x):
            return torch.tanh(x @ self.w[1]).sin()

        self.blocks = [self.first, second, torch.sin]

    def first(self, x):
        return torch.tanh(x @ self.w[0]).sin()

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def build():
    torch.manual_seed(0)
    return FunctionBlocks(), (torch.randn(4, 8, requires_grad=True),)
'''


def test_report_on_a_model_whose_blocks_are_functions(tmp_path, capsys):
    """Ended in ``vars() argument must have __dict__ attribute`` (a bound method) or
    ``'function' object has no attribute 'forward'``; now each function is a block (its
    entry in ``.blocks`` is wrapped), and the compiled rows' copy of the model computes with
    its own parameters also through the closure (gradients reach them: same set, same
    values as no AC)."""
    import json

    from sac_compile.cli import main
    path = tmp_path / "function_blocks.py"
    path.write_text(FUNCTION_BLOCKS)
    rc = main(["report", "--model", f"{path}:build", "--no-plot", "--steps", "1",
               "--out", str(tmp_path)])
    assert rc == 0, capsys.readouterr().err[-3000:]
    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["meta"]["blocks"] == 3
    rows = {r["key"]: r for r in doc["strategies"]}
    assert {k: r["status"] for k, r in rows.items()} == dict.fromkeys(rows, "ok")
    for key, row in rows.items():
        assert row["grad_rel"] <= 1e-3, (key, row)
    # the regions are there: full AC and ours recompute the blocks' ops
    assert rows["full_ac"]["recomputed_ops"] > 0 and rows["ours_eager"]["recomputed_ops"] > 0
    assert rows["full_ac"]["kept_bytes"] < rows["no_ac"]["kept_bytes"]


# -- 3. checkpoint(fn, ..., fn_kwargs=...): fn's own policy= ---------------------------------

def _scaled(x, w, *, policy="fast", debug=False, early_stop=True, alpha=1.0):
    """A user function with keywords named like checkpoint's own."""
    return torch.tanh(x @ w) * (2.0 if policy == "fast" else 1.0) + (1.0 if debug else 0.0)


def _asking_policy(asked):
    def policy(ctx, op, *args, **kwargs):
        asked.append((ctx.region, str(op)))
        return policies.save_matmuls(ctx, op, *args, **kwargs)
    return policy


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "sac_aot_eager"])
def test_fn_kwargs_reach_fn_whatever_their_names(compiled):
    """``policy=`` is the region's; ``fn_kwargs`` carries fn's own keywords, also those named
    like checkpoint's (torch's checkpoint cannot pass those either)."""
    asked = []
    policy = _asking_policy(asked)   # made outside compiled code: its list is this one

    def step(x, w):
        return sc.checkpoint(_scaled, x, w, policy=policy,
                             fn_kwargs={"policy": "slow", "debug": True})

    x, w = _inputs()
    run = torch.compile(step, backend="sac_aot_eager", fullgraph=True) if compiled else step
    with torch._functorch.config.patch(enable_autograd_cache=False):  # a hit asks no policy
        out = run(x, w)
    out.sum().backward()
    torch.testing.assert_close(out, torch.tanh(x @ w) + 1.0)    # fn saw "slow" and True
    assert {region for region, _ in asked} == {"_scaled"}         # the region's policy decided
    assert any("mm" in op for _, op in asked) and x.grad is not None


def test_a_compiled_region_passes_keywords_named_like_torchs_checkpoint_to_its_function():
    """Under compile a region runs through torch's checkpoint, which took ``debug=True``
    for itself (and failed: "debug=True is incompatible with non-default context_fn")."""
    region = sc.sac_region(policies.save_matmuls, name="Scaled")(_scaled)
    x, w = _inputs()
    out = torch.compile(region, backend="sac_aot_eager", fullgraph=True)(
        x, w, policy="slow", debug=True, early_stop=False)
    torch.testing.assert_close(out, torch.tanh(x @ w) + 1.0)


def test_fn_kwargs_conflicts_and_a_policy_meant_for_fn_say_what_to_do():
    x, w = _inputs()
    with pytest.raises(TypeError, match=r"\['alpha'\] both as keywords and in fn_kwargs"):
        sc.checkpoint(_scaled, x, w, alpha=1.0, fn_kwargs={"alpha": 2.0, "policy": "slow"})
    # a value meant for fn's policy=: the error names fn and fn_kwargs
    with pytest.raises(TypeError, match=r"unknown policy name 'slow'.*_scaled takes its own "
                                        r"policy= keyword.*fn_kwargs=\{'policy': \.\.\.\}"):
        sc.checkpoint(_scaled, x, w, policy="slow")
    # a function without a policy= keyword: torch's message alone
    with pytest.raises(TypeError) as info:
        sc.checkpoint(torch.mm, x, w, policy="slow")
    assert "fn_kwargs" not in str(info.value)


# -- 4. a region under torch.func transforms -------------------------------------------------

def _scalar_block(x, w):
    return block(x, w).sum()


@pytest.mark.parametrize("transform, called", [
    ("grad/vjp/jacrev/hessian", lambda x, w: torch.func.grad(_scalar_block)(x, w)),
    ("grad/vjp/jacrev/hessian", lambda x, w: torch.func.vjp(_scalar_block, x, w)),
    ("vmap", lambda x, w: torch.func.vmap(_scalar_block, in_dims=(0, None))(x, w)),
    ("jvp/jacfwd", lambda x, w: torch.func.jvp(_scalar_block, (x, w), (x, w))),
], ids=["grad", "vjp", "vmap", "jvp"])
def test_a_region_under_torch_func_names_itself_and_the_alternative(transform, called):
    """grad gave torch's saved-tensor-hooks message, vmap/jvp an internal assert."""
    x, w = (t.detach() for t in _inputs())
    with pytest.raises(sc.CheckpointError) as info:
        called(x, w)
    message = str(info.value)
    assert f"region 'Block' ran under torch.func.{transform}" in message
    assert "torch.autograd.grad" in message and "torch.no_grad()" in message


def test_the_alternatives_the_error_names_work():
    x, w = _inputs()
    _scalar_block(x, w).backward()                    # torch.autograd: the region records
    with torch.no_grad():                             # forward-only transforms: plain calls
        rows = torch.func.vmap(_scalar_block, in_dims=(0, None))(x, w)
        _, tangent = torch.func.jvp(_scalar_block, (x, w),
                                    (torch.ones_like(x), torch.zeros_like(w)))
    assert rows.shape == (4,)
    torch.testing.assert_close(tangent, x.grad.sum())


# -- 5. a graph without regions: torch's split, parameters not counted -------------------------

def test_a_split_by_torchs_partitioner_counts_no_parameter_in_saved_bytes(capture):
    """Handed to torch's min_cut_rematerialization_partition, whose CSE replaces the joint
    graph's nodes: the parameters it saves were reported as plain inputs and counted."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8),
                                torch.nn.LayerNorm(8))
    x = torch.randn(4, 8, requires_grad=True)
    backend = capture.backend()
    with torch._functorch.config.patch(enable_autograd_cache=False):
        torch.compile(model, backend=backend)(x).sum().backward()
    (report,) = capture.reports
    assert report.solver == "upstream"
    params = [r for r in report.saved if r.reason.startswith("parameter")]
    inputs = [r for r in report.saved if r.is_input and r not in params]
    assert sorted(r.nbytes for r in params) == [32, 32, 512, 512]  # 2 weights, LayerNorm's 2
    assert [r.nbytes for r in inputs] == [x.numel() * 4]
    assert report.saved_bytes == report.activation_bytes + x.numel() * 4


# -- 6. a custom aot_autograd backend whose partition_fn wraps SACPartitioner ------------------

def _partition_by_a_fresh_sac_partitioner(gm, joint_inputs, **kwargs):
    """Makes ours where it is called (a global, through module attributes)."""
    return sc.compiler.SACPartitioner()(gm, joint_inputs, **kwargs)


def _closure_wrapper():
    ours = sc.compiler.SACPartitioner()

    def partition(gm, joint_inputs, **kwargs):
        return ours(gm, joint_inputs, **kwargs)
    return partition


class _LoggingPartitioner:
    def __init__(self):
        self.inner, self.calls = sc.compiler.SACPartitioner(), 0

    def __call__(self, gm, joint_inputs, **kwargs):
        self.calls += 1
        return self.inner(gm, joint_inputs, **kwargs)


def _calls_torchs(gm, joint_inputs, **kwargs):
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    return min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)


@pytest.mark.parametrize("make, ours", [
    (_closure_wrapper, True),
    (lambda: _partition_by_a_fresh_sac_partitioner, True),
    (lambda: functools.partial(lambda part, *a, **k: part(*a, **k),
                               sc.compiler.SACPartitioner()), True),
    (_LoggingPartitioner, True),
    (lambda: _calls_torchs, False),
], ids=["closure", "global", "partial", "object", "torchs"])
def test_a_partition_fn_that_wraps_ours_gets_no_foreign_partitioner_warning(make, ours,
                                                                            count_our_splits):
    import warnings

    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    name = f"Wrapped_{make.__name__}_{ours}_{len(_SPLITS)}"
    region = sc.sac_region(policies.save_matmuls, name=name)(lambda x, w: torch.tanh(x @ w) @ w)
    backend = aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=make())
    x, w = _inputs()
    with warnings.catch_warnings(record=True) as caught, \
            torch._functorch.config.patch(enable_autograd_cache=False):
        warnings.simplefilter("always")
        torch.compile(region, backend=backend)(x, w).sum().backward()
    warned = [str(w.message) for w in caught if "torch's partitioner" in str(w.message)]
    assert len(warned) == (0 if ours else 1)
    # it says what torch's split does to collectives, with the measured counts (README)
    assert all("collectives that a recomputed value depends on are issued again" in m
               and "1 all_reduce more per block" in m for m in warned)
    assert len(_SPLITS) == (1 if ours else 0)   # and the split was ours indeed
    _SPLITS.clear()


_SPLITS: list = []


@pytest.fixture
def count_our_splits(monkeypatch):
    original = sc.compiler.SACPartitioner._partition

    def counting(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        _SPLITS.append(self.last_report)
        return out
    monkeypatch.setattr(sc.compiler.SACPartitioner, "_partition", counting)
    _SPLITS.clear()
    yield


# -- 7. packaging: the license as an SPDX expression -----------------------------------------

def test_pyproject_license_is_an_spdx_string_setuptools_takes_without_deprecation():
    """``make setup`` printed setuptools' deprecation of ``project.license`` as a table."""
    import os
    import warnings
    tomllib = pytest.importorskip("tomllib")
    setuptools = pytest.importorskip("setuptools")
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "pyproject.toml")
    with open(path, "rb") as f:
        doc = tomllib.load(f)
    assert doc["project"]["license"] == "BSD-3-Clause"
    assert "setuptools>=77" in doc["build-system"]["requires"]   # PEP 639 strings
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools.__version__} predates SPDX license strings")
    from setuptools.config import pyprojecttoml
    from setuptools.dist import Distribution
    dist = Distribution()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pyprojecttoml.apply_configuration(dist, path)
    assert [type(w.message).__name__ for w in caught] == []
    assert dist.metadata.license_expression == "BSD-3-Clause"
