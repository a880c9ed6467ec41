"""The GPU check in one command (issue 21): CUDA tests, peak memory and step time on a
Llama-style step, offload rows and eager overhead, within a time budget.

    PYTHONPATH=. python benchmarks/gpu_check.py --out DIR          # on a CUDA machine
    PYTHONPATH=. python benchmarks/gpu_check.py --out DIR --device cpu --quick

Needs torch (>= 2.11) and what a CUDA image has (numpy, scipy); pytest for section 1 (the
section says "pytest missing" without it). Writes ``DIR/gpu_check.json`` and
``DIR/gpu_check.md`` after every row (a run that is killed still leaves what it measured),
``DIR/pytest_cuda.log``, and prints the summary at the end.

Sections, each with a share of ``--budget-s`` (what one leaves unused goes to the next);
past its soft deadline a section starts no new row and says so; past its hard deadline
(soft + grace) it is interrupted (SIGALRM) and its partial rows stand:

1. ``python -m pytest -m cuda tests/test_cuda.py`` in a subprocess: counts, skip reasons,
   failures;
2. the Llama-style decoder (``gpu_llama.py``): every strategy's peak, step time, ratios,
   gradient difference, our graph-level peak, and the issue's targets;
3. the offload rows of ``offload.py`` (CUDA: peak/step vs upstream SAC and its offload
   pass; without CUDA: its graph-level figures on the meta device);
4. the eager per-op overhead of ``eager_overhead.py`` on the device.

``--device cpu --quick`` runs the same code at tiny sizes on the CPU: no CUDA rows (no
allocator peak; the CUDA tests skip), said so in the output.

Seen: about 3 minutes on one H100 with torch 2.11 (docs/gpu_check_h100.md), about 3.5
minutes for ``--device cpu --quick`` on 2 CPU cores.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

from gpu_check_report import evaluate_targets, render_markdown  # noqa: E402
from gpu_llama import STRATEGY_KEYS, LlamaConfig  # noqa: E402
from gpu_llama_run import run_llama, why  # noqa: E402
from sac_compile.report import fmt_bytes  # noqa: E402

#: Section -> share of the time budget.
SHARES = {"cuda_tests": 100, "llama": 210, "offload": 85, "eager_overhead": 45}
OFFLOAD_ORDER = ("no_ac,upstream_sac,ours_offload,upstream_offload_async,ours_sac,"
                 "upstream_offload,ours_bf16,ours_offload_sink")


class SectionTimeout(BaseException):
    """A section's hard deadline passed (raised by SIGALRM; a BaseException, so that the
    rows' ``except Exception`` do not swallow it)."""


class Check:
    """The run's data, written to JSON and Markdown after every change."""

    def __init__(self, out: Path, meta: dict[str, Any]) -> None:
        self.out = out
        self.t0 = time.monotonic()
        self.data: dict[str, Any] = {"meta": meta, "finished": False,
                                     "sections": {k: {"status": "not started"} for k in SHARES}}

    def say(self, text: str) -> None:
        print(text, flush=True)

    def write(self) -> None:
        self.data["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        for name, text in (("gpu_check.json", json.dumps(self.data, indent=1, default=str)),
                           ("gpu_check.md", render_markdown(self.data))):
            tmp = self.out / (name + ".tmp")
            tmp.write_text(text)
            os.replace(tmp, self.out / name)


@contextlib.contextmanager
def hard_deadline(seconds: float):
    """Raise :class:`SectionTimeout` in the main thread after ``seconds``."""
    if not hasattr(signal, "setitimer"):
        yield
        return

    def fire(signum, frame):
        raise SectionTimeout()

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# --------------------------------------------------------------------------------------
# 1. CUDA-marked tests
# --------------------------------------------------------------------------------------

_RESULT = re.compile(r"^(\S+::\S+)\s+(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")
_SUMMARY = re.compile(r"^=+ (.*\d+ \w+.*) in [\d.]+s")


