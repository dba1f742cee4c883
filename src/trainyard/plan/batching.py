"""train.micro_batch_tokens as the job runs it: auto resolved to a number of tokens by the estimate, the one rule of
the dry run, `trainyard estimate` and `train`; the rows it needs of the model; and the dry run's words for it."""

from __future__ import annotations

from typing import Any

import torch

from trainyard import estimate
from trainyard.batch import accumulation_steps, data_ranks
from trainyard.config import JobConfig
from trainyard.errors import ConfigError, ModelError, OptionError
from trainyard.estimate import memory as estimate_memory
from trainyard.estimate.timing import Lengths, micro_batches_per_step
from trainyard.model import collation
from trainyard.plan import reading

FILL = 0.9
"""auto's N fills at most this share of a device: the estimate is a model, and fragmentation grows with N."""
GRAIN = 128
"""auto's search stops within this many tokens of the largest N that fits, and rounds N down to a multiple of it."""


def micro_batch_tokens(cfg: JobConfig, hardware: estimate.Hardware | None,
                       lengths: Lengths = Lengths()) -> tuple[JobConfig, str]:
    """The job with train.micro_batch_tokens as it runs, and for auto why: the largest N whose estimated peak fits
    FILL of the device, at most the tokens of all the rows a rank takes per step (one micro-batch: no accumulation)
    and at least the longest row's (a micro-batch of its own, fitting or not). On a CPU, or where no estimate can
    tell, the data's largest micro-batch of micro_batch_size rows: the memory today's rows take, no gain."""
    if cfg.train.micro_batch_tokens != "auto":
        return cfg, ""
    rows_planned = lengths.largest_micro_batch(cfg).tokens  # auto plans as micro_batch_size rows do
    as_rows = f"the data's largest micro-batch of {cfg.train.micro_batch_size} rows, {rows_planned:,} tokens"
    if hardware is None:
        return _with_tokens(cfg, rows_planned), f"no estimate (this GPU is not a kind the estimate knows): {as_rows}"
    if hardware.gpu == "cpu":
        return _with_tokens(cfg, rows_planned), f"{as_rows}: a CPU gains nothing from larger micro-batches"
    try:
        return _largest_fitting(cfg, hardware, lengths)
    except (ModelError, ConfigError, OptionError, OSError, ValueError) as err:
        return _with_tokens(cfg, rows_planned), f"no estimate ({str(err).splitlines()[0]}): {as_rows}"


