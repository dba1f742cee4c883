"""The resolved plan of a job, computed without loading any weights (`train --dry-run`)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig

from trainyard import attention, diloco, dist, estimate, precision
from trainyard import model as model_room
from trainyard.config import JobConfig, accumulation_steps
from trainyard.dist import DistInfo
from trainyard.errors import ModelError
from trainyard.parallel import auto_strategy, choose_strategy


def _hf_config(cfg: JobConfig):
    """The architecture, from the job, a local folder, a GGUF header or the local HF cache."""
    model_cfg = cfg.model
    if model_cfg.config is not None:
        settings = dict(model_cfg.config)
        if "vocab_size" not in settings:
            settings["vocab_size"] = _tokenizer_size(cfg)
        return model_room.config_for_model(settings.pop("model_type"), settings, cfg.where("model.config"))
    assert model_cfg.path is not None
    gguf = None
    if model_cfg.path in model_room.BUILTIN_MODELS:
        gguf = model_room.builtin_gguf_file(model_cfg.path)
    elif model_cfg.path.endswith(".gguf"):
        gguf = Path(model_cfg.path)
    try:
        if gguf is not None:
            return AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # A dry run downloads nothing: only a local folder or the local HF cache.
        return AutoConfig.from_pretrained(
            model_cfg.path, trust_remote_code=model_cfg.trust_remote_code, local_files_only=True
        )
    except (OSError, ValueError):
        return None


def _tokenizer_size(cfg: JobConfig) -> int:
    """The vocabulary a config-built model will get; a common size if the tokenizer is remote."""
    try:
        return len(model_room.load_tokenizer(cfg.model, None))
    except (ModelError, OSError, ValueError):
        return 32000


def meta_model(cfg: JobConfig) -> torch.nn.Module | None:
    """The job's model (with LoRA) on the meta device: shapes and counts, no memory."""
    hf_config = _hf_config(cfg)
    if hf_config is None:
        return None
    if hasattr(hf_config, "quantization_config"):
        del hf_config.quantization_config
    with torch.device("meta"):
        model = model_room.causal_lm(hf_config, cfg.model.trust_remote_code)
        attention.refuse_dropped(cfg.model.attn_implementation, model, cfg.where("model.attn_implementation"))
        if cfg.lora.enabled:
            model = model_room.apply_lora(model, cfg.lora, cfg.train.seed)
    return model


def checkpoint_policy(cfg: JobConfig) -> str:
    """When full and lite checkpoints are written, in words."""
    ckpt = cfg.checkpoint
    full = [f"every {ckpt.every_steps} steps"] if ckpt.every_steps else []
    if ckpt.every_minutes == "auto":
        full += [f"every sqrt(2 x save stall x MTBF {ckpt.mtbf_hours:g} h / nodes) (auto)"]
    elif ckpt.every_minutes:
        full += [f"every {ckpt.every_minutes:g} min"]
    full += ["at the end"] if ckpt.at_end else []
    words = "full " + (", ".join(full) if full else "never")
    if ckpt.lite_every_steps:
        words += f"; lite (adapter) every {ckpt.lite_every_steps} steps"
    return words + f"; keep {ckpt.keep_last}{', async' if ckpt.async_save else ''}"


def _lora_words(cfg: JobConfig, model: torch.nn.Module | None) -> str:
    """Rank, alpha and what carries adapters (modules, MoE expert parameters) when the model is known."""
    lora = cfg.lora
    if not lora.enabled:
        return "off (full fine-tuning)"
    words = f"r={lora.r} alpha={lora.alpha:g}"
    return f"{words} on {model_room.describe_lora_reach(model)}" if model is not None else words


def describe_plan(cfg: JobConfig, world_size: int) -> str:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    info = DistInfo(0, world_size, 0, min(world_size, 8), device, None)
    accum = accumulation_steps(cfg, world_size)
    model = meta_model(cfg)
    samples = cfg.train.micro_batch_size * accum * world_size
    train, data = cfg.train, cfg.data
    lines = [
        f"run dir          {cfg.run_dir}",
        f"world size       {world_size}",
        f"micro batch      {cfg.train.micro_batch_size} samples x {accum} accumulation x {world_size} ranks",
        f"global batch     {samples} samples, up to {samples * cfg.data.max_length:,} tokens per step",
        f"steps            {train.max_steps} (lr {train.lr:g}, {train.schedule}, warmup {train.warmup_steps})",
        f"precision        {precision.describe(precision.resolve(cfg, device), cfg.lora.enabled)}",
        f"lora             {_lora_words(cfg, model)}",
        f"checkpoints      {checkpoint_policy(cfg)}",
    ]
    if model is None:
        lines.append(
            f"parameters       unknown: {cfg.model.path} is not in the local HF cache (a dry run downloads nothing)"
        )
        strategy, why = auto_strategy(None, info, cfg) if cfg.dist.strategy == "auto" else (cfg.dist.strategy, "")
        lines.append(f"strategy         {strategy} (requested {cfg.dist.strategy}{': ' + why if why else ''})")
    else:
        total, trainable = model_room.parameter_counts(model)
        lines.append(f"parameters       {total:,} total, {trainable:,} trainable ({trainable / max(total, 1):.2%})")
        strategy = choose_strategy(cfg.dist.strategy, model, info)
        why = ""
        if cfg.dist.strategy == "auto":
            strategy, why = auto_strategy(model, info, cfg)
            why = f": {why}"
        lines.append(f"strategy         {strategy} (requested {cfg.dist.strategy}{why})")
        if strategy == "diloco":
            sites, outer = diloco.site_count(cfg, info), cfg.diloco
            inner = outer.inner
            if inner == "hsdp":
                replicas, shard = dist.hsdp_shape(info, cfg.dist.shard_size, world_size // sites)
                inner = f"hsdp: replicate {replicas} x shard {shard}"
            lines.append(
                f"diloco           {sites} sites x {world_size // sites} ranks ({inner} within a site), "
                f"sync every {outer.sync_every} steps "
                f"(outer lr {outer.outer_lr:g}, Nesterov {outer.outer_momentum:g}, {outer.pseudo_grad_dtype})"
            )
    if data.mixture:
        total = sum(source.weight for source in data.mixture)
        shares = ", ".join(f"{source.path} {source.weight / total:.0%}" for source in data.mixture)
        lines.append(
            f"data             mixture of {shares}; rows of {data.max_length} tokens, {data.mixture_exhausted} "
            "when a source runs out"
        )
        if cfg.train.total_tokens:
            lines.append(f"token budget     {cfg.train.total_tokens:,} tokens")
    else:
        lines.append(
            f"data             {data.path} ({data.format}, max_length {data.max_length}, packing {data.packing})"
        )
    lines.append(estimate.describe(cfg, world_size))
    return "\n".join(lines)


def check_world(cfg: JobConfig, nodes: int, per_node: int) -> None:
    """The job's shape at the world a cluster script asks for, checked when the script is written: a global
    batch, shard group or set of DiLoCo sites that does not divide it would otherwise fail only once the nodes
    are allocated and every rank has started."""
    world = nodes * per_node
    info = DistInfo(0, world, 0, per_node, torch.device("cpu"), None)
    accumulation_steps(cfg, world)
    if cfg.dist.strategy == "hsdp":
        dist.hsdp_shape(info, cfg.dist.shard_size, where=cfg.where("dist.shard_size"))
    if cfg.dist.strategy == "diloco":
        sites = diloco.site_count(cfg, info)
        if cfg.diloco.inner == "hsdp":
            dist.hsdp_shape(info, cfg.dist.shard_size, world // sites, where=cfg.where("dist.shard_size"))
