"""Run the strategies of :mod:`gpu_llama` on one model: a first step each (compiles, checks
gradients against eager no AC), then interleaved timed rounds, under a deadline.

Rows are plain dicts (JSON as they are), appended to ``section["rows"]`` as they are made
and updated after every round; ``emit()`` is called after each change so that the caller
can write its files incrementally.
"""
from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from gpu_llama import (STRATEGIES, LlamaConfig, build_model, build_strategy, label_of,
                       loss_of, needs, peak_fields)

__all__ = ["run_llama", "why"]


def why(e: BaseException) -> str:
    """The root cause's type and first line (Dynamo wraps backend errors)."""
    while True:
        inner = e.__cause__ or getattr(e, "inner_exception", None)
        if not isinstance(inner, BaseException) or inner is e:
            break
        e = inner
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


def _unique_graphs() -> int:
    try:
        from torch._dynamo.utils import counters
        return int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001
        return -1


def _raise_recompile_limits() -> None:
    """Every compiled row compiles the same block code with its own backend: more cache
    entries per code object than Dynamo's default limit of 8 allows."""
    import torch._dynamo.config as dynamo_config
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), 256))


def _median_ratio(a: dict[int, float], b: dict[int, float]) -> float | None:
    """Median over the rounds both ran of a's time over b's (pairing by round cancels
    drifts of the machine that medians of each alone do not)."""
    pairs = [a[r] / b[r] for r in a if r in b and b[r] > 0]
    return statistics.median(pairs) if pairs else None


def run_llama(cfg: LlamaConfig, device: str, keys: list[str], *, mm: str, rounds: int,
              warmup: int, deadline: float, section: dict[str, Any],
              emit: Callable[[], None], say: Callable[[str], None] = print) -> None:
    """Fill ``section`` (``rows``, ``notes``) for the strategies ``keys`` (no AC first: it is
    the gradient reference). ``deadline`` is a ``time.monotonic()`` value: strategies not
    started by then are skipped, rounds stop, and the rows say so."""
    is_cuda = device.startswith("cuda")
    section.setdefault("rows", [])
    section.setdefault("notes", [])
    _raise_recompile_limits()
    if "no_ac" not in keys:
        keys = ["no_ac", *keys]
    strategies = [s for k in keys for s in STRATEGIES if s.key == k]

    def sync() -> None:
        if is_cuda:
            torch.cuda.synchronize()

    t_build = time.perf_counter()
    base, tokens, targets = build_model(cfg, device)
    named = list(base.named_parameters())
    section["params"] = sum(p.numel() for _, p in named)
    say(f"  model built in {time.perf_counter() - t_build:.1f} s: "
        f"{section['params'] / 1e6:.1f} M parameters")

    def zero_grads() -> None:
        for _, p in named:
            if p.grad is not None:
                p.grad.zero_()

    ref: dict[str, torch.Tensor] | None = None
    ref_max = 0.0
    runs: dict[str, tuple[Callable[[], None], dict[str, Any]]] = {}
    for s in strategies:
        row: dict[str, Any] = {"key": s.key, "label": label_of(s, cfg, mm), "mode": s.mode,
                               "side": s.side, "lossy": s.lossy, "status": "ok", "note": ""}
        section["rows"].append(row)
        reason = needs(s, cfg, device)
        if reason is None and time.monotonic() > deadline:
            reason = "not run: the section's deadline had passed"
        if reason is not None:
            row["status"], row["note"] = "skipped", reason
            say(f"  {row['label']}: skipped ({reason})")
            emit()
            continue
        try:
            built = build_strategy(s, base, cfg, mm)
            model = built.model

            def step(model=model) -> None:
                loss_of(model(tokens), targets).backward()

            graphs = _unique_graphs()
            zero_grads()
            t0 = time.perf_counter()
            step()
            sync()
            row["first_step_s"] = round(time.perf_counter() - t0, 2)
            row["graphs_compiled"] = _unique_graphs() - graphs if graphs >= 0 else None
            if ref is None:
                if s.key != "no_ac":
                    raise RuntimeError("no AC (eager) did not run: no gradient reference")
                ref = {n: p.grad.detach().to("cpu", copy=True) for n, p in named}
                ref_max = max(g.float().abs().max().item() for g in ref.values())
            diff = 0.0
            for n, p in named:
                diff = max(diff, (p.grad.float() - ref[n].to(device).float()).abs().max().item())
            row["grad_diff"] = diff
            row["grad_rel"] = diff / ref_max if ref_max else None
            if s.mode == "compiled" and s.side == "ours":
                row["splits"] = len(built.reports)
                row["graph_saved_bytes"] = max((r.activation_bytes for r in built.reports),
                                               default=None)
                peaks = [peak_fields(r) for r in built.reports]
                row["graph_peak"] = peaks if any(peaks) else None
                if not any(peaks):
                    row["graph_peak_note"] = ("n/a: this PartitionReport has no peak field"
                                              if built.reports else "n/a: no report")
            runs[s.key] = (step, row)
            say(f"  {row['label']}: first step {row['first_step_s']} s "
                f"({row['graphs_compiled']} graphs), grad diff {diff:.2e}")
        except Exception as e:  # noqa: BLE001 - one row's failure does not end the run
            row["status"], row["note"] = "failed", why(e)
            say(f"  {row['label']}: failed ({row['note']})")
        emit()

    _timed_rounds(runs, section, is_cuda=is_cuda, rounds=rounds, warmup=warmup,
                  deadline=deadline, zero_grads=zero_grads, sync=sync, emit=emit, say=say)


