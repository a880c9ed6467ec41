"""Memory-budget sweeps: saved bytes against recompute FLOPs, ours and upstream's.

For each budget ``b`` the GPT fixture is compiled and run once, forward and backward:

* **ours**: every block a ``sac_region(policy)``, compiled with
  ``make_backend(compiler="aot_eager", memory_budget=b)`` (``--inductor``: Inductor). A
  float budget is a fraction of the activation bytes our unconstrained cut saves, per
  forward/backward split. Policies: ``save_matmuls`` (MUST_SAVE: a budget cannot evict
  those, so low budgets are unreachable), ``relaxed(save_matmuls)`` (PREFER_SAVE, so the
  budget may evict them) and ``recompute_all``.
* **upstream**: torch's own partitioner (``min_cut_rematerialization_partition``) with
  ``torch._functorch.config.activation_memory_budget = b`` (a fraction of the bytes its
  default cut saves above the graph inputs; a 0/1 knapsack over the values its heuristics
  ban from recompute), on the model as is (no checkpointing), under torch's SAC
  (``create_selective_checkpoint_contexts``: MUST_SAVE matmuls and attention, as torch users
  write it; and PREFER_SAVE, the relaxed form) and under plain ``torch.utils.checkpoint``.

Per point: saved bytes (what the forward graph hands to the backward graph, parameters
excluded; ours from the ``PartitionReport``, upstream's read off torch's split by the same
rule, ``sac_compile._bench.partition_figures``), recompute FLOPs (``torch.utils.flop_counter``
rules for the forward ops the backward graph re-runs) and the gradient difference against
no checkpointing from the same seed (dropout 0.1 in the fixture: a recomputed dropout with a
fresh mask gives wrong gradients; such a point is marked invalid and is off both fronts).

The comparison: an upstream point (B_u, F_u) is matched when some valid point of ours has
bytes <= B_u and FLOPs <= F_u. A PNG of both fronts goes to benchmarks/out/pareto.png when
matplotlib is installed.

    python benchmarks/pareto.py [--quick] [--size bench|test] [--budgets 1.0,0.5,...]
                                [--configs ours,SAC] [--inductor] [--eager]

``--eager`` first runs ``budget_sweeps.py`` (issue 19): eager budgets against the same
blocks compiled, and one whole-model byte budget against per-region budgets of the same
total bytes.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch
import torch._functorch.config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fixtures.models import (grads_of, loss_fn, make_model,  # noqa: E402
                             max_grad_diff, reference_grads)
from sac_compile import CheckpointError  # noqa: E402
from sac_compile import CheckpointPolicy as CP  # noqa: E402
from sac_compile import make_backend, policies, sac_region  # noqa: E402
from sac_compile._bench.partition_figures import (OnPartition,  # noqa: E402
                                                  PartitionFigures, upstream_aot_eager,
                                                  upstream_backend)
from sac_compile._bench.strategies import full_ac, torch_sac_prefer, torch_sac_with  # noqa: E402,E501
from sac_compile.report import fmt_bytes  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
BUDGETS = (1.0, 0.8, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05)
QUICK_BUDGETS = (1.0, 0.6, 0.4, 0.2, 0.1)  # ``--quick`` (what ``make bench`` runs)
#: Gradient differences above this, relative to the largest reference gradient, are wrong.
GRAD_RTOL = 1e-3

#: torch SAC's save list: the ops ``policies.save_matmuls`` saves (matmuls, attention).
TORCH_SAVE_OPS = frozenset(policies.MATMUL_OPS)


def torch_sac_must(ctx, op, *args, **kwargs):
    return CP.MUST_SAVE if op in TORCH_SAVE_OPS else CP.PREFER_RECOMPUTE


@dataclasses.dataclass
class Config:
    label: str
    side: str             # "ours" | "upstream"
    wrap: str             # "region" (ours) | "none" | "torch_sac" | "full_ac"
    policy: object = None


CONFIGS = [
    Config("ours save_matmuls", "ours", "region", policies.save_matmuls),
    Config("ours relaxed(save_matmuls)", "ours", "region", policies.relaxed(policies.save_matmuls)),
    Config("ours recompute_all", "ours", "region", policies.recompute_all),
    Config("upstream no AC", "upstream", "none"),
    Config("upstream SAC MUST_SAVE mm", "upstream", "torch_sac", torch_sac_must),
    Config("upstream SAC PREFER_SAVE mm", "upstream", "torch_sac", torch_sac_prefer),
    Config("upstream full AC", "upstream", "full_ac"),
]


@dataclasses.dataclass
class Point:
    config: str
    side: str
    budget: float
    status: str = "ok"            # ok | invalid (wrong gradients) | unreachable | error
    saved: int | None = None
    flops: int | None = None
    grad_rel: float | None = None
    seconds: float = 0.0
    note: str = ""

    @property
    def valid(self) -> bool:
        return self.status == "ok"


def build(cfg: Config, size: str):
    model, inputs = make_model("gpt", size=size, seed=0)
    for i, block in enumerate(model.blocks):
        if cfg.wrap == "region":
            sac_region(cfg.policy, name=f"blocks.{i}")(block)
        elif cfg.wrap == "torch_sac":
            block.forward = torch_sac_with(cfg.policy)(i, block.forward)
        elif cfg.wrap == "full_ac":
            block.forward = full_ac(i, block.forward)
    return model, inputs


def _upstream_aot_eager(figures: PartitionFigures):
    """aot_eager with torch's partitioner, recording each split as the report does."""
    def after(fw, bw):
        figures.splits[-1]["fresh_random"] = fresh_random_ops(fw, bw)
    return upstream_aot_eager(figures, after)


