"""``tag()`` and ``name()`` under compile: identity marker ops, folded away by the
compiler's :mod:`~sac_compile.compiler.normalize` (under an eager-run checkpoint op, the
eager runtime applies them: :mod:`sac_compile.runtime.marker_rules`).

``tag(t, opinion)`` and ``name(t, label)`` while Dynamo traces become the identity ops
``sac_compile::tag_marker`` / ``sac_compile::name_marker`` (no graph break); the opinion
travels as a string argument of the op (:func:`encode_opinion`), so it is part of Dynamo's
graph, hence of AOTAutograd's cache key.

A ``SaveWithHooks`` opinion cannot be a graph argument: it is registered here, for the
process, and the string names it (``SaveWithHooks:<digest>`` when its ``pack`` and
``unpack`` have a stable identity - module-level functions, or a ``cache_hash`` attribute,
by the rules of :func:`sac_compile.policy_identity.hooks_key` - else ``SaveWithHooks@<n>``, unique in the
process). :func:`decode_opinion` gives the registered object back, so the decision of the
tagged value carries the hooks exactly as a policy's ``SaveWithHooks`` does, and the
storage pass traces them into the graphs. A region whose graph holds a tag with hooks of
no stable identity bypasses AOTAutograd's cache (:func:`sac_compile.compiler.cache_keys.annotate_regions`), as
a region whose policy has none does.
"""
from __future__ import annotations

import hashlib
import itertools
import operator
import threading
from typing import Any

import torch
import torch.fx as fx

from .policy import CheckpointError, CheckpointPolicy, Opinion, SaveWithHooks
from .torch_internals import ID_GUARDS_FUNCTIONS

__all__ = ["encode_opinion", "decode_opinion", "tag_op", "name_op", "TAG_OP", "NAME_OP",
           "MARKER_OPS", "marker_producer", "HOOKS_PREFIX", "register_hooks",
           "hooks_of_text", "stable_hooks_text", "is_stable_text"]

#: Every encoded ``SaveWithHooks`` starts with it.
HOOKS_PREFIX = "SaveWithHooks"
_STABLE = HOOKS_PREFIX + ":"    # + a digest of the hooks' stable identity
_UNSTABLE = HOOKS_PREFIX + "@"  # + a number unique in the process

_lock = threading.Lock()
_hooks_by_text: dict[str, SaveWithHooks] = {}
# (id(pack), id(unpack)) -> (hooks, text). Holds the functions, so their ids are never
# reused while registered: one entry per distinct pair a tag() was traced with (per trace,
# not per step).
_text_by_ids: dict[tuple[int, int], tuple[SaveWithHooks, str]] = {}
_numbers = itertools.count()


def encode_opinion(opinion: Opinion) -> str:
    """The marker's string for ``opinion``: a CheckpointPolicy's name, or the registered
    name of a ``SaveWithHooks``."""
    if isinstance(opinion, SaveWithHooks):
        # Its functions, not the object: Dynamo cannot hand over a SaveWithHooks built in
        # the traced code (``tag(h, SaveWithHooks(pack, unpack))``), but can its functions.
        pack, unpack = opinion.pack, opinion.unpack
        # Under Dynamo, id() guards each function that lives outside the traced code by
        # identity (its own guard on a function checks only the code, the same for two
        # closures over different dtypes): other hooks recompile, as another policy does.
        _ = id(pack), id(unpack)
        if not ID_GUARDS_FUNCTIONS:
            # torch < 2.13: id() guards an object by identity, not a function; guard the
            # SaveWithHooks (another one recompiles, even with the same functions).
            _ = id(opinion)
        return _hooks_text(pack, unpack)
    return opinion.name


@torch.compiler.assume_constant_result
def _hooks_text(pack: Any, unpack: Any) -> str:
    # Run by Dynamo at trace time on the real functions: the result is a constant of the
    # graph (Dynamo's assume_constant_result).
    return register_hooks(SaveWithHooks(pack, unpack))


