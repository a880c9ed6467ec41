"""Keep Inductor from fusing kernels apart in the graph when that keeps more bytes alive.

Inductor's scheduler fuses two kernels that read one buffer however far apart they are in
the graph. A fused kernel runs where the later of the two ran, so everything the earlier
one reads stays alive across all that runs between. In a backward that recomputes, the
same block's recomputed LayerNorm (or GELU backward) of two traversals of one model read
the same parameters: fused, one traversal's recomputed values live across the other's
whole backward (issue 17's 6-block stack traversed twice: Inductor's own peak estimate
5,453 KiB against 2,124 KiB at run time under ``aot_eager``).

Torch's own rule against it (``Scheduler.are_long_distant_nodes``: more than 64 nodes
apart) is applied only to fusions of kernels with no path between them; here the later
traversal's kernel does depend on the earlier one (through the model's output), so the
scheduler takes the pair for a producer/consumer fusion and the rule is not asked (one
traversal's partial parameter gradient is read by the other's sum). We veto, for the
graphs our backend compiles, a fusion of two kernels with anything between them
(:data:`DISTANCE`) that keeps more bytes alive than it spares (:func:`is_distant_reuse`):
the earlier kernel's inputs live until the later one runs, while only the earlier one's
outputs the later one reads are no longer allocated. And the scheduler orders a fused kernel
by its first node, hoisting what the later one needs: the later one's outputs (and what it
reads from kernels between) are made that much earlier, while the fusion spares only what
the earlier one writes for the two alone. HF GPT-2's backward made its four layers'
recomputed attention masks (256 KiB each) in the first layer's kernel, through the boolean
mask they all read; refused, its step at ``PeakBudget(26,300,000)`` measured 24,857,760 B
instead of 25,578,632 (the same cut). Adjacent kernels fuse as before.

Not only across traversals: at torch's 64 nodes (the first version of this veto) fusions
within a block still held the step's peak. Measured, every block recomputed, compiled
whole (CPU allocator, bench size): HF GPT-2 27.12 -> 25.88 MB, HF Llama 29.13 -> 25.69 MB
(``relaxed(save_matmuls)``: 36.62 -> 35.57 MB), a GPT block run twice per step 2.37 -> 1.47
MB; step time on the CPU unchanged (0.98-1.00x). The peak model then walks the graph's own
order (:mod:`.inductor_order`'s horizontal moves are among the fusions vetoed).

How: Inductor's fusion heuristics are its ``InductorChoices`` handler (``V.choices``). A
scheduler pass run just before fusion (``_pre_fusion_custom_pass``) installs a handler
that asks ours first and then the handler that was there; the pass run just after fusion
(``_post_fusion_custom_pass``) puts the previous one back. Both are ``CustomSchedulerPass``
values (registered as such when first used, so importing sac_compile loads no Inductor);
Inductor's FX graph cache pickles the one after fusion into its key, with this file's
hash, so a graph scheduled without the veto (or under another version of it) is not served
to our backend. A torch without these hooks compiles as before (no veto).
"""
from __future__ import annotations

from typing import Any

from ..torch_internals import TorchAPIMissing

__all__ = ["near_fusion_patches", "is_distant_reuse", "veto_available", "DISTANCE"]

DISTANCE = 1  # nodes apart: more than this, something runs between the two


def veto_available(config: Any = None) -> bool:
    """Whether this torch has the scheduler hooks the veto needs (``config``: Inductor's
    config module, imported here when not given)."""
    try:
        from ..torch_internals import CustomSchedulerPass, inductor_virtualized  # noqa: F401
        if config is None:
            from ..torch_internals import inductor_config as config
    except (ImportError, TorchAPIMissing):
        return False
    return hasattr(config, "_pre_fusion_custom_pass") and \
        hasattr(config, "_post_fusion_custom_pass")


def near_fusion_patches(config: Any, patches: dict[str, Any]) -> dict[str, Any]:
    """``patches`` plus the two scheduler passes (each chained with a pass of the same
    name the options or the config already set: theirs runs after ours). Unchanged on a
    torch without the hooks."""
    if not veto_available(config):
        return patches
    from ..torch_internals import CustomSchedulerPass
    for cls in (Install, Restore):  # what Inductor's cache checks for (isinstance)
        if not issubclass(cls, CustomSchedulerPass):
            CustomSchedulerPass.register(cls)
    before = patches.get("_pre_fusion_custom_pass", config._pre_fusion_custom_pass)
    after = patches.get("_post_fusion_custom_pass", config._post_fusion_custom_pass)
    if isinstance(before, Install):
        return patches  # already ours
    return {**patches, "_pre_fusion_custom_pass": Install(before),
            "_post_fusion_custom_pass": Restore(after)}


def is_distant_reuse(scheduler: Any, node1: Any, node2: Any) -> bool:
    """Two kernels more than :data:`DISTANCE` node apart whose fusion may keep more bytes
    alive than it frees: the fused kernel runs where the later one did, so what the
    earlier one reads lives until then (the backward's inputs too: Inductor frees a saved
    activation after its last use), while the fusion spares only the earlier one's
    outputs that the later one reads. (A partial parameter gradient of one traversal
    fused into the other traversal's sum keeps that traversal's recomputed activations
    alive for the other's whole backward.) A size this cannot read counts as infinite:
    unreadable on the inputs' side only, the fusion is refused, as torch's distance rule
    would; unreadable on both sides, it is left to Inductor."""
    try:
        distance = max(abs(node1.min_order - node2.max_order),
                       abs(node2.min_order - node1.max_order))
    except AttributeError:
        return False
    if distance <= DISTANCE:
        return False
    first, second = (node1, node2) if node1.min_order <= node2.min_order else (node2, node1)
    written = set(first.get_buffer_names())
    spared = {dep.name for dep in second.read_writes.reads if dep.name in written}
    kept_longer = {dep.name for dep in first.read_writes.reads if dep.name not in written}
    if _nbytes(kept_longer) > _nbytes(spared):
        return True
    return _made_early(scheduler, first, second) > _nbytes(_read_only_by(scheduler, spared,
                                                                        first, second))


