"""The policy core: what a policy may be, what one op's decision is, and how the
opinions of nested regions and tags resolve into that decision.

Both the eager runtime and the compiler call :func:`decide`, so the same policy gives
the same decision in both modes.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Union

import torch
import torch.utils.checkpoint as _torch_checkpoint

from .errors import CheckpointError
from .op_names import expand_ops, op_names, op_qualname, resolve_op  # noqa: F401 (re-exported)

CheckpointPolicy = _torch_checkpoint.CheckpointPolicy

MUST_SAVE = CheckpointPolicy.MUST_SAVE
PREFER_SAVE = CheckpointPolicy.PREFER_SAVE
MUST_RECOMPUTE = CheckpointPolicy.MUST_RECOMPUTE
PREFER_RECOMPUTE = CheckpointPolicy.PREFER_RECOMPUTE
MUST_CPU_OFFLOAD = CheckpointPolicy.MUST_CPU_OFFLOAD
PREFER_CPU_OFFLOAD = CheckpointPolicy.PREFER_CPU_OFFLOAD

_MUSTS = frozenset({MUST_SAVE, MUST_RECOMPUTE, MUST_CPU_OFFLOAD})
_SAVES = frozenset({MUST_SAVE, PREFER_SAVE, MUST_CPU_OFFLOAD, PREFER_CPU_OFFLOAD})
_OFFLOADS = frozenset({MUST_CPU_OFFLOAD, PREFER_CPU_OFFLOAD})


@dataclasses.dataclass(frozen=True, eq=False)
class SaveWithHooks:
    """A policy result: save the op's output as ``pack(t)`` and restore it with ``unpack(packed)``.

    Each hook is called exactly once per saved tensor. It is a MUST decision: it beats
    PREFER opinions and conflicts with a different MUST (a plain MUST_SAVE is compatible).
    """

    pack: Callable[[torch.Tensor], Any]
    unpack: Callable[[Any], torch.Tensor]

    def __repr__(self) -> str:
        return f"SaveWithHooks({getattr(self.pack, '__name__', self.pack)}, " \
               f"{getattr(self.unpack, '__name__', self.unpack)})"


Opinion = Union[CheckpointPolicy, SaveWithHooks]
PolicyFn = Callable[..., Any]
PolicyLike = Union[PolicyFn, str, Iterable[Any]]


class PolicyContext(_torch_checkpoint.SelectiveCheckpointContext):
    """What a policy sees besides the op: torch's ``is_recompute``/``op_output``, plus
    the region it is asked for, the path of active regions, and the labels of the output.

    Whether a policy decides by the region's name is not guessed from its code: a
    compiled region's group checks its members' answers (:mod:`sac_compile.compiler.
    group_check`)."""

    def __init__(self, *, op_output: Any = None, region: str = "",
                 region_path: tuple[str, ...] = (), names: frozenset[str] = frozenset()) -> None:
        # The user's Python is never re-run, so a policy is never asked during recompute.
        # (torch 2.11's SelectiveCheckpointContext takes no op_output: set it here.)
        super().__init__(is_recompute=False)
        self.op_output = op_output
        self.region = region
        self.region_path = region_path
        self.names = names


def region_of(ctx: Any) -> str:
    """The region a context is asked for (for our own messages; "" for torch's contexts)."""
    return getattr(ctx, "region", "")


@dataclasses.dataclass(frozen=True)
class RegionFrame:
    """One active region: its name and its normalised policy function. ``slot`` is what a
    compiled region is keyed by (:mod:`sac_compile.region_groups`): Dynamo guards its
    group's token, never the name, so identical blocks share one graph."""

    name: str
    policy: PolicyFn
    slot: Any = dataclasses.field(default=None, compare=False, repr=False)
    # The region's memory budget (a :class:`sac_compile.budgets.RegionBudget`), or None.
    budget: Any = dataclasses.field(default=None, compare=False, repr=False)


@dataclasses.dataclass(frozen=True)
class Vote:
    """One non-None opinion, from a region's policy or from a tag/name on the output."""

    opinion: Opinion
    region: str
    source: str  # "policy" | "tag" | "name"


@dataclasses.dataclass(frozen=True)
class Decision:
    """The resolved decision for one op."""

    policy: CheckpointPolicy
    hooks: SaveWithHooks | None = None
    region: str | None = None
    source: str = "default"  # "policy" | "tag" | "name" | "default" | "resolution"
    overridden: tuple[Vote, ...] = ()
    # Derived from ``policy`` once: the runtime asks them for every op, and hashing an
    # enum member runs Python code.
    is_must: bool = dataclasses.field(init=False, repr=False, compare=False)
    saves: bool = dataclasses.field(init=False, repr=False, compare=False)
    offloads: bool = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "is_must", self.policy in _MUSTS)
        object.__setattr__(self, "saves", self.policy in _SAVES)
        object.__setattr__(self, "offloads", self.policy in _OFFLOADS)

    @property
    def label(self) -> str:
        return "SaveWithHooks" if self.hooks is not None else self.policy.name

    @property
    def stored_off_device(self) -> bool:
        """Saved, and not as is on the device: offloaded to the host or packed by hooks."""
        return self.saves and (self.offloads or self.hooks is not None)

    def reason(self) -> str:
        if self.source == "default":
            return f"{self.label} by default (no policy had an opinion)"
        where = f"in region {self.region!r}"
        if self.source == "resolution":
            beaten = ", ".join(f"{_label(v.opinion)} of {v.source} in {v.region!r}"
                               for v in self.overridden)
            return f"{self.label} {where} (beats {beaten})"
        return f"{self.label} by {self.source} {where}"


