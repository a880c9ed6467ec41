"""Command-line arguments of ``python -m sac_compile``: the parser, and the checks that turn
bad input into one-line :class:`UsageError` messages (exit code 2, no traceback).

Every message says what was wrong and what to do instead.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import re
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .._bench.runner import Target

__all__ = ["UsageError", "build_parser", "parse_budget", "resolve_policy", "check_device",
           "load_target", "FIXTURES", "HF_MODELS"]

FIXTURES = ("mlp", "gpt", "conv", "moe")
#: ``--model hf:NAME``: Hugging Face models from small configs (``_bench.hf_models``).
HF_MODELS = ("gpt2", "llama", "mixtral")
HF_INSTALL = "pip install 'sac_compile[integrations]'"
DEFAULT_MODEL = "mlp"
DEFAULT_SIZE = "test"


class UsageError(Exception):
    """Bad input from the command line: printed as one line, exit code 2."""


# --------------------------------------------------------------------------------------
# The parser
# --------------------------------------------------------------------------------------

_REPORT_EPILOG = """\
strategies (one row each):
  no AC               no activation checkpointing (the reference for time and gradients)
  full AC             torch.utils.checkpoint on every block, nothing saved inside
  torch SAC eager     upstream selective checkpointing saving matmuls and attention
  torch SAC compiled  the same, under torch.compile (Inductor + torch's own partitioner)
  ours eager          sac_region(--policy) on every block, the eager runtime
  ours compiled       the same, torch.compile(backend=sac_backend)
  ours budget         ours compiled with make_backend(memory_budget=--budget), the policy's
                      MUSTs relaxed to PREFERs so that the budget can evict them

columns:
  kept      activation bytes kept for backward (eager: counted at run time; compiled: the
            partition report); parameters are never counted
  peak      measured, every row alike: the most bytes torch's allocator held at once
            during one step (gradients included), above the step's start; CUDA:
            torch.cuda.max_memory_allocated, CPU: torch.profiler's allocation events
            (sac_compile.measured_peak; Inductor's buffers included)
  working peak  CPU: the measured peak of what the step allocates and also frees
            (activations, recomputed values, temporaries; not the gradients it leaves)
  modelled peak  compiled rows: the partitioner's peak model of its graphs' activations
            (the largest split's), an explanation beside the measurement
  recompute FLOPs spent re-running forward ops in backward (torch.utils.flop_counter rules:
            matmuls, convolutions, attention)
  time      median over interleaved rounds of the step time divided by no AC's in the same
            round (forward + backward)
  grad diff largest |gradient difference| against no AC, same seed

examples:
  python -m sac_compile report                      # the default: tiny MLP, all strategies
  python -m sac_compile report --model gpt --size bench --steps 10
  python -m sac_compile report --model my_models.py:build --policy recompute_all
  python -m sac_compile report --model hf:llama    # HF Llama from a small config (no download)
  python -m sac_compile report --budget 0.5         # half of what ours saves unconstrained
  python -m sac_compile report --budget 64MiB       # an absolute byte count
  python -m sac_compile report --budget peak:40MiB  # cap the step's peak (compiled)
"""

_EXPLAIN_EPILOG = """\
TARGET is a fixture name (mlp, gpt, conv, moe), a Hugging Face model from a small config
(hf:gpt2, hf:llama, hf:mixtral; needs transformers) or MODULE:FUNCTION / PATH.py:FUNCTION,
where FUNCTION() returns (fn_or_model, example_inputs). The function's own sac_region/checkpoint
calls decide what is saved; with --policy, every block of a model that has `.blocks` (or
the whole function) runs in a region with that policy.

examples:
  python -m sac_compile explain gpt
  python -m sac_compile explain my_models.py:build --policy save_matmuls
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sac_compile",
        description="sac_compile: selective activation checkpointing, eager and compiled. "
                    "`report` compares checkpointing strategies on one model; `explain` "
                    "shows what a function saves and recomputes, eager vs compiled.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--policy", default=None, metavar="NAME",
        help="policy for our regions: recompute_all, save_all, save_matmuls (default for "
             "report), or MODULE:ATTR naming a policy object (a callable, an op list, ...)")
    common.add_argument(
        "--size", default=None, metavar="SIZE",
        help="fixture size: test (tiny, the default) or bench (the benchmark sizes); "
             "gpt also has stack32; hf:NAME models have test and bench. Ignored for "
             "MODULE:FUNCTION models")
    common.add_argument("--seed", type=int, default=0,
                        help="seed of the model, the inputs and dropout (default 0)")
    common.add_argument(
        "--device", default="cpu", metavar="{cpu,cuda}",
        help="device to run on (default cpu); cuda needs a CUDA build and a GPU")
    common.add_argument("--debug", action="store_true",
                        help="show full tracebacks and sac_compile's DEBUG logs on stderr")

    rep = sub.add_parser(
        "report", parents=[common], formatter_class=argparse.RawDescriptionHelpFormatter,
        help="compare checkpointing strategies on a model: one table, report.png, report.json",
        description="Run one model through no checkpointing, torch.utils.checkpoint full AC, "
                    "upstream SAC (eager and compiled), and sac_compile (eager, compiled, "
                    "compiled with a memory budget). Prints one row per strategy and writes "
                    "report.png and report.json.",
        epilog=_REPORT_EPILOG)
    rep.add_argument(
        "--model", default=DEFAULT_MODEL, metavar="MODEL",
        help=f"a fixture ({', '.join(FIXTURES)}; default {DEFAULT_MODEL}); a Hugging Face causal "
             f"LM from a small config, no download ({', '.join('hf:' + m for m in HF_MODELS)}; "
             f"needs {HF_INSTALL}); or MODULE:FUNCTION / PATH.py:FUNCTION, a function "
             f"returning (model, example_inputs). A model with a `.blocks` list (modules or "
             f"functions) is checkpointed per block, an HF model (a PreTrainedModel) per "
             f"decoder layer with HF's loss on labels=input_ids, anything else as a whole")
    rep.add_argument(
        "--budget", default="0.5", metavar="X",
        help="memory budget of the 'ours budget' rows: a fraction in (0, 1] of the "
             "activation bytes our partition saves without a budget (default 0.5), or a byte "
             "count such as 65536, 512KiB, 64MiB (per forward/backward split); peak:64MiB "
             "caps the step's measured peak instead (PeakBudget; eager: held by measuring "
             "its first steps, run before the row is measured); those rows relax the "
             "policy's MUSTs to PREFERs so the budget can evict them")
    rep.add_argument(
        "--steps", type=int, default=None, metavar="N",
        help="timed rounds per strategy, interleaved, after one warm-up round; time ratios "
             "are medians over these rounds (default: up to 15 rounds or 30 s of timing, "
             "at least 3)")
    rep.add_argument("--out", default="sac_report", metavar="DIR",
                     help="directory for report.png and report.json (default ./sac_report)")
    rep.add_argument("--no-compile", action="store_true",
                     help="skip the compiled strategies (no Inductor compile time)")
    rep.add_argument("--no-plot", action="store_true", help="do not write report.png")

    exp = sub.add_parser(
        "explain", parents=[common], formatter_class=argparse.RawDescriptionHelpFormatter,
        help="what a function saves and recomputes, eager vs compiled, and the difference",
        description="Run a function once in eager mode and once compiled, and print the "
                    "PartitionReport of each (saved values with the reason, recomputed ops) "
                    "and the difference between them.",
        epilog=_EXPLAIN_EPILOG)
    exp.add_argument("target", metavar="TARGET",
                     help="fixture name, hf:NAME (a Hugging Face model) or MODULE:FUNCTION")
    exp.add_argument(
        "--compiler", default="aot_eager", choices=("aot_eager", "inductor"),
        help="compiler for the compiled run: aot_eager (fast, no code generation; default) "
             "or inductor")
    return parser


# --------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------



def parse_budget(text: str) -> Any:
    """``"0.5"``, ``"1.0"`` -> a fraction in (0, 1]; ``"65536"``, ``"64MiB"`` -> bytes (int);
    ``"peak:64MiB"`` (or ``peak:0.8``) -> a :class:`~sac_compile.budgets.PeakBudget`, a cap
    on the step's peak. The same rule as ``memory_budget`` in Python
    (:func:`sac_compile.budgets.parse_budget_text`): ``"1"`` is refused (100% or
    one byte?), as are 0, negatives and floats above 1."""
    from ..budgets import PeakBudget, parse_budget_text
    peak = text.strip().lower().startswith("peak:")
    try:
        if peak:
            return PeakBudget(parse_budget_text(text.strip()[5:], what="--budget peak:"))
        return parse_budget_text(text, what="--budget")
    except ValueError as e:
        raise UsageError(str(e)) from None


def resolve_policy(name: str | None, default: str = "save_matmuls") -> tuple[str, Any]:
    """``(label, policy object)`` for ``--policy``."""
    from .. import policies
    name = name or default
    if name in policies.PRESETS:
        return name, policies.PRESETS[name]
    if ":" in name:
        obj = _load_attr(name, "--policy")
        from ..policy import normalize_policy
        try:
            normalize_policy(obj)
        except TypeError as e:
            raise UsageError(f"--policy {name}: {e}; point it at a policy callable, an op "
                             f"list or a preset name") from None
        return name, obj
    raise UsageError(f"unknown policy {name!r}; use one of {', '.join(policies.PRESETS)}, or "
                     f"MODULE:ATTR naming your own policy")


def check_device(device: str) -> str:
    import torch
    if device == "cpu":
        return device
    if device == "cuda" or device.startswith("cuda:"):
        if not torch.cuda.is_available():
            build = "this torch is a CPU build" if torch.version.cuda is None else \
                "no CUDA device is visible"
            raise UsageError(f"--device {device}: CUDA is not available ({build}); run with "
                             f"--device cpu, or install a CUDA build of torch on a GPU machine")
        return device
    raise UsageError(f"unknown device {device!r}; use --device cpu or --device cuda")


def _load_module(spec: str, flag: str) -> Any:
    if spec.endswith(".py") or os.sep in spec or "/" in spec:
        path = os.path.abspath(spec)
        if not os.path.isfile(path):
            raise UsageError(f"{flag}: no file {spec!r}; give an existing PATH.py:FUNCTION")
        mod_name = "_sac_user_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
        file_spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(file_spec)  # type: ignore[arg-type]
        sys.modules[mod_name] = module
        sys.path.insert(0, os.path.dirname(path))
        try:
            file_spec.loader.exec_module(module)  # type: ignore[union-attr]
        finally:
            sys.path.remove(os.path.dirname(path))
        return module
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(spec)
    except ModuleNotFoundError as e:
        if e.name and spec.startswith(e.name.split(".")[0]):
            raise UsageError(f"{flag}: cannot import module {spec!r}; run from the directory "
                             f"that holds it, or give PATH.py:FUNCTION") from None
        raise


def _load_attr(text: str, flag: str) -> Any:
    module_part, _, attr = text.rpartition(":")
    if not module_part or not attr:
        raise UsageError(f"{flag} {text!r}: expected MODULE:NAME or PATH.py:NAME")
    module = _load_module(module_part, flag)
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UsageError(f"{flag} {text!r}: {module_part!r} has no attribute {attr!r}; "
                             f"check the name after the colon")
        obj = getattr(obj, part)
    return obj


def _import_transformers(what: str) -> Any:
    try:
        import transformers
    except ImportError as e:
        raise UsageError(f"{what} needs Hugging Face transformers, which is not installed "
                         f"({e}); install it with {HF_INSTALL}") from None
    return transformers


def _load_hf(spec: str, *, size: str | None, seed: int, device: str, flag: str) -> Target:
    """``hf:NAME``: a Hugging Face model from a small config (``_bench.hf_models``)."""
    from .._bench.hf_models import HF_SIZES, make_hf_model
    from .._bench.runner import Target
    name = spec[len("hf:"):]
    if name not in HF_MODELS:
        raise UsageError(f"{flag} {spec}: unknown Hugging Face model {name!r}; use one of "
                         f"{', '.join('hf:' + m for m in HF_MODELS)}, or MODULE:FUNCTION "
                         f"returning (your HF model, (input_ids,))")
    size = size or DEFAULT_SIZE
    if size not in HF_SIZES:
        raise UsageError(f"unknown size {size!r} for {spec}; use one of {', '.join(HF_SIZES)}")
    _import_transformers(f"{flag} {spec}")
    model, inputs = make_hf_model(name, size=size, seed=seed, device=device)
    return Target(spec, model, tuple(inputs), True, size)


def _adapt_hf(spec: str, model: Any, flag: str) -> Any:
    """A user's HF model (a ``PreTrainedModel``): its decoder layers as ``.blocks``, HF's
    loss on ``labels=input_ids`` as the output (``_bench.hf_models.HFCausalLM``)."""
    from .._bench.hf_models import HFCausalLM, is_hf_model
    if not is_hf_model(model):
        return model
    try:
        return HFCausalLM(model)
    except ValueError as e:
        raise UsageError(f"{flag} {spec}: {e}") from None


def load_target(spec: str, *, size: str | None, seed: int, device: str,
                flag: str = "--model") -> Target:
    """A built-in model (``make_model``), a Hugging Face model from a small config
    (``hf:NAME``) or a user factory returning ``(model, example_inputs)``. A factory's
    Hugging Face model is adapted: its decoder layers are the blocks, its loss the output."""
    import torch

    from .._bench.runner import Target
    if spec.startswith("hf:"):
        return _load_hf(spec, size=size, seed=seed, device=device, flag=flag)
    if ":" not in spec:
        if spec not in FIXTURES:
            raise UsageError(f"unknown model {spec!r}; use one of {', '.join(FIXTURES)}, "
                             f"{', '.join('hf:' + m for m in HF_MODELS)}, or "
                             f"MODULE:FUNCTION / PATH.py:FUNCTION returning (model, inputs)")
        from .._bench.models import SIZES, make_model
        size = size or DEFAULT_SIZE
        if size not in SIZES[spec]:
            raise UsageError(f"unknown size {size!r} for {spec}; use one of "
                             f"{', '.join(SIZES[spec])}")
        model, inputs = make_model(spec, size=size, seed=seed, device=device)
        return Target(spec, model, tuple(inputs), True, size)

    factory = _load_attr(spec, flag)
    if not callable(factory):
        raise UsageError(f"{flag} {spec!r} is a {type(factory).__name__}, not a function; "
                         f"point it at a function returning (model, example_inputs)")
    torch.manual_seed(seed)
    try:
        result = factory()
    except TypeError as e:
        if "argument" in str(e):
            raise UsageError(f"{flag} {spec!r}: the factory must take no arguments ({e}); "
                             f"wrap it in a function with defaults") from None
        raise
    shape = "(model, example_inputs)"
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        got = f"a {type(result).__name__}" + (f" of length {len(result)}"
                                               if isinstance(result, (tuple, list)) else "")
        raise UsageError(f"{flag} {spec!r} returned {got}; it must return {shape}, e.g. "
                         f"`return model, (x,)`")
    model, inputs = result
    if not callable(model):
        raise UsageError(f"{flag} {spec!r} returned {type(model).__name__} as the model; it must "
                         f"return {shape} with an nn.Module or a function first")
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if not isinstance(inputs, (tuple, list)):
        raise UsageError(f"{flag} {spec!r} returned {type(inputs).__name__} as example_inputs; "
                         f"it must return {shape} with a tuple of tensors second")
    if not any(isinstance(t, torch.Tensor) for t in inputs):
        raise UsageError(f"{flag} {spec!r}: example_inputs hold no tensor; return {shape} with "
                         f"at least one tensor input")
    if isinstance(model, torch.nn.Module):
        model = _adapt_hf(spec, model.to(device), flag)
    inputs = tuple(t.to(device).detach().requires_grad_(t.requires_grad)
                   if isinstance(t, torch.Tensor) and t.device.type != torch.device(device).type
                   else t for t in inputs)
    return Target(spec, model, inputs, False)
