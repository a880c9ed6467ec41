"""``sac_region`` on an ``nn.Module`` instance: the region configuration a module
carries, and the class swap that runs its forward as the region.

Wrapping an ``nn.Module`` instance: class swapping
--------------------------------------------------
``sac_region(policy)(module)`` changes ``module.__class__`` to a subclass of its class,
created once per class (``SACRegion<Name>``), whose ``forward`` runs the class's forward as
the region; the region's configuration (:class:`RegionConfig`: policy, name,
``allow_cache_entry_mutation``) is an instance attribute, ``module._sac_regions``. This is
how ``torch.distributed.fsdp.fully_shard`` adds behaviour to a module. We chose it over a
wrapper module (``checkpoint_wrapper``) and over the former instance attribute
``module.forward = closure`` because:

* the module stays the same object: ``isinstance(module, type(original))`` holds,
  ``state_dict`` keys are unchanged (a wrapper module adds a prefix), parent modules,
  optimizers and hooks that refer to it need no update;
* everything of the region lives on the instance, so ``copy.deepcopy`` copies it with the
  parameters: a copy computes with *its* parameters (a closure over the original's bound
  forward computed with the original's, and sent gradients there);
* pickling (``torch.save``) works: :meth:`_RegionModule.__reduce_ex__` pickles the module as
  its own class and swaps the class back on load (the dynamic class cannot be pickled by
  reference). A policy that pickle cannot store (a lambda, a local function) raises
  :class:`CheckpointError` naming the region and the fix when pickling;
* it composes with ``fully_shard`` in either order (both are classes in the MRO; FSDP's
  hooks run around our ``forward``) and with ``torch.compile`` (dynamo inlines the forward).

Wrapping an already wrapped module again nests: the new region is the *outer* one, exactly
as decorating an already decorated function. Constructing a new instance of the swapped
class (``type(module)(...)``, as ``nn.Sequential`` slicing does) gives a plain, unwrapped
instance of the original class, as fully_shard does. A ``forward`` that was assigned on the
instance before wrapping (a monkeypatch) is the one that runs inside the region.
"""
from __future__ import annotations

import copyreg
import functools
import pickle
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .policy import CheckpointError, PolicyLike, RegionFrame, normalize_policy
from .region_groups import frame_in_group, name_module
from .region_run import run_region
from .torch_internals import OpOverload, OpOverloadPacket

__all__ = ["RegionConfig", "wrap_module", "module_class"]


# --------------------------------------------------------------------------------------
# Region configuration (what a wrapped module carries)
# --------------------------------------------------------------------------------------

class RegionConfig:
    """One region of a wrapped module: the policy as given (``spec``), its frame (name and
    normalised policy) and ``allow_cache_entry_mutation``. Immutable: copies of a module
    share it; pickling stores the policy as given and normalises it again on load."""

    __slots__ = ("spec", "frame", "allow_cache_entry_mutation")

    def __init__(self, spec: PolicyLike, frame: RegionFrame,
                 allow_cache_entry_mutation: bool) -> None:
        object.__setattr__(self, "spec", spec)
        object.__setattr__(self, "frame", frame)
        object.__setattr__(self, "allow_cache_entry_mutation", allow_cache_entry_mutation)

    def __setattr__(self, attr: str, value: Any) -> None:
        raise AttributeError("RegionConfig is immutable; wrap the module again instead")

    def __copy__(self) -> RegionConfig:
        return self

    def __deepcopy__(self, memo: dict) -> RegionConfig:
        return self

    def __reduce__(self) -> Any:
        spec = _portable_policy(self.spec)
        try:
            pickle.dumps(spec)
        except Exception as e:
            raise CheckpointError(
                f"cannot pickle the policy {self.spec!r} of region {self.frame.name!r} "
                f"({type(e).__name__}: {e}). A wrapped module (or a sac_region) is pickled "
                f"with its region's policy; make it picklable: a module-level function (not a "
                f"lambda or a local function), functools.partial of one, a list of ops, or a "
                f"preset name such as 'save_matmuls'") from e
        return (_restore_config, (spec, self.frame.name, self.allow_cache_entry_mutation,
                                  self.frame.budget))

    def __repr__(self) -> str:
        return (f"RegionConfig({self.frame.name!r}, policy={self.frame.policy!r}, "
                f"allow_cache_entry_mutation={self.allow_cache_entry_mutation})")


def _make_config(policy: PolicyLike, name: str, allow: bool, budget: Any = None
                 ) -> RegionConfig:
    return RegionConfig(policy, frame_in_group(name, normalize_policy(policy), allow,
                                               budget=budget), allow)


def _restore_config(spec: Any, name: str, allow: bool, budget: Any = None) -> RegionConfig:
    return _make_config(_resolve_policy(spec), name, allow, budget)


class _OpRef:
    """An ATen op by name, for pickling (OpOverloads themselves cannot be pickled)."""

    def __init__(self, qualified: str, overload: str | None) -> None:
        self.qualified, self.overload = qualified, overload

    def resolve(self) -> Any:
        namespace, op = self.qualified.split("::", 1)
        packet = getattr(getattr(torch.ops, namespace), op)
        return packet if self.overload is None else getattr(packet, self.overload)


def _portable_policy(spec: Any) -> Any:
    """``spec`` in a form the standard pickle can store: preset objects by name, ATen ops
    in a list by their names."""
    from . import policies
    for preset_name, preset in policies.PRESETS.items():
        if spec is preset:
            return preset_name
    if isinstance(spec, (list, tuple, set, frozenset)):
        out = []
        for op in spec:
            if isinstance(op, OpOverload):
                op = _OpRef(op._schema.name, op._overloadname)
            elif isinstance(op, OpOverloadPacket):
                op = _OpRef(op._qualified_op_name, None)
            out.append(op)
        return type(spec)(out) if not isinstance(spec, list) else out
    return spec


