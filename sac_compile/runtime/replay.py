"""Backward: unpack a handle, recomputing the missing ancestors of its node iteratively."""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch

from ..policy import CheckpointError, op_name
from .checks import (check_not_mutated, mutated_after_region, stale_leaf, unpack_foreign,
                     unpack_kept)
from .graph import (OP_INFO, ForeignSaved, LeafRef, NodeOutput, OpNode, alias_for_saving,
                    flat_outputs, kept_for, map_refs, mutated_tensors, op_info,
                    recomputes_through_hooks, ref_node)


def unpack(packed: Any) -> torch.Tensor:
    if type(packed) is not NodeOutput:
        if type(packed) is ForeignSaved:
            return unpack_foreign(packed)
        return packed
    node = packed.node
    if _CA is not None and _CA.in_compiled_autograd_region:
        return _unpack_progressive(packed)
    value = node.value
    if value is not None and node.mutated_by is None:  # (_unpack_value, inlined)
        versions = node.versions
        if versions is not None and value[packed.index]._version != versions[packed.index]:
            raise mutated_after_region(node, packed.index)
        return value[packed.index]
    if node.kept is not None and node.kept[packed.index] is not None:
        return unpack_kept(node, packed.index)
    ctx = node.ctx
    with ctx.lock:
        if torch.get_default_dtype() != ctx.default_dtype:
            with _default_dtype(ctx.default_dtype):
                return unpack(packed)
        if torch.is_grad_enabled() or _autocast_enabled():
            with torch.no_grad(), _autocast_off():
                return _materialize(node)[packed.index]
        # Autograd's engine runs backward with grad mode off (unless create_graph): skip
        # two context managers per unpack.
        return _materialize(node)[packed.index]


# -- compiled autograd ----------------------------------------------------------------------
#
# The autograd engine frees each saved variable once its node has run, so the handle, and
# with it the recomputed value, goes as soon as backward is past it. Compiled autograd
# holds every handle as an input of its graph until the graph returns: a value cached on
# its node would stay alive to the end of backward (every region's at once). Under it,
# each node counts its reads (``OpNode.uses``: its handles' unpacks and the replays of the
# recomputed nodes that read it) and a recomputed node drops its value at the last one; it
# keeps its arguments, so a second backward (retain_graph=True) recomputes it again.

# torch._dynamo.compiled_autograd once Dynamo is loaded (``unpack_hook`` looks; compiled
# autograd cannot run without it): its ``in_compiled_autograd_region`` is True while a
# compiled-autograd graph runs.
_CA: Any = None


def unpack_hook() -> Any:
    """The unpack hook to register: ``unpack`` itself. Under compiled autograd, Dynamo
    compiles the backward graph and would trace into ``unpack`` (its lock, the recorded op
    calls, the node caches), breaking the graph inside it and guarding on runtime state.
    Once Dynamo is loaded, ``unpack`` carries the flag ``torch._dynamo.disable`` puts on its
    wrapper (Dynamo calls it as an opaque function: one graph break per unpack, as for
    torch's own checkpoint hooks), and its code object the skip-with-everything-it-calls
    strategy (``keep_dynamo_out``, which ``eager_region`` applies before it asks for this
    hook), so the runtime runs as in eager mode. No wrapper:
    ``torch._dynamo.disable``'s costs a frame and two eval-frame swaps per unpack."""
    global _CA
    if _CA is None and "torch._dynamo" in sys.modules:
        from ..torch_internals import compiled_autograd, mark_dynamo_opaque
        mark_dynamo_opaque(unpack, "sac_compile's unpack hook runs the eager runtime "
                                   "(recompute)")
        _CA = compiled_autograd
    return unpack


def _unpack_progressive(packed: NodeOutput) -> torch.Tensor:
    node = packed.node
    ctx = node.ctx
    with ctx.lock:
        if node.value is not None and node.mutated_by is None:
            out = _unpack_value(node, packed.index)
        elif node.kept is not None and node.kept[packed.index] is not None:
            out = unpack_kept(node, packed.index)
        else:
            with torch.no_grad(), _autocast_off(), _default_dtype(ctx.default_dtype):
                out = _materialize(node, progressive=True)[packed.index]
        node.spent += 1
        if node.spent >= node.uses:  # the last read of this backward
            node.spent = 0
            _release(node)
    return out


def _unpack_value(node: OpNode, index: int) -> torch.Tensor:
    """A value the node holds, unless the program modified it since (it aliases the
    program's tensor while ``node.versions`` is set)."""
    value = node.value
    versions = node.versions
    if versions is not None and value[index]._version != versions[index]:
        raise mutated_after_region(node, index)
    return value[index]


def _release(node: OpNode) -> None:
    """Drop a recomputed (or reused) value that can be recomputed again; never one the
    decision keeps (a saved value, a collective's output)."""
    if node.args is not None and not node.decision.saves:
        node.value = node.versions = None


