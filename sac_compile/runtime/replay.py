"""Backward: unpack a handle, recomputing the missing ancestors of its node iteratively."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ..policy import CheckpointError, op_name
from .graph import (OP_INFO, OpNode, OutRef, SavedHandle, alias_for_saving, arg_at,
                    flat_outputs, map_refs, op_info)

def unpack(packed: Any) -> torch.Tensor:
    if type(packed) is not SavedHandle:
        return packed
    node = packed.node
    value = node.value
    if value is not None and node.mutated_by is None:
        return value[packed.index]
    with node.ctx.lock:
        if torch.is_grad_enabled() or _autocast_enabled():
            with torch.no_grad(), _autocast_off():
                return _materialize(node)[packed.index]
        # Autograd's engine runs backward with grad mode off (unless create_graph): skip
        # two context managers per unpack.
        return _materialize(node)[packed.index]


def _materialize(target: OpNode) -> list[Any]:
    """The outputs of ``target``, recomputing missing ancestors iteratively."""
    if target.value is not None and target.mutated_by is None:
        return target.value
    stack = [target]
    expanded: set[int] = set()
    while stack:
        node = stack[-1]
        if node.value is not None:
            if node.mutated_by is not None:
                _check_not_mutated(node)
            stack.pop()
            continue
        if id(node) not in expanded:
            if node.packed is not None:
                node.value = _restore_packed(node)
                stack.pop()
                continue
            if node.args is None:
                raise CheckpointError(
                    f"the value of {node.describe()} is no longer available: backward needs "
                    f"it again after it was freed. Pass retain_graph=True to the first "
                    f"backward to run backward twice")
            reused = _live_forward_outputs(node)
            if reused is not None:
                node.value = reused
                stack.pop()
                continue
            expanded.add(id(node))
            pushed = False
            for dep in node.deps:
                if dep.value is None or dep.mutated_by is not None:
                    stack.append(dep)
                    pushed = True
            if pushed:
                continue
        stack.pop()
        node.value = _replay(node)
        # The node never needs its inputs again: dropping them frees ancestors whose
        # last consumer this was.
        node.args = node.kwargs = None
        node.deps = ()
    return target.value


def _check_not_mutated(node: OpNode) -> None:
    if node.mutated_by is not None:
        raise CheckpointError(
            f"the saved output of {node.describe()} was mutated in place by "
            f"{node.mutated_by} after it was saved, so backward would use a wrong value. "
            f"Clone it before mutating, make the policy recompute {op_name(node.op)}, or pass "
            f"allow_cache_entry_mutation=True to the region (which keeps a copy)")


def _live_forward_outputs(node: OpNode) -> list[Any] | None:
    """The forward's own outputs, if every one is still alive and unmutated: no need to
    recompute what the program still holds."""
    values = []
    for facts in node.outs:
        if facts is None:
            values.append(None)
            continue
        t = facts[0]()
        if t is None or t._version != facts[1]:
            return None
        values.append(alias_for_saving(t))
    return values


def _restore_packed(node: OpNode) -> list[Any]:
    hooks = node.decision.hooks
    values = []
    for i, p in enumerate(node.packed):
        if hooks is not None and node.outs[i] is not None:
            v = hooks.unpack(p)
            shape, dtype = node.outs[i][2:]
            if not isinstance(v, torch.Tensor) or v.shape != shape or v.dtype != dtype:
                got = (f"{tuple(v.shape)} {v.dtype}" if isinstance(v, torch.Tensor)
                       else type(v).__name__)
                raise CheckpointError(
                    f"SaveWithHooks unpack for {node.describe()} returned {got}, expected "
                    f"{tuple(shape)} {dtype}; unpack must return a tensor like the one pack got")
            values.append(v)
        elif isinstance(p, tuple):
            host, device = p
            values.append(host.to(device, non_blocking=True))
        else:
            values.append(p)
    node.packed = None
    return values


def _recomputed_value(ref: OutRef) -> Any:
    return ref.node.value[ref.index]


def _resolve(a: Any) -> Any:
    return map_refs(a, _recomputed_value)


def _resolve_args(node: OpNode) -> tuple[tuple, dict]:
    args = tuple([_resolve(a) for a in node.args])
    kwargs = {k: _resolve(v) for k, v in node.kwargs.items()} if node.kwargs else {}
    return args, kwargs


def _replay(node: OpNode) -> list[Any]:
    if node.kwargs:
        args, kwargs = _resolve_args(node)
    else:
        args, kwargs = tuple([_resolve(a) for a in node.args]), {}
    info = OP_INFO[id(node.op)]
    if info.mutated:
        # Replay writes into copies: saved values, leaves and module buffers stay intact.
        args = list(args)
        for i in info.mutated:
            if i >= 0 and i < len(args) and isinstance(args[i], torch.Tensor):
                args[i] = args[i].clone()
            elif i < 0 or i >= len(args):
                name = node.op._schema.arguments[i if i >= 0 else -1 - i].name
                if isinstance(kwargs.get(name), torch.Tensor):
                    kwargs[name] = kwargs[name].clone()
        args = tuple(args)
    if node.rng is not None:
        gen, state = node.rng
        current = gen.get_state()
        gen.set_state(state)
        try:
            out = info.call(*args, **kwargs)
        finally:
            gen.set_state(current)
    else:
        out = info.call(*args, **kwargs)
    outputs = flat_outputs(out)
    if len(outputs) < len(node.outs):
        outputs.extend(_mutated_outputs(node.op, args, kwargs, outputs, len(node.outs)))
    for i, (t, facts) in enumerate(zip(outputs, node.outs)):
        if facts is not None and (not isinstance(t, torch.Tensor) or t.shape != facts[2]
                                  or t.dtype != facts[3]):
            meta = facts[2:]
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else repr(t)
            raise CheckpointError(
                f"recomputing {node.describe()} gave output {i} as {got}, but the forward "
                f"produced {tuple(meta[0])} {meta[1]}: the region's ops are not deterministic "
                f"in shape or dtype. Make the policy save this op (MUST_SAVE)")
    for stats in node.ctx.stats:
        stats.recomputed_ops.append(op_name(node.op))
    return outputs


def _mutated_outputs(op: Any, args: tuple, kwargs: dict, outputs: list[Any],
                     n: int) -> list[Any]:
    extra = []
    for i in op_info(op).mutated:
        m = arg_at(args, kwargs, op, i)
        if isinstance(m, torch.Tensor) and not any(m is o for o in outputs):
            extra.append(m)
    return extra[: n - len(outputs)]


def _autocast_enabled() -> bool:
    return torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")


@contextlib.contextmanager
def _autocast_off() -> Iterator[None]:
    # The recorded ops already carry autocast's casts; casting again would change dtypes.
    if not _autocast_enabled():
        yield
        return
    with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
        yield
