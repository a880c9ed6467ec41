"""``report.png``: activation bytes kept against step time, one labelled point per strategy.

matplotlib (the ``report`` extra) with the Agg backend, so it works without a display.
"""
from __future__ import annotations

from typing import Any

from fixtures.measure import fmt_bytes

__all__ = ["write_plot"]

_COLORS = {"no_ac": "#444444", "full_ac": "#8c564b", "torch_sac_eager": "#1f77b4",
           "torch_sac_compiled": "#17becf", "ours_eager": "#d62728",
           "ours_compiled": "#ff7f0e", "ours_budget": "#2ca02c"}
_MARKERS = {"eager": "o", "compiled": "s"}


def write_plot(path: str, rows: list[Any], meta: dict[str, Any]) -> bool:
    """Write the figure; returns False (and writes nothing) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    pts = [r for r in rows if r.status == "ok" and r.time_ratio is not None
           and r.kept_bytes is not None]
    fig, ax = plt.subplots(figsize=(9, 6), dpi=110)
    for r in pts:
        ax.scatter(r.time_ratio, r.kept_bytes, s=90, color=_COLORS.get(r.key, "k"),
                   marker=_MARKERS.get(r.kind, "o"), edgecolor="black", linewidth=0.6,
                   zorder=3, label=r.label)
    # Labels: offset, alternating sides so that neighbours do not overlap.
    order = sorted(pts, key=lambda r: (r.kept_bytes, r.time_ratio))
    for i, r in enumerate(order):
        dx = 10 if i % 2 == 0 else -10
        ax.annotate(r.label, (r.time_ratio, r.kept_bytes), xytext=(dx, 8 if i % 4 < 2 else -14),
                    textcoords="offset points", fontsize=8.5,
                    ha="left" if dx > 0 else "right", zorder=4)
    if pts:
        xs = [r.time_ratio for r in pts]
        ys = [r.kept_bytes for r in pts]
        xpad = max(0.15, (max(xs) - min(xs)) * 0.25)
        ax.set_xlim(max(0.0, min(xs) - xpad), max(xs) + xpad)
        ax.set_ylim(0, max(ys) * 1.18 if max(ys) else 1)
    ax.axvline(1.0, color="#999999", linewidth=0.8, linestyle="--", zorder=1)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: fmt_bytes(v)))
    ax.set_xlabel("step time, median ratio to no AC (lower is faster)")
    peak = "kept for backward" if not str(meta.get("device", "")).startswith("cuda") else \
        "kept for backward"
    ax.set_ylabel(f"activation bytes {peak} (lower is smaller)")
    size = f" ({meta['size']})" if meta.get("size") else ""
    ax.set_title(f"sac_compile report: {meta.get('model')}{size}, policy {meta.get('policy')}, "
                 f"{meta.get('device')}\n{meta.get('machine', '')}; torch {meta.get('torch')}; "
                 f"{str(meta.get('date', ''))[:10]}", fontsize=9.5)
    ax.grid(True, alpha=0.3, zorder=0)
    ax.legend(fontsize=8, loc="upper right", framealpha=0.9)
    skipped = [r for r in rows if r.status != "ok"]
    if skipped:
        ax.text(0.01, 0.01, "not plotted: " + "; ".join(f"{r.label} ({r.note})" for r in skipped),
                transform=ax.transAxes, fontsize=7, color="#666666", va="bottom")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True
