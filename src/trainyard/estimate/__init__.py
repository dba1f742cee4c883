"""`trainyard estimate` and the estimate `train --dry-run` prints: will the job fit each device, how long a step
and the job take, what it costs, and, when it does not fit, the cheapest change that makes it fit.

Nothing is loaded: the model is built on the meta device (arch.py), memory follows memory.py's parts and time
timing.py's FLOP and bandwidth model. Every constant there is stated where it is defined. The estimate never imports
torch.distributed, the training loop, checkpoints or the plan: the plan reads it, never the reverse.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import ValidationError

from trainyard import hardware as machines  # `hardware` names the Hardware a function plans for
from trainyard.batch import accumulation_steps, data_ranks, steps_for_epochs
from trainyard.config import JobConfig
from trainyard.errors import ConfigError, ModelError, OptionError
from trainyard.estimate import efficiency
from trainyard.estimate import host as host_room
from trainyard.estimate import memory as mem
from trainyard.estimate import timing as estimate_time
from trainyard.estimate.context import CONTEXT_STRATEGIES
from trainyard.estimate.words import (  # noqa: F401  Estimate, render, to_json: estimate.Estimate, ...
    Estimate, compile_words, micro_batch_words, process_peak_words, reference_words, render,
    size_words, to_json, traffic_words)
from trainyard.model.documents import CONTEXT_PARALLEL_FAMILIES

# How far "more GPUs" looks for a layout that fits, in nodes.
MAX_NODES = 64


@dataclass(frozen=True)
class Hardware:
    """Where the job would run."""

    gpu: str
    gpus_per_node: int = 1
    nodes: int = 1
    network_gbps: float | None = None
    """Inter-node bandwidth of one node's link, Gb/s; None: what dist.network and the device kind imply."""


@dataclass(frozen=True)
class Assumptions:
    """The figures an estimate cannot know, each with a stated default."""

    mfu: float | None = None
    """--mfu: the MFU a step is priced at; None: measured for the job's path and GPU where it was, else assumed
    (estimate/efficiency.py)."""
    diloco_h: int = 1
    """Cross-node gradient sync every H steps (DiLoCo's outer steps); 1: every step."""
    disk_gbytes_s: float = estimate_time.DEFAULT_DISK_GBYTES_S
    price_per_gpu_hour: float | None = None
    spot_discount: float = 0.0


def check_options(hardware: Hardware, assumptions: Assumptions) -> None:
    """Numbers an estimate cannot use fail with exit 2, naming the option."""
    machines.gpu(hardware.gpu)
    positive = {"--gpus-per-node": hardware.gpus_per_node, "--nodes": hardware.nodes,
                "--disk-gbytes-s": assumptions.disk_gbytes_s, "--diloco-h": assumptions.diloco_h}
    if hardware.network_gbps is not None:
        positive["--network-gbps"] = hardware.network_gbps
    if assumptions.price_per_gpu_hour is not None:
        positive["--price-per-gpu-hour"] = assumptions.price_per_gpu_hour
    for option, value in positive.items():
        if not value > 0:
            raise OptionError(f"{option} {value:g} must be a positive number", fix=f"pass {option} greater than 0")
    if assumptions.mfu is not None and not 0 < assumptions.mfu <= 1:
        raise OptionError(f"--mfu {assumptions.mfu:g} must be a fraction in (0, 1]", fix="for example --mfu 0.4")
    if not 0 <= assumptions.spot_discount < 1:
        raise OptionError(f"--spot-discount {assumptions.spot_discount:g} must be a fraction in [0, 1)",
                          fix="for example --spot-discount 0.6 for spot at 40% of the on-demand price")
    if assumptions.spot_discount and assumptions.price_per_gpu_hour is None:
        raise OptionError("--spot-discount needs --price-per-gpu-hour (the on-demand price it discounts)",
                          fix="add --price-per-gpu-hour, e.g. --price-per-gpu-hour 2.5")