def _largest_fitting(cfg: JobConfig, hardware: estimate.Hardware, lengths: Lengths) -> tuple[JobConfig, str]:
    """Bisect N between the longest row and the step's rows: the estimated peak grows with N."""
    model = estimate_memory.model_of(cfg)
    rows = step_rows(cfg, hardware.gpus_per_node * hardware.nodes)
    longest, most = _row_bounds(cfg, lengths, rows)

    def peak(tokens: int) -> tuple[int, int]:
        result = estimate.estimate(_with_tokens(cfg, tokens), hardware, model=model, suggest=False, lengths=lengths)
        return result.memory.peak, result.device_bytes

    top, device = peak(most)
    budget, gib = FILL * device, 2**30
    share = f"{FILL:.0%} of {device / gib:.1f} GiB on {hardware.gpu}"
    if top <= budget:
        return _with_tokens(cfg, most), (f"all {rows} rows a rank takes per step fit one micro-batch of {most:,} "
                                         f"tokens (peak {top / gib:.1f} GiB, within {share})")
    low, _ = peak(longest)
    if low > budget:
        return _with_tokens(cfg, longest), (f"not even the longest row's {longest:,} tokens fit {share} (peak "
                                            f"{low / gib:.1f} GiB): one row per micro-batch")
    fits, over, over_peak = longest, most, top
    while over - fits > GRAIN:
        middle = (fits + over) // 2
        middle_peak, _ = peak(middle)
        if middle_peak <= budget:
            fits = middle
        else:
            over, over_peak = middle, middle_peak
    chosen = max(fits // GRAIN * GRAIN, longest)
    return _with_tokens(cfg, chosen), (f"the largest micro-batch whose estimated peak fits {share} ({over:,} tokens "
                                       f"would peak at {over_peak / gib:.1f} GiB)")


def step_rows(cfg: JobConfig, world: int) -> int:
    """The rows each data rank takes per optimizer step, the same with or without train.micro_batch_tokens."""
    return cfg.train.micro_batch_size * accumulation_steps(cfg, data_ranks(cfg, world))


def _row_bounds(cfg: JobConfig, lengths: Lengths, rows: int) -> tuple[int, int]:
    """(the longest row's tokens, the tokens of a step's `rows` largest rows, where a step of more rows than the
    data's takes them again): every row at data.max_length where the data was not read."""
    found = lengths.row_tokens(cfg)
    return found[0], sum(found[i % len(found)] for i in range(rows))


def _with_tokens(cfg: JobConfig, tokens: int) -> JobConfig:
    resolved = cfg.model_copy(deep=True)
    resolved.train.micro_batch_tokens = tokens
    return resolved


def check_rows(cfg: JobConfig, model: torch.nn.Module | None) -> None:
    """Refuse train.micro_batch_tokens where the built model keeps rows padded (collation.padded_rows): its
    micro-batches are one padding-free row. The dry run and `train` refuse alike, before any weight is read."""
    if cfg.train.micro_batch_tokens is None or model is None:
        return
    padded = collation.padded_rows(model, cfg.data)
    if padded:
        raise ConfigError(
            f"train.micro_batch_tokens packs padding-free micro-batches, but the rows stay padded: {padded}",
            where=cfg.where("train.micro_batch_tokens"),
            fix="remove train.micro_batch_tokens (micro-batches of train.micro_batch_size padded rows)",
        )


def micro_batch_words(cfg: JobConfig, accum: int, ranks: str, why: str, lengths: Lengths = Lengths()) -> str:
    """The dry run's micro batch line: rows, or a token bound, how auto chose it and the micro-batches a step plans."""
    train = cfg.train
    if train.micro_batch_tokens is None:
        return f"micro batch      {train.micro_batch_size} samples x {accum} accumulation x {ranks}"
    chosen = f"auto -> {train.micro_batch_tokens:,}: {why}" if why else f"{train.micro_batch_tokens:,}"
    return (f"micro batch      up to {train.micro_batch_tokens:,} tokens, padding-free (train.micro_batch_tokens "
            f"{chosen}); {token_steps_words(cfg, accum, lengths)} x {ranks}")


def accumulation_words(cfg: JobConfig, accum: int, train_rows: Any) -> str:
    """`train`'s log of a step's micro-batches: the accumulation, or under train.micro_batch_tokens the dry run's
    words for the prepared rows (plan.reading.prepared_lengths, read only then)."""
    if cfg.train.micro_batch_tokens is None:
        return f"accumulation {accum}"
    return token_steps_words(cfg, accum, reading.prepared_lengths(cfg, train_rows))


def token_steps_words(cfg: JobConfig, accum: int, lengths: Lengths) -> str:
    """A token budget's step, as the dry run and `train` both say it: the rows a rank takes, in about as many
    micro-batches as the estimate plans (estimate.timing.micro_batches_per_step: their tokens / N, at least one
    row each), every rank running as many as the rank that needs the most."""
    rows, per_row = cfg.train.micro_batch_size * accum, lengths.per_row(cfg)[0]
    planned = micro_batches_per_step(cfg, accum, per_row)[0]
    return (f"each step's {rows} rows per rank (about {per_row:,.0f} tokens each) in about "
            f"{planned} micro-batch(es) of up to {cfg.train.micro_batch_tokens:,} tokens, as many on every rank")


def ran_words(cfg: JobConfig, accum: int, per_step: dict[str, float] | None) -> str:
    """`train`'s last word on a token budget's steps, beside the dry run's plan: the micro-batches they ran
    (summary.json's micro_batches_per_step); the row path ran its accumulation, logged at the start ("")."""
    if cfg.train.micro_batch_tokens is None or per_step is None:
        return ""
    low, high, mean = per_step["min"], per_step["max"], per_step["mean"]
    ran = f"{low}" if low == high else f"{low} to {high} (mean {mean:g})"
    return (f"ran each step's {cfg.train.micro_batch_size * accum} rows per rank in {ran} micro-batch(es) of up to "
            f"{cfg.train.micro_batch_tokens:,} tokens, as many on every rank")
