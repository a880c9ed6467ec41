"""The Markdown summary of ``benchmarks/gpu_check.py`` and the issue's targets, read off
its JSON data (one dict; nothing here measures)."""
from __future__ import annotations

from typing import Any

from sac_compile.report import fmt_bytes

__all__ = ["TARGETS", "evaluate_targets", "render_markdown"]

#: The issue's targets, printed beside the figures (key -> text).
TARGETS = {
    "offload": "ours compiled with an offload policy: peak <= upstream's best (its offload pass, "
               "or SAC) at <= +2% step time over torch SAC (torch PR 168316's example: peak "
               "9,160 -> 7,534 MB at +2.2%)",
    "budget": "ours at memory_budget=0.5: peak <= torch's activation_memory_budget=0.5 at "
              "equal or lower step time",
    "working_set": "backward working set of a compiled checkpointed stack <= 1.1x the eager "
                   "checkpoint peak",
    "moonshot": "moonshot: the same step time as torchtitan-style SAC (within +2%) at >= 30% "
                "less peak memory",
}


def _num(x: Any, spec: str) -> str:
    return format(x, spec) if isinstance(x, (int, float)) and not isinstance(x, bool) else "n/a"


def _rows(section: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["key"]: r for r in section.get("rows", []) if r.get("status") == "ok"}


def evaluate_targets(llama: dict[str, Any], on_cuda: bool) -> list[dict[str, str]]:
    """One entry per target: ``{"key", "target", "figures", "verdict"}`` (verdict yes / no /
    n/a with the reason)."""
    rows = _rows(llama)
    out = []

    def add(key: str, figures: str, verdict: str) -> None:
        out.append({"key": key, "target": TARGETS[key], "figures": figures, "verdict": verdict})

    if not on_cuda:
        for key in TARGETS:
            add(key, "", "n/a: no CUDA device, so no allocator peak (CPU run)")
        return out

    def have(*keys: str) -> str | None:
        missing = [k for k in keys if k not in rows or rows[k].get("peak_bytes") is None
                   or rows[k].get("step_ms") is None]
        return f"n/a: no figures for {', '.join(missing)}" if missing else None

    sac = rows.get("torch_sac_compiled")
    miss = have("ours_offload", "torch_sac_compiled")
    if miss:
        add("offload", "", miss)
    else:
        o = rows["ours_offload"]
        t = o["step_ms"] / sac["step_ms"]
        ok = o["peak_bytes"] <= sac["peak_bytes"] and t <= 1.02
        add("offload", f"ours offload {fmt_bytes(o['peak_bytes'], 2)} at {t:.3f}x torch SAC's step; "
            f"torch SAC (compiled) {fmt_bytes(sac['peak_bytes'], 2)} (upstream's offload pass: "
            f"section 3)", "yes" if ok else "no")
    miss = have("ours_budget", "torch_budget")
    if miss:
        add("budget", "", miss)
    else:
        o, u = rows["ours_budget"], rows["torch_budget"]
        ok = o["peak_bytes"] <= u["peak_bytes"] and o["step_ms"] <= u["step_ms"]
        add("budget", f"ours {fmt_bytes(o['peak_bytes'], 2)}, {o['step_ms']:.2f} ms; torch "
            f"{fmt_bytes(u['peak_bytes'], 2)}, {u['step_ms']:.2f} ms", "yes" if ok else "no")
    miss = have("ours_compiled", "ours_eager")
    if miss:
        add("working_set", "", miss)
    else:
        c, e = rows["ours_compiled"], rows["ours_eager"]
        ratio = c["act_bytes"] / max(e["act_bytes"], 1)
        text = (f"ours compiled {fmt_bytes(c['act_bytes'], 2)} / ours eager "
                f"{fmt_bytes(e['act_bytes'], 2)} = {ratio:.3f}x (activation peak: peak minus "
                f"what the step started with)")
        if "torch_sac" in rows and "torch_sac_compiled" in rows and rows["torch_sac"].get(
                "act_bytes"):
            text += (f"; torch SAC compiled/eager "
                     f"{sac['act_bytes'] / max(rows['torch_sac']['act_bytes'], 1):.3f}x")
        add("working_set", text, "yes" if ratio <= 1.1 else "no")
    if sac is None or sac.get("peak_bytes") is None:
        add("moonshot", "", "n/a: no torch SAC (compiled) figures")
    else:
        hits, best = [], None
        for k, r in rows.items():
            if r["side"] != "ours" or r.get("peak_bytes") is None or r["mode"] != "compiled":
                continue
            t = r["step_ms"] / sac["step_ms"]
            less = 1 - r["act_bytes"] / max(sac["act_bytes"], 1)
            less_total = 1 - r["peak_bytes"] / sac["peak_bytes"]
            entry = (f"{k}: {t:.3f}x time, {less * 100:.0f}% less activation peak, "
                     f"{less_total * 100:.0f}% less total peak")
            if best is None or less > best[0]:
                best = (less, entry)
            if t <= 1.02 and less >= 0.30:
                hits.append(entry + (" (lossy)" if r["lossy"] else ""))
        figures = "; ".join(hits) if hits else (best[1] if best else "no compiled rows of ours")
        add("moonshot", figures + " (vs torch SAC compiled)", "yes" if hits else "no")
    return out


def _graph_peak(splits: list[dict[str, Any]]) -> str:
    """The largest split's figures: ``peak 1.2 MiB (forward ..., backward ..., phase)``."""
    def size(p: dict[str, Any]) -> float:
        return max((v for v in p.values() if isinstance(v, (int, float))), default=0)
    p = max(splits, key=size)
    parts = [f"{k} {fmt_bytes(v, 2) if isinstance(v, (int, float)) else v}" for k, v in p.items()]
    return "; ".join(parts) + (f" (largest of {len(splits)} splits)" if len(splits) > 1 else "")