def _materialize(target: OpNode, progressive: bool = False) -> list[Any]:
    """The outputs of ``target``, recomputing missing ancestors iteratively.

    ``progressive`` (compiled autograd): a recomputed node keeps its arguments, and each
    node that gets its value spends one use of each node it reads; those whose last use
    this was drop their values once ``target`` is done."""
    if target.value is not None and target.mutated_by is None:
        return target.value
    stack = [target]
    push = stack.append
    pop = stack.pop
    done: list[OpNode] | None = [] if progressive else None
    while stack:
        node = pop()
        if node is _INPUTS_READY:  # the node below has its inputs now (no visited set)
            node = pop()
        else:
            if node.value is not None:
                if node.mutated_by is not None:
                    check_not_mutated(node)
                continue
            if node.packed is not None:
                node.value = _restore_packed(node)
                continue
            args = node.args
            if args is None:
                raise CheckpointError(
                    f"the value of {node.describe()} is no longer available: backward needs "
                    f"it again after it was freed. Pass retain_graph=True to the first "
                    f"backward to run backward twice")
            outs = node.outs
            # (one output, and dead: the common case, checked without a call)
            if len(outs) != 1 or outs[0] is None or outs[0][0]() is not None:
                reused = _live_forward_outputs(node)
                if reused is not None:
                    node.value = reused
                    if done is not None:
                        done.append(node)
                    continue
            # Its missing inputs above it, then the marker: the node replays after them.
            push(node)
            push(_INPUTS_READY)
            height = len(stack)
            for a in args:  # ``deps``, inlined for the common plain reference
                cls = type(a)
                if cls is OpNode:
                    dep = a
                elif cls is NodeOutput:
                    dep = a.node
                else:
                    if (cls is list or cls is tuple) and a:
                        _push_missing(a, node, push)
                    continue
                if (dep.value is None and (dep.kept is None or not kept_for(dep, node))) \
                        or dep.mutated_by is not None:
                    push(dep)
            if node.kwargs:
                _push_missing(node.kwargs.values(), node, push)
            if len(stack) != height:
                continue
            del stack[-2:]  # every input there: replay now
        node.value = _replay(node)
        if done is not None:
            done.append(node)
            continue
        # The node never needs its inputs again: dropping them frees ancestors whose
        # last consumer this was.
        node.args = node.kwargs = None
    if done:
        _count_down(done, target)
    return target.value


# On _materialize's stack above a node whose inputs are being recomputed.
_INPUTS_READY: Any = object()


def _push_missing(refs: Any, node: OpNode, push: Any) -> None:
    """``_materialize``'s step for references in a list or keyword arguments: push each
    node they read whose value is missing (or was mutated: its check raises)."""
    for a in refs:
        for x in (a if isinstance(a, (list, tuple)) else (a,)):
            if type(x) is OpNode or type(x) is NodeOutput:
                dep = ref_node(x)
                if (dep.value is None and (dep.kept is None or not kept_for(dep, node))) \
                        or dep.mutated_by is not None:
                    push(dep)


def _count_down(done: list[OpNode], target: OpNode) -> None:
    """Each node in ``done`` got its value: one use of each node it reads is spent."""
    last = []
    for node in done:
        for dep in node.deps:
            dep.spent += 1
            if dep.spent >= dep.uses:
                dep.spent = 0
                last.append(dep)
    for dep in last:
        if dep is not target:
            _release(dep)


def _live_forward_outputs(node: OpNode) -> list[Any] | None:
    """The forward's own outputs, if every one is still alive and unmutated: no need to
    recompute what the program still holds. Not when the recompute would read a value
    restored by ``SaveWithHooks``: a lossy pack (bf16) makes the recomputed value differ
    from the live one, and gradients must not depend on whether the caller still holds an
    output (the compiled split always recomputes through the hooks)."""
    values = []
    for facts in node.outs:
        if facts is None:
            values.append(None)
            continue
        t = facts[0]()
        if t is None or t._version != facts[1]:
            return None
        values.append(t)
    # Every output is alive (checked first: the walk below is the costlier test).
    if recomputes_through_hooks(node):
        return None
    node.versions = [f[1] if f is not None else None for f in node.outs]
    return [alias_for_saving(t) if t is not None else None for t in values]


def _restore_packed(node: OpNode) -> list[Any]:
    if node.mutated_by is not None:  # packed at region exit, after the region's mutation
        check_not_mutated(node)
    hooks = node.decision.hooks
    versions = node.versions
    if versions is not None:
        for i, p in enumerate(node.packed):
            if versions[i] is not None and p._version != versions[i]:
                raise mutated_after_region(node, i)
        node.versions = None
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


def _recomputed_value(node: OpNode, index: int) -> Any:
    if node.value is None and node.kept is not None:
        return unpack_kept(node, index)
    return _unpack_value(node, index)


class _LeafReader:
    """Reads the leaves of one replayed node, checking each was not modified since."""

    __slots__ = ("node",)

    def __init__(self, node: OpNode) -> None:
        self.node = node

    def __call__(self, leaf: LeafRef) -> torch.Tensor:
        if leaf.stale():
            raise stale_leaf(self.node, leaf)
        return leaf.value


