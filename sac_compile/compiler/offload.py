"""CPU offload under compile through torch's activation-offloading pass, and the torch APIs
that the saved-value storage passes (:mod:`.storage`, :mod:`.save_hooks`) rely on.

Every torch API these passes use is gathered here from :mod:`sac_compile.torch_internals`
(:func:`torch_api` for offload, :func:`hooks_api` for save hooks), so that a torch without
one of them fails with one message naming it and the torch version needed
(``TorchAPIMissing``) instead of an ``ImportError`` deep in a compile. Offload needs torch
>= 2.12 (``torch.ops.ao``); save hooks run on every supported torch (>= 2.11).

Offload: the saved values whose decision offloads are marked ``should_offload`` in the
extracted forward module, then torch's ``enable_activation_offloading`` (from
``torch._functorch._activation_offloading``) checks them with its ``can_offload`` and
rewrites both graphs: ``ao.offload`` after the value's last forward use, ``ao.reload``
before its first backward use (``ao.wait_tensor`` after each). Its options are torch's
``torch._functorch.config`` flags; where the user has not set them, :data:`DEFAULTS` apply:
the copies run on a side stream, the forward's waits are sunk to the end of the forward
graph and reloads are prefetched (torch's transfer-time estimate). The async path needs an
accelerator at run time; the values it moves are on one.
"""
from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx

from .. import torch_internals
from ..torch_internals import TORCH_VERSION, TorchAPIMissing, config_default
from .. import graph_meta

__all__ = ["TorchAPIMissing", "torch_api", "hooks_api", "DEFAULTS", "offload_options",
           "refusal", "apply_offload"]

# torch._functorch.config flag -> our default when the user left torch's default.
DEFAULTS: dict[str, bool] = {
    "activation_offload_separate_stream": True,   # ao.offload/ao.reload on a side stream
    # Not sunk: a value leaves the device as soon as its copy is done. Sunk to the end of
    # the forward, every offloaded value stays on the device until then - no peak saved
    # when the whole forward is one graph (576 of 705 MiB held on the benchmark's GPT).
    "activation_offload_sink_wait": False,
    "activation_reload_prefetch": True,           # reloads moved earlier in the backward
}

# The oldest torch with each API set below: torch's async offload ops (torch.ops.ao.*) first
# shipped in 2.12 (2.11's pass moves values with prims.device_put and streams ops); the
# save-hook APIs are in 2.11, the oldest torch the package supports.
_OFFLOAD_NEEDS = "2.12"
_HOOKS_NEEDS = "2.11"


@dataclasses.dataclass(frozen=True)
class HooksAPI:
    """What the save-hook pass uses (:mod:`.save_hooks`)."""
    fwd_only: Any            # torch._inductor.pattern_matcher.fwd_only (make_fx + decomps)
    select_decomp_table: Any
    extract_tensor_metadata: Any


@dataclasses.dataclass(frozen=True)
class TorchAPI(HooksAPI):
    """What the offload pass uses, besides :class:`HooksAPI`."""
    enable_activation_offloading: Any
    can_offload: Any
    offload_op: Any          # torch.ops.ao.offload.default
    reload_op: Any           # torch.ops.ao.reload.default
    wait_op: Any             # torch.ops.ao.wait_tensor.default
    functorch_config: Any


_API: list[TorchAPI] = []
_HOOKS_API: list[HooksAPI] = []


def _missing(where: str, feature: str, needs: str, e: BaseException) -> TorchAPIMissing:
    return TorchAPIMissing(where, needs, e, message=(
        f"sac_compile: torch {TORCH_VERSION} lacks {where}, which {feature} uses (it "
        f"needs torch >= {needs}); upgrade torch, or keep these values on the device with "
        f"MUST_SAVE/PREFER_SAVE ({type(e).__name__}: {e})"))


def hooks_api() -> HooksAPI:
    """The torch APIs SaveWithHooks under compile uses; :class:`TorchAPIMissing` naming the
    first one missing. (Not :func:`torch_api`: hooks need none of the offload pass.)"""
    if _HOOKS_API:
        return _HOOKS_API[0]
    try:
        api = HooksAPI(*(getattr(torch_internals, name) for name in
                         ("fwd_only", "select_decomp_table", "extract_tensor_metadata")))
    except TorchAPIMissing as e:
        raise _missing(e.where, "SaveWithHooks under torch.compile", _HOOKS_NEEDS,
                       e.error) from None
    _HOOKS_API.append(api)
    return _HOOKS_API[0]