def _timed_rounds(runs: dict[str, tuple[Callable[[], None], dict[str, Any]]],
                  section: dict[str, Any], *, is_cuda: bool, rounds: int, warmup: int,
                  deadline: float, zero_grads: Callable[[], None], sync: Callable[[], None],
                  emit: Callable[[], None], say: Callable[[str], None]) -> None:
    keys = list(runs)
    times: dict[str, dict[int, float]] = {k: {} for k in keys}
    peaks: dict[str, list[int]] = {k: [] for k in keys}
    acts: dict[str, list[int]] = {k: [] for k in keys}
    done = 0
    for r in range(warmup + rounds):
        if time.monotonic() > deadline:
            section["notes"].append(f"timed rounds cut by the section's deadline after {done} "
                                    f"of {rounds} (and {min(r, warmup)} of {warmup} warm-up)")
            say("  " + section["notes"][-1])
            break
        order = keys[r % len(keys):] + keys[:r % len(keys)] if keys else []
        for k in order:
            step, row = runs[k]
            if row["status"] != "ok":
                continue
            try:
                zero_grads()
                gc.collect()
                sync()
                if is_cuda:
                    before = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                step()
                sync()
                dt = time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001
                row["status"], row["note"] = "failed", f"in a timed step: {why(e)}"
                continue
            if r >= warmup:
                times[k][r] = dt
                if is_cuda:
                    peak = torch.cuda.max_memory_allocated()
                    peaks[k].append(peak)
                    acts[k].append(peak - before)
        if r >= warmup:
            done += 1
            _summarise(runs, times, peaks, acts, done)
            emit()
    section["rounds_done"] = done
    section["rounds_asked"] = rounds


def _summarise(runs: dict[str, tuple[Callable[[], None], dict[str, Any]]],
               times: dict[str, dict[int, float]], peaks: dict[str, list[int]],
               acts: dict[str, list[int]], done: int) -> None:
    rows = {k: row for k, (_, row) in runs.items()}
    for k, row in rows.items():
        if not times[k]:
            continue
        row["rounds"] = len(times[k])
        row["step_ms"] = statistics.median(times[k].values()) * 1e3
        row["peak_bytes"] = max(peaks[k]) if peaks[k] else None
        row["act_bytes"] = max(acts[k]) if acts[k] else None
        mode = row["mode"]
        for ref_key, name in ((("no_ac" if mode == "eager" else "no_ac_compiled"), "vs_no_ac"),
                              (("torch_sac" if mode == "eager" else "torch_sac_compiled"),
                               "vs_torch_sac")):
            ok = ref_key in rows and rows[ref_key]["status"] == "ok" and times.get(ref_key)
            row[name] = _median_ratio(times[k], times[ref_key]) if ok else None
            if name == "vs_no_ac" and ok and row["peak_bytes"] and rows[ref_key].get("peak_bytes"):
                row["peak_vs_no_ac"] = row["peak_bytes"] / rows[ref_key]["peak_bytes"]
