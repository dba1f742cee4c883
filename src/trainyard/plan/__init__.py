"""The resolved plan of a job, computed without loading any weights (`train --dry-run`)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import psutil
import torch
import torch.distributed as torch_dist

from trainyard import dist, estimate, hardware, precision
from trainyard.batch import accumulation_steps, data_ranks
from trainyard.config import JobConfig
from trainyard.diloco import outer as diloco
from trainyard.dist import DistInfo
from trainyard.errors import ConfigError, ModelError, OptionError
from trainyard.estimate import arch as estimate_arch
from trainyard.estimate import memory as estimate_memory
from trainyard.estimate.timing import Lengths, dpo_reference
from trainyard.model import collation
from trainyard.model import attention, state_layers
from trainyard.model import build as model_room
from trainyard.model import nf4_experts, quantize
from trainyard.parallel import context_parallel as context_parallel_room
from trainyard.parallel import expert_parallel
from trainyard.parallel import parallelize as parallel
from trainyard.plan import batching, reading


def meta_model(cfg: JobConfig, device_type: str = "cpu") -> torch.nn.Module | None:
    """The job's model (with LoRA) on the meta device, as the estimate builds it, with the attention implementation
    the job gets on `device_type` and its state layers split as train's build splits them (a choice only the
    machine that trains can make, such as flash-attention's package, is left to it); None when its architecture is
    neither on this machine nor in the estimator's table."""
    try:
        model = estimate_arch.meta_model(cfg, estimate_arch.hf_config(cfg))
    except ModelError as err:
        if "not available offline" in err.what:
            return None
        raise
    packed = attention.packed_rows(cfg.data)
    attention.refuse_dropped(cfg.model.attn_implementation, model, cfg.where("model.attn_implementation"), packed)
    try:
        model.config._attn_implementation = attention.choose(cfg.model.attn_implementation, model,
                                                             torch.device(device_type), packed=packed)
    except ModelError:
        return model
    state_layers.install(model)
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
    from trainyard.model import lora as lora_room  # PEFT: only for a LoRA job

    return f"{words} on {lora_room.describe_lora_reach(model)}" if model is not None else words


# AdamW keeps two fp32 moments per trainable parameter.
_ADAM_BYTES_PER_PARAM = 8
# Replicated state may use at most this share of a device; the rest is activations.
_DDP_MEMORY_SHARE = 0.5


def device_memory_bytes(info: DistInfo) -> int:
    if info.device.type == "cuda":
        return torch.cuda.get_device_properties(info.device).total_memory
    return psutil.virtual_memory().total // max(info.local_world_size, 1)


def replicated_state_bytes(model: torch.nn.Module) -> int:
    """Weights + gradients + AdamW moments, as each DDP rank would hold them."""
    total = 0
    for param in model.parameters():
        size = param.numel() * param.element_size()
        total += size
        if param.requires_grad:
            total += size + param.numel() * _ADAM_BYTES_PER_PARAM
    return total


def choose_strategy(requested: str, model: torch.nn.Module, info: DistInfo, cfg: JobConfig | None = None) -> str:
    """The strategy to run; for `auto`, see auto_strategy. A strategy asked for by name is kept in a
    1-process group (one GPU still tests its wrapper)."""
    if requested != "auto":
        return requested if info.distributed or torch_dist.is_initialized() else "none"
    return auto_strategy(model, info, cfg)[0]


def auto_strategy(
    model: torch.nn.Module | None, info: DistInfo, cfg: JobConfig | None = None, device: int | None = None,
    lengths: Lengths = Lengths(),
) -> tuple[str, str]:
    """(strategy, why) for `dist.strategy: auto`: none alone; else the first of ddp, hsdp (several nodes:
    only gradients cross the slow link) and fsdp whose estimated peak per rank (weights, gradients, optimizer,
    activations, buffers: estimate.py) fits the device. Without a job the estimate can model, the replicated
    training state decides: ddp while it fits half a device. `device`: bytes per rank of the target when it is
    not this machine (a dry run for another cluster). `lengths`: the data's, whose largest micro-batch the peaks
    are for (unread: every row fills data.max_length)."""
    if info.world_size == 1:
        return "none", "one process"
    device = device or device_memory_bytes(info)
    if cfg is not None:
        try:
            batch = lengths.largest_micro_batch(cfg)
            chosen, peaks = estimate.auto_strategy(cfg, info.world_size, info.local_world_size, device, batch)
            said = ", ".join(f"{name} {peak / 2**30:.1f} GiB" for name, peak in peaks)
            return chosen, f"estimated peak per rank {said}, of {device / 2**30:.1f} GiB"
        except (ModelError, ConfigError, OptionError, OSError, ValueError) as err:
            reason = f"no estimate ({str(err).splitlines()[0]}); replicated state decides: "
    else:
        reason = "replicated state decides: "
    if model is None:
        return "auto", reason + "unknown before the model is built"
    state, budget = replicated_state_bytes(model), _DDP_MEMORY_SHARE * device
    reason += f"{state / 2**30:.2f} GiB of weights, gradients and AdamW state, budget {budget / 2**30:.1f} GiB"
    if state <= budget:
        return "ddp", reason
    several_nodes = info.world_size > info.local_world_size
    return ("hsdp" if several_nodes and state / info.local_world_size <= budget else "fsdp"), reason