def fresh_random_ops(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule) -> int:
    """Random ops (dropout) of the forward that the backward runs again without the
    forward's RNG state (torch replays a state only through ``run_with_rng_state``)."""
    fw_names = {n.name for n in fw.graph.nodes if n.op == "call_function"}

    def draws(n: torch.fx.Node) -> bool:
        if torch.Tag.nondeterministic_seeded not in getattr(n.target, "tags", ()):
            return False
        if "attention" in str(n.target):  # seeded only through its dropout_p
            p = n.kwargs.get("dropout_p", n.args[3] if len(n.args) > 3 else 0.0)
            return isinstance(p, (int, float)) and p > 0
        return True
    return sum(1 for n in bw.graph.nodes
               if n.op == "call_function" and n.name in fw_names and draws(n))


def run_point(cfg: Config, budget: float, size: str, ref: dict, ref_max: float,
              inductor: bool) -> Point:
    """Compile the model with ``cfg``'s backend at ``budget``, run one forward and backward
    from seed 0, and measure the split."""
    point = Point(cfg.label, cfg.side, budget)
    figures = PartitionFigures()
    model, inputs = build(cfg, size)
    if cfg.side == "ours":
        backend = make_backend(compiler="inductor" if inductor else "aot_eager",
                               memory_budget=budget, on_partition=OnPartition(figures, None))
        patch = {}
    else:
        backend = upstream_backend(figures) if inductor else _upstream_aot_eager(figures)
        patch = {"activation_memory_budget": budget}
    torch._dynamo.reset()
    t0 = time.perf_counter()
    try:
        # The budget must be in force while the graphs are partitioned: at the first call,
        # which compiles (tracing draws no random numbers: the seed holds for the run).
        # Inductor: eager's RNG, so that dropout masks match no AC. Not set for aot_eager
        # (eager's RNG anyway): it also keeps dead random ops through FX's dead-code
        # elimination, which our report then counts as recomputed.
        with torch._functorch.config.patch(patch), \
                torch._inductor.config.patch(fallback_random=inductor):
            torch.manual_seed(0)
            loss_fn(torch.compile(model, backend=backend)(*inputs)).backward()
    except Exception as e:  # noqa: BLE001 - one failed point does not end the sweep
        cause = e
        while cause.__cause__ is not None and not isinstance(cause, CheckpointError):
            cause = cause.__cause__
        if isinstance(cause, CheckpointError):
            point.status, point.note = "unreachable", str(cause).split(": even")[0][:90]
        else:
            point.status = "error"
            point.note = f"{type(cause).__name__}: {cause}"[:90]
        return point
    finally:
        point.seconds = time.perf_counter() - t0
    point.saved, point.flops = figures.kept_bytes, figures.recompute_flops
    point.grad_rel = max_grad_diff(ref, grads_of(model, inputs)) / ref_max
    fresh = sum(split.get("fresh_random", 0) for split in figures.splits)
    if fresh:
        point.note = f"{fresh} random ops recomputed with a fresh draw"
    if point.grad_rel > GRAD_RTOL:
        point.status = "invalid"
        point.note = "wrong gradients" + (f": {point.note}" if point.note else "")
    return point


