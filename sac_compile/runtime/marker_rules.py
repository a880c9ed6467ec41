"""The compiler's ``tag()``/``name()`` marker ops under the eager runtime.

When torch's checkpoint op runs eagerly (a backend without AOTAutograd runs Dynamo's graph
as it is), the markers in that graph run under the runtime's recorder: they are applied as
eager ``tag()``/``name()`` are (the same opinions, the same errors, the same hooks), then
recorded as the identity ops they are. Registered when the runtime is imported.
"""
from __future__ import annotations

from typing import Any

from ..markers import decode_opinion, name_op, tag_op
from ..policy import CheckpointError, foreign_tensor_message
from .record import RegionRecorder

__all__ = ["register"]


def _rule(what: str) -> Any:
    def apply(recorder: RegionRecorder, func: Any, types: Any, args: tuple = (),
              kwargs: Any = None) -> Any:
        tensor, arg = args
        if what == "tag":
            found = recorder.redecide(tensor, tag=decode_opinion(arg))
        else:
            found = recorder.redecide(tensor, label=arg)
        if not found:
            raise CheckpointError(foreign_tensor_message(f"{what}()", recorder.frames[-1].name))
        return recorder.__torch_dispatch__(func, types, args, kwargs or {})
    return apply


def register() -> None:
    tag_op.register_torch_dispatch(RegionRecorder, _rule("tag"))
    name_op.register_torch_dispatch(RegionRecorder, _rule("name"))
