"""Library code prints nothing: torch's context_fn warning is skipped for our own regions,
and still shown (once) for a user's own torch.utils.checkpoint(..., context_fn=...)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import functools, sys, torch
    import sac_compile as sc
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    @sc.sac_region("save_matmuls", name="Block")
    def block(x, w):
        y = x @ w
        y.relu_()                                   # in place: still correct under compile
        return y.sin() @ w

    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(16, 16, requires_grad=True)
    torch.compile(block, backend=sc.make_backend(compiler="aot_eager"))(x, w).sum().backward()
    sys.stderr.write("=== user's own torch SAC ===\\n")
    ctx = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])

    def f(x, w):
        return checkpoint(lambda x, w: (x @ w).sin(), x, w, use_reentrant=False,
                          context_fn=ctx)
    torch.compile(f, backend="aot_eager")(x, w).sum().backward()
""")


def test_context_fn_warning_only_for_users_own_checkpoint():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours, _, theirs = proc.stderr.partition("=== user's own torch SAC ===")
    assert _ == "=== user's own torch SAC ===", proc.stderr[-3000:]
    assert "context_fn" not in ours, ours[-3000:]
    assert "Detected that context_fn is passed to torch.utils.checkpoint" in theirs


SCRIPT_REPORTS_TORCH_SAC = textwrap.dedent("""
    import functools, sys, torch
    import sac_compile  # noqa: F401  (installs the quiet hook, as the report does)
    from sac_compile.compiler.regions_compiled import torch_sac_contexts
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(16, 16, requires_grad=True)
    ops = [torch.ops.aten.mm.default]

    def run(context_fn):
        def f(x, w):
            return checkpoint(lambda x, w: (x @ w).sin(), x, w, use_reentrant=False,
                              context_fn=context_fn)
        torch._dynamo.reset()
        torch.compile(f, backend="aot_eager")(x, w).sum().backward()

    run(functools.partial(torch_sac_contexts, ops))     # the report's "torch SAC" rows
    sys.stderr.write("=== user's own torch SAC ===\\n")
    run(functools.partial(create_selective_checkpoint_contexts, ops))
""")


def test_torch_sac_run_by_the_report_is_quiet_too():
    """`make demo` printed torch's warning in the middle of its table: it came from the
    report's own "torch SAC compiled" row (torch's SAC, compiled on purpose), not from a
    region of ours. That row's context_fn is torch_sac_contexts, skipped like ours."""
    proc = subprocess.run([sys.executable, "-c", SCRIPT_REPORTS_TORCH_SAC],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours, sep, theirs = proc.stderr.partition("=== user's own torch SAC ===")
    assert sep, proc.stderr[-3000:]
    assert "context_fn" not in ours, ours[-3000:]
    assert "Detected that context_fn is passed to torch.utils.checkpoint" in theirs


SCRIPT_SOLVER_OUTPUT = textwrap.dedent("""
    import json, logging, math
    import scipy.optimize
    from sac_compile.cut import exact

    real_milp = scipy.optimize.milp

    def loud_milp(*args, options=None, **kwargs):   # HiGHS printing from C++, as its
        return real_milp(*args, options={**(options or {}), "disp": True}, **kwargs)
    scipy.optimize.milp = loud_milp                  # debug lines do whatever disp says

    records = []
    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)
    logging.getLogger("sac_compile").setLevel(logging.DEBUG)
    logging.getLogger("sac_compile").addHandler(Keep())

    inf = math.inf   # input -> a -> b, both needed by the backward; 8 bytes fit
    p = exact.ExactProblem([(1, 2), (3, 4), (3, 7), (5, 7)], [4, 8, 8], [inf] * 3,
                           [inf, 5, 20], [True, False, False])
    sol = exact.solve_exact(p, 8)
    ours = [r for r in records if r.getMessage().startswith("HiGHS: ")]
    print("SOLVED", json.dumps([sol.kept, sol.recomputed, len(ours),
                                sorted({r.name for r in ours}),
                                sorted({r.levelname for r in ours})]), flush=True)
""")


def test_the_milp_solvers_own_output_goes_to_our_debug_log_not_the_terminal():
    """A budgeted compile printed HiGHS's C++ lines (``HighsMipSolverData::...``) on the
    user's terminal: they are printf, not governed by ``disp``. Whatever the solver prints
    on file descriptor 1 now becomes DEBUG records of ``sac_compile.cut.exact``."""
    proc = subprocess.run([sys.executable, "-c", SCRIPT_SOLVER_OUTPUT], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("SOLVED "), proc.stdout[-3000:]
    kept, recomputed, count, loggers, levels = json.loads(lines[0].split(" ", 1)[1])
    assert (kept, recomputed) == ([0, 2], [1])       # keeps b (and the input), recomputes a
    assert count > 5                                 # HiGHS's banner, its presolve, ...
    assert (loggers, levels) == (["sac_compile.cut.exact"], ["DEBUG"])
    assert "HiGHS" not in proc.stderr
