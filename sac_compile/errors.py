"""The library's errors, one module below everything that raises them.

* :class:`CheckpointError` - checkpointing misuse; the message names the op, the region and
  the fix. A subclass of torch's ``CheckpointError``, so code that catches torch's catches
  ours.
* :class:`CompiledCheckpointError` - the same error raised while compiling. Dynamo wraps what
  a backend raises into ``BackendCompilerFailed``, except ``ShortenTraceback`` subclasses:
  an error that is both reaches the user with its type and message, as in eager mode.
  Raised by both engines' shared code (the cut, budgets) when it runs under compile.
"""
from __future__ import annotations

import torch.utils.checkpoint as _torch_checkpoint

from .torch_internals import ShortenTraceback

__all__ = ["CheckpointError", "CompiledCheckpointError", "reraise_compiled"]


class CheckpointError(_torch_checkpoint.CheckpointError):
    """Raised for checkpointing misuse; the message names the op, the region and the fix."""


class CompiledCheckpointError(CheckpointError, ShortenTraceback):
    """A :class:`CheckpointError` raised while compiling; same message as in eager."""

    def __init__(self, msg: str) -> None:
        ShortenTraceback.__init__(self, msg, first_useful_frame=None)


def reraise_compiled(e: CheckpointError) -> None:
    """Raise ``e`` as a :class:`CompiledCheckpointError` (as it is, if it is one)."""
    if isinstance(e, CompiledCheckpointError):
        raise e
    raise CompiledCheckpointError(str(e)) from None