def _resolve(a: Any, leaf_value: Any = None) -> Any:
    return map_refs(a, _recomputed_value, leaf_value)


def _copy_mutated(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return a.clone()
    if isinstance(a, (list, tuple)):
        return type(a)(x.clone() if isinstance(x, torch.Tensor) else x for x in a)
    return a


def _call(node: OpNode, info: Any, args: tuple, kwargs: dict) -> Any:
    if node.rng is None:
        return info.call(*args, **kwargs)
    gen, state = node.rng
    current = gen.get_state()
    gen.set_state(state)
    try:
        return info.call(*args, **kwargs)
    finally:
        gen.set_state(current)


_Tensor = torch.Tensor


def _replay(node: OpNode) -> list[Any]:
    # The recorded arguments with each reference replaced by its value now (map_refs,
    # inlined for the common plain reference: no call per argument).
    args = []
    read = None
    for a in node.args:
        cls = type(a)
        if cls is OpNode:  # output 0 of that node
            value = a.value
            if value is not None and a.versions is None:  # recomputed: nothing to check
                args.append(value[0])
            else:
                args.append(_recomputed_value(a, 0))
        elif cls is NodeOutput:
            dep = a.node
            value = dep.value
            if value is not None and dep.versions is None:
                args.append(value[a.index])
            else:
                args.append(_recomputed_value(dep, a.index))
        elif cls is LeafRef:
            if not a.snapshot and a.version is not None and a.value._version != a.version:
                raise stale_leaf(node, a)  # (LeafRef.stale, inlined)
            args.append(a.value)
        elif cls is list or cls is tuple:
            read = read or _LeafReader(node)
            args.append(_resolve(a, read))
        else:
            args.append(a)
    info = OP_INFO[id(node.op)]
    kwargs = {}
    if not node.kwargs and info.plain and len(node.outs) == 1:
        # The common op (as the recorder's fast path): call it, check its one output. (A
        # plain op draws no random numbers: the recorder gave it no generator state.)
        out = info.call(*args)
        facts = node.outs[0]
        if type(out) is _Tensor and facts is not None and out.shape == facts[2] \
                and out.dtype == facts[3] and not node.ctx.stats:
            return [out]
    else:
        if node.kwargs:
            read = read or _LeafReader(node)
            kwargs = {k: _resolve(v, read) for k, v in node.kwargs.items()}
        if info.mutated:
            # Replay writes into copies: saved values, leaves and module buffers stay intact.
            for i in info.mutated:
                if i >= 0 and i < len(args):
                    args[i] = _copy_mutated(args[i])
                else:
                    name = node.op._schema.arguments[i if i >= 0 else -1 - i].name
                    if name in kwargs:
                        kwargs[name] = _copy_mutated(kwargs[name])
        out = _call(node, info, args, kwargs)
    outputs = flat_outputs(out)
    if not info.mutated and not torch.is_grad_enabled() and any(
            o is None and f is not None for o, f in zip(outputs, node.outs)):
        # Some kernels return an output only with grad mode on (mkldnn_rnn_layer's
        # workspace, which its backward needs); replay the op as the forward ran it.
        with torch.enable_grad():
            outputs = flat_outputs(_call(node, info, args, kwargs))
    if len(outputs) < len(node.outs):
        outputs.extend(_mutated_outputs(node.op, args, kwargs, outputs, len(node.outs)))
    return _checked(node, outputs, args, kwargs)


def _checked(node: OpNode, outputs: list[Any], args: Any, kwargs: Any) -> list[Any]:
    """The replayed outputs, once each is checked against the forward's shape and dtype."""
    for i, (t, facts) in enumerate(zip(outputs, node.outs)):
        if facts is not None and (not isinstance(t, torch.Tensor) or t.shape != facts[2]
                                  or t.dtype != facts[3]):
            meta = facts[2:]
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else repr(t)
            raise CheckpointError(
                f"recomputing {node.describe()} gave output {i} as {got}, but the forward "
                f"produced {tuple(meta[0])} {meta[1]}: the region's ops are not deterministic "
                f"in shape or dtype. Make the policy save this op (MUST_SAVE)")
    if node.ctx.stats:  # (collecting stats only: FLOPs as the compiler counts them, once)
        from ..op_costs import op_flops
        flops = op_flops(node.op, args, kwargs, outputs)[0]
    for stats in node.ctx.stats:
        stats.recomputed_flops += flops
        stats.recomputed_ops.append(op_name(node.op))
        stats.recomputed_regions.append(node.frames[-1].name if node.frames else "")
        stats.track_replayed(outputs)
    return outputs


def _mutated_outputs(op: Any, args: tuple, kwargs: dict, outputs: list[Any],
                     n: int) -> list[Any]:
    extra = [m for m in mutated_tensors(args, kwargs, op, op_info(op))
             if not any(m is o for o in outputs)]
    return extra[: n - len(outputs)]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    current = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(current)


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
