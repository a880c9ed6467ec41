"""The fusion veto's rule (``compiler/near_fusion.py``), on stand-ins for Inductor's scheduler
nodes: which fusions of kernels with something between them it refuses, by bytes.

Inductor orders a fused kernel by its first node and hoists what the later one needs, so a
fusion makes the later kernel's outputs (and what it reads from kernels between) that much
earlier; before fusing it, the earlier kernel's inputs were the cost counted. HF GPT-2's
backward (bench, Inductor): four layers' recomputed attention masks (256 KiB each) were
fused into the first layer's kernel through the boolean mask they share, all four made at
the first layer; refused, the step's measured peak at ``PeakBudget(26,300,000)`` fell from
25,578,632 to 24,857,760 B.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from sac_compile.compiler import near_fusion

BYTES = {"pos": 4_096, "same": 65_536, "mask0": 262_144, "mask3": 262_144, "h": 524_288,
         "grad": 524_288}


class Kernel:
    def __init__(self, name: str, at: int, reads: tuple[str, ...], writes: tuple[str, ...]):
        self.name, self.min_order, self.max_order = name, at, at
        self.read_writes = SimpleNamespace(reads=[SimpleNamespace(name=r) for r in reads])
        self.writes = writes

    def get_buffer_names(self) -> set[str]:
        return set(self.writes)

    def get_operation_names(self) -> set[str]:
        return {self.name}


def _scheduler(*kernels: Kernel) -> SimpleNamespace:
    """name_to_buf (each buffer's users and maker) and name_to_fused_node, as Inductor's."""
    bufs = {}
    for k in kernels:
        for w in k.writes:
            users = [SimpleNamespace(node=u) for u in kernels if w in
                     {d.name for d in u.read_writes.reads}]
            bufs[w] = SimpleNamespace(users=users, defining_op=SimpleNamespace(
                get_name=lambda k=k: k.name))
    return SimpleNamespace(name_to_buf=bufs, name_to_fused_node={k.name: k for k in kernels})


@pytest.fixture(autouse=True)
def _sizes(monkeypatch):
    def nbytes(names, unreadable=float("inf")):
        return float(sum(BYTES.get(n, unreadable) for n in names))
    monkeypatch.setattr(near_fusion, "_nbytes", nbytes)


def test_a_kernel_made_early_through_a_value_others_read_too_is_refused():
    """The shared boolean mask (read by every layer's mask kernel) is not spared by fusing
    one of them: the fourth layer's mask would be made 70 kernels early, for nothing."""
    same = Kernel("op35", 35, ("pos",), ("same",))
    mask0 = Kernel("op36", 36, ("same",), ("mask0",))
    mask3 = Kernel("op105", 105, ("same",), ("mask3",))
    sched = _scheduler(same, mask0, mask3)
    assert near_fusion.is_distant_reuse(sched, same, mask3)
    assert not near_fusion.is_distant_reuse(sched, same, mask0)  # (adjacent: fused)


def test_a_producer_read_by_its_far_consumer_alone_may_fuse():
    """The consumer's output replaces the value it alone reads (as many bytes): no more
    alive, the fusion stands (it spares a round trip through memory)."""
    make = Kernel("op10", 10, ("pos",), ("h",))
    use = Kernel("op40", 40, ("h",), ("grad",))
    sched = _scheduler(make, use)
    assert not near_fusion.is_distant_reuse(sched, make, use)


def test_what_the_later_kernel_reads_from_kernels_between_counts_as_made_early():
    """The later kernel needs a value made between the two: fused, that value (hoisted
    with its kernel) exists from the earlier kernel on."""
    make = Kernel("op10", 10, ("pos",), ("h",))
    between = Kernel("op20", 20, ("pos",), ("mask0",))
    use = Kernel("op40", 40, ("h", "mask0"), ("grad",))
    sched = _scheduler(make, between, use)
    assert near_fusion.is_distant_reuse(sched, make, use)


def test_the_earlier_kernels_inputs_kept_alive_still_count():
    """The rule before: what the earlier kernel reads lives until the fused one runs."""
    first = Kernel("op10", 10, ("h",), ("pos",))
    later = Kernel("op40", 40, ("pos",), ())
    sched = _scheduler(first, later)
    assert near_fusion.is_distant_reuse(sched, first, later)
