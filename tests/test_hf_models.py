"""Hugging Face transformers models through sac_compile: the real library, tiny configs built
here (nothing is downloaded), each decoder layer wrapped with
``sac_region(policies.save_matmuls)(layer)``.

Parity, against the same model run without checkpointing from the same seed
(``torch.manual_seed(SEED)`` before the forward), loss and every parameter gradient:

* eager mode: bitwise equal (``torch.equal``). The runtime replays the recorded ATen kernels
  on the same values, with the generator state each random op saw, so dropout masks match.
* ``torch.compile`` with ``make_backend(compiler="aot_eager")``: within ``AOT_EAGER_ATOL``.
  The graph runs ATen kernels eagerly, but AOTAutograd's functionalisation and
  decompositions can change a reduction's summation order. Seen here: 0 (GPT-2, both
  dropouts), 2.4e-8 (Llama sdpa), 1.5e-8 (Mixtral).
* Inductor (``sac_backend``, slow): within ``INDUCTOR_ATOL``. Generated C++ kernels fuse
  and reorder float sums; dropout runs with ``fallback_random=True`` so its masks come from
  the eager generator.

Saved bytes, parameters excluded (``fixtures.measure``): ours at most what torch's own SAC
keeps with the same op list (``policies.MATMUL_OPS``), in eager mode and compiled.

Models: GPT-2 (dropout 0 and 0.1), Llama with grouped-query attention
(``num_key_value_heads < num_attention_heads``; ``attn_implementation`` "sdpa" and
"eager") and Mixtral (mixture of experts; HF runs its experts with ``aten._grouped_mm`` in
eager mode and with its own custom op ``transformers::grouped_mm_fallback`` under compile
with float32 weights). Configs set ``use_cache=False`` (with the default, HF's cache breaks
the graph inside every layer); GPT-2 gets ``model.loss_type`` (without one, HF's
``logger.warning_once`` breaks the graph each time dynamo traces the loss).
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as tuc

transformers = pytest.importorskip(
    "transformers", minversion="4.40",
    reason="Hugging Face transformers is not installed (pip install -e '.[integrations]')")

import sac_compile as sc  # noqa: E402
from fixtures.measure import measure_noac, measure_ours, measure_torch_sac  # noqa: E402
from sac_compile import policies, sac_region  # noqa: E402

SEED = 123
AOT_EAGER_ATOL = 1e-6
INDUCTOR_ATOL = 1e-4
MATMUL_LIST = sorted(policies.MATMUL_OPS, key=str)  # the same policy, as torch's op list
IDS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))


# --------------------------------------------------------------------------------------
# Models: tiny configs, deterministic weights
# --------------------------------------------------------------------------------------

_COMMON = dict(vocab_size=64, use_cache=False, bos_token_id=0, eos_token_id=0)


def gpt2(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=32,
                                  resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                                  **_COMMON)
    model = transformers.GPT2LMHeadModel(cfg).train()
    model.loss_type = "ForCausalLM"  # GPT-2 has none: HF warns (a graph break) every trace
    return model


def llama(attn: str = "sdpa") -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=32, attn_implementation=attn,
                                   **_COMMON)
    return transformers.LlamaForCausalLM(cfg).train()


def moe() -> nn.Module:
    torch.manual_seed(0)
    kwargs = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                  attn_implementation="sdpa", num_experts_per_tok=2, **_COMMON)
    if hasattr(transformers, "MixtralForCausalLM"):
        cfg = transformers.MixtralConfig(num_local_experts=4, **kwargs)
        return transformers.MixtralForCausalLM(cfg).train()
    cfg = transformers.Qwen2MoeConfig(num_experts=4, moe_intermediate_size=64,  # pragma: no cover
                                      shared_expert_intermediate_size=64, **kwargs)
    return transformers.Qwen2MoeForCausalLM(cfg).train()


MODELS = {
    "gpt2": functools.partial(gpt2, 0.0),
    "gpt2-dropout": functools.partial(gpt2, 0.1),
    "llama-gqa-sdpa": functools.partial(llama, "sdpa"),
    "llama-gqa-eager": functools.partial(llama, "eager"),
    "moe": moe,
}


def layers(model: nn.Module) -> nn.ModuleList:
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


def wrap_layers(model: nn.Module, policy=policies.save_matmuls) -> nn.Module:
    for i, layer in enumerate(layers(model)):
        assert sac_region(policy)(layer) is layer  # wrapping keeps the module object
        assert layers(model)[i] is layer
    return model


def step(call, model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One seeded forward+backward through ``call`` (the model or its compiled form);
    the loss and every parameter's gradient, read off ``model``."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(SEED)
    loss = call(input_ids=IDS, labels=IDS).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    assert len(grads) == len(list(model.parameters())), "a parameter got no gradient"
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@functools.lru_cache(maxsize=None)
def reference(name: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = MODELS[name]()
    return step(model, model)


def max_diff(name: str, loss: torch.Tensor, grads: dict[str, torch.Tensor]) -> float:
    ref_loss, ref_grads = reference(name)
    assert grads.keys() == ref_grads.keys()
    return max([(loss - ref_loss).abs().item()]
               + [(grads[k] - ref_grads[k]).abs().max().item() for k in grads])


def assert_equal(name: str, loss: torch.Tensor, grads: dict[str, torch.Tensor]) -> None:
    ref_loss, ref_grads = reference(name)
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    unequal = [k for k in grads if not torch.equal(grads[k], ref_grads[k])]
    assert not unequal, f"gradients differ: {unequal}"


class LossOfBlocks(nn.Module):
    """An HF model as ``fixtures.measure`` takes it: ``.blocks`` and ``forward(ids) -> loss``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.blocks = layers(model)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, labels=ids).loss