def matched(up: Point, ours: list[Point]) -> Point | None:
    """A valid point of ours with bytes <= and FLOPs <= the upstream point's, if any
    (the one with the fewest bytes, then FLOPs)."""
    hits = [p for p in ours if p.valid and p.saved <= up.saved and p.flops <= up.flops]
    return min(hits, key=lambda p: (p.saved, p.flops)) if hits else None


def front(points: list[Point]) -> list[Point]:
    """The non-dominated valid points, by bytes."""
    pts = sorted({(p.saved, p.flops): p for p in points if p.valid}.values(),
                 key=lambda p: (p.saved, p.flops))
    out: list[Point] = []
    for p in pts:
        if not out or p.flops < out[-1].flops:
            out.append(p)
    return out


def fmt_flops(n: float) -> str:
    if n == 0:
        return "0"
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f}"


def _cell(p: Point | None) -> str:
    if p is None:
        return "-"
    if p.saved is None:
        return p.status
    return f"{fmt_bytes(p.saved)} / {fmt_flops(p.flops)}{'' if p.valid else ' BAD'}"


def _at(p: Point) -> str:
    at = fmt_bytes(p.budget) if isinstance(p.budget, int) else f"{p.budget:g}"
    return f"{p.config} @{at}"


def match_pass(ours: list[Point], ups: list[Point], size: str, ref: dict, ref_max: float,
               inductor: bool, input_bytes: int) -> list[Point]:
    """Ours at each unmatched upstream point's own bytes: a fraction sweep only samples our
    front, while a budget in bytes asks for the cheapest cut within exactly those bytes
    (the budget caps activations; the measured bytes also count the model's input)."""
    cfg = next(c for c in CONFIGS if c.label == "ours relaxed(save_matmuls)")
    extra = []
    for up in ups:
        if not up.valid or matched(up, ours + extra) is not None:
            continue
        cap = int(up.saved) - input_bytes
        if cap < 2:
            continue
        p = run_point(cfg, cap, size, ref, ref_max, inductor)
        print(f"  match {_at(up)}: {_at(p)} -> {_cell(p)} {p.note}", flush=True)
        extra.append(p)
    return extra


def print_table(points: list[Point], budgets: list[float], configs: list[Config]) -> None:
    by = {(p.config, p.budget): p for p in points}
    print(f"\nSaved bytes / recompute FLOPs per budget. BAD: gradients differ from no "
          f"checkpointing by more than {GRAD_RTOL:g} of the largest gradient; unreachable: the "
          f"budget is below what the policy's MUSTs allow (CheckpointError); error: the "
          f"compile raised")
    for side in ("ours", "upstream"):
        cols = [c.label for c in configs if c.side == side]
        if not cols:
            continue
        width = max(24, *(len(c) for c in cols))
        print(f"\n{'budget':>6} | " + " | ".join(f"{c:<{width}}" for c in cols))
        for b in budgets:
            print(f"{b:>6g} | " + " | ".join(f"{_cell(by.get((c, b))):<{width}}" for c in cols))