def _made_early(scheduler: Any, first: Any, second: Any) -> float:
    """Bytes the fused kernel makes earlier than ``second`` alone would: it runs where
    ``first`` did (the scheduler orders fused kernels by their first node and hoists what
    they need), so ``second``'s outputs, and what it reads from kernels between the two,
    exist from there on (a size this cannot read counts nothing: this term only adds
    vetoes)."""
    made = set(second.get_buffer_names())
    bufs = getattr(scheduler, "name_to_buf", {})
    fused = getattr(scheduler, "name_to_fused_node", {})  # (a torch without: outputs only)
    for dep in second.read_writes.reads:
        op = getattr(bufs.get(dep.name), "defining_op", None)
        node = fused.get(op.get_name()) if op is not None else None
        if node is not None and node is not second and node.min_order > first.max_order:
            made.add(dep.name)
    return _nbytes(made, unreadable=0.0)


def _read_only_by(scheduler: Any, names: set[str], first: Any, second: Any) -> set[str]:
    """Of ``names``, the buffers no kernel but ``first`` and ``second`` reads (the fusion
    spares those only: another reader still needs the buffer)."""
    ours = set(first.get_operation_names()) | set(second.get_operation_names())
    bufs = getattr(scheduler, "name_to_buf", {})

    def within(user: Any) -> bool:  # (the graph's output is no kernel: not within)
        get = getattr(user.node, "get_operation_names", None)
        ops = set(get()) if get is not None else set()
        return bool(ops) and ops <= ours

    return {name for name in names
            if (users := getattr(bufs.get(name), "users", None)) is not None
            and all(within(u) for u in users)}


def _nbytes(names: set[str], unreadable: float = float("inf")) -> float:
    """The bytes of Inductor's buffers ``names``; one whose size cannot be read counts
    ``unreadable`` (by default infinite: the fusion is refused)."""
    from ..torch_internals import inductor_virtualized
    graph = inductor_virtualized.V.graph
    total = 0.0
    for name in names:
        try:
            buffer = graph.get_buffer(name)
            total += _hint(graph.sizevars, buffer.get_numel()) * buffer.get_dtype().itemsize
        except Exception:  # noqa: BLE001 - a size we cannot read
            if unreadable == float("inf"):
                return unreadable
            total += unreadable
    return total


def _hint(sizevars: Any, numel: Any) -> int:
    """A size as a number: ``optimization_hint`` (torch 2.13), ``size_hint`` before."""
    if isinstance(numel, int):
        return numel
    hint = getattr(sizevars, "optimization_hint", None) or sizevars.size_hint
    return int(hint(numel))


class NearFusionChoices:
    """``V.choices`` while one scheduler fuses: our veto, then the handler before."""

    def __init__(self, prior: Any, scheduler: Any) -> None:
        self.prior, self.scheduler = prior, scheduler

    def __getattr__(self, name: str) -> Any:
        return getattr(self.prior, name)

    def can_fuse(self, scheduler: Any, node1: Any, node2: Any, shared_data_score: int) -> bool:
        # only the scheduler it was installed for: a schedule that raised between the two
        # passes leaves this handler behind, and another compile (not ours) must not get
        # the veto
        if scheduler is self.scheduler and is_distant_reuse(scheduler, node1, node2):
            return False
        return self.prior.can_fuse(scheduler, node1, node2, shared_data_score)


class _SchedulerPass:
    """A scheduler pass that runs ``then`` (the user's pass of the same name) after its
    own step; keyed by this file's hash and ``then``'s key."""

    def __init__(self, then: Any = None) -> None:
        self.then = then

    def __call__(self, nodes: list[Any]) -> list[Any]:
        from ..torch_internals import inductor_virtualized
        self.step(inductor_virtualized.V, nodes)
        return nodes if self.then is None else self.then(nodes)

    def step(self, V: Any, nodes: list[Any]) -> None:  # noqa: N803 - Inductor's name
        raise NotImplementedError

    def uuid(self) -> Any:
        from ..torch_internals import get_hash_for_files
        own = get_hash_for_files((__file__,)).hex()
        if self.then is None:
            return own
        then = self.then.uuid() if hasattr(self.then, "uuid") else None
        return None if then is None else (own, then)  # None: the user's pass is not cached

    def __getstate__(self) -> dict[str, Any]:
        # what Inductor's cache key pickles (the pass after fusion is pickled, not asked
        # for its uuid): the code's hash with the chained pass
        return {"then": self.then, "uuid": self.uuid()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.then = state["then"]


class Install(_SchedulerPass):
    """Before fusion: our fusion veto in front of the current choices handler."""

    def step(self, V: Any, nodes: list[Any]) -> None:  # noqa: N803
        prior = V.choices
        while isinstance(prior, NearFusionChoices):  # left by a schedule that raised
            prior = prior.prior
        scheduler = getattr(nodes[0], "scheduler", None) if nodes else None
        V.set_choices_handler(NearFusionChoices(prior, scheduler))


class Restore(_SchedulerPass):
    """After fusion: the choices handler there was before :class:`Install`."""

    def step(self, V: Any, nodes: list[Any]) -> None:  # noqa: N803
        current = V.choices
        if isinstance(current, NearFusionChoices):
            V.set_choices_handler(current.prior)
