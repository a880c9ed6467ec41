"""Memory an op allocates for itself while it runs, beyond its outputs: what the allocator
sees that the graph's values do not say (:mod:`.peak` counts it in the step's peak).

One rule, measured: a matmul whose operand BLAS cannot read in place - neither row- nor
column-major with a valid leading dimension, such as the gradient of ``sum`` expanded to a
matrix (stride 0) - copies it into a contiguous temporary first (``addmm_impl_cpu_``;
cuBLAS's callers do the same), freed when the op returns. On issue 17's stack this is the
64 KiB between the step's modelled and measured peaks (``tests/test_compile_peak_budget.py``).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .. import graph_meta
from ..op_costs import hint

__all__ = ["operand_copy_bytes"]

_ADDMM = torch.ops.aten.addmm.default
_MATMULS = (torch.ops.aten.mm.default, _ADDMM, torch.ops.aten.bmm.default)


def operand_copy_bytes(node: fx.Node) -> int:
    """Bytes of the contiguous copies ``node`` makes of operands BLAS cannot read."""
    if node.op != "call_function" or node.target not in _MATMULS:
        return 0
    copies = 0
    for a in node.args[1:3] if node.target is _ADDMM else node.args[-2:]:
        val = graph_meta.val(a) if isinstance(a, fx.Node) and graph_meta.has_val(a) else None
        if isinstance(val, torch.Tensor) and not _blas_readable(val):
            copies += hint(val.numel(), fallback=0) * val.element_size()
    return copies


def _blas_readable(t: torch.Tensor) -> bool:
    """BLAS reads a matrix (the last two dimensions) in place when it is row-major or
    column-major with a valid leading dimension (and a batch not broadcast). Sizes are
    read by their hints: never a guard on a symbolic size (that would specialise it)."""
    if t.dim() < 2:
        return True
    rows, cols = (hint(n, fallback=-1) for n in t.shape[-2:])
    s_row, s_col = (hint(s, fallback=-1) for s in t.stride()[-2:])
    if -1 in (rows, cols, s_row, s_col):  # no hint: assume it is read in place
        return True
    if t.dim() == 3 and hint(t.shape[0], fallback=1) > 1 and \
            hint(t.stride()[0], fallback=1) == 0:
        return False
    return (s_col == 1 and s_row >= max(1, cols)) or (s_row == 1 and s_col >= max(1, rows))
