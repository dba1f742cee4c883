"""The model on the meta device (no memory), in the job's dtypes and with the attention chosen for its family;
a whole model in memory for export; counts and decoder blocks.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from accelerate import init_empty_weights
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from trainyard.atomic import exclusive_lock
from trainyard.config import ModelConfig
from trainyard.errors import ModelError
from trainyard.model import attention, state_layers
from trainyard.model import flex  # noqa: F401  registers attention.FLEX with transformers
from trainyard.model import torch_varlen  # noqa: F401  registers attention.TORCH_VARLEN with transformers
from trainyard.model.source import architecture, first_sentence


def causal_lm(config, trust_remote_code: bool, **kwargs: Any) -> torch.nn.Module:  # type: ignore[no-untyped-def]
    """AutoModelForCausalLM.from_config, refusing what is not a causal language model with exit 2."""
    try:
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code, **kwargs)
    except (ValueError, TypeError, StrictDataclassError) as err:  # e.g. heads do not divide hidden_size
        if "Unrecognized configuration class" in str(err):
            raise ModelError(
                f"model {config.model_type}: transformers has no causal language model for it "
                "(AutoModelForCausalLM); trainyard trains decoder-only LLMs",
                fix="use a decoder-only family (docs/model-families.md); vision-language and encoder-decoder "
                "models are not supported",
            ) from None
        raise ModelError(
            f"model.config: {first_sentence(err)}", fix="use keys and values of the model's HF config.json"
        ) from None


def build_meta_model(  # type: ignore[no-untyped-def]
    cfg: ModelConfig, config, dtype: torch.dtype, device: torch.device, training: bool = True, where: str | None = None,
    packed: bool = True,
) -> torch.nn.Module:
    """The model with every parameter on the meta device (no memory), buffers real, and the attention
    implementation chosen for it (one that computes every feature of its family on the job's rows, `packed` or
    not: attention.packed_rows; or a refusal), and its state layers kept to each document (state_layers.py).

    Parameters take `dtype`, except those the family keeps in fp32 (`_keep_in_fp32_modules_strict`, e.g. MoE
    routers; `_keep_in_fp32_modules` under fp16), as transformers' from_pretrained keeps them."""
    with init_empty_weights(include_buffers=False):
        model = causal_lm(config, cfg.trust_remote_code, dtype=dtype)
    model.tie_weights()  # the meta context gave tied weights one tensor each: one again
    kept = kept_in_fp32(model, dtype)
    for name, param in model.named_parameters():
        param.data = param.data.to(torch.float32 if kept(name) else dtype)  # from_config keeps norms in fp32 too
    model.config._attn_implementation = attention.choose(
        cfg.attn_implementation, model, device, training, where, packed, cfg.gradient_checkpointing
    )
    state_layers.install(model)
    return model


def kept_in_fp32(model: torch.nn.Module, dtype: torch.dtype) -> Callable[[str], bool]:
    """Whether a parameter stays fp32 when the model is stored in `dtype`: transformers' own plan for the family
    (a private method of PreTrainedModel, matched as from_pretrained matches it: a regex search of the name)."""
    patterns = list(model._get_dtype_plan(dtype)) if hasattr(model, "_get_dtype_plan") else []
    if not patterns:
        return lambda name: False
    found = re.compile("|".join(f"(?:{pattern.replace('*', '.*')})" for pattern in patterns))
    return lambda name: found.search(name) is not None


def random_init(cfg: ModelConfig, config, seed: int) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """Seeded fp32 random weights by checkpoint name, as transformers' own init draws them.

    A whole model in memory: transformers draws every tensor from one random stream in its
    construction order, so a rank cannot draw only its own part and get the same numbers."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=cfg.trust_remote_code)
    return model.state_dict()


def random_init_file(cfg: ModelConfig, config, seed: int, cache_dir: Path) -> Path:  # type: ignore[no-untyped-def]
    """The seeded random init drawn once per cache folder (a node, or every node sharing it) and written as
    safetensors: one process holds the whole model while it draws, the others wait on a file lock (no collective)
    and every rank then reads only its own rows. The same numbers as `random_init`, at any world size."""
    identity = json.dumps([config.to_json_string(), seed, transformers.__version__, torch.__version__])
    target = cache_dir / "random-init" / hashlib.sha256(identity.encode()).hexdigest()[:16] / "model.safetensors"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(target.with_suffix(".lock"), timeout_s=None, done=target.is_file) as held:
        if held and not target.is_file():
            tensors = _unshared(random_init(cfg, copy.deepcopy(config), seed))  # from_config edits its config
            partial = target.with_suffix(f".{os.getpid()}.partial")
            save_file(tensors, str(partial))
            os.replace(partial, target)
    return target


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (tied embeddings): each name gets its own copy."""
    seen: set[int] = set()
    own = {}
    for name, tensor in tensors.items():
        pointer = tensor.data_ptr()
        own[name] = tensor.clone() if pointer in seen else tensor.contiguous()
        seen.add(pointer)
    return own


def load_model(
    cfg: ModelConfig, model_path: str | None, tokenizer: PreTrainedTokenizerBase, dtype: torch.dtype, seed: int
) -> torch.nn.Module:
    """A whole model in CPU memory in `dtype` (export merges adapters into it): from_pretrained,
    or from a config with the seeded random init."""
    if cfg.config is not None:
        config = architecture(cfg, tokenizer, model_path)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(
                model_path, dtype=dtype, trust_remote_code=cfg.trust_remote_code, low_cpu_mem_usage=True
            )
        except (OSError, ValueError, SafetensorError) as err:
            raise ModelError(f"model.path: cannot load {model_path}: {err}", fix="check model.path") from None
    kept = kept_in_fp32(model, dtype)
    for name, param in model.named_parameters():  # one dtype to merge adapters into, as training stored them
        param.data = param.data.to(torch.float32 if kept(name) else dtype)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return model


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return total, trainable


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks: FSDP shards each one, then the root."""
    names = set(getattr(_base_pretrained(model), "_no_split_modules", None) or [])
    blocks = [module for module in model.modules() if type(module).__name__ in names]
    if not blocks:
        blocks = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)][:1]
        blocks = list(blocks[0]) if blocks else []
    return blocks


def untied_ends(model: torch.nn.Module) -> tuple[torch.nn.Module | None, torch.nn.Module | None]:
    """The input embedding and the head, where they share no weight and no block holds either (None, None
    otherwise): FSDP2 shards each as a unit of its own (parallelize), and the estimate counts them so (estimate.arch).
    In the root, both were gathered for the whole step, and at once: the 0.93B Llama's embedding and head in bf16
    (2 x 131 MB gathered, their all-gather's output beside them) were a rank's largest moment under nf4."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if embedding is None or head is None:
        return None, None
    blocks = {id(param) for block in decoder_blocks(model) for param in block.parameters()}
    ends = set(map(id, embedding.parameters())) | set(map(id, head.parameters()))
    if ends & blocks or set(map(id, embedding.parameters())) & set(map(id, head.parameters())):
        return None, None
    return embedding, head


def is_peft(model: torch.nn.Module) -> bool:
    """Whether PEFT wrapped `model`; False without importing PEFT when nothing in this process has (full
    fine-tuning never loads it)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def _base_pretrained(model: torch.nn.Module) -> torch.nn.Module:
    return model.get_base_model() if is_peft(model) else model