def check_fits(
    strategy: str, requested: str, shards: int, model: torch.nn.Module, info: DistInfo, where: str | None,
    cfg: JobConfig | None = None, lengths: Lengths = Lengths(),
) -> None:
    """Refuse, before any weight is read, a plan whose training state cannot fit a device, then (given the job)
    one whose estimated peak does not: the dry run's rule (`does_not_fit`), for the data's largest micro-batch.
    `shards`: how many ranks the state is divided over (1 for ddp, the shard group for hsdp)."""
    _check_state_fits(strategy, requested, shards, model, info, where)
    if cfg is None:
        return
    hardware = this_hardware(info)
    if hardware is None:
        logging.getLogger("trainyard").info("no estimate to check the fit by: %s is not a known GPU kind",
                                            torch.cuda.get_device_name(info.device))
        return
    planned = cfg.model_copy(deep=True)
    planned.dist.strategy = strategy  # auto as it was resolved here
    try:
        result = estimate.estimate(planned, hardware, lengths=lengths)
    except (ModelError, ConfigError, OptionError, OSError, ValueError) as err:
        logging.getLogger("trainyard").info("no estimate to check the fit by: %s", str(err).splitlines()[0])
        return
    problem = does_not_fit(result)
    if problem:
        raise ConfigError(problem, where=where, fix="see `trainyard train CONFIG --dry-run` for the whole plan")
    batch = result.micro_batch
    logging.getLogger("trainyard").info(
        "planned peak %s MiB a rank (%s)%s: the train events' peak_memory_bytes say what ran",
        f"{result.memory.peak / 2**20:,.0f}", "RSS" if info.device.type == "cpu" else "device memory",
        f", for a micro-batch of {batch.tokens:,} tokens ({batch.source})" if batch else "")


def this_hardware(info: DistInfo) -> estimate.Hardware | None:
    """This machine as the estimate knows it; None for a GPU not in its table."""
    kind = estimate.this_gpu() if info.device.type == "cuda" else "cpu"
    if info.device.type == "cuda" and kind == "cpu":
        return None
    nodes = math.ceil(info.world_size / max(info.local_world_size, 1))
    return estimate.Hardware(kind, max(info.local_world_size, 1), nodes)


def context_parallel(cfg: JobConfig, hardware: estimate.Hardware | None,
                     lengths: Lengths = Lengths()) -> tuple[JobConfig, str]:
    """The job with dist.context_parallel as it runs, and for auto why: the estimate's rule
    (estimate.context_parallel_auto) on the hardware the job runs on, decided here for the dry run and `train` before
    anything counts the data ranks, the accumulation or the mesh from it (the estimate applies the same rule to
    itself); 1 where no estimate can tell (hardware None: a GPU the estimate does not know)."""
    if cfg.dist.context_parallel != "auto":
        return cfg, ""
    try:
        if hardware is not None:
            return estimate.context_parallel_auto(cfg, hardware, lengths=lengths)
        why = "no estimate: this GPU is not a kind the estimate knows"
    except (ModelError, ConfigError, OptionError, OSError, ValueError) as err:
        why = f"no estimate ({str(err).splitlines()[0]})"
    alone = cfg.model_copy(deep=True)
    alone.dist.context_parallel = 1
    return alone, why


def does_not_fit(result: estimate.Estimate) -> str | None:
    """Why a plan cannot run, in words, or None when its estimated process peak fits the device: the one rule by
    which both `train --dry-run` and `train` refuse a job."""
    if result.fits:
        return None
    batch = result.micro_batch
    planned = f", planned for a micro-batch of {batch.tokens:,} tokens ({batch.source})" if batch else ""
    return (f"the plan does not fit: peak {result.memory.peak / 2**30:.1f} GiB per device{planned}, "
            f"{result.layout.gpu.name} has {result.device_bytes / 2**30:.1f} GiB (cheapest fix: {result.fix})")


