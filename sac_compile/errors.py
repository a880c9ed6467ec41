"""The library's errors, one module below everything that raises them.

* :class:`CheckpointError` - checkpointing misuse; the message names the op, the region and
  the fix. A subclass of torch's ``CheckpointError``, so code that catches torch's catches
  ours.
* :class:`CompiledCheckpointError` - the same error raised while compiling. Dynamo wraps what
  a backend raises into ``BackendCompilerFailed``, except ``ShortenTraceback`` subclasses:
  an error that is both reaches the user with its type and message, as in eager mode.
  Raised by both engines' shared code (the cut, budgets) when it runs under compile.
* :class:`BudgetUnreachableError` - a memory budget below what the region (or the split, or
  the model) can keep. Besides the message, fields a program can act on: the budget
  given, the least bytes reachable and ``proposed_budget``, a valid budget that is met.
"""
from __future__ import annotations

import torch.utils.checkpoint as _torch_checkpoint

from .torch_internals import ShortenTraceback

from typing import Union

__all__ = ["CheckpointError", "CompiledCheckpointError", "BudgetUnreachableError",
           "reraise_compiled"]


class CheckpointError(_torch_checkpoint.CheckpointError):
    """Raised for checkpointing misuse; the message names the op, the region and the fix."""


class CompiledCheckpointError(CheckpointError, ShortenTraceback):
    """A :class:`CheckpointError` raised while compiling; same message as in eager."""

    def __init__(self, msg: str) -> None:
        ShortenTraceback.__init__(self, msg, first_useful_frame=None)


class BudgetUnreachableError(CompiledCheckpointError):
    """A memory budget that cannot be met, with what to pass instead.

    ``budget``: the value given (a fraction or bytes); ``least_bytes``: the fewest device
    bytes of activations reachable; ``unconstrained_bytes``: what is kept without a
    budget; ``proposed_budget``: a value :func:`~sac_compile.budgets.check_budget` accepts,
    of the kind given (a fraction in (0, 1], or bytes as an int >= 2), that is met; rerun
    with ``memory_budget=e.proposed_budget``. The message says the same in words. For a
    :class:`~sac_compile.budgets.PeakBudget` the figures are modelled peaks: ``least_bytes``
    the least found, ``unconstrained_bytes`` the split's without a budget, and
    ``proposed_budget`` a ``PeakBudget`` of the same form."""

    def __init__(self, msg: str, *, budget: Union[float, int], least_bytes: int,
                 unconstrained_bytes: int, proposed_budget: Union[float, int]) -> None:
        super().__init__(msg)
        self.budget = budget
        self.least_bytes = least_bytes
        self.unconstrained_bytes = unconstrained_bytes
        self.proposed_budget = proposed_budget

    def prefixed(self, prefix: str) -> BudgetUnreachableError:
        """The same error, its message after ``prefix`` (which region, which mode)."""
        return BudgetUnreachableError(
            prefix + str(self), budget=self.budget, least_bytes=self.least_bytes,
            unconstrained_bytes=self.unconstrained_bytes, proposed_budget=self.proposed_budget)

    def __reduce__(self):  # type: ignore[no-untyped-def]  (keyword fields: pickle them)
        return (_rebuild_unreachable, (str(self), self.budget, self.least_bytes,
                                       self.unconstrained_bytes, self.proposed_budget))


def _rebuild_unreachable(msg: str, budget: Union[float, int], least: int, unconstrained: int,
                         proposed: Union[float, int]) -> BudgetUnreachableError:
    return BudgetUnreachableError(msg, budget=budget, least_bytes=least,
                                  unconstrained_bytes=unconstrained, proposed_budget=proposed)


def reraise_compiled(e: CheckpointError) -> None:
    """Raise ``e`` as a :class:`CompiledCheckpointError` (as it is, if it is one)."""
    if isinstance(e, CompiledCheckpointError):
        raise e
    raise CompiledCheckpointError(str(e)) from None