def estimate(cfg: JobConfig, hardware: Hardware, assumptions: Assumptions = Assumptions(),
             model: mem.Model | None = None, suggest: bool = True,
             lengths: estimate_time.Lengths = estimate_time.Lengths()) -> Estimate:
    """The whole estimate of a job on `hardware`; `suggest`: also search the cheapest change when it does not fit.
    `lengths`: the data's document lengths, when it was read (else every row is taken to fill max_length)."""
    check_options(hardware, assumptions)
    kind = machines.gpu(hardware.gpu)
    if hardware.network_gbps is None:
        network_gbps, network = machines.network_of(kind, cfg.dist.network)
    else:
        network_gbps, network = hardware.network_gbps, "--network-gbps"
    model = model or mem.model_of(cfg)
    cfg, context_why = context_parallel_auto(cfg, hardware, model, lengths)
    batch = lengths.largest_micro_batch(cfg)
    if cfg.dist.strategy == "auto" and hardware.gpus_per_node * hardware.nodes > 1:
        device = mem.device_bytes(kind, hardware.gpus_per_node)
        strategy = auto_strategy(cfg, hardware.gpus_per_node * hardware.nodes, hardware.gpus_per_node, device,
                                 batch)[0]
        cfg = _with(cfg, **{"dist.strategy": strategy})
    layout = mem.resolve_strategy(cfg, model, kind, hardware.gpus_per_node, hardware.nodes)
    precision = mem.resolve_precision(cfg, kind)
    size = mem.dtypes(cfg, precision, layout.strategy)
    accum = accumulation_steps(cfg, data_ranks(cfg, layout.world))
    memory = mem.memory(cfg, model, layout, precision, batch)
    priced = efficiency.efficiency(cfg, model, layout.gpu, precision.name, estimate_time.compiles(cfg, layout),
                                   assumptions.mfu)
    timed = estimate_time.timing(cfg, model, layout, size, accum, priced, network_gbps,
                                 assumptions.diloco_h, assumptions.disk_gbytes_s, lengths)
    result = Estimate(
        layout=layout,
        precision=precision.name,
        accumulation=accum,
        total_params=model.counts.total,
        trainable_params=model.counts.trainable,
        memory=memory,
        timing=timed,
        cost=estimate_time.cost(timed, layout, assumptions.price_per_gpu_hour, assumptions.spot_discount),
        network=f"{network_gbps:g} Gb/s per node ({network})" if layout.nodes > 1 else "one node: no inter-node link",
        lengths=lengths.source,
        micro_batch=batch,
        efficiency=priced,
        context_parallel_why=context_why,
    )
    if suggest and not result.fits:
        result.fix = cheapest_fix(cfg, model, hardware, lengths)
    return result


def host_memory(cfg: JobConfig, hardware: Hardware) -> host_room.HostMemory:
    """Host memory one node of the job needs (what a pod or an allocation requests)."""
    result = estimate(cfg, hardware, suggest=False)
    return host_room.host_memory(cfg, result.memory, result.layout.gpu, hardware.gpus_per_node,
                                 result.total_params, result.trainable_params)


def planned_peak(cfg: JobConfig, strategy: str, world: int, per_node: int, device_bytes: int,
                 batch: mem.MicroBatch | None = None) -> int:
    """The job's predicted peak bytes per rank under `strategy` on `world` ranks, `per_node` of them per node,
    on devices of `device_bytes`, for the micro-batch `batch` (default: mem.micro_batch_bound): what
    `dist.strategy: auto` (plan.choose_strategy) decides from; without CP where dist.context_parallel is auto (it is
    resolved on the strategy chosen: context_parallel_auto)."""
    whole = {"dist.context_parallel": 1} if cfg.dist.context_parallel == "auto" else {}
    planned = _with(cfg, **whole, **{"dist.shard_size": None, "dist.strategy": strategy})
    model = mem.model_of(cfg)
    kind = machines.Gpu("planned", device_bytes, "planned", 0.0)
    layout = mem.resolve_strategy(planned, model, kind, per_node, math.ceil(world / per_node))
    precision = mem.resolve_precision(cfg, kind)  # as on a GPU: auto is bf16-mixed
    return mem.memory(planned, model, layout, precision, batch).peak


def auto_strategy(cfg: JobConfig, world: int, per_node: int, device_bytes: int,
                  batch: mem.MicroBatch | None = None) -> tuple[str, list[tuple[str, int]]]:
    """dist.strategy auto, the one rule of the dry run, the estimate and `train`: the first of ddp, hsdp (several
    nodes: only gradients cross the slow link) and fsdp whose estimated peak per rank fits the device; with the
    peaks tried, in that order."""
    peaks: list[tuple[str, int]] = []
    for candidate in ["ddp", *(["hsdp"] if world > per_node else []), "fsdp"]:
        peaks.append((candidate, planned_peak(cfg, candidate, world, per_node, device_bytes, batch)))
        if peaks[-1][1] <= device_bytes:
            break
    return peaks[-1][0], peaks


def fits(cfg: JobConfig, strategy: str, world: int, device_bytes: int) -> bool:
    """Whether the job's peak fits `device_bytes` per rank under `strategy` on `world` ranks (8 per node)."""
    return planned_peak(cfg, strategy, world, min(world, 8), device_bytes) <= device_bytes


def _with(cfg: JobConfig, **changes: Any) -> JobConfig:
    """A copy of the job with dotted fields changed in order (each validated as an override would be)."""
    changed = cfg.model_copy(deep=True)
    for dotted, value in changes.items():
        section, name = dotted.split(".")
        setattr(getattr(changed, section), name, value)
    return changed