def _check_state_fits(
    strategy: str, requested: str, shards: int, model: torch.nn.Module, info: DistInfo, where: str | None
) -> None:
    """Weights, gradients and AdamW state alone, whatever the estimate knows of the model."""
    state = replicated_state_bytes(model)
    per_rank = state / shards
    device = device_memory_bytes(info)
    if per_rank <= device:
        return
    gib = 2**30
    sharded = state / info.world_size
    fix = (
        f"use dist.strategy: fsdp (about {sharded / gib:.1f} GiB per rank over {info.world_size} ranks)"
        if sharded <= device
        else f"use more ranks (at least {int(state // device) + 1} for fsdp), LoRA, or a smaller model"
    )
    raise ConfigError(
        f"dist.strategy {requested}{f' ({strategy} on {info.world_size} rank)' if strategy != requested else ''}: "
        f"weights, gradients and AdamW state need about {per_rank / gib:.1f} GiB per rank, "
        f"more than the {device / gib:.1f} GiB of {info.device.type} memory each rank has",
        where=where,
        fix=fix,
    )


@dataclass(frozen=True)
class Target:
    """Where a job is planned for: a device kind and the cluster's shape, not necessarily this machine."""

    gpu: str
    gpus_per_node: int
    nodes: int

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    @classmethod
    def here(cls, world_size: int) -> Target:
        """This machine's device kind, 8 ranks per node."""
        per_node = min(world_size, 8)
        return cls(estimate.this_gpu(), per_node, math.ceil(world_size / per_node))


def dry_run(cfg: JobConfig, target: Target, read_data: bool = True) -> tuple[str, list[str]]:
    """Everything that can be known before the nodes are allocated, for `target`: the plan, the data (read and
    encoded as training will), the resume point and the fit. Raises PlanError, after the plan is printed by the
    caller, when the job cannot run as planned."""
    problems: list[str] = []
    cfg = cfg.model_copy(deep=True)  # train.epochs sets max_steps from the rows the survey counts
    found = None
    if read_data:
        found, data_lines, lengths = reading.survey_data(cfg, problems)
    else:
        data_lines = ["data             not read here (--skip-data-check)"]
        lengths = Lengths(batch_why="--skip-data-check, the data was not read")
    cfg, tokens_why = batching.micro_batch_tokens(cfg, _hardware(target), lengths)  # before what counts its batch
    if found is not None:  # over the data ranks of the CP size those lengths decide
        context = context_parallel(cfg, _hardware(target), lengths)[0]
        data_lines = reading.data_lines(cfg, found, data_ranks(context, target.world))
    text = describe_plan(cfg, target.world, target, lengths, data_lines, tokens_why)
    _, result = estimate.describe(cfg, _hardware(target), lengths)
    problem = does_not_fit(result) if result is not None else None
    if problem:
        problems.append(problem)
    lines = [text, f"resume           {reading.resume_words(cfg, problems)}"]
    return "\n".join(lines), problems


def _hardware(target: Target) -> estimate.Hardware:
    return estimate.Hardware(target.gpu, target.gpus_per_node, target.nodes)


def _steps_words(train: Any) -> str:
    if train.epochs is None:
        return str(train.max_steps)
    if train.epoch_rows is None:
        return f"from train.epochs {train.epochs:g} once the rows are counted (the data was not read)"
    return f"{train.max_steps} (train.epochs {train.epochs:g} over {train.epoch_rows:,} rows)"


def precision_on(cfg: JobConfig, target: Target) -> precision.Precision:
    """train.precision on the target's devices (a GPU kind never asked of this machine's torch)."""
    if target.gpu == "cpu":
        return precision.resolve(cfg, torch.device("cpu"))
    return estimate_memory.resolve_precision(cfg, hardware.gpu(target.gpu))


def _global_batch_words(cfg: JobConfig, samples: int) -> str:
    if cfg.train.objective == "dpo":  # each of a pair's two documents is cut at max_length
        return f"{samples} pairs, up to {2 * samples * cfg.data.max_length:,} tokens per step"
    return f"{samples} samples, up to {samples * cfg.data.max_length:,} tokens per step"


def _objective_words(cfg: JobConfig) -> str:
    if cfg.train.objective == "sft":
        return "sft: cross-entropy on the target tokens"
    dpo = cfg.dpo
    settings = [f"beta {dpo.beta:g}"] + ([f"label_smoothing {dpo.label_smoothing:g}"] if dpo.label_smoothing else [])
    if dpo.loss == "simpo":
        settings.append(f"simpo_gamma {dpo.simpo_gamma:g}")
    reference = {"adapters": "the model with its LoRA adapters off",
                 "precomputed": "the initial model's log-probabilities, computed before the first step",
                 None: "none (reference-free)"}[dpo_reference(cfg)]
    return f"dpo, loss {dpo.loss} ({', '.join(settings)}); reference: {reference}"


