"""The causal-LM families transformers ships (its registry, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), which of them
trainyard claims, and a tiny config for each claimed one with its features switched on.

trainyard claims the text-only decoder LMs. It leaves out, by rule:
- encoder-decoder models (`is_encoder_decoder`: BART, Marian, Whisper...): their causal-LM class is the decoder
  half, which reads an encoder's states trainyard never computes;
- multimodal models (a vision, audio or other tower in `sub_configs`: Gemma 3, Llama 4, Qwen3.5...): the text model
  trains under its own `*_text` type where transformers registers one;
and, by name (NOT_CLAIMED), the encoders registered as decoders (BERT and its kin: bidirectional models that are a
causal LM only with `is_decoder`, as an encoder-decoder's half), models whose tokens are not text, and models that
are no plain next-token LM (permutation, locality-sensitive hashing or multi-stream training).

The tiny configs start from each family's own defaults and shrink what the registry's configs name alike (hidden
size, heads, layers, experts, states); features switch on where a config has them: sliding windows (8 tokens) and
chunks (8) shorter than the test documents (13-27 tokens), one layer of each kind in `layer_types`, MoE layers with
shared experts, MLA head sizes, linear-attention, state-space and convolution layers at small widths. TINY_CHANGES
holds what one family names its own way.
"""

from __future__ import annotations

import functools
from typing import Any

from transformers import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

ENCODER = "an encoder (bidirectional) that is a causal LM only as an encoder-decoder's half (is_decoder)"
NOT_CLAIMED: dict[str, str] = {
    **{name: ENCODER for name in (
        "bert", "bert-generation", "big_bird", "camembert", "data2vec-text", "electra", "ernie", "megatron-bert",
        "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer", "xlm-roberta", "xlm-roberta-xl",
        "xmod",
    )},
    "trocr": "the text decoder of an image-to-text model (reads a vision encoder's states)",
    "xlm": "a masked/translation language model, not a causal one",
    "xlnet": "permutation language modelling (two attention streams), not next-token training",
    "reformer": "locality-sensitive hashing and chunked feed-forward: no per-token causal training of its own",
    "blt": "byte patches made by a separate patcher model, not token rows",
    "gemma4_assistant": "a draft model for speculative decoding of Gemma 4 (its config needs the target's)",
    "gemma4_unified_assistant": "a draft model for speculative decoding of Gemma 4 (its config needs the target's)",
    "cpmant": "its attention adds segment and position buckets trainyard does not build",
}
"""Families of the registry trainyard does not claim, with why (besides the rules on encoder-decoder and
multimodal configs)."""