def _candidates(cfg: JobConfig, hardware: Hardware, shape: mem.Shape) -> list[tuple[str, JobConfig, Hardware]]:
    """Changes in the order they cost least: activation checkpointing (kept for the rest), then a smaller
    micro-batch, then fsdp instead of ddp, then each document split over N of a node's GPUs (context parallelism),
    then (a LoRA job) its frozen base in 4 bits, then more nodes under fsdp. LoRA is never proposed: it changes the
    job."""
    steps: list[tuple[str, JobConfig, Hardware]] = []
    words: list[str] = []
    if not cfg.model.gradient_checkpointing:
        cfg = _with(cfg, **{"model.gradient_checkpointing": True})
        words.append("model.gradient_checkpointing=true")
        steps.append((" ".join(words), cfg, hardware))
    micro = cfg.train.micro_batch_size
    while micro > 1:
        micro //= 2
        smaller = _with(cfg, **{"train.micro_batch_size": micro})
        steps.append((" ".join([*words, f"train.micro_batch_size={micro}"]), smaller, hardware))
    alone = hardware.gpus_per_node * hardware.nodes == 1
    one_gpu = (list(words), cfg)  # what a lone GPU runs: fsdp changes nothing there
    if cfg.dist.strategy not in ("fsdp", "hsdp"):
        cfg = _with(cfg, **{"dist.shard_size": None, "dist.strategy": "fsdp"})
        words.append("dist.strategy=fsdp")
        if not alone:
            steps.append((" ".join(words), cfg, hardware))
    if not alone:
        steps += _context_steps(words, cfg, hardware, shape)
    steps += _nf4_step(*(one_gpu if alone else (words, cfg)), hardware)
    for nodes in range(hardware.nodes + 1, MAX_NODES + 1):
        more = Hardware(hardware.gpu, hardware.gpus_per_node, nodes, hardware.network_gbps)
        steps.append((" ".join([*words, f"--nodes {nodes}"]), cfg, more))
    return steps


def _context_steps(words: list[str], cfg: JobConfig, hardware: Hardware,
                   shape: mem.Shape) -> list[tuple[str, JobConfig, Hardware]]:
    """A document too long for one device's activations: its tokens split over N GPUs of a node (the all-to-alls
    stay inside it), the least N first, where the job's rules and the family allow context parallelism."""
    if cfg.dist.context_parallel != 1:
        return []
    splits, _ = context_splits(cfg, hardware, shape)
    return [(" ".join([*words, f"dist.context_parallel={size}"]), split, hardware) for size, split in splits]


def context_splits(cfg: JobConfig, hardware: Hardware, shape: mem.Shape) -> tuple[list[tuple[int, JobConfig]], str]:
    """The CP sizes a job of dist.strategy fsdp/hsdp can take on `hardware`, least first, each with the job at that
    size: those dividing a node's GPUs, the shard group and the heads, where the family and the job's rules allow
    CP; else why none."""
    if shape.family not in CONTEXT_PARALLEL_FAMILIES:
        return [], f"context parallelism is not proven exact for {shape.family}"
    gpus = hardware.gpus_per_node
    shard = mem.shard_size(cfg, cfg.dist.strategy, gpus * hardware.nodes, gpus)
    splits = []
    for size in range(2, gpus + 1):
        if gpus % size or shard % size or shape.heads % size:
            continue
        try:  # the job's own rules (no orpo, padding-free rows, EP a multiple of CP), as loading the file would apply
            split = _with(cfg, **{"dist.context_parallel": size})
            type(cfg).model_validate(split.model_dump(by_alias=True))
        except ValidationError as err:
            return [], err.errors()[0]["msg"].removeprefix("Value error, ")
        except ConfigError as err:
            return [], err.what
        splits.append((size, split))
    if not splits:
        return [], f"no size divides a node's {gpus} GPUs, the shard group ({shard}) and the {shape.heads} heads"
    return splits, ""