@functools.lru_cache(maxsize=None)
def torch_sac_bytes(name: str, *, rng_states: bool = False) -> int:
    """What torch's SAC keeps (its caches and everything autograd keeps outside the
    checkpoints, parameters excluded) with the op list of ``save_matmuls``. ``rng_states``:
    with the CPU RNG state its checkpoint stashes per call, as compiled reports count the
    RNG states of recomputed random ops."""
    res = measure_torch_sac(LossOfBlocks(MODELS[name]()), (IDS,), MATMUL_LIST, seed=SEED,
                            loss=lambda out: out)
    return res.saved_bytes + (res.rng_state_bytes if rng_states else 0)


def compiled_step(model: nn.Module, backend) -> tuple[torch.Tensor, dict]:
    return step(torch.compile(model, backend=backend), model)


# --------------------------------------------------------------------------------------
# Eager mode
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(MODELS))
def test_eager_regions_match_no_checkpointing_exactly(name):
    model = wrap_layers(MODELS[name]())
    assert_equal(name, *step(model, model))


@pytest.mark.parametrize("name", list(MODELS))
def test_eager_saves_no_more_than_torch_sac(name):
    """Same op list, same seed: our runtime keeps at most torch SAC's bytes (it also
    replays only what backward unpacks), and less than no checkpointing."""
    model = LossOfBlocks(MODELS[name]())
    ours = measure_ours(model, (IDS,), policies.save_matmuls, seed=SEED, loss=lambda out: out)
    noac = measure_noac(model, (IDS,), seed=SEED, loss=lambda out: out)
    assert ours.saved_bytes <= torch_sac_bytes(name) < noac.saved_bytes


def test_eager_moe_saves_expert_matmuls():
    """``save_matmuls`` covers ``aten._grouped_mm`` (HF's experts in eager mode): saved,
    never recomputed; the eager report counts 0 recompute FLOPs."""
    model = wrap_layers(moe())
    report = sc.explain(lambda: model(input_ids=IDS, labels=IDS).loss, mode="eager")
    saved_ops = set(report.saved_ops)
    assert "aten._grouped_mm.default" in saved_ops
    assert not [op for op in report.recomputed if "mm" in op.split(".")[1]]
    assert report.recompute_flops == 0
    assert report.outside_bytes and report.outside_bytes > 0


def test_eager_explain_counts_recompute_flops():
    """With ``recompute_all`` every layer's projections are recomputed; the eager report
    counts their FLOPs by flop_counter rules (it said 0 before)."""
    model = wrap_layers(llama("sdpa"), "recompute_all")
    report = sc.explain(lambda: model(input_ids=IDS, labels=IDS).loss, mode="eager")
    n_mm = report.recomputed_ops["aten.mm.default"]
    assert n_mm > 0
    # each recomputed projection: 32 tokens x 32 in x at least 16 out (GQA's k/v)
    assert report.recompute_flops >= n_mm * 2 * 32 * 32 * 16
    assert "region internals" in report.coverage


