"""sac_compile: selective activation checkpointing, one system in eager mode and under
``torch.compile``. Write a policy once; get the same decisions in both modes."""
from . import policies
from .policy import CheckpointError, CheckpointPolicy, PolicyContext, SaveWithHooks
from .regions import checkpoint, name, sac_region, tag

__all__ = ["CheckpointError", "CheckpointPolicy", "PolicyContext", "SaveWithHooks", "checkpoint",
           "name", "policies", "sac_region", "tag"]
__version__ = "0.1.0"
