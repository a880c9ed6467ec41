"""Our backends under names Dynamo knows: ``torch.compile(model, backend="sac_inductor")``.

Two names, for configurations that take a backend as a string (torchtitan's
``CompileConfig.backend``, Hugging Face's ``TrainingArguments(torch_compile_backend=...)``):

* ``"sac_inductor"``: :func:`~.backend.sac_backend`, Inductor with our partitioner;
  ``mode=`` and ``options=`` are Inductor's.
* ``"sac_aot_eager"``: AOTAutograd with our partitioner and no code generation (as torch's
  ``"aot_eager"``, it ignores ``mode``/``options`` with torch's log warning).

They reach Dynamo through the ``torch_dynamo_backends`` entry point in ``pyproject.toml``
(torch's ``_dynamo.backends.registry`` loads it on the first lookup of an unknown name), so
they work after ``pip install`` without importing sac_compile first. :func:`register`
adds them directly as well (``sac_compile.compiler`` calls it on import) for a checkout run
without installing (``PYTHONPATH=.``).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["BACKEND_NAMES", "register", "sac_aot_eager", "sac_inductor"]


def sac_inductor(gm: torch.fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Any:
    """``backend="sac_inductor"``: the same backend as ``sac_compile.sac_backend``."""
    from .backend import sac_backend
    return sac_backend(gm, example_inputs, **kwargs)


def sac_aot_eager(gm: torch.fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Any:
    """``backend="sac_aot_eager"``: ``make_backend(compiler="aot_eager")``, made once."""
    return _aot_eager()(gm, example_inputs, **kwargs)


_AOT_EAGER: list[Callable[..., Any]] = []


def _aot_eager() -> Callable[..., Any]:
    if not _AOT_EAGER:
        from .backend import make_backend
        _AOT_EAGER.append(make_backend(compiler="aot_eager"))
    return _AOT_EAGER[0]


#: name -> backend, as the entry points in pyproject.toml list them.
BACKEND_NAMES: dict[str, Callable[..., Any]] = {
    "sac_inductor": sac_inductor,
    "sac_aot_eager": sac_aot_eager,
}


def register() -> None:
    """Add our names to Dynamo's registry unless they are there already: registered before,
    or found as entry points (Dynamo then loads and registers them itself, and a second
    registration would be its "duplicate name" error; this module is imported by that very
    load). Idempotent."""
    from ..torch_internals import dynamo_backend_registered, register_dynamo_backend
    for name, fn in BACKEND_NAMES.items():
        if not dynamo_backend_registered(name):
            register_dynamo_backend(name, fn)
