"""The long fuzz campaign (``make fuzz``): thousands of random programs, counts printed.

    python tests/fuzzlib/run.py [--eager 1800] [--compile 200] [--seed 0] [--inductor 0]
                                [--safe-tags]

Pass 1 runs every program and counts outcomes without stopping. If any failed, pass 2
replays the same seed with hypothesis shrinking on, and prints the minimal failing program
as a standalone repro script. Exit status 1 when anything failed.

Programs place tag()/name() anywhere: inside and outside regions, on values from outside
the region (an error in both modes), with the result unused. ``--safe-tags`` keeps compiled
programs' tags inside a region on values the region body defined.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fuzzlib import harness  # noqa: E402
from fuzzlib.gen import programs  # noqa: E402


def _kind(message: str) -> str:
    first = message.strip().split("\n")[0]
    return re.sub(r"\d+(\.\d+)?", "N", first)[:160]


def campaign(n: int, modes: tuple, compiler: str, seed_: int, safe_tags: bool,
             counts: collections.Counter, failures: collections.Counter, label: str, *,
             shrink: bool = False) -> None:
    """Run ``n`` programs, counting outcomes. With ``shrink``, the same programs (same seed,
    same draws) run until the first failure, which hypothesis shrinks and which is printed
    as a standalone repro."""
    small = "compile" in modes
    strategy = programs(max_top=3 if small else 5, max_body=3 if small else 4,
                        safe_tags=safe_tags, bare_tags=not safe_tags)
    done = [0]
    start = time.time()
    budgets = [None, None, 0.5, 1.0] if small and harness.budget_supported() else [None]
    phases = [Phase.generate, Phase.shrink] if shrink else [Phase.generate]

    @seed(seed_)
    @settings(max_examples=n, deadline=None, database=None, phases=phases,
              suppress_health_check=list(HealthCheck), report_multiple_bugs=False)
    @given(strategy, st.sampled_from(budgets))
    def one(program, budget):
        done[0] += 1
        kwargs = dict(modes=modes, compiler=compiler, dropout=program.dropout,
                      memory_budget=budget)
        try:
            outcome = harness.check(program.source, has_inplace=program.inplace, **kwargs)
        except harness.FuzzFailure as e:
            if shrink:
                raise harness.FuzzFailure(
                    f"{e}\n\n---- standalone repro ----\n"
                    f"{harness.repro(program.source, has_inplace=program.inplace, **kwargs)}"
                ) from None
            counts[f"{label}: FAILED"] += 1
            failures[f"{label}: {_kind(str(e))}"] += 1
            return
        if shrink:
            return
        counts[f"{label}: programs"] += 1
        counts[f"{label}: {outcome.status}"] += 1
        for note in outcome.notes:
            counts[f"{label}: note: {_kind(note)}"] += 1
        if budget is not None:
            counts[f"{label}: (memory budget {budget})"] += 1
        if program.n_regions > 1:
            counts[f"{label}: (several regions)"] += 1
        if program.depth >= 3:
            counts[f"{label}: (nesting depth 3)"] += 1
        if done[0] % 200 == 0:
            print(f"  {label}: {done[0]}/{n} in {time.time() - start:.0f} s", flush=True)

    if not shrink:
        one()
        return
    try:
        one()
    except harness.FuzzFailure as e:
        print(str(e))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--eager", type=int, default=1800, help="programs checked in eager mode")
    p.add_argument("--compile", type=int, default=200,
                   help="programs checked in eager mode and compiled with aot_eager")
    p.add_argument("--inductor", type=int, default=0, help="programs compiled with Inductor")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--safe-tags", action="store_true",
                   help="compiled programs tag only values their region body defined")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    import logging
    logging.getLogger("torch").setLevel(logging.ERROR)

    counts: collections.Counter = collections.Counter()
    failures: collections.Counter = collections.Counter()
    runs = [("eager", args.eager, ("eager",), "aot_eager", False),
            ("compile", args.compile, ("eager", "compile"), "aot_eager", args.safe_tags),
            ("inductor", args.inductor, ("eager", "compile"), "inductor", args.safe_tags)]
    start = time.time()
    for label, n, modes, compiler, safe in runs:
        if n:
            campaign(n, modes, compiler, args.seed, safe, counts, failures, label)
    total = sum(v for k, v in counts.items() if k.endswith(": programs"))
    bad = sum(v for k, v in counts.items() if k.endswith(": FAILED"))
    total += bad
    print(f"\nfuzz: {total} programs in {time.time() - start:.0f} s, seed {args.seed}")
    for k in sorted(counts):
        print(f"  {counts[k]:6d}  {k}")
    if failures:
        print("\nfailures by kind:")
        for k, v in failures.most_common():
            print(f"  {v:6d}  {k}")
        for label, n, modes, compiler, safe in runs:
            if counts.get(f"{label}: FAILED"):
                print(f"\nshrinking the first {label} failure ...", flush=True)
                campaign(n, modes, compiler, args.seed, safe, counts, failures, label,
                         shrink=True)
    print(f"\nfuzz: {total} programs, {total - bad} passed, {bad} failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
