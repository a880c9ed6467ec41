"""``report.png``: activation bytes kept against step time, one labelled point per strategy.

matplotlib (the ``report`` extra) with the Agg backend, so it works without a display.
"""
from __future__ import annotations

from typing import Any


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

    pts = [r for r in rows if r.status == "ok" and r.time_ratio is not None
           and r.kept_bytes is not None]
    top = max((r.kept_bytes for r in pts), default=0)
    unit, scale = next(((u, s) for u, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
                        if top >= 2 * s), ("bytes", 1))
    fig, ax = plt.subplots(figsize=(9, 6), dpi=110)
    for r in pts:
        ax.scatter(r.time_ratio, r.kept_bytes / scale, s=90, color=_COLORS.get(r.key, "k"),
                   marker=_MARKERS.get(r.kind, "o"), edgecolor="black", linewidth=0.6,
                   zorder=3, label=r.label)
    if pts:
        xs = [r.time_ratio for r in pts]
        xpad = max(0.15, (max(xs) - min(xs)) * 0.3)
        ax.set_xlim(max(0.0, min(xs) - xpad), max(xs) + xpad)
        ax.set_ylim(0, top / scale * 1.2 if top else 1)
    ax.axvline(1.0, color="#999999", linewidth=0.8, linestyle="--", zorder=1)
    ax.set_xlabel("step time, median ratio to no AC (lower is faster)")
    ax.set_ylabel(f"activation {unit} kept for backward (lower is smaller)")
    size = f" ({meta['size']})" if meta.get("size") else ""
    ax.set_title(f"sac_compile report: {meta.get('model')}{size}, policy {meta.get('policy')}, "
                 f"{meta.get('device')}\n{meta.get('machine', '')}; torch {meta.get('torch')}; "
                 f"{str(meta.get('date', ''))[:10]}", fontsize=9.5)
    ax.grid(True, alpha=0.3, zorder=0)
    legend = ax.legend(fontsize=8, loc="upper right", framealpha=0.9)
    _place_labels(fig, ax, [(r.label, r.time_ratio, r.kept_bytes / scale) for r in pts],
                  avoid=[legend])
    skipped = [r for r in rows if r.status != "ok"]
    if skipped:
        ax.text(0.01, 0.01, "not plotted: " + "; ".join(f"{r.label} ({r.note})" for r in skipped),
                transform=ax.transAxes, fontsize=7, color="#666666", va="bottom")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def _place_labels(fig: Any, ax: Any, points: list[tuple[str, float, float]],
                  avoid: list[Any] = ()) -> None:
    """Put each label at the first of eight offsets around its point whose box overlaps no
    other label, marker or the legend; the least-overlapping offset otherwise."""
    offsets = [(10, 6, "left", "bottom"), (-10, 6, "right", "bottom"),
               (10, -6, "left", "top"), (-10, -6, "right", "top"),
               (0, 12, "center", "bottom"), (0, -12, "center", "top"),
               (16, 0, "left", "center"), (-16, 0, "right", "center")]
    renderer = fig.canvas.get_renderer()
    fig.tight_layout()
    marker_boxes = []
    for _, x, y in points:
        px, py = ax.transData.transform((x, y))
        marker_boxes.append((px - 7, py - 7, px + 7, py + 7))
    placed: list[tuple[float, float, float, float]] = []
    for artist in avoid:
        bb = artist.get_window_extent(renderer)
        placed.append((bb.x0, bb.y0, bb.x1, bb.y1))
    axbox = ax.get_window_extent(renderer)

    def overlap(a: tuple, b: tuple) -> float:
        w = min(a[2], b[2]) - max(a[0], b[0])
        h = min(a[3], b[3]) - max(a[1], b[1])
        return w * h if w > 0 and h > 0 else 0.0

    for i, (label, x, y) in enumerate(points):
        best = None
        for dx, dy, ha, va in offsets:
            t = ax.annotate(label, (x, y), xytext=(dx, dy), textcoords="offset points",
                            fontsize=8.5, ha=ha, va=va, zorder=4)
            bb = t.get_window_extent(renderer)
            box = (bb.x0, bb.y0, bb.x1, bb.y1)
            cost = sum(overlap(box, o) for o in placed)
            cost += sum(overlap(box, m) for j, m in enumerate(marker_boxes) if j != i)
            outside = (max(0, axbox.x0 - box[0]) + max(0, box[2] - axbox.x1)
                       + max(0, axbox.y0 - box[1]) + max(0, box[3] - axbox.y1))
            cost += outside * 50
            if best is None or cost < best[0]:
                if best is not None:
                    best[1].remove()
                best = (cost, t, box)
            else:
                t.remove()
            if cost == 0:
                break
        placed.append(best[2])
