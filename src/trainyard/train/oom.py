"""An out-of-memory error that says which batch it was and what the estimate predicted, instead of torch's
allocator dump: with train.worst_batch_first it comes at step 1, on the job's largest micro-batches."""

from __future__ import annotations

import torch

from trainyard.config import JobConfig
from trainyard.errors import OutOfMemory, TrainyardError
from trainyard.train.job import Job
from trainyard.train.votes import document_lengths


def explain(job: Job, window: list[dict[str, torch.Tensor]], step: int, strategy: str) -> OutOfMemory:
    cfg, info = job.cfg, job.info
    tokens = [int(batch["input_ids"].numel()) for batch in window]
    longest = max(max(document_lengths(batch), default=0) for batch in window)
    when = ("the first step trains every rank's largest micro-batches (train.worst_batch_first): no later step "
            "needs more" if step == 1 and cfg.train.worst_batch_first else
            "train.worst_batch_first would have met it at step 1" if not cfg.train.worst_batch_first else
            "later steps hold no larger micro-batch than step 1's: memory grew since (see memory per step in "
            "`trainyard report`)")
    return OutOfMemory(
        f"out of memory at step {step} on rank {info.rank} ({info.device}): this step's micro-batches hold "
        f"{', '.join(f'{t:,}' for t in tokens)} tokens (rows up to {longest:,}); {when}. {_predicted(job, strategy)}",
        fix=f"lower {_micro_batch_field(cfg)} (train.global_batch_size keeps the step's samples through "
            "accumulation) or data.max_length, set model.gradient_checkpointing: true, or shard more "
            "(dist.strategy: fsdp); `trainyard estimate CONFIG` compares the options",
    )


def _micro_batch_field(cfg: JobConfig) -> str:
    """What bounds this job's micro-batches: rows, or tokens (an auto N was resolved to a number: set one lower)."""
    return "train.micro_batch_size" if cfg.train.micro_batch_tokens is None else (
        f"train.micro_batch_tokens (now {cfg.train.micro_batch_tokens:,})")


def _predicted(job: Job, strategy: str) -> str:
    """The estimate's peak for this job on this device, made now (the model is built on the meta device)."""
    from trainyard import estimate
    from trainyard.estimate.timing import Lengths

    info, cfg = job.info, job.cfg
    if info.device.type != "cuda":
        return "The estimate is for GPUs; on a CPU the process's memory is the host's."
    capacity = torch.cuda.get_device_properties(info.device).total_memory
    try:
        batch = Lengths().largest_micro_batch(cfg)  # micro_batch_size rows, or train.micro_batch_tokens, unread
        peak = estimate.planned_peak(cfg, strategy, info.world_size, info.local_world_size, capacity, batch)
    except TrainyardError as err:
        return f"The estimate could not be made: {err.what}."
    return f"The estimate predicted a peak of {peak / 2**30:.1f} GiB of {capacity / 2**30:.1f} GiB per device."
