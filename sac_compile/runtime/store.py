"""What the forward keeps for backward once its decisions are made: the nodes some backward
needs (what no handle reaches is dropped), each saved value as its decision says (as is,
offloaded to the CPU, or packed by the policy's ``SaveWithHooks``), the records of what was
kept (``collect_stats``), and a random op's generator state, which its replay restores. The
recorder (``record.py``) decides; this keeps."""
from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch

from ..policy import CheckpointError, op_name
from ..tensor_memory import storage_key, storage_nbytes
from .graph import NodeOutput, OpNode, ref_node
from .stats import SavedValueRecord

__all__ = ["count_uses", "store_saved", "saved_records", "capture_rng"]


def count_uses(handles: Sequence[NodeOutput], nodes: Sequence[OpNode]) -> None:
    """Count ``OpNode.uses``, how often one backward reads each node: once per handle, once
    per recomputed node that reads it (compiled autograd's progressive release). A node
    some handle needs (its own node, or an input of a node that will be recomputed) is one
    with ``uses`` > 0 afterwards (nodes are fresh per region call: every count starts at 0).

    ``nodes``: the region's nodes in recording order, which is topological (a node reads
    only nodes recorded before it). Swept from the last, each node's count is final when
    it is reached: no stack, no visited set."""
    if not handles:
        return  # backward reads nothing of the region
    for handle in handles:
        handle.node.uses += 1
    for node in reversed(nodes):
        if not node.uses:
            continue  # no backward reads it
        args = node.args
        if args is None or (node.value is not None and node.decision is not None
                            and node.decision.saves):
            continue  # saved (or never recomputed): its inputs are not read
        for a in args:  # ``deps``, inlined for the common plain reference
            cls = type(a)
            if cls is OpNode:
                a.uses += 1
            elif cls is NodeOutput:
                a.node.uses += 1
            elif (cls is list or cls is tuple) and a:
                _use_all(a)
        if node.kwargs:
            _use_all(node.kwargs.values())


def _use_all(refs: Any) -> None:
    """``count_uses``'s step for references in a list or keyword arguments."""
    for a in refs:
        for x in (a if isinstance(a, (list, tuple)) else (a,)):
            if type(x) is OpNode or type(x) is NodeOutput:
                ref_node(x).uses += 1


def _call_pack(node: OpNode, value: torch.Tensor) -> Any:
    try:
        return node.decision.hooks.pack(value)
    except Exception as e:
        raise CheckpointError(
            f"{node.decision.hooks!r} on {node.describe()}: pack raised {type(e).__name__}: "
            f"{e} while saving {tuple(value.shape)} {value.dtype}; fix the pack hook, or "
            f"return MUST_SAVE for this op") from e


def store_saved(node: OpNode) -> None:
    """Apply the decision's storage: plain, CPU offload, or the user's pack hook."""
    decision = node.decision
    if decision.hooks is not None:
        node.packed = [_call_pack(node, v) if isinstance(v, torch.Tensor) else v
                       for v in node.value]
    elif decision.offloads:
        if not _WARNED_OFFLOAD_ON_CPU and any(
                isinstance(v, torch.Tensor) and v.device.type == "cpu" for v in node.value):
            _warn_offload_on_cpu(node)
        node.packed = [_offload(v) for v in node.value]
    else:
        return
    node.value = None
    # A packed tensor may still alias the program's (an identity pack, a CPU "offload").
    node.versions = [p._version if isinstance(p, torch.Tensor) and not p.is_inference()
                     else None for p in node.packed]


_WARNED_OFFLOAD_ON_CPU = False


def _warn_offload_on_cpu(node: OpNode) -> None:
    global _WARNED_OFFLOAD_ON_CPU
    _WARNED_OFFLOAD_ON_CPU = True
    why = "no accelerator is available" if not torch.accelerator.is_available() \
        else "the tensor is already on the CPU"
    warnings.warn(f"{node.decision.label} for {node.describe()}: {why}, so CPU offload is a "
                  f"plain save (warned once). Use MUST_SAVE/PREFER_SAVE to say so", stacklevel=2)


def _offload(v: Any) -> Any:
    if not isinstance(v, torch.Tensor) or v.device.type == "cpu":
        return v
    host = torch.empty(v.shape, dtype=v.dtype, device="cpu",
                       pin_memory=torch.cuda.is_available() if v.is_cuda else False)
    host.copy_(v, non_blocking=True)
    return (host, v.device)


def saved_records(node: OpNode, seen: set[int]) -> list[SavedValueRecord]:
    """One record per saved tensor output; a storage shared by several counts once."""
    records = []
    for i, t in enumerate(node.value):
        if not isinstance(t, torch.Tensor):
            continue
        key = storage_key(t)
        size = 0 if key in seen else storage_nbytes(t)
        seen.add(key)
        records.append(SavedValueRecord(f"{op_name(node.op)}#{node.seq}:{i}", op_name(node.op),
                                        size, node.decision.reason(), node.region,
                                        node.decision.label,
                                        node.decision.is_must and node.decision.hooks is None))
    return records


def capture_rng(args: tuple, kwargs: dict) -> tuple[torch.Generator, torch.Tensor]:
    """The generator a random op draws from (its ``generator=``, else the default one of
    its device) and that generator's state now, before the op: its replay restores it."""
    gen = kwargs.get("generator")
    if gen is None:
        device = kwargs.get("device")
        if device is None:
            device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        device = torch.device(device) if device is not None else torch.get_default_device()
        if device.type == "cpu":
            gen = torch.default_generator
        else:
            mod = getattr(torch, device.type)
            idx = device.index if device.index is not None else mod.current_device()
            gen = mod.default_generators[idx]
    return gen, gen.get_state()
