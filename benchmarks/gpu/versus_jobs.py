"""The jobs of benchmarks/gpu/versus.py, and what both stacks read of them: the model shapes (and their toy sizes
for --smoke), the documents cut from the repository's own text, trainyard's job file and the weights' size."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

LLAMA_1B = {
    "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
    "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
    "tie_word_embeddings": True, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
}
LLAMA_8B = {
    "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "tie_word_embeddings": False, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
}
QWEN3_MOE = {  # Qwen3-30B-A3B with 8 of its 48 layers
    "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "num_hidden_layers": 8, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "tie_word_embeddings": False, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 40960,
}
# The same families at toy sizes for --smoke: the plumbing on a CPU (a vocabulary still larger than the tokenizer's).
TINY_LLAMA = {"model_type": "llama", "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "rope_theta": 500000.0, "max_position_embeddings": 2048}
TINY_MOE = {"model_type": "qwen3_moe", "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128,
            "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "tie_word_embeddings": False, "rope_theta": 1000000.0, "max_position_embeddings": 2048}


@dataclass(frozen=True)
class Job:
    """One job both stacks train: its model, LoRA (None: full fine-tuning), batch, length and time limits."""

    name: str
    model_config: dict[str, Any]
    lora: dict[str, Any] | None
    steps: int
    micro_batch_size: int
    rows_per_step: int
    lr: float
    warmup_steps: int = 1
    min_tokens: int = 200
    max_tokens: int = 2048
    """Documents' lengths in tokens, EOS included (data.max_length: none is cut)."""
    trainyard_timeout_s: int = 180
    hf_timeout_s: int = 100
    seed: int = 42

    @property
    def accumulation(self) -> int:
        return self.rows_per_step // self.micro_batch_size


# Micro-batches of 4 rows (8B: 2) of up to 2048 tokens: HF's padded and flattened rows both fit an 80 GB H100
# without activation checkpointing (the 8B's 4 x 2048 rows would not: ~55 GB of activations beside 16 GB of
# weights and 12 GB of logits). Rows per step: ~28k tokens (1B, MoE) and ~16k (8B) at the documents' mean of ~1,150.
JOBS = {
    "llama-1b-full": Job("llama-1b-full", LLAMA_1B, None, steps=8, micro_batch_size=4, rows_per_step=24,
                         lr=1e-4, trainyard_timeout_s=100, hf_timeout_s=75),
    "llama-8b-lora": Job("llama-8b-lora", LLAMA_8B, {"r": 16, "alpha": 32}, steps=5, micro_batch_size=2,
                         rows_per_step=14, lr=2e-4, trainyard_timeout_s=150, hf_timeout_s=100),
    "qwen3-moe-lora": Job("qwen3-moe-lora", QWEN3_MOE, {"r": 16, "alpha": 32, "moe_adapter": "grouped"}, steps=5,
                          micro_batch_size=4, rows_per_step=24, lr=2e-4, trainyard_timeout_s=140, hf_timeout_s=100),
}
SMOKE = {
    "llama-1b-full": replace(JOBS["llama-1b-full"], model_config={**TINY_LLAMA, "tie_word_embeddings": True}),
    "llama-8b-lora": replace(JOBS["llama-8b-lora"], model_config={**TINY_LLAMA, "tie_word_embeddings": False}),
    "qwen3-moe-lora": replace(JOBS["qwen3-moe-lora"], model_config=TINY_MOE),
}
SMOKE = {name: replace(job, steps=3, micro_batch_size=2, rows_per_step=4, min_tokens=32, max_tokens=256,
                       trainyard_timeout_s=150, hf_timeout_s=120) for name, job in SMOKE.items()}


def paragraphs() -> list[str]:
    """The repository's documentation, paragraph by paragraph: real English and code, nothing downloaded."""
    files = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    text = "\n\n".join(path.read_text() for path in files if path.is_file())
    return [part.strip() for part in text.split("\n\n") if part.strip()]


def documents(count: int, low: int, high: int, seed: int) -> list[str]:
    """`count` documents of consecutive whole paragraphs, each as long as a log-uniform draw in [low, high] tokens
    (or a paragraph more) and shorter than `high` with the EOS trainyard appends (one token a byte): a paragraph that
    would pass that ends the document once it has `low` tokens, else is cut. The text starts over when it runs out."""
    rng = random.Random(seed)
    parts = paragraphs()
    cursor, found = 0, []
    while len(found) < count:
        target = math.exp(rng.uniform(math.log(low), math.log(high)))
        chosen: list[str] = []
        size, room = 0, high - 2  # the EOS, and a row shorter than data.max_length: nothing reads as truncated
        while size < target:
            part = parts[cursor % len(parts)]
            if size >= low and size + len(part.encode()) + 2 > room:
                break  # long enough, and a whole paragraph more would not fit: the document ends here
            chosen.append(part)
            size += len(part.encode()) + 2
            cursor += 1
        found.append("\n\n".join(chosen).encode()[:room].decode("utf-8", "ignore"))
    return found


def job_file(job: Job, folder: Path, data: Path, weights: Path) -> dict[str, Any]:
    """What a user writes for this job: the model folder, data, LoRA, length, batch, lr, and no eval, checkpoint or
    progress bar."""
    lora: dict[str, Any] = {"enabled": False} if job.lora is None else {"enabled": True, **job.lora}
    return {
        "run_name": "trainyard",
        "output_dir": str(folder),
        "model": {"path": str(weights), "tokenizer": "builtin:bytes"},
        "lora": lora,
        "data": {"path": str(data), "max_length": job.max_tokens},
        "train": {"max_steps": job.steps, "micro_batch_size": job.micro_batch_size,
                  "global_batch_size": job.rows_per_step, "lr": job.lr, "warmup_steps": job.warmup_steps,
                  "seed": job.seed},
        "eval": {"every_steps": 0, "at_end": False},
        "checkpoint": {"every_minutes": 0, "at_end": False},
        "log": {"every_steps": 1, "progress": False, "tensorboard": False},
    }


def weight_bytes(job: Job) -> int:
    """The model folder's size: 2 bytes a parameter for LoRA's bf16 base, 4 for full fine-tuning (fp32 weights),
    counted on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = dict(job.model_config)
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return (2 if job.lora else 4) * sum(p.numel() for p in model.parameters())
