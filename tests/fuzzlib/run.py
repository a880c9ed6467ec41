"""The long fuzz campaign (``make fuzz``): thousands of random programs, counts printed.

    python tests/fuzzlib/run.py [--eager 1800] [--compile 200] [--seed 0] [--inductor 0]
                                [--safe-tags] [--boundary 3000] [--boundary-compile 200]
                                [--features input_mut,output_mut,...] [--cache 48]

Two families. The first (gen.programs) checks decisions, outputs and gradients against an
independent oracle. The boundary family (gen.boundary_programs) updates values in place
across the region boundary (region inputs and outputs, parameters, buffers, foreach ops,
rrelu, no_grad/inference_mode blocks, module copies, default-dtype switches) and is checked
against plain autograd (harness.check_boundary): every program ends exact, both-raised,
CheckpointError (naming the region), forward-values, unverified or (compiled) as-torch.compile
(what torch.compile does to it without regions), or fails as a silent
mismatch or another failure.

Pass 1 runs every program and counts outcomes without stopping; boundary failures are
also counted by the known kind that explains them (harness.KNOWN_KINDS, pinned as strict
xfails in tests/test_fuzz.py) or as unexplained. If any failed, pass 2 replays the same
seed with hypothesis shrinking on, and prints the minimal failing program as a standalone
repro script; for the boundary family, one per feature that fails on its own (a campaign
drawing only that feature) and per category, each reduced further by deleting statements
(harness.reduce_boundary), within --shrink-budget seconds. Exit status 1 when anything
failed.

A third family (gen.cache_programs, ``--cache``) checks the persistent compile caches:
each program's policy reads a value of a drawn kind (a global dict, an enum, an object
attribute, a helper function, os.environ, a closure cell, functools.partial, a callable
class instance); it is compiled with Inductor in one process with one value, then in
another with the other value and the same TORCHINDUCTOR_CACHE_DIR, whose split must be a
cold compile's (harness.check_cache_batch). Failures are printed whole with a rerun recipe.

Two more (tests/fuzzlib/trust.py, issue 26): ``--outside`` programs whose region keeps
values as bf16 (hooks) or offloads them while code outside the region, and another region,
read its outputs - every gradient that does not flow back through the lossy region must be
exact, eager and compiled; ``--dynamic`` the same programs compiled once with
``dynamic=True`` and run at three batch sizes, every hooked value on an op the policy hooks.

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
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fuzzlib import harness  # noqa: E402
from fuzzlib.gen import (CACHE_KINDS, FEATURES, boundary_programs, cache_batch,  # noqa: E402
                         programs)


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


# -- the boundary family -----------------------------------------------------------------

B_OUTCOMES = ("exact", "forward-values", "both-raised", "CheckpointError", "unverified",
              "as-torch.compile")


def boundary_campaign(n: int, modes: tuple, seed_: int, features: tuple, counts: Any,
                      failures: Any, label: str, *, shrink_to: str | None = None,
                      failed_features: Any = None) -> str | None:
    """Run ``n`` boundary programs. With ``shrink_to`` (a failure category), the same
    programs run until the first failure of that category, which hypothesis shrinks; the
    standalone repro is returned."""
    small = "compile" in modes
    strategy = boundary_programs(features=features, max_top=3 if small else 4,
                                 max_body=3 if small else 4)
    done = [0]
    start = time.time()
    phases = [Phase.generate, Phase.shrink] if shrink_to else [Phase.generate]

    @seed(seed_)
    @settings(max_examples=n, deadline=None, database=None, phases=phases,
              suppress_health_check=list(HealthCheck), report_multiple_bugs=False)
    @given(strategy)
    def one(program):
        done[0] += 1
        try:
            outcomes = harness.check_boundary(program.source, modes=modes)
        except harness.FuzzFailure as e:
            category = getattr(e, "category", "other failure")
            if shrink_to:
                if category == shrink_to:
                    raise _Shrunk(program.source, e)
                return
            counts[f"{label}: programs"] += 1
            counts[f"{label}: {category}"] += 1
            known = harness.explain_failure(program.source, modes)
            counts[f"{label}: {category}: {known or 'unexplained'}"] += 1
            failures[f"{label}: {_kind(str(e))}"] += 1
            if failed_features is not None:
                failed_features.update(program.features)
            return
        if shrink_to:
            return
        counts[f"{label}: programs"] += 1
        for mode, outcome in outcomes.items():
            counts[f"{label}: {mode}: {outcome}"] += 1
        for f in program.features:
            counts[f"{label}: (feature) {f}"] += 1
        if done[0] % 500 == 0:
            print(f"  {label}: {done[0]}/{n} in {time.time() - start:.0f} s", flush=True)

    if not shrink_to:
        one()
        return None
    try:
        one()
    except _Shrunk as shrunk:
        source, e = shrunk.args
    else:
        return None
    # then shrink the text: delete statements while the same kind of failure remains
    sig = _signature(e)

    def fails(candidate: str) -> bool:
        try:
            harness.check_boundary(candidate, modes=modes)
        except harness.FuzzFailure as e2:
            return _signature(e2) == sig
        return False

    source = harness.reduce_boundary(source, fails)
    try:
        harness.check_boundary(source, modes=modes)
    except harness.FuzzFailure as e2:
        e = e2
    mode = "compile" if str(e).startswith("compile") else "eager"
    known = harness.explain_failure(source, modes)
    return (f"{getattr(e, 'category', 'other failure')}: {e}\n"
            f"(known kind: {known or 'none, a new failure'})\n\n" +
            harness.repro_boundary(source, failure=str(e), mode=mode))


class _Shrunk(Exception):
    """The minimal failing program hypothesis found (source, failure)."""


def _signature(e: BaseException) -> tuple:
    """What must stay the same while a failing program is reduced: the category, the mode,
    whether plain autograd raised, and for other failures the exception's first line."""
    first = str(e).split("\n")[0]
    category = getattr(e, "category", "other failure")
    if category == "other failure":
        return category, _kind(first)
    return category, first.split(":")[0]


