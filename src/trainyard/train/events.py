"""The train events the loop writes: the log window's figures over the ranks they cover (the world, or a DiLoCo
site between outer syncs), the epoch, each mixture source's tokens, the experts no token reached, and a rank's
memory that keeps growing."""

from __future__ import annotations

import logging
from typing import Any

import torch

from trainyard.data import ResumableSampler
from trainyard.data.mixture import MixtureStream
from trainyard import health
from trainyard.hardware import GIB, MIB
from trainyard.metrics import LogWindow, MemoryGrowth
from trainyard.model import routing
from trainyard.train import votes as agreement
from trainyard.train.job import Job
from trainyard.train.state import LoopState


def log_interval(
    state: LoopState, job: Job, interval: LogWindow, lr: float, grad_norm: torch.Tensor, whole_world: bool,
    steps: dict[str, Any],
) -> None:
    """The train event: over the world, or under DiLoCo between outer syncs over rank 0's site only (`site`);
    `steps`: the micro-batches its steps ran (data.token_batches.StepWindows.since_log)."""
    health.leak_if_injected(job.info, state.step)
    figures = interval.figures(None if whole_world else agreement.step_group(job))  # the group's ranks: one all-gather
    growth = interval.memory_growth(state.step)
    interval.reset()
    _warn_idle_experts(job, state.step, figures.get("expert_load"))
    _warn_memory_growth(job, growth)
    state.first_loss = figures["loss"] if state.first_loss is None else state.first_loss
    state.last_loss = figures["loss"]
    job.sink.emit(
        "train", step=state.step, lr=lr, grad_norm=float(grad_norm), **figures, **site_field(job, whole_world),
        tokens=state.tokens, **steps,
        **({"tokens_per_source": per_source(job)} if isinstance(job.sampler, MixtureStream) else {}),
        **({"epoch": epoch(job.sampler)} if isinstance(job.sampler, ResumableSampler) else {}),
    )


def _warn_idle_experts(job: Job, step: int, load: dict[str, Any] | None) -> None:
    """An expert that no token reached for a whole log window is learning nothing: a router collapsing, or too few
    tokens per window for the experts (a longer log.every_steps tells the two apart)."""
    idle = routing.idle_by_layer(load)
    if idle:
        job.sink.emit("system", step=step, event="idle_experts", idle_experts={str(k): v for k, v in idle.items()})
        if job.info.is_main:
            logging.getLogger("trainyard").warning(
                "step %d: experts that received no token since the last log, by layer: %s", step,
                "; ".join(f"layer {layer}: {experts}" for layer, experts in idle.items()))


def _warn_memory_growth(job: Job, growth: MemoryGrowth | None) -> None:
    """A leak (tensors kept across steps, a growing cache) kills a job hours later with an OOM that names no cause:
    say it while the job runs, with the rate and the step where that rate runs out of memory."""
    if growth is None:
        return
    job.sink.emit("system", step=growth.step, event="memory_growth", ranks=growth.ranks,
                  bytes_per_step=round(growth.bytes_per_step), memory_bytes=int(growth.memory_bytes),
                  available_bytes=int(growth.available_bytes), runs_out_at_step=growth.runs_out_at_step)
    if job.info.is_main:
        runs_out = f"near step {growth.runs_out_at_step}" if growth.runs_out_at_step else "at a step not known"
        logging.getLogger("trainyard").warning(
            "step %d: memory grew over the last log windows on rank(s) %s: %.1f MiB per step, %.2f GiB now with "
            "%.2f GiB left; at this rate it runs out %s (a leak: tensors or caches kept across steps?)",
            growth.step, growth.ranks, growth.bytes_per_step / MIB, growth.memory_bytes / GIB,
            growth.available_bytes / GIB, runs_out)


def site_field(job: Job, whole_world: bool) -> dict[str, int]:
    """`site`: the DiLoCo site an event's figures come from, where they are not the whole world's."""
    return {} if whole_world or job.outer is None else {"site": job.outer.site}


def epoch(sampler: ResumableSampler) -> float:
    """Passes over the training rows so far: the rows all ranks took (the sampler's global position) / rows."""
    return round(sampler.consumed / sampler.num_samples, 6)


def per_source(job: Job) -> dict[str, int] | None:
    """Tokens each mixture source gave all ranks so far (a map-style dataset has one source: None)."""
    return job.sampler.tokens_per_source() if isinstance(job.sampler, MixtureStream) else None