def context_parallel_auto(cfg: JobConfig, hardware: Hardware, model: mem.Model | None = None,
                          lengths: estimate_time.Lengths = estimate_time.Lengths()) -> tuple[JobConfig, str]:
    """dist.context_parallel auto, the one rule of the dry run, the estimate and `train` (plan.context_parallel): 1
    where the job fits a device as it is; else the fewest of a node's GPUs whose split of every row makes it fit (the
    cheapest fix's CP step, the rest of the job unchanged); 1 where none does or the job cannot run CP. The job with
    that size, and why; a size above 1 comes with the strategy (and EP size) it was planned under, which CP needs
    set. A job that names a size comes back as it is."""
    if cfg.dist.context_parallel != "auto":
        return cfg, ""
    alone = _with(cfg, **{"dist.context_parallel": 1})
    if hardware.gpus_per_node * hardware.nodes == 1:
        return alone, "one process"
    model = model or mem.model_of(cfg)
    whole = estimate(alone, hardware, model=model, suggest=False, lengths=lengths)
    as_it_is = (f"peak {whole.memory.peak / machines.GIB:.1f} GiB per device as it is, of "
                f"{whole.device_bytes / machines.GIB:.1f}")
    if whole.fits:
        return alone, f"the job fits without it ({as_it_is})"
    layout = whole.layout
    if layout.strategy not in CONTEXT_STRATEGIES:
        return alone, f"the job does not fit ({as_it_is}), but CP is carved out of fsdp/hsdp, not {layout.strategy}"
    planned = _with(alone, **{"dist.shard_size": cfg.dist.shard_size if layout.strategy == "hsdp" else None,
                              "dist.strategy": layout.strategy, "dist.expert_parallel": layout.expert_parallel})
    splits, why = context_splits(planned, hardware, model.shape)
    if not splits:
        return alone, f"the job does not fit ({as_it_is}), but {why}"
    for size, split in splits:
        attempt = estimate(split, hardware, model=model, suggest=False, lengths=lengths)
        peak = f"peak {attempt.memory.peak / machines.GIB:.1f} GiB"
        if attempt.fits:
            train = split.train
            if train.epochs is not None and train.epoch_rows:  # the steps over the rows of world / N data ranks
                train.max_steps = steps_for_epochs(split, train.epoch_rows, data_ranks(split, layout.world))
            return split, (f"the job does not fit ({as_it_is}); {size} of a node's {hardware.gpus_per_node} GPUs "
                           f"are the fewest whose split fits it ({peak})")
    return alone, (f"the job does not fit ({as_it_is}), nor split over a node's {hardware.gpus_per_node} GPUs "
                   f"({peak} at context parallel {size})")


def _nf4_step(words: list[str], cfg: JobConfig, hardware: Hardware) -> list[tuple[str, JobConfig, Hardware]]:
    """A LoRA job's frozen base in 4 bits (model.quantize nf4), where the job's config allows it: its one step, or
    none."""
    if cfg.model.quantize != "none":
        return []
    quantized = _with(cfg, **{"model.quantize": "nf4"})
    try:  # the job's own rules for nf4 (config/job.py), as loading the changed file would apply them
        type(cfg).model_validate(quantized.model_dump(by_alias=True))
    except (ValidationError, ConfigError):
        return []
    return [(" ".join([*words, "model.quantize=nf4"]), quantized, hardware)]


def cheapest_fix(cfg: JobConfig, model: mem.Model, hardware: Hardware,
                 lengths: estimate_time.Lengths = estimate_time.Lengths()) -> str:
    """The first change (with those before it) whose estimate fits, in words and as overrides."""
    for words, changed, where in _candidates(cfg, hardware, model.shape):
        try:
            attempt = estimate(changed, where, model=model, suggest=False, lengths=lengths)
        except ConfigError:  # e.g. a global batch that a smaller micro-batch no longer divides
            continue
        if attempt.fits:
            return f"{words} (peak {attempt.memory.peak / machines.GIB:.1f} GiB per device)"
    return f"nothing up to {MAX_NODES} nodes: a smaller model, or LoRA"


def describe(cfg: JobConfig, hardware: Hardware,
             lengths: estimate_time.Lengths = estimate_time.Lengths()) -> tuple[str, Estimate | None]:
    """The estimate lines `train --dry-run` prints for the target hardware, and the estimate (None: unknown)."""
    try:
        result = estimate(cfg, hardware, lengths=lengths)
    except (ModelError, ConfigError) as err:
        return f"estimate         unknown: {err.what}", None
    verdict = "fits" if result.fits else "does NOT fit"
    where = f"{hardware.nodes} x {hardware.gpus_per_node} {hardware.gpu}"
    line = (f"estimate         process peak {size_words(result.memory.peak)} ({process_peak_words(result.layout)}; "
            f"live tensors {size_words(result.memory.peak_tensor_bytes)}) of {size_words(result.device_bytes)} per "
            "device"
            f" on {where}"
            f" ({verdict}), planned for a micro-batch of {micro_batch_words(result.micro_batch)}"
            f"; step {result.timing.step_s:.3g} s at {result.efficiency.words()}, "
            f"{result.timing.tokens_per_step:,} tokens ({result.lengths}){compile_words(result)}; "
            f"network {result.network}"
            f"\ntraffic          {traffic_words(result, why=False)}")
    if result.timing.reference:
        line += f"\nreference        {reference_words(result.timing)}"
    if result.fix:
        line += f"\ncheapest fix     {result.fix}"
    return line, result


def this_gpu() -> str:
    """The known kind of this machine's first GPU, or cpu."""
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        return next((key for key, kind in machines.GPUS.items() if kind.device_name == name), "cpu")
    return "cpu"