DEFAULT_DECISION = Decision(PREFER_RECOMPUTE)


def _label(opinion: Opinion) -> str:
    return "SaveWithHooks" if isinstance(opinion, SaveWithHooks) else opinion.name


def _is_must(opinion: Opinion) -> bool:
    return isinstance(opinion, SaveWithHooks) or opinion in _MUSTS


def op_name(op: Any) -> str:
    return str(op)


# --------------------------------------------------------------------------------------
# Policy forms
# --------------------------------------------------------------------------------------

class PolicyValue:
    """Base of the library's policies (the presets of :mod:`.policies`, the op-list form):
    frozen dataclasses, so a policy is a value - it hashes, compares and pickles by what it
    holds, as JAX's ``SaveOnlyTheseNames`` does. That value is what a compiled region's
    graph and the compile caches are keyed by (:mod:`.policy_identity`).

    ``constant``: the same opinion for every op, or None (lets the runtime skip asking).
    ``by_op()``: whether the answer depends on the op alone (see :func:`answers_by_op`)."""

    constant: Opinion | None = None

    def __call__(self, ctx: PolicyContext, op: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def by_op(self) -> bool:
        return False


def answers_by_op(policy: Any) -> bool:
    """Whether ``policy`` is one of our values whose answer depends on the op alone (not on
    its arguments, its output, the region or labels), so that the eager runtime may ask it
    once per op overload and stack of regions. Trusted only where the class that defines
    the policy's ``__call__`` also declares ``by_op``: a subclass that overrides
    ``__call__`` (it may read anything), and any plain function, is asked for every op."""
    if not isinstance(policy, PolicyValue):
        return False
    for klass in type(policy).__mro__:
        if "__call__" in klass.__dict__:
            return "by_op" in klass.__dict__ and policy.by_op()
    return False


class OpSetPolicy(PolicyValue):
    """A policy value that holds ops by name (field ``ops``); ``op_set`` resolves them once
    per object (not pickled: ops are found again by name on load). ``opinion`` is what the
    listed ops get (no opinion on the others); ``label`` names the constructor in repr."""

    ops: tuple[str, ...]
    opinion: Opinion | None = None
    label: str = ""

    def __call__(self, ctx: PolicyContext, op: Any, *args: Any, **kwargs: Any) -> Any:
        return self.opinion if op in self.op_set else None

    def by_op(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"{self.label}({', '.join(self.ops)})"

    @property
    def op_set(self) -> frozenset[Any]:
        found = self.__dict__.get("_op_set")
        if found is None:
            found = frozenset(resolve_op(name) for name in self.ops)
            object.__setattr__(self, "_op_set", found)
        return found

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_op_set"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


@dataclasses.dataclass(frozen=True)
class SaveListedOps(OpSetPolicy):
    """The list form of a policy (``sac_region([aten.mm, ...])``): MUST_SAVE the listed
    ops, PREFER_RECOMPUTE everything else (what torch's list form means)."""

    ops: tuple[str, ...]

    def __call__(self, ctx: PolicyContext, op: Any, *args: Any, **kwargs: Any) -> Any:
        return MUST_SAVE if op in self.op_set else PREFER_RECOMPUTE

    def by_op(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"[{', '.join(self.ops)}]"


#: Policies a region may name by string (``sac_region("save_matmuls")``). The presets live
#: in :mod:`.policies`, which fills this table when it is imported (``sac_compile`` imports
#: it): the core does not import the presets built on it.
PRESETS: dict[str, PolicyFn] = {}


def normalize_policy(policy: PolicyLike) -> PolicyFn:
    """Turn any accepted policy form into a function ``(ctx, op, *args, **kwargs)``.

    Raises ``TypeError`` naming the value for anything that is not a policy.
    """
    if isinstance(policy, str):
        preset = PRESETS.get(policy)
        if preset is None:
            raise TypeError(f"unknown policy name {policy!r}; expected one of "
                            f"{sorted(PRESETS)} or a policy function")
        return preset
    if isinstance(policy, (list, tuple, set, frozenset)):
        return SaveListedOps(op_names(policy, what="policy list"))
    if isinstance(policy, (CheckpointPolicy, bool, SaveWithHooks)) or policy is None:
        raise TypeError(
            f"policy {policy!r} is a decision, not a policy; pass a function returning it, "
            f"e.g. lambda ctx, op, *a, **k: {policy!r}")
    if callable(policy):
        return policy
    raise TypeError(f"policy must be a function (ctx, op, *args, **kwargs), a list/tuple/set "
                    f"of ops, or one of 'recompute_all', 'save_all', 'save_matmuls'; "
                    f"got {policy!r} of type {type(policy).__name__}")


def _is_numpy_bool(value: Any) -> bool:
    cls = type(value)
    return cls.__module__ == "numpy" and cls.__name__ in ("bool_", "bool")


def coerce_opinion(value: Any, op: Any, region: str) -> Opinion | None:
    """What torch accepts from a policy (bool included), or a CheckpointError.

    One rule in both modes: ``bool`` and ``numpy.bool_`` mean what torch's bool means (True
    -> MUST_SAVE, False -> PREFER_RECOMPUTE); any other value, ints and floats included
    (``1 == True``), is rejected, naming the op and the region."""
    if value is None or isinstance(value, (CheckpointPolicy, SaveWithHooks)):
        return value
    if isinstance(value, bool) or _is_numpy_bool(value):
        return MUST_SAVE if value else PREFER_RECOMPUTE
    raise CheckpointError(
        f"the policy of region {region!r} returned {value!r} (type {type(value).__name__}) "
        f"for op {op_name(op)}; a policy must return a CheckpointPolicy, a bool, None or "
        f"SaveWithHooks")


# --------------------------------------------------------------------------------------
# Resolution: one function decides every op
# --------------------------------------------------------------------------------------

def resolve_decision(op: Any, votes: Sequence[Vote]) -> Decision:
    """Resolve the opinions of one op, ordered from the outermost region to the innermost
    (a tag on the output last).

    MUST beats PREFER; two different MUSTs are an error; between PREFERs the innermost
    wins; no opinion at all is PREFER_RECOMPUTE.
    """
    if not votes:
        return DEFAULT_DECISION
    must: Vote | None = None
    prefer: Vote | None = None
    for vote in votes:
        if _is_must(vote.opinion):
            if must is None:
                must = vote
            else:
                must = _merge_musts(op, must, vote)
        else:
            prefer = vote  # innermost PREFER wins
    winner = must if must is not None else prefer
    assert winner is not None
    overridden = tuple(v for v in votes if v is not winner and v.opinion is not winner.opinion)
    opinion = winner.opinion
    hooks = opinion if isinstance(opinion, SaveWithHooks) else None
    policy = MUST_SAVE if hooks is not None else opinion
    source = "resolution" if overridden else winner.source
    return Decision(policy, hooks, winner.region, source, overridden)


def _merge_musts(op: Any, a: Vote, b: Vote) -> Vote:
    if a.opinion is b.opinion:
        return b
    # A plain MUST_SAVE and SaveWithHooks agree that the value is saved; the hooks say how.
    if isinstance(a.opinion, SaveWithHooks) and b.opinion is MUST_SAVE:
        return a
    if isinstance(b.opinion, SaveWithHooks) and a.opinion is MUST_SAVE:
        return b
    raise CheckpointError(
        f"conflicting decisions for op {op_name(op)}: {_label(a.opinion)} by {a.source} in "
        f"region {a.region!r} and {_label(b.opinion)} by {b.source} in region {b.region!r}. "
        f"Two MUST decisions cannot both hold; make one of them PREFER_* or return None "
        f"for this op in one of the policies")


def ask_policies(frames: Sequence[RegionFrame], op: Any, args: tuple, kwargs: dict,
                 output: Any, names: frozenset[str] = frozenset()) -> list[Vote]:
    """Ask each active region's policy, outermost first; keep the opinions that are not None."""
    votes: list[Vote] = []
    path = tuple(f.name for f in frames)
    for frame in frames:
        ctx = PolicyContext(op_output=output, region=frame.name, region_path=path, names=names)
        opinion = coerce_opinion(_ask(frame, ctx, op, args, kwargs), op, frame.name)
        if opinion is not None:
            # A decision asked again because the output got a label is reported as by name.
            votes.append(Vote(opinion, frame.name, "name" if names else "policy"))
    return votes


def _ask(frame: RegionFrame, ctx: PolicyContext, op: Any, args: tuple, kwargs: dict) -> Any:
    try:
        return frame.policy(ctx, op, *args, **kwargs)
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(
            f"the policy of region {frame.name!r} raised {type(e).__name__}: {e} while "
            f"deciding op {op_name(op)}; fix the policy or return None for ops it does "
            f"not know") from e


def decide(frames: Sequence[RegionFrame], op: Any, args: tuple, kwargs: dict, output: Any, *,
           names: frozenset[str] = frozenset(), tag: Opinion | None = None,
           tag_region: str | None = None) -> Decision:
    """The decision for one op: the policies of ``frames`` (outermost first), then the tag."""
    votes = ask_policies(frames, op, args, kwargs, output, names)
    if tag is not None:
        votes.append(Vote(tag, tag_region or (frames[-1].name if frames else "<none>"), "tag"))
    return resolve_decision(op, votes)


def foreign_tensor_message(what: str, region: str) -> str:
    """The error for ``tag()``/``name()`` in a region on a tensor no op of it produced."""
    return (f"{what} in region {region!r} got a tensor that no op of the region produced (an "
            f"input, a parameter, or a value from outside); apply it to the output of the op "
            f"you mean, inside the region")