def print_boundary(counts: Any, label: str, modes: tuple, seconds: float) -> None:
    total = counts[f"{label}: programs"]
    print(f"\n{label}: {total} programs in {seconds:.0f} s")
    for mode in modes:
        for o in B_OUTCOMES:
            if o == "as-torch.compile" and mode == "eager":
                continue
            print(f"  {counts[f'{label}: {mode}: {o}']:6d}  {mode}: {o}")
    for category in ("silent mismatch", "other failure"):
        kinds = sorted((k.split(": ")[-1], v) for k, v in counts.items()
                       if k.startswith(f"{label}: {category}: "))
        plural = {"silent mismatch": "silent mismatches"}.get(category, category + "s")
        print(f"  {counts[f'{label}: {category}']:6d}  {plural}" + (
            " (" + ", ".join(f"{v} {k}" for k, v in kinds) + ")" if kinds else ""))
    if counts[f"{label}: harness"]:
        print(f"  {counts[f'{label}: harness']:6d}  harness errors (the reference itself)")
    feats = sorted((k.split(') ')[1], v) for k, v in counts.items()
                   if k.startswith(f"{label}: (feature)"))
    print("  programs per feature drawn: " + ", ".join(f"{k} {v}" for k, v in feats))


def shrink_boundary(n: int, modes: tuple, seed_: int, label: str, failed: Any,
                    categories: list, deadline: float) -> None:
    """One shrunk repro per feature that fails on its own, per failure category; the
    whole family's first failure when no single feature does. No new campaign starts
    after ``deadline`` (time.time())."""
    found = set()
    for category in categories:
        for feature in [f for f in FEATURES if f in failed]:
            if time.time() > deadline:
                print("\n(shrink budget spent: --shrink-budget)")
                return
            sub = f"{label} [{feature} only]"
            print(f"\nshrinking {category} with only '{feature}' ({sub}) ...", flush=True)
            out = boundary_campaign(min(n, 300), modes, seed_, (feature,), None, None, sub,
                                    shrink_to=category)
            if out:
                found.add(category)
                print(out, flush=True)
            else:
                print("  (none in 300 programs drawing only this feature)")
        if category not in found and time.time() < deadline:
            print(f"\nshrinking the first {category} of {label} ...", flush=True)
            print(boundary_campaign(n, modes, seed_, FEATURES, None, None, label,
                                    shrink_to=category))


# -- the cache family ---------------------------------------------------------------------

def cache_campaign(n: int, seed_: int, counts: Any) -> list:
    """``n`` cache programs (gen.cache_batch) through harness.check_cache_batch's three
    processes, in one temporary directory; counts per kind; returns the failures as
    (program, outcome). No shrinking: a program is one op chain and one policy, printed
    whole with how to rerun it."""
    import tempfile
    programs_ = cache_batch(n, seed=seed_)
    with tempfile.TemporaryDirectory(prefix="sac_fuzz_cache_") as workdir:
        outcomes = harness.check_cache_batch(programs_, workdir)
    failed = []
    for program, outcome in zip(programs_, outcomes):
        label = f"cache: {program.kind}"
        counts["cache: programs"] += 1
        counts[f"{label}: programs"] += 1
        counts[f"{label}: {outcome.status}"] += 1
        if outcome.split_changed:
            counts[f"{label}: the two values split differently"] += 1
        for process, delta in outcome.cache.items():
            for what, k in delta.items():
                if k and process in ("warm", "again"):
                    counts[f"{label}: process {'2' if process == 'warm' else '3'} "
                           f"cache {what}"] += k
        if outcome.status != "ok":
            counts["cache: FAILED"] += 1
            failed.append((program, outcome))
    return failed