def register_hooks(hooks: SaveWithHooks) -> str:
    """Register ``hooks`` for :func:`decode_opinion`; returns the string that names it."""
    ident = (id(hooks.pack), id(hooks.unpack))
    with _lock:
        known = _text_by_ids.get(ident)
        if known is not None:
            return known[1]
        text = stable_hooks_text(hooks)
        if text is None:
            text = f"{_UNSTABLE}{next(_numbers)}"
        # Equal stable texts: the same pack and unpack code, so either one serves.
        _hooks_by_text.setdefault(text, hooks)
        _text_by_ids[ident] = (hooks, text)
        return text


def stable_hooks_text(hooks: SaveWithHooks) -> str | None:
    """``SaveWithHooks:<digest>`` of the hooks' identity in every process, or None."""
    from .policy_identity import hooks_key
    key = hooks_key(hooks)
    if key is None:
        return None
    return f"{_STABLE}{hashlib.sha256(key.encode()).hexdigest()[:24]}"


def is_stable_text(text: str) -> bool:
    """False for the string of a ``SaveWithHooks`` with no stable identity (its number means
    nothing in another process): a graph holding it must not be served from a cache."""
    return not text.startswith(_UNSTABLE)


def hooks_of_text(text: str) -> SaveWithHooks:
    hooks = _hooks_by_text.get(text)
    if hooks is None:
        raise CheckpointError(
            f"tag(..., SaveWithHooks) under compile: the hooks {text!r} of a tag() in this "
            f"graph are not registered in this process (the graph was traced in another "
            f"one); compile the model again in this process (torch._dynamo.reset()), or "
            f"return the SaveWithHooks from the region's policy")
    return hooks


def decode_opinion(text: str) -> Opinion:
    if text.startswith(HOOKS_PREFIX):
        return hooks_of_text(text)
    return CheckpointPolicy[text]


# --------------------------------------------------------------------------------------
# The marker ops
# --------------------------------------------------------------------------------------

def _identity_marker(name: str, doc: str) -> Any:
    """An identity custom op ``sac_compile::<name>(Tensor x, str text) -> Tensor`` (a clone,
    so FX keeps it; its gradient passes through)."""
    def marker(x: torch.Tensor, text: str) -> torch.Tensor:
        return x.clone()

    marker.__doc__ = doc
    op = torch.library.custom_op(f"sac_compile::{name}", mutates_args=())(marker)
    op.register_fake(lambda x, text: torch.empty_like(x))
    op.register_autograd(lambda ctx, grad: (grad, None))
    return op


tag_op = _identity_marker(
    "tag_marker", "Identity; ``text`` (:func:`encode_opinion`) is for the op that produced x.")
name_op = _identity_marker("name_marker", "Identity; labels the output of the op that "
                                          "produced x.")

TAG_OP = torch.ops.sac_compile.tag_marker.default
NAME_OP = torch.ops.sac_compile.name_marker.default
MARKER_OPS = frozenset({TAG_OP, NAME_OP})

# ``tag(y, ...)`` whose result is unused is still an opinion on y's producer (eager applies
# it): FX dead-code elimination (dynamo's, AOTAutograd's) must keep the marker. normalize
# removes every marker before the cut, so nothing of it reaches the compiled code.
for _op in (TAG_OP, NAME_OP, torch.ops.sac_compile.tag_marker, torch.ops.sac_compile.name_marker):
    fx.node.has_side_effect(_op)


def marker_producer(marker: fx.Node) -> fx.Node:
    """The node whose decision a tag()/name() marker is about: through other markers
    (``tag(name(y, ...), ...)``) and ``getitem`` to the op that produced the value."""
    src = marker.args[0]
    while src.target in MARKER_OPS:
        src = src.args[0]
    return src.args[0] if src.target is operator.getitem else src