def print_fronts(ours: list[Point], ups: list[Point]) -> None:
    fo, fu = front(ours), front(ups)
    print("\nPareto fronts (valid points that no other valid point of the same side beats "
          "in both), side by side:")
    w = 36
    print(f"{'ours: bytes':>12} {'FLOPs':>9}  {'point':<{w}} | {'upstream: bytes':>15} "
          f"{'FLOPs':>9}  point")
    for i in range(max(len(fo), len(fu))):
        a = fo[i] if i < len(fo) else None
        b = fu[i] if i < len(fu) else None
        left = (f"{fmt_bytes(a.saved):>12} {fmt_flops(a.flops):>9}  {_at(a):<{w}}" if a
                else " " * (24 + w))
        right = f"{fmt_bytes(b.saved):>15} {fmt_flops(b.flops):>9}  {_at(b)}" if b else ""
        print(f"{left} | {right}")


def summary(ours: list[Point], ups: list[Point]) -> str:
    valid_up = [p for p in ups if p.valid]
    hits = [(p, matched(p, ours)) for p in valid_up]
    k = sum(1 for _, m in hits if m is not None)
    n = len(valid_up)
    lines = [f"every valid upstream point matched or beaten in both bytes and FLOPs: "
             f"{'yes' if n and k == n else 'no'} ({k} of {n})"]
    for p, m in hits:
        if m is None:
            lines.append(f"  not matched: {_at(p)} ({fmt_bytes(p.saved)}, "
                         f"{fmt_flops(p.flops)} FLOPs)")
    front_up = front(ups)
    k_front = sum(1 for p in front_up if matched(p, ours) is not None)
    lines.append(f"  upstream's front: {k_front} of {len(front_up)} points matched or beaten")
    invalid = [p for p in ups if p.status == "invalid"]
    if invalid:
        lines.append("  upstream points with wrong gradients (left out): "
                     + ", ".join(f"{_at(p)} (rel {p.grad_rel:.2g})" for p in invalid))
    errors = [p for p in ups if p.status == "error"]
    if errors:
        lines.append("  upstream points whose compile raised (left out): "
                     + ", ".join(_at(p) for p in errors) + f" [{errors[0].note}]")
    bad_ours = [p for p in ours if p.status in ("invalid", "error")]
    if bad_ours:
        lines.append("  OUR points with wrong gradients or errors: "
                     + ", ".join(f"{_at(p)} ({p.status}: {p.note})" for p in bad_ours))
    return "\n".join(lines)


