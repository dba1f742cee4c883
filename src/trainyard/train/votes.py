"""What the ranks agree on: each step's one small all-reduce outside DDP/FSDP (token counts for the loss and the
figures, and the facts every rank must act on together), and under DiLoCo, the round's tally the sites agree on
right after the outer sync. An inner step's votes span the site, so sites never wait on each other between syncs."""

from __future__ import annotations

from dataclasses import astuple, dataclass, field, replace

import torch
from torch.distributed import ProcessGroup

from trainyard import dist
from trainyard.dist import DistInfo
from trainyard.hardware import FlopShape, training_flops
from trainyard.model import attention
from trainyard.train import state as loop_state
from trainyard.train.job import Job


@dataclass
class StepVotes:
    """What every rank puts into the step's one all-reduce outside DDP/FSDP, by name: token
    counts for the loss normalisation, and facts every rank must agree on before acting."""

    targets: float = 0.0  # what the loss is normalised by in this rank's window: target tokens (SFT) or pairs (DPO)
    real_tokens: float = 0.0  # tokens that are not padding, for tokens/s
    flops: float = 0.0  # model FLOPs of this rank's window (hardware.training_flops), for MFU
    save_written: float = 0.0  # this rank's part of the async save in flight is on disk
    save_failed: float = 0.0  # this rank's part of it failed
    preempted: float = 0.0  # this rank caught a preemption signal
    timed_save: float = 0.0  # rank 0: checkpoint.every_minutes passed since the last full save
    data_ended: float = 0.0  # this rank's pretraining stream ended before a full window (mixture_exhausted: stop)

    def summed(self, device: torch.device | None, group: ProcessGroup | None = None) -> StepVotes:
        """Every field summed over the group's ranks (the world by default), in one all-reduce."""
        values = torch.tensor(astuple(self), dtype=torch.float64, device=device)
        dist.all_reduce_sum(values, group)
        return StepVotes(*values.tolist())

    def plus(self, other: StepVotes) -> StepVotes:
        return StepVotes(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))


@dataclass
class RoundTally:
    """DiLoCo: what a site's steps since the last outer sync add up to, for the sites to agree on at the sync."""

    stops: StepVotes = field(default_factory=StepVotes)
    """The site's votes summed over the round's steps: a preemption, a timed save or an ended stream anywhere in it."""
    trained_tokens: float = 0.0
    """Real tokens of the steps the site trained (not the skipped or idle ones)."""


def votes_device(info: DistInfo) -> torch.device | None:
    """Where a step's votes are summed: on the host (None: torch's default device) wherever the group has a host
    backend (gloo, beside NCCL by default), so that reading them never waits for the device's queue (the step's one
    wait is the non-finite check); on the device where the job named a device-only backend."""
    return None if "gloo" in (info.backend or "gloo") or info.device.type == "cpu" else info.device


def step_group(job: Job) -> ProcessGroup | None:
    """The ranks an inner step's votes, non-finite check and log figures span: under DiLoCo the site's (sites meet
    only at the outer sync), otherwise the world (None)."""
    return job.outer.within if job.outer is not None else None


def own_votes(job: Job, window: list[dict[str, torch.Tensor]], last_full: float) -> StepVotes:
    """This rank's part of the step's votes."""
    return StepVotes(
        targets=sum(job.objective.count(b) for b in window),
        real_tokens=sum(int(b.pop("real_tokens")) for b in window),
        flops=sum(micro_batch_flops(job.flops, b, job.cfg.dist.context_parallel) for b in window),
        save_written=float(job.saves.written_here()),
        save_failed=float(job.saves.failed_here()),
        preempted=float(bool(loop_state.SIGNALLED)),
        timed_save=float(job.info.is_main and loop_state.timed_save_due(job, last_full)),
        data_ended=float(len(window) < job.accum and job.cfg.train.micro_batch_tokens is None),  # a stream's end
    )


def agree_at_sync(job: Job, tally: RoundTally, votes: StepVotes) -> StepVotes:
    """DiLoCo: the round's stops and trained tokens and this step's save votes, summed over the world by one small
    all-reduce across sites right after the outer sync. Each rank holds its site's sums, so summing over the ranks at
    its position in every site gives the world's; the async save in flight settles here. A fault-tolerant site is a
    world of its own (its "site" group is itself): it agrees with itself, and so decides its own stops."""
    assert job.outer is not None
    round_votes = replace(
        tally.stops, real_tokens=tally.trained_tokens, save_written=votes.save_written, save_failed=votes.save_failed
    )
    agreed = round_votes.summed(job.info.device, job.outer.group)
    job.saves.settle(
        written_everywhere=agreed.save_written == job.info.world_size, failed_somewhere=agreed.save_failed > 0
    )
    return agreed


def micro_batch_flops(shape: FlopShape, batch: dict[str, torch.Tensor], context: int) -> float:
    """Model FLOPs of a micro-batch on this rank. A context-parallel slice (`context` ranks share each row) carries
    the whole row's document bounds (collate.context_slice): each rank counts 1/`context` of the whole row's
    FLOPs, so the group sums to the row's, its attention over whole documents, not over the slices' pieces."""
    return training_flops(shape, document_lengths(batch)) / context


def document_lengths(batch: dict[str, torch.Tensor]) -> list[int]:
    """The documents a micro-batch computes, each attending to itself: a padded row's unmasked tokens, or a
    padding-free row's documents from the bounds the collator made (a CP slice: the whole row's), else the blocks
    its position_ids restart. A padded packed row's padding restarts too: the one padding MFU counts."""
    if "attention_mask" in batch:
        return batch["attention_mask"].sum(dim=1).tolist()
    if "cu_seq_lens" in batch:
        return batch["cu_seq_lens"].diff().tolist()
    return [end - start for row in attention.document_bounds(batch["position_ids"]) for start, end in row]
