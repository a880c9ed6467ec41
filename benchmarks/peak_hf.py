"""Inductor's own peak estimates (forward and backward graph) on Hugging Face GPT-2 and
Llama, ours (``make_backend()``) against torch's partitioner (``"inductor"``) on the same
tagged program, the same seed (issue 17, "peak memory"). Cases:

* ``layers save_matmuls``: each decoder layer a region, ours ``save_matmuls``; torch: its
  SAC with the same op list;
* ``layers recompute_all``: each decoder layer ours ``recompute_all``; torch:
  ``torch.utils.checkpoint``;
* ``hf ckpt``: HF's own ``gradient_checkpointing_enable()`` (non-reentrant), one program,
  compiled whole by both.

Figures are ``torch._inductor.memory``'s logged estimates (``fixtures.inductor_memory``:
the best of its reorderings of each graph), deterministic given the graph; no clock.

    python benchmarks/peak_hf.py [--size bench|test] [--models gpt2,llama] [--cases ...]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fixtures.inductor_memory import inductor_estimates  # noqa: E402
from fixtures.models import make_hf_model  # noqa: E402
from sac_compile._bench.measure import wrap_blocks  # noqa: E402
from sac_compile._bench.strategies import full_ac, ours, torch_sac  # noqa: E402
from sac_compile.compiler import make_backend  # noqa: E402

CASES = ("layers save_matmuls", "layers recompute_all", "hf ckpt")


def tagged_model(name: str, size: str, case: str, who: str):
    """(model, inputs): HF ``name`` with ``case``'s checkpointing as ``who`` (ours, torch)
    applies it."""
    model, inputs = make_hf_model(name, size=size)
    if case == "hf ckpt":
        model.model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
    elif who == "ours":
        wrap_blocks(model, ours(case.split()[-1]))
    else:
        wrap_blocks(model, torch_sac if case.endswith("save_matmuls") else full_ac)
    return model, inputs


def estimates(name: str, size: str, case: str, who: str, backend=None) -> list[int]:
    """Inductor's estimates of every graph one compiled step schedules (forward graphs
    first, then backward ones)."""
    from torch._inductor import config
    model, inputs = tagged_model(name, size, case, who)
    if backend is None:
        backend = make_backend() if who == "ours" else "inductor"
    torch._dynamo.reset()
    torch.manual_seed(0)
    with inductor_estimates() as found, config.patch(force_disable_caches=True):
        loss = torch.compile(model, backend=backend)(*inputs)
        loss.backward()
    return list(found)


def _kib(n: int | None) -> str:
    return "-" if n is None else f"{n / 1024:,.0f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="bench")
    ap.add_argument("--models", default="gpt2,llama")
    ap.add_argument("--cases", default=",".join(CASES))
    args = ap.parse_args()
    header = (f"{'model':6s} {'case':21s} {'fw torch':>9s} {'fw ours':>9s} {'ratio':>6s} "
              f"{'bw torch':>9s} {'bw ours':>9s} {'ratio':>6s}  (KiB; graphs)")
    print(header)
    print("-" * len(header))
    for name in args.models.split(","):
        for case in args.cases.split(","):
            t = estimates(name, args.size, case, "torch")
            o = estimates(name, args.size, case, "ours")
            half = lambda f: (f[0], f[-1]) if len(f) >= 2 else (None, None)  # noqa: E731
            (tf, tb), (of, ob) = half(t), half(o)
            ratio = lambda a, b: f"{b / a:5.2f}x" if a and b else "    -"  # noqa: E731
            print(f"{name:6s} {case:21s} {_kib(tf):>9s} {_kib(of):>9s} {ratio(tf, of):>6s} "
                  f"{_kib(tb):>9s} {_kib(ob):>9s} {ratio(tb, ob):>6s}  ({len(t)}; {len(o)})",
                  flush=True)


if __name__ == "__main__":
    main()