def plot(ours: list[Point], ups: list[Point], path: Path, title: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install matplotlib, or the "
              "package's 'report' extra)")
        return
    fig, ax = plt.subplots(figsize=(8, 5.5))
    markers = "osD^vP*X"
    for i, cfg in enumerate(CONFIGS):
        pts = [p for p in ours + ups if p.config == cfg.label and p.saved is not None]
        color = f"C{i}"
        good = [p for p in pts if p.valid]
        bad = [p for p in pts if not p.valid]
        ax.scatter([p.saved / 2**20 for p in good], [p.flops / 1e9 for p in good],
                   marker=markers[i % len(markers)], color=color, label=cfg.label, alpha=0.8)
        if bad:
            ax.scatter([p.saved / 2**20 for p in bad], [p.flops / 1e9 for p in bad],
                       marker="x", color=color, s=60,
                       label=f"{cfg.label}: wrong gradients")
    for pts, style, label in ((front(ours), "-", "ours: front"),
                              (front(ups), "--", "upstream: front")):
        if pts:
            xs, ys = [], []
            for p in pts:  # a staircase: each point dominates up and to the right
                if xs:
                    xs.append(p.saved / 2**20)
                    ys.append(ys[-1])
                xs.append(p.saved / 2**20)
                ys.append(p.flops / 1e9)
            ax.plot(xs, ys, style, color="black" if style == "-" else "gray", lw=1.2,
                    label=label)
    ax.set_xlabel("saved activation bytes (MiB, parameters excluded)")
    ax.set_ylabel("recompute GFLOPs in backward")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="bench", help="GPT fixture size (test, bench)")
    parser.add_argument("--budgets", default=None,
                        help="comma-separated fractions in (0, 1] (default "
                             f"{','.join(map(str, BUDGETS))})")
    parser.add_argument("--quick", action="store_true",
                        help=f"budgets {','.join(map(str, QUICK_BUDGETS))} (make bench)")
    parser.add_argument("--inductor", action="store_true",
                        help="compile with Inductor (code generation: much slower)")
    parser.add_argument("--configs", default="",
                        help="comma-separated substrings: run only the matching configs")
    parser.add_argument("--png", default=str(OUT / "pareto.png"))
    parser.add_argument("--no-match", action="store_true",
                        help="skip running ours at the bytes of unmatched upstream points")
    parser.add_argument("--eager", action="store_true", help="also budget_sweeps.py: eager vs "
                        "compiled budgets, whole-model vs per-region at equal bytes (issue 19)")
    args = parser.parse_args(argv)
    if args.eager:
        import budget_sweeps
        budget_sweeps.main(["--size", args.size]
                           + (["--budgets", args.budgets] if args.budgets else []))
    text = args.budgets or ",".join(map(str, QUICK_BUDGETS if args.quick else BUDGETS))
    budgets = [float(b) for b in text.split(",") if b.strip()]
    configs = [c for c in CONFIGS if not args.configs
               or any(s.strip() in c.label for s in args.configs.split(","))]

    import logging
    logging.getLogger("torch._functorch.partitioners").setLevel(logging.ERROR)
    model, inputs = make_model("gpt", size=args.size, seed=0)
    ref = reference_grads(model, inputs, 0)
    ref_max = max(g.abs().max().item() for g in ref.values())
    n_params = sum(p.numel() for p in model.parameters())
    del model
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; GPT fixture "
          f"size={args.size} (input {tuple(inputs[0].shape)}, {n_params:,} parameters, "
          f"dropout 0.1), {'Inductor' if args.inductor else 'aot_eager (partition only)'}")

    points: list[Point] = []
    t_all = time.perf_counter()
    for cfg in configs:
        for b in budgets:
            p = run_point(cfg, b, args.size, ref, ref_max, args.inductor)
            points.append(p)
            status = p.status if p.status != "ok" else ""
            grad = f" grad rel {p.grad_rel:.1e}" if p.grad_rel is not None else ""
            print(f"  {cfg.label:<30} {b:<5g} {_cell(p) if p.saved is not None else '':<26}"
                  f"{grad} {status} {p.note} ({p.seconds:.1f} s)", flush=True)
    print(f"sweep: {time.perf_counter() - t_all:.0f} s")
    ours = [p for p in points if p.side == "ours"]
    ups = [p for p in points if p.side == "upstream"]
    if not args.no_match and any(c.label == "ours relaxed(save_matmuls)" for c in configs):
        print("ours at the bytes of each upstream point not yet matched:")
        input_bytes = sum(t.numel() * t.element_size() for t in inputs
                          if isinstance(t, torch.Tensor))
        ours += match_pass(ours, ups, args.size, ref, ref_max, args.inductor, input_bytes)
    print_table(points, budgets, configs)
    print_fronts(ours, ups)
    print()
    print(summary(ours, ups))
    plot(ours, ups, Path(args.png),
         f"GPT fixture ({args.size}), torch {torch.__version__}, "
         f"{'Inductor' if args.inductor else 'aot_eager'}\nsaved bytes vs recompute FLOPs, "
         f"budgets {', '.join(f'{b:g}' for b in budgets)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
