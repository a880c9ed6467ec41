"""The gradients a run is checked by: one step without checkpointing from a seed
(:func:`reference_grads`), the gradients of parameters and inputs as a dict
(:func:`grads_of`), and the largest difference between two such dicts (:func:`max_grad_diff`).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
from torch import Tensor

__all__ = ["loss_fn", "reference_grads", "grads_of", "clear_grads", "max_grad_diff"]


def loss_fn(out: Tensor) -> Tensor:
    """The fixtures' loss: the sum of the output (the model's head makes it non-trivial)."""
    return out.sum()


def grads_of(model: nn.Module, inputs: tuple[Tensor, ...]) -> dict[str, Tensor]:
    """Detached copies of the current ``.grad`` of parameters (``"param:<name>"``) and of
    inputs that require grad (``"input:<i>"``); missing grads are left out."""
    out: dict[str, Tensor] = {}
    for pname, p in model.named_parameters():
        if p.grad is not None:
            out[f"param:{pname}"] = p.grad.detach().clone()
    for i, t in enumerate(inputs):
        if isinstance(t, Tensor) and t.requires_grad and t.grad is not None:
            out[f"input:{i}"] = t.grad.detach().clone()
    return out


def clear_grads(model: nn.Module, inputs: tuple[Tensor, ...]) -> None:
    """Set ``.grad`` of the model's parameters and of the inputs that require grad to None."""
    for p in model.parameters():
        p.grad = None
    for t in inputs:
        if isinstance(t, Tensor) and t.requires_grad:
            t.grad = None


def reference_grads(model: nn.Module, inputs: tuple[Tensor, ...], seed: int = 0, *,
                    loss: Callable[[Tensor], Tensor] = loss_fn,
                    forward: Callable[..., Tensor] | None = None) -> dict[str, Tensor]:
    """One forward+backward without checkpointing, from ``torch.manual_seed(seed)``.

    Returns the parameter and input gradients (see :func:`grads_of`). ``.grad`` of the model
    and the inputs is cleared before and after, so calls do not accumulate. Like any training
    step it updates BatchNorm running stats; pass a ``copy.deepcopy`` of the model if the
    buffers matter. ``forward`` (default ``model``) lets a caller run a wrapped forward with
    the same bookkeeping, e.g. ``reference_grads(m, x, 0, forward=checkpointed_forward)``.
    """
    fwd = model if forward is None else forward
    clear_grads(model, inputs)
    torch.manual_seed(seed)
    loss(fwd(*inputs)).backward()
    grads = grads_of(model, inputs)
    clear_grads(model, inputs)
    return grads


def max_grad_diff(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    """Largest absolute difference over the gradients of two :func:`grads_of` dicts.

    A key present in only one of them is an error (a gradient that went missing)."""
    if a.keys() != b.keys():
        raise KeyError(f"gradient sets differ: only in first {sorted(a.keys() - b.keys())}, "
                       f"only in second {sorted(b.keys() - a.keys())}")
    worst = 0.0
    for key in a:
        worst = max(worst, (a[key].float() - b[key].float()).abs().max().item())
    return worst
