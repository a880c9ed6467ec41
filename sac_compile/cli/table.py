"""The report's output: the table on stdout and report.json."""
from __future__ import annotations

import datetime
import json
import os
import platform
from typing import Any

import torch

from .._bench.runner import GRAD_RTOL, ReportConfig, Row
from .._bench.strategies import as_blocked_model
from ..report import fmt_bytes
from ..torch_internals import TORCH_VERSION

__all__ = ["format_table", "machine_label", "meta", "write_json"]


def _fmt_flops(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(n)


def format_table(rows: list[Row], device: str) -> str:
    peak_head = "peak (CUDA)" if device.startswith("cuda") else "peak (CPU)"
    header = ["strategy", "kept", peak_head, "working peak", "modelled peak",
              "recompute FLOPs", "ops recomputed", "time vs no AC", "max |grad diff|"]
    body = []
    for r in rows:
        if r.status != "ok":
            body.append([r.label, *["-"] * (len(header) - 2), f"{r.status}: {r.note}"])
            continue
        body.append([
            r.label, fmt_bytes(r.kept_bytes, 2), fmt_bytes(r.peak_bytes, 2),
            "-" if r.working_bytes is None else fmt_bytes(r.working_bytes, 2),
            "-" if r.model_peak_bytes is None else fmt_bytes(r.model_peak_bytes, 2),
            _fmt_flops(r.recompute_flops),
            "-" if r.recomputed_ops is None else str(r.recomputed_ops),
            f"{r.time_ratio:.2f}x" if r.time_ratio is not None else "-",
            ("0" if not r.grad_diff else f"{r.grad_diff:.1e}")
            + ("" if r.grad_rel is None or r.grad_rel <= GRAD_RTOL else "  (!)"),
        ])
    widths = [max(len(row[i]) for row in [header, *body])
              for i in range(len(header) - 1)]

    def fmt(row: list[str]) -> str:
        cells = [c.ljust(w) if i == 0 else c.rjust(w)
                 for i, (c, w) in enumerate(zip(row[:-1], widths))]
        return "  ".join(cells + [row[-1]])
    line = "  ".join("-" * w for w in widths) + "  " + "-" * len(header[-1])
    return "\n".join([fmt(header), line, *map(fmt, body)])


def machine_label() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{cpu}, {cores} cores, {platform.system()} {platform.machine()}"


def meta(cfg: ReportConfig, elapsed: float) -> dict[str, Any]:
    t = cfg.target
    n_params = sum(p.numel() for p in as_blocked_model(t.fn).parameters())
    return {
        "model": t.label, "size": t.size, "policy": cfg.policy_label,
        "budget": repr(cfg.budget) if hasattr(cfg.budget, "label") else cfg.budget,
        "device": cfg.device, "steps": cfg.steps, "seed": cfg.seed,
        "parameters": n_params,
        "inputs": [list(x.shape) if isinstance(x, torch.Tensor) else repr(x) for x in t.inputs],
        "blocks": len(as_blocked_model(t.fn).blocks),
        "torch": TORCH_VERSION, "python": platform.python_version(),
        "machine": machine_label(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "elapsed_s": round(elapsed, 1),
        "definitions": {
            "kept_bytes": "activation bytes kept for backward (eager: counted at run time, "
                          "inside and outside the blocks; compiled: what the partition's "
                          "forward hands to its backward); parameters and buffers excluded",
            "peak_bytes": "measured, every strategy alike (sac_compile.measured_peak): the "
                          "most bytes torch's allocator held at once during one step "
                          "(forward, backward, the gradients it makes) above what it held "
                          "when the step began; " + (
                              "torch.cuda.max_memory_allocated" if cfg.device.startswith("cuda")
                              else "CPU: the profiler's allocation events (Inductor's "
                                   "buffers included), replayed in time order"),
            "model_peak_bytes": "compiled strategies: the partitioner's peak model of its "
                                "forward/backward graphs (activations only, the largest "
                                "split's; sac_compile.compiler.peak), beside the measurement",
            "grad_bytes": "what the measured step left allocated: its gradients",
            "working_bytes": "CPU: the measured peak of what the step allocates and also "
                             "frees (activations, recomputed values, temporaries; not the "
                             "gradients it leaves allocated); null on a device",
            "recompute_flops": "FLOPs of forward ops re-run in backward, torch.utils."
                               "flop_counter rules (eager: FlopCounterMode over the step minus "
                               "no AC's; compiled: the partition's recomputed nodes)",
            "time_ratio": "median over interleaved rounds of step time / no AC's step time "
                          "in the same round",
            "grad_diff": "max |grad - no-AC grad| over parameters and inputs, same seed "
                         "(compiled: inductor fallback_random, eager RNG)",
        },
    }


def write_json(path: str, cfg: ReportConfig, rows: list[Row], elapsed: float) -> None:
    doc = {"meta": meta(cfg, elapsed), "strategies": [r.to_json() for r in rows]}
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
