"""Backward's version checks across the region boundary: saved-tensor hooks turn off
autograd's own check, so a value the program modified in place after the region read or
returned it (a region input, a parameter, a saved output) raises a ``CheckpointError``
naming the op, the region, the tensor and the fix, as plain autograd would raise, instead
of computing a gradient from the new value."""
from __future__ import annotations

import torch

from ..policy import CheckpointError, op_name
from ..torch_internals import current_autograd_node
from .graph import ForeignSaved, LeafRef, OpNode, tensor_text

__all__ = ["unpack_kept", "unpack_foreign", "mutated_after_region", "stale_leaf",
           "check_not_mutated"]


def unpack_kept(node: OpNode, index: int) -> torch.Tensor:
    """An output a memory budget kept of a multi-output op, unless modified since."""
    t, version = node.kept[index], node.kept_versions[index]
    if version is not None and t._version != version:
        raise CheckpointError(
            f"output {index} of {node.describe()}, {tensor_text(t)} kept for backward under "
            f"the region's memory budget, was modified in place after the region returned it "
            f"(version {version} -> {t._version}), so backward would use the modified value. "
            f"Clone it before modifying it, or use an out-of-place op")
    return t


def unpack_foreign(saved: ForeignSaved) -> torch.Tensor:
    t = saved.value
    if saved.version is not None and t._version != saved.version:
        grad_fn = current_autograd_node()
        op = f"the backward of {grad_fn.name()}" if grad_fn is not None else "backward"
        what = "a parameter" if isinstance(t, torch.nn.Parameter) else \
            "a tensor from outside the region (an input, a parameter or a buffer)"
        raise CheckpointError(
            f"{op} in region {saved.region!r} needs {tensor_text(t)}, {what}, that autograd "
            f"saved in the forward at version {saved.version}; it was modified in place since "
            f"(now version {t._version}), so its gradient would be computed from the new "
            f"value. Run backward before modifying it (e.g. before optimizer.step()), or use an "
            f"out-of-place update (h = h + f(h) instead of h += f(h)); plain autograd raises "
            f"here too")
    return t


def mutated_after_region(node: OpNode, index: int) -> CheckpointError:
    t = node.value[index] if node.value is not None else node.packed[index]
    return CheckpointError(
        f"output {index} of {node.describe()}, {tensor_text(t)} the policy saved for "
        f"backward, was modified in place after the region returned it (version "
        f"{node.versions[index]} -> {t._version}), so backward would use the modified "
        f"value. Clone it before modifying it (y = y.clone()), use an out-of-place op "
        f"(y = y + ... instead of y += ...), or make the policy recompute "
        f"{op_name(node.op)} (a mutation after the region cannot be allowed with "
        f"allow_cache_entry_mutation)")


def stale_leaf(node: OpNode, leaf: LeafRef) -> CheckpointError:
    position = next((i for i, a in enumerate(node.args)
                     if a is leaf or (isinstance(a, (list, tuple)) and any(x is leaf for x in a))),
                    None)
    where = f"argument {position}" if position is not None else "an argument"
    what = "a parameter" if leaf.is_parameter else \
        "a tensor from outside the region (an input or a buffer)"
    return CheckpointError(
        f"recomputing {node.describe()} needs {where}, {tensor_text(leaf.value)}, {what}; it "
        f"was modified in place after the region read it (version {leaf.version} -> "
        f"{leaf.value._version}), so the recompute would see the new value. Use an "
        f"out-of-place update (h = h + block(h) instead of h += block(h)), clone it before "
        f"modifying it, or make the policy save {op_name(node.op)} (MUST_SAVE) so backward "
        f"does not recompute it")


def check_not_mutated(node: OpNode) -> None:
    if node.mutated_by is not None:
        raise CheckpointError(
            f"the saved output of {node.describe()} was mutated in place by "
            f"{node.mutated_by} after it was saved, so backward would use a wrong value. "
            f"Clone it before mutating, make the policy recompute {op_name(node.op)}, or pass "
            f"allow_cache_entry_mutation=True to the region (which keeps a copy)")
