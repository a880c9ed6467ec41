"""What a graph input is: a forward input, a parameter, a tangent, RNG state.

One place answers it for every pass. AOTAutograd describes each placeholder of the graphs
it traces in ``node.meta["desc"]`` (an ``AOTInput``: ``PlainAOTInput``, ``ParamAOTInput``,
``TangentAOTInput``, ``PhiloxForwardSeedAOTInput``, ...); the forward and backward graphs
that ``_extract_fwd_bwd_modules`` builds share their placeholders' ``meta`` with the joint
graph, so they carry it too. The names (``primals_3``, ``tangents_1``, ``fwd_seed``) are
read only where torch gives nothing else: while the joint graph is still being traced (the
descriptors are attached after tracing) and in graphs that did not come from AOTAutograd.
They follow torch's own naming rules (``torch._functorch._aot_autograd.utils._is_primal``).

Parameters: under dynamo (modules inlined) parameters and buffers reach AOTAutograd as
plain inputs; what says they live as long as the model is the partitioner's
``static_lifetime_input_indices``, indices into :func:`forward_inputs` -
:func:`static_inputs` reads them. ``Role.PARAMETER`` is what the descriptor says.
"""
from __future__ import annotations

import enum
from collections.abc import Iterable

import torch.fx as fx

from .. import graph_meta

__all__ = ["Role", "node_role", "forward_inputs", "static_inputs", "is_joint_graph"]


class Role(enum.Enum):
    """The part a node plays in an AOTAutograd graph."""

    INPUT = "input"                            # a forward input (user value, effect token)
    PARAMETER = "parameter"                    # a forward input that is a parameter or buffer
    TANGENT = "tangent"                        # the gradient of a forward output (backward input)
    FORWARD_RNG_STATE = "forward RNG state"    # philox seed/offset for the forward's random ops
    BACKWARD_RNG_STATE = "backward RNG state"  # ... and for the backward's
    VALUE = "value"                            # computed by the graph: not a placeholder

    @property
    def is_forward_input(self) -> bool:
        """A primal by torch's definition: what ``static_lifetime_input_indices`` index."""
        return self in (Role.INPUT, Role.PARAMETER)

    @property
    def runs_in_backward(self) -> bool:
        """An input only the backward has: what depends on it cannot run in the forward."""
        return self in (Role.TANGENT, Role.BACKWARD_RNG_STATE)


def node_role(node: fx.Node) -> Role:
    if node.op != "placeholder":
        return Role.VALUE
    desc = graph_meta.desc(node)
    if desc is not None:
        role = _role_from_descriptor(desc)
        if role is not None:
            return role
    return _role_from_name(str(node.target))


def _role_from_descriptor(desc: object) -> Role | None:
    from ..torch_internals import aot_descriptors as d

    if not isinstance(desc, d.AOTInput):
        return None
    if desc.is_tangent() or isinstance(desc, d.BackwardTokenAOTInput):
        return Role.TANGENT  # torch names backward tokens tangents_token*, and treats them so
    if isinstance(desc, (d.PhiloxForwardSeedAOTInput, d.PhiloxForwardBaseOffsetAOTInput)):
        return Role.FORWARD_RNG_STATE
    if isinstance(desc, (d.PhiloxBackwardSeedAOTInput, d.PhiloxBackwardBaseOffsetAOTInput)):
        return Role.BACKWARD_RNG_STATE
    if desc.is_param() or desc.is_buffer():
        return Role.PARAMETER
    return Role.INPUT


def _role_from_name(name: str) -> Role:
    # torch's naming, as its partitioner reads it (_aot_autograd/utils.py: _is_tangent,
    # _is_fwd_seed_offset, _is_bwd_seed_offset, _is_primal).
    if "tangents" in name:
        return Role.TANGENT
    if "bwd_seed" in name or "bwd_base_offset" in name:
        return Role.BACKWARD_RNG_STATE
    if "fwd_seed" in name or "fwd_base_offset" in name:
        return Role.FORWARD_RNG_STATE
    return Role.INPUT


def forward_inputs(graph: fx.Graph) -> list[fx.Node]:
    """The forward inputs in placeholder order: torch's ``primal_inputs``, the list that
    ``static_lifetime_input_indices`` indexes."""
    return [n for n in graph.find_nodes(op="placeholder") if node_role(n).is_forward_input]


def static_inputs(graph: fx.Graph, indices: Iterable[int] | None) -> set[fx.Node]:
    """The forward inputs that live as long as the model (parameters, buffers), from the
    partitioner's ``static_lifetime_input_indices``."""
    inputs = forward_inputs(graph)
    return {inputs[i] for i in indices or () if i < len(inputs)}


def is_joint_graph(graph: fx.Graph) -> bool:
    """A joint forward/backward graph (it has tangents): one a partitioner will split."""
    return any(node_role(n) is Role.TANGENT for n in graph.find_nodes(op="placeholder"))


def is_backward_formula(node: fx.Node) -> bool:
    """A node AOTAutograd traced for a backward formula (``cos(mm)`` of sin's backward,
    which needs no tangent, is one), or one we made for the backward (a recompute)."""
    return bool(graph_meta.autograd_backward(node)) or \
        graph_meta.partitioner_tag(node) == "is_backward"