TINY = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
    eos_token_id=2,
    # windows and chunks shorter than the documents
    sliding_window=8, attention_chunk_size=8, use_sliding_window=True, max_window_layers=1,
    # experts
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
    # MLA
    q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    # linear attention
    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_head_dim=16, linear_num_heads=4, num_experts_per_token=2, num_shared_experts=1, num_expert_group=1,
    # state-space layers
    mamba_d_state=8, ssm_state_size=8, state_size=8, mamba_n_heads=4, mamba_d_head=16, mamba_head_dim=16,
    mamba_num_heads=4, mamba_n_groups=1, n_groups=1, mamba_chunk_size=8, chunk_size=8, mamba_expand=2,
    mamba_d_ssm=64, time_step_rank=8,
    # one config for every layer (the per-layer ones name layers of the full-size model)
    per_layer_config={}, rotary_dim=8, vocab_size_per_layer_input=96, hidden_size_per_layer_input=16,
    zero_expert_num=2, unpadded_vocab_size=96, swa_head_dim=16, index_topk=8, index_head_dim=16,
    shared_experts_intermediate_size=32,
)
"""Settings every family's config gets where its defaults have the attribute."""
RANDOM = ("dropout", "pdrop", "jitter_noise")
"""Settings that draw random numbers in training (dropout, router jitter): 0, so that padded and padding-free rows
compute the same function."""
TINY_CHANGES: dict[str, dict[str, Any]] = {
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], window_size=8),
    "gemma3n_text": dict(num_kv_shared_layers=0),
    "kolibri1_1": dict(index_num_heads=2),  # at most the query heads of a key head (4 / 2)
    "zamba": dict(num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, attention_head_dim=16,
                  layer_types=["linear_attention", "hybrid"] * 2),  # two hybrid layers share one block
    "zamba2": dict(num_hidden_layers=4, hybrid_layer_ids=[1, 3], attention_head_dim=16, mamba_headdim=16,
                   n_mamba_heads=8, kv_channels=16, layer_types=["linear_attention", "hybrid"] * 2),
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
                           indexer_compress_ratio=2),
    "bamba": dict(attn_layer_indices=[1], mamba_n_heads=8),
    "mamba2": dict(num_heads=8, head_dim=16),
    "cohere_compass_text": dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"], mamba_n_heads=8, shared_intermediate_size=64),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),
    "nemotron_h": dict(num_hidden_layers=4, layers_block_type=["linear_attention", "moe", "full_attention", "mlp"]),
    "recurrent_gemma": dict(block_types=["recurrent", "attention"], lru_width=64),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "zaya": dict(num_experts_per_tok=1),
    "dory": dict(n_input_layers=1, n_recurrent_layers=2, n_output_layers=1, num_hidden_layers=4, layer_types=None),
}
"""What a family names its own way, or needs beyond TINY to build or to switch its features on (None: leave the
setting to the family, which derives it from the others)."""


def registry() -> dict[str, str]:
    """model_type -> its causal-LM class name, as transformers registers them."""
    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def why_not_claimed(model_type: str) -> str | None:
    """None for a family trainyard claims; else why not."""
    if model_type in NOT_CLAIMED:
        return NOT_CLAIMED[model_type]
    config = CONFIG_MAPPING[model_type]()
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder: its causal-LM class is the decoder half, which reads an encoder's states"
    towers = sorted(getattr(config, "sub_configs", None) or {})
    if towers:
        return f"multimodal or composite ({', '.join(towers)}): the text model trains under its own *_text type"
    return None


@functools.cache
def claimed() -> tuple[str, ...]:
    return tuple(name for name in registry() if why_not_claimed(name) is None)


def settings(model_type: str) -> dict[str, Any]:
    """The family's tiny config: its defaults' attributes that TINY names, shrunk; one layer of each of its layer
    types; then TINY_CHANGES."""
    defaults = CONFIG_MAPPING[model_type]()
    found = {key: value for key, value in TINY.items() if _has(defaults, key)}
    found.update({key: 0.0 for key in defaults.to_dict() if any(word in key for word in RANDOM)})
    if "kv_lora_rank" in found:  # MLA: a key and a value head for every query head; rotary on qk_rope_head_dim
        found.update(num_key_value_heads=found["num_attention_heads"], head_dim=found["qk_rope_head_dim"])
    kinds = defaults.to_dict().get("layer_types")
    if isinstance(kinds, list) and kinds and _has(defaults, "layer_types"):
        distinct = list(dict.fromkeys(kinds))
        distinct = distinct if len(distinct) > 1 else distinct * 2
        found.update(layer_types=distinct, num_hidden_layers=len(distinct))
    layers = found.get("num_hidden_layers", 2)
    for key, value in defaults.to_dict().items():  # other per-layer lists: the first layers'
        if key != "layer_types" and isinstance(value, list) and len(value) == defaults.num_hidden_layers:
            found[key] = value[:layers]
    found = {"model_type": model_type, **found, **TINY_CHANGES.get(model_type, {})}
    return {key: value for key, value in found.items() if value is not None}


def _has(config: Any, key: str) -> bool:
    """Whether the config takes `key`: an attribute (not one it derives from others) or an alias of one."""
    if isinstance(getattr(type(config), key, None), property):
        return False
    return key in getattr(config, "attribute_map", {}) or key in config.to_dict()
