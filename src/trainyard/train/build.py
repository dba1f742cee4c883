"""The job's model, ready to train: built on the meta device (+ LoRA), a strategy chosen and checked
to fit before any weight is read, wrapped, then filled with each rank's own weights.

One function shared by training and `trainyard eval`, so both build exactly the same model.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from trainyard import dist, plan
from trainyard.config import JobConfig
from trainyard.config.preference import REFERENCE_FREE
from trainyard.diloco import outer as diloco
from trainyard.model import attention
from trainyard.model import build as model_room
from trainyard.model import quantize
from trainyard.model import source as source_room
from trainyard.model import weights
from trainyard.parallel import context_parallel, expert_parallel
from trainyard.parallel import parallelize as parallel
from trainyard.precision import Precision


def planned_context(cfg: JobConfig, info: dist.DistInfo, train_rows: Any) -> JobConfig:
    """The job with train.micro_batch_tokens and dist.context_parallel auto resolved as the dry run resolves them
    (plan.batching.micro_batch_tokens, plan.context_parallel, for the prepared rows on this machine), before the
    sampler, the accumulation or the mesh count its data ranks and micro-batches."""
    hardware, lengths = plan.this_hardware(info), plan.reading.prepared_lengths(cfg, train_rows)
    log = logging.getLogger("trainyard")
    cfg, why = plan.batching.micro_batch_tokens(cfg, hardware, lengths)
    if why:
        log.info("train.micro_batch_tokens auto -> %d: %s", cfg.train.micro_batch_tokens, why)
    resolved, why = plan.context_parallel(cfg, hardware, lengths)
    if why:
        log.info("dist.context_parallel auto -> %d: %s", resolved.dist.context_parallel, why)
    return resolved


def build_and_wrap(
    cfg: JobConfig,
    info: dist.DistInfo,
    precision: Precision,
    model_path: str | None,
    tokenizer: Any,
    forward_only: bool = False,
    train_rows: Any = None,
) -> tuple[torch.nn.Module, str, DeviceMesh | None]:
    """Meta-device model (+ LoRA) → strategy, checked to fit → mesh → wrap → each rank's own weights.
    Forward only (evaluation), DDP's replicas add nothing: FSDP stays, as it lets a big model fit. `train_rows`:
    the prepared training rows, whose largest micro-batch the strategy and the fit are planned for."""
    config = source_room.architecture(cfg.model, tokenizer, model_path)
    trainable_dtype = precision.trainable_dtype
    base_dtype = precision.frozen_dtype if cfg.lora.enabled else trainable_dtype
    where = cfg.where("model.attn_implementation")
    model = model_room.build_meta_model(cfg.model, config, base_dtype, info.device, not forward_only, where,
                                        attention.packed_rows(cfg.data))
    plan.batching.check_rows(cfg, model)
    nf4 = quantize.nf4_targets(model, base_dtype) if cfg.model.quantize == "nf4" else None
    if cfg.lora.enabled:
        from trainyard.model import lora as lora_room  # PEFT: a full fine-tune never loads it

        with lora_room.real_stand_ins(model, trainable_dtype):
            reference = cfg.train.objective == "dpo" and cfg.dpo.loss not in REFERENCE_FREE
            model = lora_room.apply_lora(model, cfg.lora, cfg.train.seed, reference=reference)
        logging.getLogger("trainyard").info(
            "lora r=%d alpha=%g on %s", cfg.lora.r, cfg.lora.alpha, lora_room.describe_lora_reach(model)
        )
    lengths = plan.reading.prepared_lengths(cfg, train_rows)
    strategy = plan.choose_strategy(cfg.dist.strategy, model, info)
    if cfg.dist.strategy == "auto" and info.distributed:
        strategy, why = plan.auto_strategy(model, info, cfg, lengths=lengths)
        logging.getLogger("trainyard").info("dist.strategy auto -> %s: %s", strategy, why)
    if forward_only and strategy == "diloco":
        strategy = cfg.diloco.inner
    if forward_only and strategy == "ddp":
        strategy = "none"
    sites = diloco.site_count(cfg, info) if strategy == "diloco" else None
    # `trainyard eval` reads a checkpoint as a run without EP wrote it (adapter file, whole expert stacks in DCP)
    ep, why = (1, "") if forward_only else plan.expert_parallel_size(cfg, info, strategy)
    if why:
        logging.getLogger("trainyard").info("dist.expert_parallel auto -> %d: %s", ep, why)
    shard = dist.hsdp_shape(info, cfg.dist.shard_size)[1] if strategy == "hsdp" else info.world_size
    if sites is not None:  # diloco: CP is carved out of a site's shard dimension
        shard = diloco.site_shard(cfg, info, sites)
    if ep > 1:
        expert_parallel.check(model, ep, strategy, shard, cfg.where("dist.expert_parallel"))
    cp = 1 if forward_only else cfg.dist.context_parallel  # `trainyard eval` runs whole rows on each rank
    assert cp != "auto", "dist.context_parallel auto is resolved first (planned_context)"
    context_parallel.check(model, cp, shard, cfg.data, cfg.where("dist.context_parallel"))
    mesh = dist.build_mesh(info, strategy, cfg.dist.shard_size, sites, cfg.diloco.inner, ep, cp)
    shards = mesh.size(-1) if mesh is not None and parallel.shards_within(strategy, cfg.diloco.inner) else 1
    plan.check_fits(strategy, cfg.dist.strategy, shards, model, info, cfg.where("dist.strategy"),
                    None if forward_only else cfg, lengths)
    if cfg.model.config is not None and info.local_world_size > 1:  # one whole model per node, not per rank
        init = model_room.random_init_file(cfg.model, config, cfg.train.seed, source_room.model_cache_dir(cfg.model))
        source: weights.SafetensorsFolder | weights.InMemory = weights.SafetensorsFolder.open(init.parent)
    elif cfg.model.config is not None:
        source = weights.InMemory(model_room.random_init(cfg.model, config, cfg.train.seed))
    else:
        assert model_path is not None
        source = weights.SafetensorsFolder.open(model_path, model)
    if nf4 is not None:
        if parallel.shards_within(strategy, cfg.diloco.inner):
            quantize.refuse_lone_shards(shards, info.world_size, cfg.where("dist.shard_size"))
        quantize.quantize_meta(model, set(nf4[0]), shards, info.device, weights.checkpoint_key, ep)
        logging.getLogger("trainyard").info("model.quantize nf4: %s", quantize.describe(*nf4))
    wrapped = parallel.apply(model, strategy, info, precision, source, mesh, cfg.diloco.inner,
                             cfg.model.gradient_checkpointing, cfg.train.compile, ep, cp)
    return wrapped, strategy, mesh
