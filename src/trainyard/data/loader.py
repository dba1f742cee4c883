"""Micro-batches in sampler order: the one loader interface the trainer iterates."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import numpy
import torch

from trainyard.data.collate import collate
from trainyard.data.mixture import MixtureStream
from trainyard.data.sampler import ResumableSampler
from trainyard.runs import layout as run_layout

COLUMNS = ("input_ids", "labels", "seq_lens", "ref_logps")
RECORD_ENV = "TRAINYARD_RECORD_SAMPLES"


def sample_record_path(run_dir: Path, rank: int) -> Path | None:
    """Where this rank records the rows it reads, when TRAINYARD_RECORD_SAMPLES=1 asks for it.

    An audit of the data order across restarts and world-size changes: which rows were
    trained, and whether a resume skipped or repeated any.
    """
    if os.environ.get(RECORD_ENV, "") in ("", "0"):
        return None
    return run_dir / run_layout.SAMPLES / f"rank-{rank}.jsonl"


class SampleRecord:
    """Appends one JSON line per micro-batch: what each of its rows is.

    Each start of the job first appends a `start` line (where the data stream stands, world size, rank), so a
    reader can tell the attempts apart. Rows drawn for a step that never finished (killed, or rewound by a
    preemption save) are recorded too: the next `start` line says where training went on from.
    """

    def __init__(self, path: Path, start: dict[str, Any]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.handle = open(path, "a+b")
        self.handle.seek(0, os.SEEK_END)
        if self.handle.tell() > 0:  # a line cut short by a kill must not swallow the next one
            self.handle.seek(-1, os.SEEK_END)
            if self.handle.read(1) != b"\n":
                self.handle.write(b"\n")
        self.write(start)

    def write(self, record: dict[str, Any]) -> None:
        self.handle.write((json.dumps(record) + "\n").encode())  # one write per line
        self.handle.flush()


def row_lengths(dataset: Any) -> numpy.ndarray:
    """Every row's tokens, as the padding-free collator concatenates them."""
    import pyarrow.compute  # only for an Arrow dataset: a mixture's stream never comes here

    return pyarrow.compute.list_value_length(dataset.with_format("arrow")["input_ids"]).to_numpy()


def largest_rows(dataset: Any, count: int) -> list[int]:
    """The `count` rows with the most tokens, most first (ties: the lower index): a micro-batch of the first of them
    is the epoch's largest, padded (the longest rows) or padding-free (the most tokens)."""
    return numpy.argsort(-row_lengths(dataset), kind="stable")[:count].tolist()


def micro_batches(
    dataset: Any,
    sampler: ResumableSampler,
    micro_batch_size: int,
    pad_id: int,
    record: Path | None = None,
    padding_free: bool = True,
    context: tuple[int, int] = (0, 1),
    balance: bool = True,
) -> Iterator[dict[str, torch.Tensor]]:
    """Collated micro-batches, forever; each one's rows ([epoch, position in epoch, dataset index]) appended to
    `record` when given. Padding-free, with `balance` (data.balance_ranks), each micro-batch's rows across the ranks
    are dealt by their tokens (ResumableSampler.take); padded rows cost the longest row's length each, so they keep
    the stream's round robin.

    Nothing is read ahead: after a micro-batch is yielded, `sampler.state_dict()` is exactly the
    point to resume from, so a checkpoint taken between steps replays no row and skips none. `context`: this rank's
    slice of each row under context parallelism (collate).
    """
    columns = [name for name in COLUMNS if name in dataset.column_names]
    rows_of = dataset.select_columns(columns)
    recorder = sample_recorder(record, sampler)
    lengths = row_lengths(dataset) if padding_free and balance else None
    try:
        while True:
            positions, picked = sampler.take(micro_batch_size, lengths)
            if recorder is not None:
                epochs = [divmod(p, sampler.num_samples) for p in positions]
                recorder.write({"rows": [[*at, i] for at, i in zip(epochs, picked, strict=True)]})
            fetched = rows_of[picked]
            rows = [{name: fetched[name][i] for name in columns} for i in range(len(picked))]
            yield collate(rows, pad_id, padding_free, context)
    finally:
        if recorder is not None:
            recorder.handle.close()


def stream_batches(
    stream: MixtureStream,
    micro_batch_size: int,
    pad_id: int,
    record: Path | None = None,
    padding_free: bool = True,
    context: tuple[int, int] = (0, 1),
) -> Iterator[dict[str, torch.Tensor]]:
    """Collated micro-batches of a pretraining stream's fixed-length rows, until the stream ends (under
    data.mixture_exhausted: stop). With `record`, each row's [global row, source, digest of its token ids] is
    appended, so two runs can be compared by the exact tokens they fed the model.

    Like micro_batches, nothing is read ahead: `stream.state_dict()` after a yield is the point to resume from.
    """
    recorder = None
    if record is not None:
        start = {"start": stream.state_dict(), "world_size": stream.world_size, "rank": stream.rank}
        recorder = SampleRecord(record, start)
    rows = iter(stream)
    try:
        while batch := list(islice(rows, micro_batch_size)):
            if len(batch) < micro_batch_size:
                return  # the stream ended inside this micro-batch: it is not trained on
            if recorder is not None:
                recorder.write({"rows": [[row["row"], row["source"], _digest(row["input_ids"])] for row in batch]})
            yield collate(batch, pad_id, padding_free, context)
    finally:
        if recorder is not None:
            recorder.handle.close()


def _digest(token_ids: list[int]) -> str:
    return hashlib.blake2b(json.dumps(token_ids).encode(), digest_size=8).hexdigest()


def sample_recorder(record: Path | None, sampler: ResumableSampler) -> SampleRecord | None:
    """Where each micro-batch's rows are appended (`record`), opened with the point the sampler starts from."""
    if record is None:
        return None
    start = {"start": sampler.state_dict(), "world_size": sampler.world_size, "rank": sampler.rank}
    return SampleRecord(record, {**start, "samples_per_epoch": sampler.num_samples})
