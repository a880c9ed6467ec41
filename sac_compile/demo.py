"""``python -m sac_compile.demo`` (``make demo``) runs ``python -m sac_compile report`` with no
flags (see :mod:`sac_compile.cli.report`). This module keeps the eager-only measurement of
the earlier demo, used by the benchmarks and tests: :func:`run` measures one small model
three ways.

Rows: no activation checkpointing; upstream ``torch.utils.checkpoint`` selective
checkpointing saving matmuls and attention; and sac_compile in eager mode with
``policy="save_matmuls"`` on each block. Per row: the activation bytes kept for backward,
the ATen ops recomputed in backward, and the largest gradient difference against no-AC
(same seed, so the dropout masks are the same).

How the figures are measured (see ``fixtures.measure``):

* no AC: unique storages of the tensors autograd packs (a ``saved_tensors_hooks`` pair).
* torch SAC: the tensors in its cache after forward, plus what autograd packs outside the
  checkpointed blocks (the checkpoints' saved inputs included); recomputed ops are the cache
  misses of its recompute dispatch mode.
* sac_compile: the runtime's ``collect_stats()`` (``saved_bytes``, ``recomputed_ops``), plus
  what autograd packs outside the regions, plus the regions' tensor inputs (counted as
  kept, as torch's checkpoint keeps them; the runtime's stats do not list them).

Parameters and buffers are never counted: weights are not activations.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from fixtures import make_model
from fixtures.measure import (SavedBytes, StepResult, TORCH_SAVE_MATMUL_OPS,
                              measure_noac, measure_torch_sac, param_storages, wrapped_blocks)
from fixtures.models import clear_grads, grads_of, loss_fn, max_grad_diff

from . import eager
from .regions import sac_region

__all__ = ["ours_blocks", "measure_ours", "run", "main"]


def ours_blocks(model: nn.Module, policy: Any = "save_matmuls",
                on_call: Callable[[tuple], None] | None = None) -> contextlib.AbstractContextManager:
    """Run every ``model.blocks[i]`` as ``sac_region(policy, name=f"blocks.{i}")`` while the
    context is active (the module objects are not replaced). ``on_call(args)`` sees the
    arguments of every region call."""

    def wrap(i: int, fwd: Callable[..., Any]) -> Callable[..., Any]:
        region = sac_region(policy, name=f"blocks.{i}")(fwd)
        if on_call is None:
            return region

        def observed(*args: Any, **kwargs: Any) -> Any:
            on_call(args)
            return region(*args, **kwargs)
        return observed

    return wrapped_blocks(model, wrap)


def measure_ours(model: nn.Module, inputs: tuple, policy: Any = "save_matmuls", *,
                 seed: int = 0, loss: Callable[[Any], torch.Tensor] = loss_fn,
                 strategy: str = "sac_compile") -> StepResult:
    """Every block as an eager region with ``policy``; figures from ``collect_stats()``."""
    exclude = param_storages(model)
    region_inputs = SavedBytes(exclude)

    def record_inputs(args: tuple) -> None:
        for a in args:
            region_inputs.add(a)

    clear_grads(model, inputs)
    torch.manual_seed(seed)
    with eager.collect_stats() as stats:
        with ours_blocks(model, policy, record_inputs), SavedBytes(exclude) as outside:
            out = loss(model(*inputs))
        policy_bytes = stats.saved_bytes
        out.backward()
    recomputed = stats.recomputed_ops
    recomputed = recomputed if isinstance(recomputed, int) else len(recomputed)
    # Storages seen both outside and as region inputs count once; the runtime's own saved
    # values cannot be matched against them (the stats hold sizes, not tensors), so a value
    # saved by one region and passed into the next would count twice: never in our favour.
    others = SavedBytes(exclude)
    others.storages.update(outside.storages)
    others.storages.update(region_inputs.storages)
    grads = grads_of(model, inputs)
    clear_grads(model, inputs)
    return StepResult(strategy, policy_bytes + others.nbytes, policy_bytes, recomputed, grads)


def run(model_name: str = "gpt", size: str = "bench", seed: int = 0) -> list[tuple[StepResult, float]]:
    """Measure the three strategies on a fresh fixture; returns (result, max grad diff)."""
    model, inputs = make_model(model_name, size=size, seed=seed)
    results = [
        measure_noac(model, inputs, seed=seed),
        measure_torch_sac(model, inputs, TORCH_SAVE_MATMUL_OPS, seed=seed,
                          strategy="torch SAC (save matmuls)"),
        measure_ours(model, inputs, "save_matmuls", seed=seed,
                     strategy="sac_compile eager (save_matmuls)"),
    ]
    ref = results[0].grads
    return [(r, max_grad_diff(ref, r.grads)) for r in results]


def main(argv: list[str] | None = None) -> int:
    """``make demo``: ``python -m sac_compile report`` with no flags (extra arguments are
    passed on, e.g. ``python -m sac_compile.demo --model gpt``)."""
    import sys

    from .cli import main as cli_main
    return cli_main(["report", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
