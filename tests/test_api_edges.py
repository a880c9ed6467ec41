"""Small API edges (issue 20), each as a new user meets it: the call that failed or misled,
now either working or refused with an error that names what to do."""
from __future__ import annotations

import pytest
import torch

import sac_compile as sc
from sac_compile import policies


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


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