def torch_api() -> TorchAPI:
    """The pinned torch APIs of CPU offload under compile; :class:`TorchAPIMissing` naming
    the first one missing and the torch it needs."""
    if _API:
        return _API[0]
    hooks = hooks_api()
    try:
        enable_activation_offloading = torch_internals.enable_activation_offloading
        can_offload = torch_internals.can_offload
        ops = torch_internals.offload_ops()
        functorch_config = torch_internals.functorch_config
    except TorchAPIMissing as e:
        raise _missing(e.where, "CPU offload under torch.compile", _OFFLOAD_NEEDS,
                       e.error) from None
    try:
        for flag in DEFAULTS:
            getattr(functorch_config, flag)
    except AttributeError as e:
        raise _missing("torch._functorch.config.activation_offload_* flags",
                       "CPU offload under torch.compile", _OFFLOAD_NEEDS, e) from None
    _API.append(TorchAPI(hooks.fwd_only, hooks.select_decomp_table,
                         hooks.extract_tensor_metadata, enable_activation_offloading,
                         can_offload, *ops, functorch_config))
    return _API[0]


def offload_options(device: torch.device | None = None,
                    overrides: dict[str, bool] | None = None) -> dict[str, bool]:
    """torch's offload flags as they apply: ``overrides`` (``SACPartitioner(
    offload_options=...)``), else the user's torch config where it differs from torch's
    default, else ours. Prefetching times the backward's compute ops by running them
    (torch's ``benchmark_node``), so it is off unless ``device`` is the available
    accelerator's."""
    cfg = torch_api().functorch_config
    overrides = overrides or {}
    unknown = sorted(set(overrides) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"offload_options: unknown flags {unknown}; expected some of "
                         f"{sorted(DEFAULTS)}")
    options = {flag: overrides.get(flag, value if value != config_default(cfg, flag)
                                   else default)
               for flag, default in DEFAULTS.items() for value in [getattr(cfg, flag)]}
    if options["activation_reload_prefetch"] and not _runnable(device):
        options["activation_reload_prefetch"] = False
    return options


def _runnable(device: torch.device | None) -> bool:
    try:
        acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() \
            else None
    except Exception:  # pragma: no cover - a torch without torch.accelerator
        return False
    return acc is not None and device is not None and acc.type == device.type


def refusal(fw_node: fx.Node, fwd_outputs: Iterable[fx.Node], num_fwd_outputs: int,
            static: set[fx.Node]) -> str | None:
    """Why torch's pass would not offload ``fw_node`` (None: it will). Asks torch's own
    ``can_offload``; the reason is ours (torch only logs it)."""
    api = torch_api()
    outs = list(fwd_outputs)
    from ..torch_internals import OrderedSet
    if api.can_offload(fw_node, OrderedSet(outs), OrderedSet(outs[:num_fwd_outputs]),
                       OrderedSet(static)):
        return None
    from ..cut import costs
    val = graph_meta.val(fw_node)
    if fw_node in outs[:num_fwd_outputs]:
        return "it is also an output of the compiled graph (the caller holds it)"
    if fw_node in static:
        return "it is a static input (a parameter or buffer)"
    if fw_node.target is operator.getitem:
        return ("it is one output of a multi-output op (torch's offload pass refuses "
                "getitems)")
    if costs.is_view(fw_node):
        return "it is a view (torch's offload pass refuses views)"
    if isinstance(val, torch.Tensor) and not val.is_contiguous():
        return "it is not contiguous (torch's offload pass refuses non-contiguous values)"
    return "torch's offload pass refuses it"


def apply_offload(fw: fx.GraphModule, bw: fx.GraphModule, names: list[str],
                  num_fwd_outputs: int, static_names: set[str],
                  overrides: dict[str, bool] | None = None) -> dict[str, bool]:
    """Mark the forward outputs named ``names`` ``should_offload`` and run torch's pass.
    Returns the options it ran with."""
    api = torch_api()
    wanted = set(names)
    for node in fw.graph.nodes:
        if node.name in wanted:
            graph_meta.set_should_offload(node)
    from ..torch_internals import OrderedSet
    static = OrderedSet(n for n in fw.graph.find_nodes(op="placeholder")
                        if n.name in static_names)
    device = next((graph_meta.val(n).device for n in fw.graph.nodes if n.name in wanted
                   and isinstance(graph_meta.val(n), torch.Tensor)), None)
    options = offload_options(device, overrides)
    with api.functorch_config.patch(options):
        api.enable_activation_offloading(fw, bw, num_fwd_outputs, static)
    for node in fw.graph.nodes:
        graph_meta.clear_should_offload(node)
    fw.recompile()
    bw.recompile()
    return options