# --------------------------------------------------------------------------------------
# Compiled: aot_eager (quick) and Inductor (slow)
# --------------------------------------------------------------------------------------

def _aot_eager_case(name):
    reports = []
    model = wrap_layers(MODELS[name]())
    loss, grads = compiled_step(model, sc.make_backend(compiler="aot_eager",
                                                             on_partition=reports.append))
    assert max_diff(name, loss, grads) <= AOT_EAGER_ATOL
    assert reports, "nothing was partitioned"
    saved = sum(r.saved_bytes for r in reports)
    assert saved <= torch_sac_bytes(name, rng_states=True)
    return reports


@pytest.mark.parametrize("name", ["gpt2-dropout", "llama-gqa-sdpa", "moe"])
def test_aot_eager_regions(name):
    reports = _aot_eager_case(name)
    if name == "moe":
        # HF's own grouped matmul (a custom op under compile) is one of save_matmuls' ops
        saved = [r.op for rep in reports for r in rep.saved]
        assert saved.count("transformers.grouped_mm_fallback.default") == 4
        assert any("transformers.grouped_mm_fallback.default" in rep.cost_estimated
                   for rep in reports)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama-gqa-eager"])
def test_aot_eager_regions_more(name):
    _aot_eager_case(name)


def _hf_checkpointing_case(name):
    """HF's own switch with torch's SAC policy, unchanged, compiled with our backend: we
    partition from torch's tags."""
    reports = []
    model = MODELS[name]()
    kwargs = {"use_reentrant": False,
              "context_fn": functools.partial(tuc.create_selective_checkpoint_contexts,
                                              MATMUL_LIST)}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    loss, grads = compiled_step(model, sc.make_backend(compiler="aot_eager",
                                                             on_partition=reports.append))
    assert max_diff(name, loss, grads) <= AOT_EAGER_ATOL
    assert reports
    assert sum(r.saved_bytes for r in reports) <= torch_sac_bytes(name, rng_states=True)


@pytest.mark.filterwarnings("ignore:.*in-place ops")
def test_hf_gradient_checkpointing_with_torch_sac_policy_compiled():
    _hf_checkpointing_case("llama-gqa-sdpa")


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*in-place ops")
@pytest.mark.parametrize("name", ["gpt2-dropout", "moe"])
def test_hf_gradient_checkpointing_more(name):
    _hf_checkpointing_case(name)


def test_custom_op_recompute_is_costed_and_flagged():
    """``recompute_all`` on the MoE model: HF's grouped-matmul custom op is recomputed,
    costed from its shapes (2 x tokens x in x out per call) and flagged in the report."""
    model = wrap_layers(moe(), "recompute_all")
    report = sc.explain(lambda: model(input_ids=IDS, labels=IDS).loss, mode="compile")
    op = "transformers.grouped_mm_fallback.default"
    assert report.recomputed_ops[op] == 4
    # per layer: gate_up 2 x 64 tokens x 32 x 128, down 2 x 64 x 64 x 32 (top-2 of 32)
    assert report.recompute_flops >= 2 * (2 * 64 * 32 * 128 + 2 * 64 * 64 * 32)
    assert report.cost_estimated == [op]
    assert "cost estimated" in report.snapshot() and "cost estimated" in str(report)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2-dropout", "llama-gqa-sdpa", "moe"])
def test_inductor_regions(name):
    """``sac_backend``'s compiler; about a minute or two each on 2 CPU cores."""
    reports = []
    model = wrap_layers(MODELS[name]())
    backend = sc.make_backend(compiler="inductor", on_partition=reports.append)
    # fallback_random: dropout masks from the eager generator, as the reference's.
    # No AOTAutograd cache: a hit would skip the partitioner, and with it the report.
    with torch._inductor.config.patch(fallback_random=True), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        loss, grads = compiled_step(model, backend)
    assert max_diff(name, loss, grads) <= INDUCTOR_ATOL
    assert reports
    assert sum(r.saved_bytes for r in reports) <= torch_sac_bytes(name, rng_states=True)
