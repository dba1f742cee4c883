"""The model and LoRA sections: where the model comes from, how it is stored and attends, what carries adapters."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, ValidatorFunctionWrapHandler, field_validator, model_validator

from trainyard.config.section import Section


class ModelConfig(Section):
    path: str | None = None
    """HF model folder, hub id, a .gguf file, or `builtin:smollm2-135m-instruct`."""
    config: dict[str, Any] | None = None
    """Build from this HF config (needs `model_type`) with random init, instead of `path`."""
    tokenizer: str | None = None
    """Tokenizer folder or hub id; `builtin:bytes` for the local byte tokenizer. Default: `path`."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """How frozen base weights are stored (LoRA); trainable ones follow train.precision. auto: the compute dtype."""
    gradient_checkpointing: bool | Literal["selective"] = False
    """Recompute each decoder layer's activations in the backward instead of keeping them. true: all of them (least
    memory, the slowest); selective: all but the matmul and attention outputs (most of the saving, less recompute)."""
    attn_implementation: Literal[
        "auto", "varlen", "sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3"
    ] = "auto"
    """auto: flash_attention_2 on a GPU with flash-attn installed where it keeps every feature of the family; else on
    a GPU torch's own varlen kernel (FlashAttention-2 inside torch) where it keeps them, and flex_attention for
    soft-capping or sinks (Gemma 2, gpt-oss); else varlen (each document of a padding-free
    row on its own, no mask, with the family's windows, soft-capping and sinks). sdpa/eager isolate documents with
    a dense mask; flex_attention with a block mask per document read from the positions. A choice that would drop a
    feature of the family is refused."""
    quantize: Literal["none", "nf4"] = "none"
    """nf4: LoRA's frozen base linears (attention, MLP, per-expert linears) and MoE experts fused in 3-D stacks
    (each expert quantized alone) stored in 4-bit NF4 with torchao (install trainyard[quant]); embeddings, norms and
    the head stay in model.dtype, as does a tensor (or a stack's expert) whose size NF4's blocks (64 values, scales
    in blocks of 256) do not divide: the log names them. About 0.53 bytes per weight instead of 2. torchao, not
    bitsandbytes: its NF4Tensor gathers under FSDP2 as its own type, while bitsandbytes' NF4 packed in bf16 is
    corrupted by FSDP2 (bitsandbytes#1945) and its uint8 storage trains to loss 0 / grad nan (accelerate#3983).
    LoRA only: full fine-tuning would update the 4-bit weights."""
    trust_remote_code: bool = False
    cache_dir: str | None = None
    """Where GGUF files are converted to safetensors once, and a model.config job's random init is drawn once per
    node for its ranks to read their rows from. Default: ~/.cache/trainyard/models."""
    download_timeout_s: float | None = Field(None, gt=0)
    """How long the other processes of a node wait (on a file lock, in no collective) while the first downloads a
    hub id into the HF cache. Default: as long as the download takes."""

    @model_validator(mode="after")
    def _one_source(self) -> "ModelConfig":
        if (self.path is None) == (self.config is None):
            raise ValueError("set exactly one of model.path and model.config")
        if self.config is not None and "model_type" not in self.config:
            raise ValueError("model.config needs a model_type (for example: llama)")
        return self

    @field_validator("gradient_checkpointing", mode="wrap")
    @classmethod
    def _checkpointing_mode(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> bool | str:
        """One message naming the three choices, instead of pydantic's one per member of the union."""
        try:
            return handler(value)
        except ValidationError:
            raise ValueError("must be false, true (full) or selective") from None

    @field_validator("dtype")
    @classmethod
    def _no_float16(cls, dtype: str) -> str:
        if dtype == "float16":
            raise ValueError(
                "float16 overflows without a loss scaler, and trainyard has none: use bfloat16 (same memory, "
                "fp32's range) or auto"
            )
        return dtype


def quantize_problems(model: ModelConfig, lora: "LoraConfig", save_frozen: bool) -> list[tuple[str, str]]:
    """Where model.quantize cannot apply, as (field, why and the fix): 4-bit weights take no optimizer step."""
    if model.quantize == "none":
        return []
    if not lora.enabled:
        return [("model.quantize", f"{model.quantize} stores the frozen base of a LoRA job in 4 bits, but lora.enabled "
                 "is false (full fine-tuning would train the 4-bit weights): set lora.enabled: true, or "
                 "model.quantize: none")]
    if save_frozen:
        return [("checkpoint.save_frozen", f"stores the frozen base in full checkpoints, which model.quantize "
                 f"{model.quantize} holds in 4 bits and rebuilds from model.path: set checkpoint.save_frozen: false, "
                 "or model.quantize: none")]
    if lora.moe_adapter == "peft":
        return [("lora.moe_adapter", "peft folds W + B·A over each whole expert stack, which model.quantize "
                 f"{model.quantize} stores in 4 bits: set lora.moe_adapter: grouped, or model.quantize: none")]
    return []


class LoraConfig(Section):
    enabled: bool = True
    r: int = Field(16, ge=1)
    alpha: float = Field(32.0, gt=0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    """Modules that get adapters, by name or name suffix (q_proj); all-linear: every linear layer but the head."""
    target_parameters: list[str] | Literal["auto"] = "auto"
    """Parameters that get adapters, by name or suffix (mlp.experts.gate_up_proj): how LoRA reaches MoE experts that
    transformers stores fused as one 3-D tensor [experts, out, in] instead of one linear layer each (PEFT's
    parameter targeting). auto: every 3-D parameter of the model, so routed experts carry adapters by default and a
    dense model gets none; [] names none itself (but see below).

    PEFT 0.21 treats gate_proj/up_proj/down_proj and the router `gate` in target_modules (all-linear includes them)
    as the pre-fusion names of the experts on the MoE models transformers fuses (glm4_moe, qwen2_moe, mixtral, ...):
    it moves them to these fused parameters (gate_up_proj at twice the rank) and the router's weight, so there the
    dense layers' MLP and the shared experts carry no adapter. trainyard keeps PEFT's choice: an exported adapter
    loads the same way. The router is the exception: it stays frozen (in fp32, as the family keeps it) unless
    target_modules names `gate` itself, or target_parameters names its `gate.weight`."""
    moe_adapter: Literal["grouped", "peft"] = "grouped"
    """How fused experts' adapters run. grouped: the experts as transformers' grouped products over the tokens routed
    to each, each expert's adapter applied to its own tokens as two rank-r products (no expert-stack-sized tensor).
    peft: PEFT's own forward, which folds W + B·A over every expert of the layer on every step (for comparison).
    Same parameters and adapter files either way."""
    init_from: str | None = Field(None, min_length=1)
    """A PEFT adapter folder (adapter_config.json + adapter_model.safetensors: a checkpoint's adapter/, or an
    export's) to start from, e.g. SFT's before DPO. Its own r, alpha and targets replace this section's. Under
    train.objective dpo the same adapter, frozen, is the reference (the model the policy must not stray from)."""

    @model_validator(mode="after")
    def _init_from_is_an_adapters(self) -> "LoraConfig":
        if self.init_from is not None and not self.enabled:
            raise ValueError(f"lora.init_from {self.init_from} is an adapter to start from, but lora.enabled is false: "
                             "set lora.enabled: true, or remove lora.init_from")
        return self
