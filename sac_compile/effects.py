"""Which ops are never replayed: collectives and other effectful ops.

One predicate for both modes. Eager: the runtime keeps the outputs of such an op (counted
as saved, reason "collective: not replayed") instead of replaying it in backward, unless
the policy says MUST_RECOMPUTE. Compiled: the cut (``cut/network.py``) bans recomputing
them under the same condition.

Replaying a collective in backward re-issues it: one more round of communication, and a
hang if the ranks do not all replay it in the same order. An effectful op (``aten._print``,
a torchbind method call) would repeat its effect.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from .policy import CheckpointPolicy, Decision
from .torch_internals import HigherOrderOperator, OpOverload, OpOverloadPacket, TorchAPIMissing

# Namespaces whose every op talks to other ranks: functional collectives (the autograd
# variants too) and the process-group ops that torch.distributed dispatches
# (``c10d._allgather_base_``, FSDP2's all-gathers and reduce-scatters, ...).
COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "_c10d_functional_autograd", "c10d"})

# Collectives issued through a ProcessGroup: they write into an output argument and return
# a Work handle the caller waits on. A replay would get a new Work that nobody waits on.
PROCESS_GROUP_NAMESPACES = frozenset({"c10d"})


def _op_namespace(op: Any) -> str | None:
    if isinstance(op, OpOverload):
        return op.namespace
    if isinstance(op, OpOverloadPacket):
        return op._qualified_op_name.split("::", 1)[0]
    return None


def effect_reason(op: Any) -> str | None:
    """``"collective"``, ``"effectful op"`` or None: why ``op`` must not be replayed
    (recomputed) unless a policy says MUST_RECOMPUTE. ``op`` is an OpOverload (eager, or an
    FX node's target) or a higher-order operator."""
    if _op_namespace(op) in COLLECTIVE_NAMESPACES:
        return "collective"
    if isinstance(op, (OpOverload, HigherOrderOperator)):
        try:
            from .torch_internals import has_effects
            if has_effects(op):  # registered effects: aten._print, torchbind calls, ...
                return "effectful op"
        except (TorchAPIMissing, RuntimeError, ValueError):  # pragma: no cover - older torch
            return None
    return None


def is_process_group_collective(op: Any) -> bool:
    """A collective the eager runtime cannot replay even when told to (see above)."""
    return _op_namespace(op) in PROCESS_GROUP_NAMESPACES


@dataclasses.dataclass(frozen=True)
class KeptDecision(Decision):
    """A collective's or effectful op's outputs, kept because they are never replayed.

    ``original`` is the decision the policies gave (it did not save and was not
    MUST_RECOMPUTE); the inert-policy warning looks at that one."""

    why: str = "collective"
    original: Decision | None = None

    def reason(self) -> str:
        return f"{self.why}: not replayed"


def kept_decision(why: str, region: str, original: Decision) -> KeptDecision:
    return KeptDecision(CheckpointPolicy.MUST_SAVE, region=region, source=why, why=why,
                        original=original)