def print_cache(counts: Any, seconds: float) -> None:
    print(f"\ncache: {counts['cache: programs']} programs (3 processes) in {seconds:.0f} s, "
          f"{counts['cache: FAILED']} failed")
    for kind in CACHE_KINDS:
        label = f"cache: {kind}"
        rest = sorted((k[len(label) + 2:], v) for k, v in counts.items()
                      if k.startswith(label + ": ") and not k.endswith(": programs"))
        print(f"  {counts[f'{label}: programs']:4d}  {kind}: " +
              ", ".join(f"{v} {k}" for k, v in rest))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--eager", type=int, default=1800, help="programs checked in eager mode")
    p.add_argument("--compile", type=int, default=200,
                   help="programs checked in eager mode and compiled with aot_eager")
    p.add_argument("--inductor", type=int, default=0, help="programs compiled with Inductor")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--safe-tags", action="store_true",
                   help="compiled programs tag only values their region body defined")
    p.add_argument("--boundary", type=int, default=3000,
                   help="boundary-family programs checked in eager mode")
    p.add_argument("--boundary-compile", type=int, default=200,
                   help="boundary-family programs checked in eager mode and compiled "
                        "(aot_eager)")
    p.add_argument("--features", default=",".join(FEATURES),
                   help="boundary features to draw (comma-separated; default all)")
    p.add_argument("--cache", type=int, default=48,
                   help="cache-family programs: policies reading a value, compiled with "
                        "Inductor in three processes sharing one persistent cache")
    p.add_argument("--outside", type=int, default=400,
                   help="trust-family programs: a lossy region read outside it (aot_eager)")
    p.add_argument("--dynamic", type=int, default=60,
                   help="trust-family programs under dynamic=True at three batch sizes")
    p.add_argument("--no-shrink", action="store_true", help="count only")
    p.add_argument("--shrink-budget", type=float, default=300,
                   help="seconds after which no new boundary shrink campaign starts")
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

    features = tuple(f for f in args.features.split(",") if f)
    bcounts: collections.Counter = collections.Counter()
    failed_features: dict = {}
    bruns = [("boundary", args.boundary, ("eager",)),
             ("boundary-compile", args.boundary_compile, ("eager", "compile"))]
    for label, n, modes in bruns:
        if n:
            t0 = time.time()
            failed_features[label] = collections.Counter()
            boundary_campaign(n, modes, args.seed, features, bcounts, failures, label,
                              failed_features=failed_features[label])
            print_boundary(bcounts, label, modes, time.time() - t0)
    btotal = sum(bcounts[f"{label}: programs"] for label, _, _ in bruns)
    bbad = sum(bcounts[f"{label}: {c}"] for label, _, _ in bruns
               for c in ("silent mismatch", "other failure", "harness"))

    ccounts: collections.Counter = collections.Counter()
    cache_failed: list = []
    if args.cache:
        t0 = time.time()
        cache_failed = cache_campaign(args.cache, args.seed, ccounts)
        print_cache(ccounts, time.time() - t0)
        for program, outcome in cache_failed:
            failures[f"cache: {program.kind}: {_kind(outcome.failure)}"] += 1
            print(f"\ncache failure ({program.kind}): {outcome.failure}\n"
                  f"{harness.repro_cache(program)}", flush=True)
    ctotal, cbad = ccounts["cache: programs"], len(cache_failed)

    ttotal, tbad = 0, 0
    for label, n, dynamic in (("outside", args.outside, False),
                              ("dynamic", args.dynamic, True)):
        if n:
            from fuzzlib import trust
            t0 = time.time()
            ran, failed = trust.campaign(n, args.seed, dynamic=dynamic)
            ttotal, tbad = ttotal + ran, tbad + len(failed)
            print(f"\n{label}: {ran} programs in {time.time() - t0:.0f} s, {len(failed)} failed")
            for text in failed[:5]:
                failures[f"{label}: {_kind(text)}"] += 1
                print(f"\n{label} failure: {text}", flush=True)

    if failures:
        print("\nfailures by kind:")
        for k, v in failures.most_common():
            print(f"  {v:6d}  {k}")
    if not args.no_shrink:
        deadline = time.time() + args.shrink_budget
        for label, n, modes, compiler, safe in runs:
            if counts.get(f"{label}: FAILED"):
                print(f"\nshrinking the first {label} failure ...", flush=True)
                campaign(n, modes, compiler, args.seed, safe, counts, failures, label,
                         shrink=True)
        for label, n, modes in bruns:
            cats = [c for c in ("silent mismatch", "other failure", "harness")
                    if bcounts[f"{label}: {c}"]]
            if cats:
                shrink_boundary(n, modes, args.seed, label, failed_features[label], cats,
                                deadline)
    print(f"\nfuzz: {total + btotal + ctotal + ttotal} programs in {time.time() - start:.0f} s "
          f"({total} first family, {btotal} boundary family, {ctotal} cache family, "
          f"{ttotal} trust families), {bad + bbad + cbad + tbad} failed "
          f"({bbad} boundary: {sum(bcounts[f'{l}: silent mismatch'] for l, _, _ in bruns)} "
          f"silent mismatches, {sum(bcounts[f'{l}: other failure'] for l, _, _ in bruns)} "
          f"other failures; {cbad} cache)")
    return 1 if bad or bbad or cbad or tbad else 0


if __name__ == "__main__":
    sys.exit(main())
