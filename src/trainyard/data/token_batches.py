"""Token-bounded micro-batches (train.micro_batch_tokens): each optimizer step's rows, the very rows the row path
takes, cut in order into padding-free micro-batches of up to N tokens. Every rank runs as many micro-batches as the
rank that needs the most (FSDP's gathers, expert all-to-alls and DDP's one synced backward pair up across ranks);
each rank knows that count from the sampler's deterministic stream, without a collective. StepWindows counts the
micro-batches the loop takes, for its train events and summary.json."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import islice
from pathlib import Path
from typing import Any

import numpy
import torch

from trainyard.data.collate import collate
from trainyard.data.loader import COLUMNS, row_lengths, sample_recorder
from trainyard.data.sampler import ResumableSampler

Window = list[dict[str, torch.Tensor]]


def token_groups(lengths: Sequence[int], budget: int, count: int = 0) -> list[list[int]]:
    """Positions 0..n-1 of rows of `lengths` tokens, grouped in order, each group up to `budget` tokens (a longer
    row alone); then, until there are `count` groups, the group of most tokens among those of several rows is
    halved. Halving keeps every group within the budget, so any count up to the rows can be reached."""
    groups: list[list[int]] = []
    held = 0
    for position, length in enumerate(lengths):
        if not groups or held + length > budget:
            groups.append([])
            held = 0
        groups[-1].append(position)
        held += length
    while len(groups) < count:
        split = max((g for g in groups if len(g) > 1), key=lambda g: sum(lengths[i] for i in g))
        at = groups.index(split)
        groups[at : at + 1] = [split[: len(split) // 2], split[len(split) // 2 :]]
    return groups


def step_count(lengths: numpy.ndarray, sampler: ResumableSampler, rows: int, budget: int,
               dealt: numpy.ndarray | None) -> int:
    """The micro-batches of the next step on every rank: the most any rank's share of the step's rows needs (dealt by
    `dealt`, as ResumableSampler.take deals them)."""
    slot, shares = sampler.shares(rows, dealt)
    every = lengths[slot]
    return max(len(token_groups(every[share].tolist(), budget)) for share in shares)


def accumulation_windows(batches: Iterator[dict[str, torch.Tensor]], accum: int) -> Iterator[Window]:
    """The row path's steps: `accum` micro-batches each (fewer where a pretraining stream ended)."""
    while True:
        yield list(islice(batches, accum))


class StepWindows:
    """The loop's windows, each step's micro-batches counted as it takes them: under a token budget that count
    follows the rows' lengths, so the train events and summary.json say what ran, not the row path's accumulation.
    Every rank runs as many (step_count), so one rank's counts are its data ranks'."""

    def __init__(self, windows: Iterator[Window], budget: int | None, accum: int) -> None:
        self.windows, self.budget, self.accum = windows, budget, accum
        self.counts: list[int] = []
        self.logged = 0

    def __iter__(self) -> StepWindows:
        return self

    def __next__(self) -> Window:
        window = next(self.windows)
        self.counts.append(len(window))
        return window

    def since_log(self) -> dict[str, int | float | None]:
        """A train event's: the token budget (under one) and the mean micro-batches of the steps since the last."""
        counts, self.logged = self.counts[self.logged :], len(self.counts)
        return {**self._budget(), "micro_batches_per_step": _mean(counts)}

    def summary(self) -> dict[str, Any]:
        """summary.json's: the row path's accumulation (none under a token budget, whose steps' counts vary), the
        budget, and the micro-batches per step this process ran: mean, min and max (None before any step)."""
        counts = self.counts
        per_step = {"mean": _mean(counts), "min": min(counts), "max": max(counts)} if counts else None
        return {"accumulation": self.accum if self.budget is None else None, "micro_batch_tokens": self.budget,
                "micro_batches_per_step": per_step}

    def _budget(self) -> dict[str, int]:
        return {} if self.budget is None else {"micro_batch_tokens": self.budget}


def _mean(counts: list[int]) -> float | None:
    return round(sum(counts) / len(counts), 3) if counts else None


def token_windows(
    dataset: Any,
    sampler: ResumableSampler,
    rows: int,
    budget: int,
    pad_id: int,
    record: Path | None = None,
    context: tuple[int, int] = (0, 1),
    balance: bool = True,
) -> Iterator[Window]:
    """Each step's window: this rank's share of the step's rows (`rows` a rank; dealt by their tokens with `balance`,
    data.balance_ranks) in micro-batches of up to `budget` tokens, as many as step_count says. Like
    loader.micro_batches, nothing is read ahead (the sampler's state after a yield is the next step's start) and each
    micro-batch's rows are appended to `record` when given."""
    columns = [name for name in COLUMNS if name in dataset.column_names]
    rows_of, lengths = dataset.select_columns(columns), row_lengths(dataset)
    dealt = lengths if balance else None  # the lengths the ranks' shares are dealt by
    recorder = sample_recorder(record, sampler)
    try:
        while True:
            count = step_count(lengths, sampler, rows, budget, dealt)
            positions, picked = sampler.take(rows, dealt)
            window = []
            for group in token_groups(lengths[picked].tolist(), budget, count):
                if recorder is not None:
                    at = [[*divmod(positions[i], sampler.num_samples), picked[i]] for i in group]
                    recorder.write({"rows": at})
                fetched = rows_of[[picked[i] for i in group]]
                window.append(collate([{name: fetched[name][i] for name in columns} for i in range(len(group))],
                                      pad_id, True, context))
            yield window
    finally:
        if recorder is not None:
            recorder.handle.close()
