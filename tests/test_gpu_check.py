"""``benchmarks/gpu_check.py --device cpu --quick`` (issue 21): the GPU check's harness runs
end to end on the CPU at tiny sizes, the same code the GPU runs, and writes what it
measured. A subprocess, as the GPU machine runs it; about 2-3 minutes here (Inductor)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    env = dict(os.environ, PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--out", str(out),
                           "--device", "cpu", "--quick"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads((out / "gpu_check.json").read_text()), out, proc.stdout


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


@pytest.mark.slow
def test_quick_cpu_run_writes_every_section(quick_run):
    data, out, stdout = quick_run
    assert data["finished"] is True
    assert data["meta"]["device"] == "cpu" and data["meta"]["quick"] is True
    assert "CPU run: no CUDA rows" in " ".join(data["meta"]["notes"])
    sections = data["sections"]
    assert set(sections) == {"cuda_tests", "llama", "offload", "eager_overhead"}
    for name, sec in sections.items():
        assert sec["status"] == "ok", (name, sec.get("status"), sec.get("note"))
    md = (out / "gpu_check.md").read_text()
    assert md in stdout  # the summary is printed at the end
    for heading in ("## 1. CUDA-marked tests", "## 2. Llama-style decoder", "### Targets",
                    "## 3. Offload rows", "## 4. Eager per-op overhead"):
        assert heading in md, heading


@pytest.mark.slow
def test_quick_cpu_run_the_cuda_tests_are_collected_and_skip(quick_run):
    tests = quick_run[0]["sections"]["cuda_tests"]
    assert tests["counts"].get("skipped", 0) > 0
    assert not tests["counts"].get("failed") and not tests["counts"].get("errors")
    assert any("needs a CUDA device" in d for d in tests["details"])


@pytest.mark.slow
def test_quick_cpu_run_llama_rows(quick_run):
    from gpu_llama import STRATEGY_KEYS
    llama = quick_run[0]["sections"]["llama"]
    rows = {r["key"]: r for r in llama["rows"]}
    assert list(rows) == STRATEGY_KEYS
    for key, r in rows.items():
        if r["status"] == "skipped":  # only what this torch lacks, with its version named
            assert key in ("ours_offload", "ours_hooks") and torch.__version__ in r["note"], r
            continue
        assert r["status"] == "ok", r
        assert _finite(r["step_ms"]) and r["step_ms"] > 0, r
        assert _finite(r["vs_no_ac"]) and _finite(r["vs_torch_sac"]), r
        assert r["peak_bytes"] is None  # no allocator peak on the CPU
        # eager rows replay the same kernels: exact; compiled rows: Inductor's bf16 rounding
        limit = 1e-6 if r["mode"] == "eager" else (0.2 if r["lossy"] else 5e-2)
        assert _finite(r["grad_rel"]) and r["grad_rel"] <= limit, r
        if r["mode"] == "compiled" and r["side"] == "ours":
            assert r["splits"] >= 1 and r["graph_saved_bytes"] > 0, r
            assert r["graph_peak"] or r["graph_peak_note"], r
    assert llama["rounds_done"] == llama["rounds_asked"] == 2
    assert [t["key"] for t in llama["targets"]] == ["offload", "budget", "working_set",
                                                    "moonshot"]
    assert all(t["verdict"].startswith("n/a: no CUDA") for t in llama["targets"])


@pytest.mark.slow
def test_quick_cpu_run_offload_and_overhead_rows(quick_run):
    sections = quick_run[0]["sections"]
    offload = {r["configuration"]: r for r in sections["offload"]["rows"]}
    assert offload["no AC"]["status"] == "ok"
    assert offload["upstream SAC (save mm + attention)"]["status"] == "ok"
    assert "meta device" in sections["offload"]["setup"]
    eager = sections["eager_overhead"]
    assert len(eager["chains"]) == 2
    for row in eager["chains"]:
        assert _finite(float(row["torch SAC us/op"])), row
    assert [r["strategy"] for r in eager["mlp_bytes"]][0] == "no AC"
