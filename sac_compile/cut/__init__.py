"""The cut: which values a region keeps and which it recomputes, as a minimum cut of a flow
network. Shared by both engines: the compiler builds the network from
the joint graph AOTAutograd traces, the eager runtime from the ops a region recorded, and
both solve it with this code (the same decisions, the same errors).

* :mod:`.roles` - what a graph input is (forward input, parameter, tangent, RNG state).
* :mod:`.costs` - bytes, FLOPs and memory traffic of one node.
* :mod:`.reasons` - why a value is saved or cannot be recomputed: a kind and a text.
* :mod:`.network` - the flow network and its objective (the formulation, one screen).
* :mod:`.stand_ins` - values kept in place of others (views, stand-ins off the device).
* :mod:`.solvers` - scipy's and networkx's max-flow, and the minimum cut they give.
* :mod:`.exact` - the exact program (scipy's MILP) that makes a budgeted cut optimal.

Memory budgets - the price search over this cut, per-region caps, whole-model prices - are
:mod:`sac_compile.budgets`, one layer up.
"""