def parse_pytest(text: str) -> tuple[dict[str, int], list[str]]:
    """Counts (from the closing line, else from the verbose result lines) and the skip
    reasons / failures pytest's ``-rfEs`` summary lists."""
    counts: dict[str, int] = {}
    for line in text.splitlines():
        m = _SUMMARY.match(line)
        if m:
            counts = {}
            for n, word in re.findall(r"(\d+) (\w+)", m.group(1)):
                counts[{"error": "errors"}.get(word, word)] = int(n)
    if not counts:
        for line in text.splitlines():
            m = _RESULT.match(line)
            if m:
                key = {"ERROR": "errors"}.get(m.group(2), m.group(2).lower())
                counts[key] = counts.get(key, 0) + 1
    details = [ln.strip() for ln in text.splitlines()
               if ln.startswith(("SKIPPED [", "FAILED ", "ERROR "))]
    return counts, details[:40]


def section_tests(check: Check, sec: dict[str, Any], device: str, hard: float) -> None:
    if importlib.util.find_spec("pytest") is None:
        sec["status"], sec["note"] = "skipped", "pytest missing (not importable here)"
        return
    log = check.out / "pytest_cuda.log"
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-v", "-rfEs", "-p", "no:cacheprovider",
           "tests/test_cuda.py"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU run: the CUDA tests skip, as on CI
    sec["command"] = " ".join(cmd[1:])
    check.say(f"  $ python {sec['command']}  (log: {log.name})")
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=max(hard - 2 - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            rc = None
        finally:  # also when the section's alarm interrupts the wait
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    counts, details = parse_pytest(log.read_text(errors="replace"))
    sec["counts"], sec["details"], sec["returncode"] = counts, details, rc
    if rc is None:
        sec["status"] = "cut"
        sec["note"] = "pytest killed at the section's deadline; counts are the tests finished"
    elif counts.get("failed") or counts.get("errors"):
        sec["status"] = "failed"
    elif rc not in (0, 5):
        sec["status"], sec["note"] = "failed", f"pytest exited {rc}; see {log.name}"
    else:
        sec["status"] = "ok"
    if device == "cpu":
        sec["note"] = (sec.get("note", "") + " CPU run: CUDA hidden, so the CUDA tests skip.").strip()
    check.say(f"  counts: {counts}")


# --------------------------------------------------------------------------------------
# 3. Offload rows, 4. eager overhead
# --------------------------------------------------------------------------------------

def section_offload(check: Check, sec: dict[str, Any], args: argparse.Namespace, device: str,
                    soft: float) -> None:
    import offload as ob
    oargs = ob.build_parser().parse_args([])
    if args.quick:
        oargs.d, oargs.heads, oargs.batch, oargs.seq, oargs.meta_layers = 128, 4, 2, 64, 1
    oargs.layers, oargs.steps, oargs.warmup = args.offload_layers, args.offload_steps, 2
    keys = [k.strip() for k in args.offload_configs.split(",") if k.strip()]
    configs = [c for k in keys for c in ob.CONFIGS if c.key == k]
    sec["rows"], sec["notes"] = [], []
    if device == "cpu":
        sec["setup"] = (f"no CUDA: graph-level figures on the meta device, GPT d={oargs.d}, "
                        f"{oargs.meta_layers} layer(s), batch {oargs.batch} x seq {oargs.seq}, "
                        f"aot_eager (partition only); no peak or step time")
        sec["header"] = ["configuration", "status", "device bytes", "host bytes", "offloads",
                         "reloads", "held to forward end", "recomputed ops", "note"]
        for cfg in configs:
            row = {"configuration": cfg.label}
            sec["rows"].append(row)
            if time.monotonic() > soft or ob.unavailable(cfg):
                row["status"] = "skipped"
                row["note"] = ob.unavailable(cfg) or "section deadline passed"
                continue
            cfg = ob.dataclasses.replace(cfg, torch_flags={
                k: v for k, v in cfg.torch_flags.items() if k != "activation_reload_prefetch"})
            figs, note = ob.trace_graphs(cfg, oargs)
            if figs is None:
                row.update(status="failed", note=note)
            else:
                row.update({"status": "ok", "device bytes": fmt_bytes(figs.device_bytes, 2),
                            "host bytes": fmt_bytes(figs.host_bytes, 2), "offloads": figs.offloads,
                            "reloads": figs.reloads, "recomputed ops": figs.recomputed,
                            "held to forward end": fmt_bytes(figs.held_to_end, 2), "note": note})
            check.write()
        return
    sec["setup"] = (f"CUDA: GPT d={oargs.d}, {oargs.heads} heads, {oargs.layers} layers, batch "
                    f"{oargs.batch} x seq {oargs.seq}, {oargs.dtype}, whole model compiled with "
                    f"Inductor per configuration; median of {oargs.steps} steps after "
                    f"{oargs.warmup}")
    sec["header"] = ["configuration", "status", "peak", "peak/no AC", "step ms", "time/no AC",
                     "time/upstream SAC", "grad rel", "compile s", "note"]
    ref = ob.reference_grads_cuda(oargs)
    rows = []
    for cfg in configs:
        if time.monotonic() > soft:
            sec["rows"].append({"configuration": cfg.label, "status": "skipped",
                                "note": "section deadline passed before it ran"})
            continue
        check.say(f"  offload: {cfg.label} ...")
        rows.append(ob.run_cuda_row(cfg, oargs, ref))
        sec["rows"] = _offload_rows(rows) + [r for r in sec["rows"] if r["status"] == "skipped"]
        check.write()
    sec["target"] = ob.target_line(rows)


def _offload_rows(rows: list[Any]) -> list[dict[str, Any]]:
    base = next((r for r in rows if r.cfg.key == "no_ac" and r.status == "ok"), None)
    sac = next((r for r in rows if r.cfg.key == "upstream_sac" and r.status == "ok"), None)
    out = []
    for r in rows:
        d = {"configuration": r.cfg.label, "status": r.status, "note": r.note}
        if r.status == "ok":
            d.update({"peak": fmt_bytes(r.peak, 2), "peak_bytes": r.peak, "step ms": f"{r.ms:.2f}",
                      "grad rel": f"{r.grad_rel:.1e}" if r.grad_rel is not None else "n/a",
                      "compile s": f"{r.compile_s:.0f}"})
            if base:
                d["peak/no AC"] = f"{r.peak / base.peak:.3f}"
                d["time/no AC"] = f"{r.ms / base.ms:.3f}"
            if sac:
                d["time/upstream SAC"] = f"{r.ms / sac.ms:.3f}"
        out.append(d)
    return out


def section_eager(check: Check, sec: dict[str, Any], args: argparse.Namespace, device: str,
                  soft: float) -> None:
    import eager_overhead as eo
    chain_reps, mlp_reps = (3, 3) if args.quick else (11, 7)
    sec["setup"] = f"device {device}; chain rounds {chain_reps}, MLP rounds <= {mlp_reps}"
    sec["notes"] = []
    sec["chains"] = [dict(zip(eo.CHAIN_HEADER, r)) for r in eo.bench_chains(chain_reps, device)]
    check.write()
    left = soft - time.monotonic()
    if left < 5:
        sec["notes"].append("MLP rows not run: the section's deadline had passed")
        return
    size = "test" if args.quick else "bench"
    time_rows, byte_rows, n = eo.bench_mlp(mlp_reps, max(left * 0.5, 1.0), device, size)
    sec["mlp_time"] = [dict(zip(eo.MLP_TIME_HEADER, r)) for r in time_rows]
    sec["mlp_bytes"] = [dict(zip(eo.MLP_BYTES_HEADER, r)) for r in byte_rows]
    sec["notes"].append(f"MLP fixture at size {size!r}"
                        + (" (quick: 2 layers of 16->64->16, not the 8-layer one)"
                           if args.quick else "") + f"; step: median of {n} interleaved rounds")


# --------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="folder for the JSON, Markdown, log")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--quick", action="store_true", help="tiny sizes (the CPU check)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="total time budget (default 450 s; 900 s with --quick)")
    p.add_argument("--sections", default=",".join(SHARES), help="any of " + ", ".join(SHARES))
    g = p.add_argument_group("section 2: the Llama-style decoder")
    for name, default in (("layers", 8), ("d", 2048), ("heads", 16), ("kv-heads", 8), ("ffn", 0),
                          ("vocab", 32768), ("seq", 2048), ("batch", 1)):
        g.add_argument(f"--{name}", type=int, default=None, help=f"default {default}")
    g.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    g.add_argument("--rounds", type=int, default=None, help="timed rounds (default 5; quick 2)")
    g.add_argument("--warmup", type=int, default=1, help="untimed rounds after the first step")
    g.add_argument("--strategies", default=",".join(STRATEGY_KEYS))
    g.add_argument("--torch-sac-mm", choices=("all", "every_other"), default="all",
                   help="torch SAC saves every mm of torchtitan's list, or every second one "
                        "(torchtitan's op-SAC policy)")
    g = p.add_argument_group("section 3: offload rows")
    g.add_argument("--offload-configs", default=OFFLOAD_ORDER)
    g.add_argument("--offload-layers", type=int, default=2)
    g.add_argument("--offload-steps", type=int, default=5)
    return p


QUICK = dict(layers=2, d=64, heads=4, kv_heads=2, ffn=0, vocab=128, seq=32, batch=2)


def llama_config(args: argparse.Namespace) -> LlamaConfig:
    defaults = QUICK if args.quick else {}
    kw = {}
    for f in ("layers", "d", "heads", "kv_heads", "ffn", "vocab", "seq", "batch"):
        v = getattr(args, f)
        if v is not None:
            kw[f] = v
        elif f in defaults:
            kw[f] = defaults[f]
    return LlamaConfig(dtype=args.dtype, **kw)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    budget = args.budget_s or (900.0 if args.quick else 450.0)
    wanted = [s for s in SHARES if s in args.sections.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    notes = []
    if device == "cpu":
        notes.append("CPU run: no CUDA rows (no allocator peak, CUDA tests skip); the same "
                     "harness at " + ("tiny sizes." if args.quick else "the sizes given."))
    check = Check(args.out, {
        "torch": torch.__version__, "python": platform.python_version(), "device": device,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else
        f"CPU ({platform.machine()}, {os.cpu_count()} cores)",
        "started": datetime.datetime.now().isoformat(timespec="seconds"), "budget_s": budget,
        "quick": args.quick, "argv": sys.argv[1:] if argv is None else argv, "notes": notes})
    check.write()
    end = check.t0 + budget
    for i, name in enumerate(wanted):
        sec = check.data["sections"][name]
        now = time.monotonic()
        share = SHARES[name] / sum(SHARES[n] for n in wanted[i:])
        soft = now + max(end - now, 0) * share
        hard = min(soft + min(45.0, 0.25 * SHARES[name] * budget / 450), end + 10)
        sec.update(status="running", deadline_s=round(soft - now, 1))
        check.say(f"\n== {name}: soft deadline {soft - now:.0f} s, hard {hard - now:.0f} s")
        check.write()
        try:
            with hard_deadline(hard - now):
                if name == "cuda_tests":
                    section_tests(check, sec, device, hard)
                elif name == "llama":
                    cfg = llama_config(args)
                    sec["config"] = {**{k: getattr(cfg, k) for k in (
                        "layers", "d", "heads", "kv_heads", "vocab", "seq", "batch", "dtype")},
                        "ffn": cfg.ffn_dim, "torch_sac_mm": args.torch_sac_mm}
                    keys = [k for k in args.strategies.split(",") if k]
                    run_llama(cfg, device, keys, mm=args.torch_sac_mm,
                              rounds=args.rounds or (2 if args.quick else 5),
                              warmup=args.warmup, deadline=soft, section=sec,
                              emit=check.write, say=check.say)
                    sec["targets"] = evaluate_targets(sec, device == "cuda")
                    failed = [r["key"] for r in sec["rows"] if r["status"] == "failed"]
                    if failed:
                        sec["note"] = f"{len(failed)} row(s) failed: {', '.join(failed)}"
                elif name == "offload":
                    section_offload(check, sec, args, device, soft)
                else:
                    section_eager(check, sec, args, device, soft)
            if sec["status"] == "running":
                sec["status"] = "ok"
        except SectionTimeout:
            sec["status"] = "cut"
            sec["note"] = (f"interrupted at its hard deadline ({hard - now:.0f} s); the rows "
                           f"above are what it finished, the rest did not run")
            if name == "llama":
                sec["targets"] = evaluate_targets(sec, device == "cuda")
        except Exception as e:  # noqa: BLE001 - a section's failure does not end the check
            sec["status"], sec["note"] = "failed", why(e)
        sec["seconds"] = round(time.monotonic() - now, 1)
        check.say(f"== {name}: {sec['status']} in {sec['seconds']:.0f} s "
                  f"{sec.get('note', '')}")
        check.write()
    for name in SHARES:
        if name not in wanted:
            check.data["sections"][name].update(status="skipped", note="not in --sections")
    check.data["finished"] = True
    check.write()
    print("\n" + (args.out / "gpu_check.md").read_text(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