def _resolve_policy(spec: Any) -> Any:
    if isinstance(spec, (list, tuple, set, frozenset)):
        ops = [op.resolve() if isinstance(op, _OpRef) else op for op in spec]
        return type(spec)(ops) if not isinstance(spec, list) else ops
    return spec


# --------------------------------------------------------------------------------------
# Module wrapping by class swap
# --------------------------------------------------------------------------------------

class _RegionModule:
    """Mixin placed first in the MRO of a wrapped module's class (see the module docstring)."""

    _sac_regions: tuple[RegionConfig, ...]  # set per instance, outermost first
    _sac_inner_forward: Any = None  # an instance-assigned forward found when wrapping

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # A new instance (nn.Sequential slicing builds ``type(self)(...)``) is a plain,
        # unwrapped instance of the original class, as with fully_shard.
        return cls.__dict__["_sac_base"](*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        inner = self._sac_inner_forward
        if inner is None:
            inner = super().forward  # type: ignore[misc]
        return _run_regions(self._sac_regions, inner, *args, **kwargs)

    # Marks this function for _region_name (dynamo's ``is`` does not compare functions).
    forward._sac_region_forward = True  # type: ignore[attr-defined]

    def __prepare_scriptable__(self) -> Any:
        # torch.jit.script calls this first: a region is a Python runtime (a dispatch mode
        # and saved-tensor hooks), which TorchScript cannot compile.
        raise TypeError(
            f"torch.jit.script cannot compile the sac_region {self._sac_regions[0].frame.name!r}: "
            f"a region runs a Python runtime (a dispatch mode and saved-tensor hooks) that "
            f"TorchScript cannot represent. Script the module without sac_region, or use "
            f"torch.compile(model, backend=sac_compile.sac_backend), which keeps the region")

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A copy (copy.deepcopy) or a loaded module: its regions' names are found again by
        # this module, as the original's are (region_groups.name_in_graph), so a copy
        # compiled whole reports and budgets each block by its own name.
        super().__setstate__(state)  # type: ignore[misc]
        for config in self.__dict__.get("_sac_regions", ()):
            name_module(self, config.frame.name)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Pickled as the original class (which pickle finds by name); the class is
        # swapped back on load. The region config travels in the instance's state.
        func, args, *rest = super().__reduce_ex__(protocol)  # type: ignore[misc]
        cls = type(self)
        if func is copyreg.__newobj__ and args and args[0] is cls:
            return (_new_region_module, (cls.__dict__["_sac_base"], *args[1:]), *rest)
        if func is copyreg.__newobj_ex__ and args and args[0] is cls:
            return (_new_region_module_ex, (cls.__dict__["_sac_base"], *args[1:]), *rest)
        return (_rewrap_module, (func, args), *rest)  # the class's own __reduce__


def _run_regions(configs: tuple[RegionConfig, ...], fn: Callable[..., Any], *args: Any,
                 **kwargs: Any) -> Any:
    config, rest = configs[0], configs[1:]
    body = functools.partial(_run_regions, rest, fn) if rest else fn
    return run_region(config.frame, body, args, kwargs, config.allow_cache_entry_mutation)


_REGION_CLASSES: dict[type, type] = {}
_REGION_CLASSES_LOCK = threading.Lock()


def _region_class(cls: type) -> type:
    """The swapped class for ``cls``, created once per class."""
    with _REGION_CLASSES_LOCK:
        new = _REGION_CLASSES.get(cls)
        if new is None:
            new = type(f"SACRegion{cls.__name__}", (_RegionModule, cls),
                       {"_sac_base": cls,
                        "__doc__": f"{cls.__qualname__} whose forward is a sac_region "
                                   f"(created by sac_compile.sac_region)."})
            _REGION_CLASSES[cls] = new
        return new


def _new_region_module(base: type, *args: Any) -> Any:
    return base.__new__(_region_class(base), *args)


def _new_region_module_ex(base: type, args: tuple, kwargs: dict) -> Any:
    return base.__new__(_region_class(base), *args, **kwargs)


def _rewrap_module(func: Callable[..., Any], args: tuple) -> Any:
    module = func(*args)
    if not isinstance(module, _RegionModule):
        module.__class__ = _region_class(type(module))
    return module


def wrap_module(module: nn.Module, config: RegionConfig) -> nn.Module:
    name_module(module, config.frame.name)
    if isinstance(module, _RegionModule):
        # Wrapped again: the new region encloses the existing ones (outermost first).
        object.__setattr__(module, "_sac_regions", (config, *module._sac_regions))
        return module
    patched = module.__dict__.pop("forward", None)
    if patched is not None:
        object.__setattr__(module, "_sac_inner_forward", patched)
    object.__setattr__(module, "_sac_regions", (config,))
    module.__class__ = _region_class(type(module))
    return module


def module_class(module: nn.Module) -> type:
    """The user's class of ``module``, under our class swap and fully_shard's."""
    cls = type(module)
    while True:
        if issubclass(cls, _RegionModule) and "_sac_base" in cls.__dict__:
            cls = cls.__dict__["_sac_base"]
        elif getattr(cls, "_orig_cls_mro_index", None) is not None and \
                len(cls.__mro__) > cls._orig_cls_mro_index:
            # fully_shard/replicate: FSDP<Orig> -> Orig (the index torch keeps for __new__)
            cls = cls.__mro__[cls._orig_cls_mro_index]
        else:
            return cls
