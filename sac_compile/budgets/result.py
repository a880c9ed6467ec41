"""What a kept-byte budget solve chose, for one split: one type for every solver
(:mod:`.split`'s search, :mod:`.groups`' exact program over the regions' caps, and the
peak search over both, :mod:`sac_compile.compiler.peak_budget`)."""
from __future__ import annotations

import dataclasses

import torch.fx as fx

__all__ = ["BudgetResult"]


@dataclasses.dataclass
class BudgetResult:
    saved: list[fx.Node]                 # the chosen cut's saved nodes, graph order
    budget: float | int                  # as given
    budget_bytes: float                  # the cap on activation bytes for this split
    activation_bytes: int                # what the chosen cut saves (inputs excluded)
    unconstrained_bytes: int             # what the cut without a budget saves
    min_bytes: int                       # the least reachable
    weight: float                        # the chosen w (1.0: the unconstrained cut)
    evicted: list[fx.Node]               # saved without the budget, not with it
    solves: int
    seconds: float
    offloaded: list[fx.Node] = dataclasses.field(default_factory=list)  # kept on the host
    method: str = ""                     # how the cut was found
    cost: float = 0.0                    # its recompute + offload + kept-input cost
    lagrangian_cost: float = 0.0         # the same for the Lagrangian search's cut
    lifted: list[fx.Node] = dataclasses.field(default_factory=list)  # upstream bans lifted