def describe_plan(
    cfg: JobConfig,
    world_size: int,
    target: Target | None = None,
    lengths: Lengths = Lengths(),
    data_lines: list[str] | None = None,
    tokens_why: str = "",
) -> str:
    """The plan's lines; `data_lines`: what a survey of the data found, in place of the data settings; `tokens_why`:
    how train.micro_batch_tokens auto was resolved (plan.batching, before `cfg` came here)."""
    target = target or Target.here(world_size)
    info = DistInfo(0, world_size, 0, target.gpus_per_node, torch.device("cpu"), None)
    device_bytes = hardware.device_bytes(hardware.gpu(target.gpu), target.gpus_per_node)
    context, context_why = context_parallel(cfg, _hardware(target), lengths)
    context_size = context.dist.context_parallel
    ranks = data_ranks(context, world_size)
    accum = accumulation_steps(context, ranks)
    model = meta_model(cfg, "cpu" if target.gpu == "cpu" else "cuda")
    samples = cfg.train.micro_batch_size * accum * ranks
    train, data = cfg.train, cfg.data
    lines = [
        f"run dir          {cfg.run_dir}",
        f"world size       {world_size}",
        batching.micro_batch_words(cfg, accum, _ranks_words(context_size, ranks), tokens_why, lengths),
        f"global batch     {_global_batch_words(cfg, samples)}",
        f"objective        {_objective_words(cfg)}",
        f"steps            {_steps_words(train)} (lr {train.lr:g}, {train.schedule}, warmup {train.warmup_steps})",
        f"precision        {precision.describe(precision_on(cfg, target), cfg.lora.enabled)}",
        f"lora             {_lora_words(cfg, model)}",
        f"checkpoints      {checkpoint_policy(cfg)}",
    ]
    if model is None:
        lines.append(
            f"parameters       unknown: {cfg.model.path} is not in the local HF cache (a dry run downloads nothing)"
        )
        strategy, why = (auto_strategy(None, info, cfg, device_bytes, lengths) if cfg.dist.strategy == "auto"
                         else (cfg.dist.strategy, ""))
        lines.append(f"strategy         {strategy} (requested {cfg.dist.strategy}{': ' + why if why else ''})")
    else:
        total, trainable = model_room.parameter_counts(model)
        lines.append(f"parameters       {total:,} total, {trainable:,} trainable ({trainable / max(total, 1):.2%})")
        strategy = cfg.dist.strategy if world_size > 1 else "none"
        why = ""
        if cfg.dist.strategy == "auto":
            strategy, why = auto_strategy(model, info, cfg, device_bytes, lengths)
            why = f": {why}"
        lines.append(f"strategy         {strategy} (requested {cfg.dist.strategy}{why})")
        if cfg.dist.expert_parallel != 1 and world_size > 1:
            lines.append(_experts_words(cfg, model, info, strategy, target.gpu))
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
    if cfg.model.quantize == "nf4" and parallel.shards_within(strategy, cfg.diloco.inner):  # as the build refuses it
        shards = estimate_memory.shard_size(cfg, strategy, world_size, target.gpus_per_node)
        quantize.refuse_lone_shards(shards, world_size, cfg.where("dist.shard_size"))
    lines += _context_lines(context_size, context_why, model, cfg)
    if data.mixture:
        total = sum(source.weight for source in data.mixture)
        shares = ", ".join(f"{source.path} {source.weight / total:.0%}" for source in data.mixture)
        lines.append(
            f"data             mixture of {shares}; rows of {data.max_length} tokens, {data.mixture_exhausted} "
            "when a source runs out"
        )
        if cfg.train.total_tokens:
            lines.append(f"token budget     {cfg.train.total_tokens:,} tokens")
    elif data_lines:
        lines += data_lines
    else:
        lines.append(
            f"data             {data.path} ({data.format}, max_length {data.max_length}, packing {data.packing})"
        )
    if not data.padding_free and attention.packed_rows(data) and cfg.model.attn_implementation in ("auto",
                                                                                                    *attention.FLASH):
        lines.append("attention        packed rows reach flash-attention as one padding-free row per micro-batch "
                     "(its varlen path keeps documents apart only in a batch of one row)")
    if model is not None and (padded := collation.padded_rows(model, data)):
        lines.append(f"attention        padded rows: {padded}")
    elif model is not None and collation.one_row(model.config._attn_implementation, data, model) and (
            split := state_layers.split_classes(model)):
        lines.append(f"state layers     {', '.join(split)} run each document of the padding-free row on its own")
    batching.check_rows(cfg, model)
    if model is not None and cfg.train.objective == "dpo":
        collation.check_pair_rows(model)
    lines.append(estimate.describe(cfg, _hardware(target), lengths)[0])
    return "\n".join(lines)


