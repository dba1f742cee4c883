"""What the training loop works on, built once by the recipe: the model, optimizer, data position, metrics
sink and the facts a checkpoint must match. The loop and its checkpoint state (state.py) both read it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainyard import dist
from trainyard import precision as precision_room
from trainyard.checkpoint import save as checkpoint
from trainyard.config import JobConfig
from trainyard.data import PreparedData, ResumableSampler
from trainyard.data.mixture import MixtureStream
from trainyard.diloco import ft as diloco_ft
from trainyard.diloco import outer as diloco
from trainyard.hardware import FlopShape
from trainyard.metrics import MetricsSink
from trainyard.objective import Objective, Sft
from trainyard.parallel import comm
from trainyard.runs import layout as run_layout


@dataclass
class Job:
    """What the loop works on, built once by `run`."""

    cfg: JobConfig
    info: dist.DistInfo
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    sampler: ResumableSampler | MixtureStream
    """Where the data stands: rows of a map-style dataset, or a pretraining mixture's stream."""
    data: PreparedData
    tokenizer: Any
    sink: MetricsSink
    accum: int
    flops: FlopShape
    """What a token costs in FLOPs: with each step's documents, the model FLOPs MFU reports."""
    facts: dict[str, Any]
    """What a checkpoint must match to be resumed by this job (see checkpoint.check_compatible)."""
    saves: checkpoint.Checkpointer
    precision: precision_room.Precision
    strategy: str = "none"
    """The strategy the job was wrapped with (build.build_and_wrap): what an out-of-memory error is estimated for."""
    objective: Objective = field(default_factory=Sft)
    """train.objective: a micro-batch's loss sum and the count the step normalises it by."""
    comm_timer: comm.CommTimer | None = None
    outer: diloco.OuterSync | None = None
    """dist.strategy diloco: the round-start weights and outer momentum, synced every diloco.sync_every steps."""
    across: diloco_ft.FaultTolerantSync | None = None
    """diloco.fault_tolerant: the outer sync across sites, through torchft (`outer` keeps the state)."""

    def autocast(self):  # type: ignore[no-untyped-def]
        """bf16 products over fp32 weights where no FSDP2 policy casts them (DDP, one process)."""
        return precision_room.autocast(self.precision, self.info.device, enabled=not dist.is_fsdp(self.model))

    @property
    def checkpoints(self) -> Path:
        return self.cfg.run_dir / run_layout.CHECKPOINTS
