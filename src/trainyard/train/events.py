"""The train events the loop writes: the log window's figures over the ranks they cover (the world, or a DiLoCo
site between outer syncs), the epoch, each mixture source's tokens, and the experts no token reached."""

from __future__ import annotations

import logging
from typing import Any

import torch

from trainyard.data import ResumableSampler
from trainyard.data.mixture import MixtureStream
from trainyard.metrics import LogWindow, peak_memory_bytes
from trainyard.model import routing
from trainyard.train import votes as agreement
from trainyard.train.job import Job
from trainyard.train.state import LoopState


def log_interval(
    state: LoopState, job: Job, interval: LogWindow, lr: float, grad_norm: torch.Tensor, whole_world: bool
) -> None:
    """The train event: over the world, or under DiLoCo between outer syncs over rank 0's site only (`site`)."""
    figures = interval.figures(None if whole_world else agreement.step_group(job))  # the group's ranks: one all-gather
    interval.reset()
    _warn_idle_experts(job, state.step, figures.get("expert_load"))
    state.first_loss = figures["loss"] if state.first_loss is None else state.first_loss
    state.last_loss = figures["loss"]
    job.sink.emit(
        "train", step=state.step, lr=lr, grad_norm=float(grad_norm), **figures, **site_field(job, whole_world),
        peak_memory_bytes=peak_memory_bytes(job.info.device), tokens=state.tokens,
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


def site_field(job: Job, whole_world: bool) -> dict[str, int]:
    """`site`: the DiLoCo site an event's figures come from, where they are not the whole world's."""
    return {} if whole_world or job.outer is None else {"site": job.outer.site}


def epoch(sampler: ResumableSampler) -> float:
    """Passes over the training rows so far: the rows all ranks took (the sampler's global position) / rows."""
    return round(sampler.consumed / sampler.num_samples, 6)


def per_source(job: Job) -> dict[str, int] | None:
    """Tokens each mixture source gave all ranks so far (a map-style dataset has one source: None)."""
    return job.sampler.tokens_per_source() if isinstance(job.sampler, MixtureStream) else None
