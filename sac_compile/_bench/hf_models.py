"""Hugging Face causal language models under the built-in models' protocol (``models.py``):
``.blocks`` are the checkpointable units, ``model(*inputs)`` the loss.

``make_hf_model(name, size=..., seed=..., device=...)`` (``HF_MODEL_NAMES``; needs
``transformers``, the ``integrations`` extra): GPT-2, Llama with grouped-query attention and
Mixtral, built from small configs (nothing is downloaded) with ``use_cache=False``, as
``tests/test_hf_models.py`` builds them. :class:`HFCausalLM` adapts any such model (one a
user's factory returns, too): ``.blocks`` are its decoder layers and ``forward(input_ids)``
returns HF's own loss with ``labels=input_ids``.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch import Tensor

__all__ = ["HF_MODEL_NAMES", "HF_SIZES", "HFCausalLM", "is_hf_model", "make_hf_model",
           "decoder_layers"]

HF_MODEL_NAMES: tuple[str, ...] = ("gpt2", "llama", "mixtral")

#: size -> (config overrides, input_ids shape) shared by the HF models.
HF_SIZES: dict[str, tuple[dict, tuple[int, int]]] = {
    # As tests/test_hf_models.py: 2 layers, width 32, vocabulary 64, 2 x 16 tokens.
    "test": (dict(layers=2, width=32, heads=4, kv_heads=2, ffn=64, vocab=64, positions=32),
             (2, 16)),
    "bench": (dict(layers=4, width=256, heads=8, kv_heads=4, ffn=688, vocab=4096,
                   positions=256), (4, 128)),
}


def _hf_config(transformers: Any, name: str, c: dict) -> Any:
    common = dict(vocab_size=c["vocab"], use_cache=False, bos_token_id=0, eos_token_id=0)
    if name == "gpt2":
        return transformers.GPT2Config(n_layer=c["layers"], n_embd=c["width"], n_head=c["heads"],
                                       n_positions=c["positions"], **common)
    kwargs = dict(num_hidden_layers=c["layers"], hidden_size=c["width"],
                  intermediate_size=c["ffn"], num_attention_heads=c["heads"],
                  num_key_value_heads=c["kv_heads"], max_position_embeddings=c["positions"],
                  attn_implementation="sdpa", **common)
    if name == "llama":
        return transformers.LlamaConfig(**kwargs)
    return transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **kwargs)


def is_hf_model(model: Any) -> bool:
    """A ``transformers`` model (a ``PreTrainedModel``), without importing transformers."""
    return isinstance(model, nn.Module) and any(
        c.__module__.startswith("transformers.") and c.__name__ == "PreTrainedModel"
        for c in type(model).__mro__)


def decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    """The model's decoder layers: the ``ModuleList`` of the classes HF names in
    ``_no_split_modules`` (what accelerate and FSDP wrap one by one), else the first
    ``ModuleList`` named ``layers`` or ``h``."""
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    fallback = None
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if layer_classes and all(type(m).__name__ in layer_classes for m in module):
            return module
        if fallback is None and name.rsplit(".", 1)[-1] in ("layers", "h"):
            fallback = module
    return fallback


class HFCausalLM(nn.Module):
    """A Hugging Face causal LM as the report measures models: ``.blocks`` are its decoder
    layers (each becomes one region), ``forward(input_ids)`` is HF's loss on
    ``labels=input_ids`` (its own shifted cross-entropy, outside every region)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        layers = decoder_layers(model)
        if layers is None:
            raise ValueError(f"{type(model).__name__}: no decoder layers found (no ModuleList of "
                             f"its _no_split_modules {getattr(model, '_no_split_modules', None)}"
                             f", none named 'layers' or 'h'); return a model with a `.blocks` "
                             f"list and forward(*inputs) -> loss instead")
        if getattr(model, "loss_type", "") is None:
            # GPT-2 has none: HF warns that it defaults to this one, and under compile the
            # warning is a graph break each time Dynamo traces the loss.
            model.loss_type = "ForCausalLM"
        self.model = model
        self.blocks = layers

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        kwargs = {} if attention_mask is None else {"attention_mask": attention_mask}
        out = self.model(input_ids=input_ids, labels=input_ids, **kwargs)
        if getattr(out, "loss", None) is None:
            raise ValueError(f"{type(self.model).__name__}(input_ids=..., labels=...) returned no "
                             f"loss; the report takes a causal language model (...ForCausalLM)")
        return out.loss


def make_hf_model(name: str, *, size: str = "test", seed: int = 0,
                  device: str | torch.device = "cpu") -> tuple[nn.Module, tuple[Tensor, ...]]:
    """HF model ``name`` (``HF_MODEL_NAMES``) from a small config, in training mode, as an
    :class:`HFCausalLM`, and its ``input_ids``. Weights and tokens are a function of
    ``seed`` alone (the global RNG is left as it was). Raises ``ImportError`` without
    ``transformers``."""
    import transformers
    if name not in HF_MODEL_NAMES:
        raise ValueError(f"unknown Hugging Face model {name!r}; expected one of "
                         f"{list(HF_MODEL_NAMES)}")
    if size not in HF_SIZES:
        raise ValueError(f"unknown size {size!r} for hf:{name}; expected one of {list(HF_SIZES)}")
    overrides, shape = HF_SIZES[size]
    cfg = _hf_config(transformers, name, overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(cfg)
        ids = torch.randint(0, overrides["vocab"], shape)
    wrapped = HFCausalLM(model.to(device).train())
    wrapped.fixture_name = f"hf:{name}"
    wrapped.fixture_size = size
    return wrapped, (ids.to(device),)
