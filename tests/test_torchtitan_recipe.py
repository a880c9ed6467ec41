"""torchtitan's recipe, on a model built as torchtitan builds its models (fixtures/titan.py:
``layers`` an ``nn.ModuleDict`` of blocks), without depending on torchtitan:

* per-block compile, ``block.compile(backend=..., fullgraph=True)`` (``apply_compile``);
* the blocks made regions by ``apply_regions``, with torchtitan's per-call "save every
  other matmul" policy (``per_call``), or left to torchtitan's own ``apply_ac``
  (``checkpoint_wrapper`` with its ``context_fn``, torch's SAC tags);
* backend ``"inductor"`` - all torchtitan accepts for FlexAttention models - with
  ``torch._inductor.config.custom_partitioner_fn = SACPartitioner()``: the same splits and
  bytes as our own backend (``"sac_inductor"``), gradients equal to no checkpointing.
"""
from __future__ import annotations

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    checkpoint_wrapper as ptd_checkpoint_wrapper,
)

import sac_compile as sc
from fixtures.titan import (TransformerBlock, make_policy, make_titan_model,
                            selective_checkpointing_context_fn)
from sac_compile.compiler import SACPartitioner

STEPS = 2


@pytest.fixture
def reports(monkeypatch):
    """Every split SACPartitioner makes, whichever way it was reached."""
    made = []
    original = SACPartitioner._partition

    def spy(self, gm, joint_inputs, **kwargs):
        out = original(self, gm, joint_inputs, **kwargs)
        made.append(self.last_report)
        return out

    monkeypatch.setattr(SACPartitioner, "_partition", spy)
    return made


def _apply_ac_like_torchtitan(model):
    """torchtitan's ``apply_ac`` (selective, op): its checkpoint wrapper, its context_fn."""
    for layer_id, block in model.layers.named_children():
        model.layers.register_module(layer_id, ptd_checkpoint_wrapper(
            block, context_fn=selective_checkpointing_context_fn, preserve_rng_state=False))


WRAPS = {
    "apply_regions(per_call)": lambda m: sc.apply_regions(m, sc.per_call(make_policy),
                                                          where=TransformerBlock),
    "torchtitan apply_ac": _apply_ac_like_torchtitan,
}


def _train(wrap, backend, partitioner=None):
    model, tokens = make_titan_model()
    wrap(model)
    grads = []
    # AOTAutograd's cache would skip the partitioner on a warm run: every split is made here
    with torch._inductor.config.patch(custom_partitioner_fn=partitioner), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        for block in model.layers.values():  # torchtitan's apply_compile
            block.compile(backend=backend, fullgraph=True)
        for _ in range(STEPS):
            model.zero_grad(set_to_none=True)
            model(tokens).sum().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
    return grads


def _reference_grads():
    model, tokens = make_titan_model()
    model(tokens).sum().backward()
    return [p.grad for p in model.parameters()]


def _bytes(reports):
    return [sum(r.nbytes for r in rep.saved) for rep in reports]


@pytest.mark.parametrize("wrap", list(WRAPS))
def test_inductor_with_our_partitioner_gives_our_backends_splits(wrap, reports):
    want = _reference_grads()
    ours = _train(WRAPS[wrap], "sac_inductor")
    ours_bytes, ours_recomputed = _bytes(reports), [r.recomputed for r in reports]
    assert ours_bytes and all(rep.solver != "upstream" for rep in reports)
    reports.clear()
    hooked = _train(WRAPS[wrap], "inductor", SACPartitioner())
    assert _bytes(reports) == ours_bytes
    assert [r.recomputed for r in reports] == ours_recomputed
    for grads in ours + hooked:
        for g, w in zip(grads, want):
            torch.testing.assert_close(g, w)


def test_torchtitans_own_ac_and_our_regions_keep_the_same_bytes(reports):
    """torchtitan's unchanged ``apply_ac`` (torch's tags, per-call policy) and our regions
    with ``per_call`` of the same policy: the same split of each block."""
    _train(WRAPS["torchtitan apply_ac"], "sac_inductor")
    theirs = set(_bytes(reports))
    reports.clear()
    _train(WRAPS["apply_regions(per_call)"], "sac_inductor")
    assert len(theirs) == 1 and set(_bytes(reports)) == theirs