def _llama_table(section: dict[str, Any]) -> list[str]:
    head = ("| strategy | status | peak | act peak | peak/no AC | step ms | vs no AC | "
            "vs torch SAC | max grad diff (rel) | graph-level peak (ours) | first step s |")
    lines = [head, "|" + "---|" * 11]
    for r in section.get("rows", []):
        if r.get("status") != "ok":
            lines.append(f"| {r['label']} | {r['status']}: {r.get('note', '')} |" + " |" * 9)
            continue
        graph = "n/a" if r["mode"] != "compiled" or r["side"] != "ours" else (
            _graph_peak(r["graph_peak"]) if r.get("graph_peak")
            else r.get("graph_peak_note", "n/a"))
        grad = f"{_num(r.get('grad_diff'), '.1e')} ({_num(r.get('grad_rel'), '.1e')})"
        if r.get("lossy"):
            grad += " lossy"
        lines.append(
            f"| {r['label']} | ok | {fmt_bytes(r.get('peak_bytes'), 2)} | "
            f"{fmt_bytes(r.get('act_bytes'), 2)} | {_num(r.get('peak_vs_no_ac'), '.3f')} | "
            f"{_num(r.get('step_ms'), '.2f')} | {_num(r.get('vs_no_ac'), '.3f')} | "
            f"{_num(r.get('vs_torch_sac'), '.3f')} | {grad} | {graph} | "
            f"{_num(r.get('first_step_s'), '.1f')} |")
    return lines


def _generic_table(rows: list[dict[str, Any]], header: list[str]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(h, "")) for h in header) + " |")
    return lines


def _status_line(sec: dict[str, Any]) -> str:
    text = f"status: **{sec.get('status', 'not started')}**"
    if sec.get("seconds") is not None:
        text += f", {sec['seconds']:.0f} s"
    if sec.get("deadline_s") is not None:
        text += f" (deadline {sec['deadline_s']:.0f} s)"
    return text + (f". {sec['note']}" if sec.get("note") else "")


def render_markdown(data: dict[str, Any]) -> str:
    meta = data.get("meta", {})
    s = data.get("sections", {})
    out = [f"# GPU check: {meta.get('device_name', '?')}",
           "",
           f"torch {meta.get('torch')}, Python {meta.get('python')}, started "
           f"{meta.get('started')}; time budget {meta.get('budget_s')} s; elapsed "
           f"{_num(data.get('elapsed_s'), '.0f')} s; finished: "
           f"{'yes' if data.get('finished') else 'no (cut or still running)'}."]
    out += [f"{n}" for n in meta.get("notes", [])]

    t = s.get("cuda_tests", {})
    out += ["", "## 1. CUDA-marked tests (`pytest -m cuda tests/test_cuda.py`)", "",
            _status_line(t)]
    if t.get("counts"):
        out.append("counts: " + ", ".join(f"{k} {v}" for k, v in t["counts"].items()))
    out += [f"- {line}" for line in t.get("details", [])]

    ll = s.get("llama", {})
    out += ["", "## 2. Llama-style decoder, one training step per strategy", "", _status_line(ll)]
    if ll.get("config"):
        out.append("config: " + ", ".join(f"{k}={v}" for k, v in ll["config"].items()) +
                   (f"; {ll['params'] / 1e6:.1f} M parameters" if ll.get("params") else ""))
    if ll.get("rows"):
        out += ["", *_llama_table(ll), ""]
        out.append(f"rounds: {ll.get('rounds_done', 0)} of {ll.get('rounds_asked', '?')}. "
                   "peak: torch.cuda.max_memory_allocated during the step; act peak: the same "
                   "minus what was allocated when the step began (parameters, gradients, "
                   "tokens); step: median, CUDA-synchronised; vs no AC / vs torch SAC: median "
                   "per-round ratio to the row of the same mode (eager or compiled); grad diff: "
                   "max |grad - eager no AC's| (relative: over the largest reference gradient); "
                   "graph-level peak: what our PartitionReport computes for one block's split.")
    out += [f"- {n}" for n in ll.get("notes", [])]
    if ll.get("targets"):
        out += ["", "### Targets (issue 21)", "", "| target | figures | met |", "|---|---|---|"]
        out += [f"| {x['target']} | {x['figures']} | {x['verdict']} |" for x in ll["targets"]]

    o = s.get("offload", {})
    out += ["", "## 3. Offload rows (`benchmarks/offload.py`)", "", _status_line(o)]
    if o.get("setup"):
        out.append(o["setup"])
    if o.get("rows"):
        out += ["", *_generic_table(o["rows"], o.get("header", list(o["rows"][0])))]
    if o.get("target"):
        out += ["", f"target: {o['target']}"]
    out += [f"- {n}" for n in o.get("notes", [])]

    e = s.get("eager_overhead", {})
    out += ["", "## 4. Eager per-op overhead (`benchmarks/eager_overhead.py`)", "",
            _status_line(e)]
    for name, title in (("chains", "per-op overhead, recompute-everything policy"),
                        ("mlp_time", "MLP fixture, save matmuls: step time"),
                        ("mlp_bytes", "MLP fixture, save matmuls: bytes kept")):
        if e.get(name):
            out += ["", f"{title}:", "", *_generic_table(e[name], list(e[name][0]))]
    out += [f"- {n}" for n in e.get("notes", [])]
    return "\n".join(out) + "\n"