def expert_parallel_size(cfg: JobConfig, info: DistInfo, strategy: str, gpu: str | None = None) -> tuple[int, str]:
    """(EP size, why) the job runs: dist.expert_parallel as given, or for auto the estimate's choice on `gpu`
    (default: this machine's kind): the largest size within a node that divides the experts and the shard group
    where the all-to-all moves fewer bytes than FSDP2's gathers of the experts; 1 for a dense model."""
    requested = cfg.dist.expert_parallel
    if requested != "auto":
        return requested, ""
    if info.world_size == 1:
        return 1, "one process"
    shard = dist.hsdp_shape(info, cfg.dist.shard_size)[1] if strategy == "hsdp" else info.world_size
    try:
        model = estimate_memory.model_of(cfg)
    except (ModelError, ConfigError) as err:
        return 1, f"no estimate ({err.what})"
    kind = hardware.gpu(gpu or estimate.this_gpu())
    return estimate_memory.expert_parallel(cfg, model, kind, strategy, shard, info.local_world_size, info.world_size)


def _experts_words(cfg: JobConfig, model: torch.nn.Module, info: DistInfo, strategy: str, gpu: str) -> str:
    """dist.expert_parallel resolved and checked against the model and the shard dimension, and what each rank
    holds."""
    ep, why = expert_parallel_size(cfg, info, strategy, gpu)
    requested = "" if cfg.dist.expert_parallel != "auto" else f" (requested auto: {why})"
    if ep == 1:
        return f"experts          no expert parallelism{requested}"
    shard = dist.hsdp_shape(info, cfg.dist.shard_size)[1] if strategy == "hsdp" else info.world_size
    expert_parallel.check(model, ep, strategy, shard, cfg.where("dist.expert_parallel"))
    if cfg.model.quantize == "nf4" and nf4_experts.quantizable_stacks(model):  # as the build refuses it
        nf4_experts.refuse_lone_expert_shards(shard, ep, cfg.where("dist.expert_parallel"))
    experts = expert_parallel.find_expert_stacks(model)[0].experts.num_experts
    further = f"sharded further over {shard // ep} ranks" if shard > ep else "not sharded further"
    return (f"experts          expert parallel {ep}: each rank holds {experts // ep} of the {experts} routed experts "
            f"of each MoE layer (tokens sent to them by all-to-all), {further}{requested}")


def _ranks_words(size: int, ranks: int) -> str:
    """The ranks that read rows: under context parallelism, each group of dist.context_parallel ranks is one."""
    return f"{ranks} ranks" if size == 1 else f"{ranks} data ranks (context-parallel groups of {size} ranks)"


def _context_lines(size: int, why: str, model: torch.nn.Module | None, cfg: JobConfig) -> list[str]:
    """dist.context_parallel as resolved, checked against the model's family and layers (`train` refuses the same
    before any weight is read), and for auto why."""
    requested = f" (requested auto: {why})" if why else ""
    if size == 1:
        return [f"context          no context parallelism{requested}"] if why else []
    if model is not None:
        context_parallel_room.refuse_family(model, size, cfg.where("dist.context_parallel"))
    return [f"context          context parallel {size}: each rank holds 1/{size} of every row's tokens and attends "
            f"whole documents for heads / {size} (an all-to-all around each attention){requested}"]


def check_world(cfg: JobConfig, nodes: int, per_node: int) -> None:
    """The job's shape at the world a cluster script asks for, checked when the script is written: a global
    batch, shard group or set of DiLoCo sites that does not divide it would otherwise fail only once the nodes
    are allocated and every rank has started."""
    world = nodes * per_node
    info = DistInfo(0, world, 0, per_node, torch.device("cpu"), None)
    accumulation_steps(cfg, data_ranks(cfg, world))
    if cfg.dist.strategy == "hsdp":
        dist.hsdp_shape(info, cfg.dist.shard_size, where=cfg.where("dist.shard_size"))
    if cfg.dist.strategy == "diloco":
        sites = diloco.site_count(cfg, info)
        if cfg.diloco.inner == "hsdp":
            dist.hsdp_shape(info, cfg.dist.shard_size, world // sites, where=cfg.where("dist.shard_size"))
