"""Tiny configs of the model families users fine-tune, with the features that matter switched on: sliding windows
shorter than the test documents, soft-capping, attention sinks, tied embeddings, shared experts, MLA head sizes."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

VOCAB = 96
BASE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
ROUTED = dict(MOE, n_routed_experts=4, first_k_dense_replace=1, n_shared_experts=1, n_group=1, topk_group=1)
WINDOWED = ["sliding_attention", "full_attention"]
FAMILIES: dict[str, dict] = {
    "llama": dict(tie_word_embeddings=True),
    "mistral": dict(sliding_window=8),
    "mixtral": dict(sliding_window=8, num_local_experts=4, num_experts_per_tok=2),
    "qwen2": dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
    "qwen3": dict(use_sliding_window=True, sliding_window=8, max_window_layers=1, head_dim=16),
    "qwen3_moe": dict(MOE, num_experts=4, head_dim=16),
    "gemma2": dict(sliding_window=8, attn_logit_softcapping=0.5, final_logit_softcapping=5.0, head_dim=16,
                   query_pre_attn_scalar=16),
    "gemma3_text": dict(sliding_window=8, head_dim=16, query_pre_attn_scalar=16, layer_types=WINDOWED),
    "phi3": dict(sliding_window=8),
    "olmo2": {},
    "glm4_moe": dict(ROUTED, head_dim=16),
    "deepseek_v3": dict(ROUTED, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=16),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8, head_dim=16, layer_types=WINDOWED),
}
DOCUMENTS = (20, 13, 27)
"""Longer than the windows (8), so a dropped window changes the result."""


def settings(family: str) -> dict:
    return {"model_type": family, **BASE, **FAMILIES[family]}


def build(family: str, attention: str, seed: int = 0, **changes: object) -> PreTrainedModel:
    config = AutoConfig.for_model(**{**settings(family), **changes})
    config._attn_implementation = attention
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def documents(seed: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (length,), generator=generator) for length in DOCUMENTS]
