"""The partitioner's options: one validated, documented value.

:class:`PartitionerConfig` holds what :class:`~sac_compile.compiler.SACPartitioner` takes
(and ``make_backend`` passes through), :class:`OffloadOptions` torch's activation-offload
flags. Both are frozen dataclasses, as torchtitan's activation-checkpointing ``Config``: a
wrong type or value is a ``TypeError``/``ValueError`` naming the field and what it takes
when the value is built, not a surprise at the first compile; the value hashes, compares
and pickles by its fields, and its ``repr`` is part of the partitioner's cache key
(``SACPartitioner.uuid``).

The keyword API builds them (``SACPartitioner(memory_budget=0.5, offload_options={...})``):
:meth:`PartitionerConfig.from_kwargs`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Union

from ..budgets import PeakBudget, check_budget
from ..cut.network import CostModel

__all__ = ["PartitionerConfig", "OffloadOptions", "SOLVERS"]

#: What ``solver`` may name (None: scipy's compiled Dinic when scipy is installed, else
#: networkx).
SOLVERS = (None, "scipy", "networkx")


def _check_flag(owner: str, name: str, value: Any, *, optional: bool) -> None:
    if isinstance(value, bool) or (optional and value is None):
        return
    allowed = "True, False or None (None: as torch's config says)" if optional \
        else "True or False"
    raise TypeError(f"{name} must be {allowed}, got {value!r} of type "
                    f"{type(value).__name__} ({owner}.{name})")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OffloadOptions:
    """torch's activation-offload flags (``torch._functorch.config``) for one partitioner,
    used where a policy offloads values (``*_CPU_OFFLOAD``) under compile. ``None`` leaves a
    flag as the user's torch config sets it, or, where that is torch's default, as
    :data:`sac_compile.compiler.offload.DEFAULTS` says."""

    activation_offload_separate_stream: Union[bool, None] = None
    """Copies to and from the host on a side stream (ours: True)."""

    activation_offload_sink_wait: Union[bool, None] = None
    """Sink the forward's offload waits to the end of the forward graph (ours: False: a
    value leaves the device as soon as its copy is done; sunk, every offloaded value stays
    until the forward ends)."""

    activation_reload_prefetch: Union[bool, None] = None
    """Move reloads earlier in the backward, by torch's transfer-time estimate (ours: True;
    off unless the graph runs on the available accelerator)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _check_flag("OffloadOptions", f.name, getattr(self, f.name), optional=True)

    @classmethod
    def coerce(cls, value: Any) -> OffloadOptions:
        """``None``, an :class:`OffloadOptions`, or a dict of flag names to bools (the
        keyword form): an :class:`OffloadOptions`, checked."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise TypeError(f"offload_options must be an OffloadOptions or a dict of flag "
                            f"names to True/False, got {value!r} of type "
                            f"{type(value).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(str(k) for k in value if k not in names)
        if unknown:
            raise ValueError(f"offload_options: unknown flags {unknown}; expected some of "
                             f"{sorted(names)}")
        for name, flag in value.items():
            _check_flag("offload_options", name, flag, optional=False)
        return cls(**value)

    def overrides(self) -> dict[str, bool]:
        """The flags set here (not None), by torch's names."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None}


@dataclasses.dataclass(frozen=True, kw_only=True)
class PartitionerConfig:
    """What :class:`~sac_compile.compiler.SACPartitioner` splits a joint graph with.
    (``on_partition``, a callback rather than an option, stays the partitioner's.)"""

    memory_budget: Union[float, int, str, PeakBudget, None] = None
    """A float in (0, 1]: a fraction of the activation bytes each split saves without a
    budget; an int >= 2 or a string such as ``"64MiB"``: bytes per split (inputs and
    parameters are not counted). None: no budget. Read by
    :func:`sac_compile.budgets.check_budget` (a string is stored as its bytes). A
    :class:`~sac_compile.budgets.PeakBudget` (the same forms inside) caps the step's
    modelled peak (the split's forward, or its backward with the gradients it makes)
    instead of its kept bytes."""

    solver: Union[str, None] = None
    """The min-cut solver: ``"scipy"`` (compiled Dinic), ``"networkx"``, or None (scipy when
    installed, else networkx)."""

    cost_model: CostModel = CostModel()
    """The objective's weights (:class:`sac_compile.cut.network.CostModel`)."""

    cse: bool = False
    """Run torch's FX common-subexpression elimination first, as upstream's partitioner
    does."""

    delegate_untagged: bool = True
    """Hand a joint graph without any region to torch's partitioner unchanged (upstream's
    behaviour for untagged code); False splits it with our min-cut too."""

    offload: OffloadOptions = OffloadOptions()
    """torch's activation-offload flags (:class:`OffloadOptions`); the keyword API's
    ``offload_options`` dict builds it."""

    def __post_init__(self) -> None:
        if not isinstance(self.memory_budget, PeakBudget):
            object.__setattr__(self, "memory_budget", check_budget(self.memory_budget))
        if self.solver not in SOLVERS:
            raise ValueError(f"solver must be 'scipy', 'networkx' or None, got "
                             f"{self.solver!r} (PartitionerConfig.solver)")
        if not isinstance(self.cost_model, CostModel):
            raise TypeError(f"cost_model must be a sac_compile.cut.network.CostModel, got "
                            f"{self.cost_model!r} of type {type(self.cost_model).__name__} "
                            f"(PartitionerConfig.cost_model)")
        for name in ("cse", "delegate_untagged"):
            _check_flag("PartitionerConfig", name, getattr(self, name), optional=False)
        if not isinstance(self.offload, OffloadOptions):
            raise TypeError(f"PartitionerConfig.offload must be an OffloadOptions (or pass "
                            f"offload_options={{...}} to SACPartitioner), got "
                            f"{self.offload!r}")

    @classmethod
    def from_kwargs(cls, *, cost_model: CostModel | None = None,
                    offload_options: Any = None, **kwargs: Any) -> PartitionerConfig:
        """The keyword API (``SACPartitioner(...)``, ``make_backend(...)``): ``cost_model=None``
        is the default model, ``offload_options`` a dict (or an :class:`OffloadOptions`)."""
        if cost_model is not None:
            kwargs["cost_model"] = cost_model
        return cls(offload=OffloadOptions.coerce(offload_options), **kwargs)
