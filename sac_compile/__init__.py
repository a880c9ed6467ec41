"""sac_compile: selective activation checkpointing, one system in eager mode and under
``torch.compile``. Write a policy once; get the same decisions in both modes.

The public surface::

    CheckpointPolicy, CheckpointError, SaveWithHooks, PolicyContext   # decisions
    BudgetUnreachableError        # a memory budget out of reach, with a budget that is met
    PeakBudget                    # memory_budget=PeakBudget("2GiB"): cap the step's peak
    sac_region, checkpoint, apply_regions, tag, name                   # where they apply
    policies, per_call                                # presets that compose; per-call state
    sac_backend, make_backend, SACPartitioner                          # torch.compile
    explain, PartitionReport, SavedTensorRecord                        # what was decided, why
"""
from typing import Any

from . import logs, policies  # logs: honours SAC_COMPILE_LOGS for every user, CLI or not
from .budgets import PeakBudget
from .errors import BudgetUnreachableError
from .policy import CheckpointError, CheckpointPolicy, PolicyContext, SaveWithHooks
from .per_call import per_call
from .regions import apply_regions, checkpoint, name, sac_region, tag

# The compiler side imports torch._dynamo and Inductor: loaded on first use, so eager-only
# users do not pay for it at import time.
_LAZY = {
    "sac_backend": ".compiler",
    "make_backend": ".compiler",
    "SACPartitioner": ".compiler",
    "explain": ".explaining",
    "PartitionReport": ".report",
    "SavedTensorRecord": ".report",
}


def __getattr__(attr: str) -> Any:
    module = _LAZY.get(attr)
    if module is None:
        raise AttributeError(f"module 'sac_compile' has no attribute {attr!r}")
    import importlib
    value = getattr(importlib.import_module(module, __name__), attr)
    globals()[attr] = value
    return value


__all__ = ["BudgetUnreachableError", "CheckpointError", "CheckpointPolicy", "PeakBudget",
           "PolicyContext", "SaveWithHooks", "apply_regions", "checkpoint",
           "logs", "name", "per_call", "policies", "sac_region", "tag", *_LAZY]
__version__ = "0.1.0"
