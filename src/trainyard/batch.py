"""The global batch across world sizes: micro-batches accumulated per rank for a world size, and the optimizer
steps train.epochs makes over the rows. Shared by the trainer, the plan and the estimate.

The world size here counts data ranks: the ranks of a context-parallel group train the same rows, so a job of W
processes at dist.context_parallel N has W / N of them (`data_ranks`)."""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable
from dataclasses import dataclass
from fractions import Fraction

from trainyard.config import JobConfig
from trainyard.errors import ConfigError


@dataclass(frozen=True)
class MicroBatch:
    """The micro-batch memory is planned for: its tokens as collated (padding included) and its longest document
    (the attention scores a token keeps span it)."""

    tokens: int
    longest: int
    source: str = "micro_batch_size x data.max_length: the data was not read"


def data_ranks(cfg: JobConfig, world_size: int) -> int:
    """The data-parallel ranks of `world_size` processes: each context-parallel group reads one rank's rows.
    dist.context_parallel auto, before the plan resolves it (a launcher's check of a node range): every rank, the
    strictest global-batch rule, since a batch that W ranks divide W / N divide too."""
    size = cfg.dist.context_parallel
    return max(world_size // (1 if size == "auto" else size), 1)


def steps_for_epochs(cfg: JobConfig, rows: int, world_size: int, saved_samples: int | None = None) -> int:
    """Optimizer steps for train.epochs passes over `rows` training rows (after bad rows are dropped):
    ceil(epochs x rows / global batch in samples), the global batch being micro_batch_size x world_size x
    accumulation. `saved_samples` is a resumed checkpoint's global batch, as for accumulation_steps: a resume on
    another world size keeps the batch, so the steps. Exact for decimal epochs (0.1 x 30 rows is 3, not 4)."""
    if cfg.train.epochs is None:
        raise ValueError("steps_for_epochs needs train.epochs")
    samples = cfg.train.micro_batch_size * world_size * accumulation_steps(cfg, world_size, saved_samples)
    return math.ceil(Fraction(str(cfg.train.epochs)) * rows / samples)


def largest_micro_batch(rows: Iterable[int], cfg: JobConfig) -> tuple[int, int]:
    """The tokens a rank's largest micro-batch computes as the job collates it (padding included), and its longest
    row, from the rows' token lengths: packed rows each fill data.max_length (as many as the documents fill);
    padding-free rows are summed; padded rows each take the longest one's length. Under train.micro_batch_tokens N:
    N tokens, or the longest row where it is longer (a micro-batch of its own). The dry run, the estimate and the
    trainer's fit check all use it."""
    micro, data, budget = cfg.train.micro_batch_size, cfg.data, cfg.train.micro_batch_tokens
    if isinstance(budget, int):
        rows = list(rows)
        longest = min(data.max_length, sum(rows)) if data.packing else max(rows)
        return max(budget, longest), longest
    if data.packing:
        tokens = min(micro * data.max_length, sum(rows))
        return tokens, min(data.max_length, tokens)
    top = heapq.nlargest(micro, rows)
    return (sum(top) if data.padding_free else top[0] * len(top)), top[0]


def accumulation_steps(cfg: JobConfig, world_size: int, saved_samples: int | None = None) -> int:
    """Micro-batches per optimizer step on each rank, from the global batch rule.

    Without train.global_batch_size/tokens the global batch is micro x world (accumulation 1),
    except when resuming: then the checkpoint's global batch (`saved_samples`) is kept, so a
    restart on another world size re-derives accumulation instead of changing the batch. `world_size`: the data
    ranks (`data_ranks`), as for steps_for_epochs.
    """
    train = cfg.train
    per_pass_samples = train.micro_batch_size * world_size
    ranks = "world_size" if cfg.dist.context_parallel in (1, "auto") else "data ranks (world / dist.context_parallel)"
    if train.global_batch_size is not None:
        total, unit, field = train.global_batch_size, per_pass_samples, "train.global_batch_size"
        head = f"{field}={total}"
        unit_text = f"micro_batch_size x {ranks} = {train.micro_batch_size} x {world_size}"
        other = f"set {field} to a multiple of {unit}, or change micro_batch_size"
    elif train.global_batch_tokens is not None:
        total = train.global_batch_tokens
        unit = per_pass_samples * cfg.data.max_length
        field = "train.global_batch_tokens"
        head = f"{field}={total}"
        unit_text = (
            f"micro_batch_size x {ranks} x data.max_length = "
            f"{train.micro_batch_size} x {world_size} x {cfg.data.max_length}"
        )
        other = f"set {field} to a multiple of {unit}, or change micro_batch_size"
    elif saved_samples is not None:
        total, unit, field = saved_samples, per_pass_samples, "train.micro_batch_size"
        head = (
            f"the checkpoint's global batch of {total} samples (micro_batch_size x {ranks} when it was saved: "
            "train.global_batch_size is unset)"
        )
        unit_text = f"micro_batch_size x {ranks} = {train.micro_batch_size} x {world_size}"
        other = "change micro_batch_size, or start a fresh run (checkpoint.resume: never)"
    else:
        return 1
    if total % unit != 0:
        sizes = _divisors(total // (unit // world_size)) if total % (unit // world_size) == 0 else []
        can = f"world sizes that keep it: {', '.join(map(str, sizes))}" if sizes else "no world size keeps it"
        raise ConfigError(
            f"{head} is not a multiple of {unit_text} = {unit}; {can}",
            where=cfg.where(field),
            fix=f"run on one of those world sizes (--nproc, --nnodes), or {other}" if sizes else other,
        )
    return total // unit


def _divisors(number: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(number) + 1) if number % d == 0]
    return sorted({*small, *(number // d for d in small)})
