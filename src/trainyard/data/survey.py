"""What the job's data looks like, read before any node is allocated (`train --dry-run`, `slurm`, `k8s`).

The same reading and encoding the job will do (data/prepare.py's sources, data/formats.py's encode_rows), on
up to SURVEY_ROWS rows: how many rows, which would be dropped and why (the first file:line of each reason),
the documents' token lengths, and one example with the tokens the loss trains on marked. Nothing is cached.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from trainyard.batch import largest_micro_batch
from trainyard.config import JobConfig
from trainyard.data.formats import IGNORE_INDEX, BadRow, Truncation, detect_format, encode_rows, truncation_warning
from trainyard.data.preference import check_objective_fits
from trainyard.data.prepare import sources
from trainyard.data.shapes import Objective, no_rows_fix
from trainyard.errors import DataError

SURVEY_ROWS = 20_000
"""Rows encoded at most; beyond them rows are only counted (a dry run stays seconds, not minutes)."""
MARK_OPEN, MARK_CLOSE = "\u00ab", "\u00bb"
"""«» around the tokens an example trains on."""


@dataclass
class Survey:
    path: str
    format: str = "auto"
    rows: int = 0
    """Rows in the source (all of them, counted even beyond SURVEY_ROWS)."""
    encoded: int = 0
    """Rows read and encoded (at most SURVEY_ROWS)."""
    lengths: list[int] = field(default_factory=list)
    """Tokens of each usable row (after truncation at data.max_length): a document, or a preference pair's two."""
    documents: list[int] = field(default_factory=list)
    """Tokens of each document of the usable rows: a pair's chosen, then its rejected."""
    targets: int = 0
    truncated: int = 0
    """Usable rows data.max_length cut: documents longer than it; pairs with a document that reaches it."""
    truncation: Truncation = field(default_factory=Truncation)
    """The rows whose target tokens data.max_length cut, and every row's length before the cut."""
    dropped: Counter[str] = field(default_factory=Counter)
    first_dropped: dict[str, str] = field(default_factory=dict)
    """The location of the first row dropped for each reason."""
    example: str = ""
    example_where: str = ""
    last_where: str = ""
    """The location of the row being encoded."""

    @property
    def usable(self) -> int:
        return len(self.lengths)

    def usable_rows_estimate(self) -> float:
        """Usable rows in the whole source: the encoded rows' usable share applied to every row."""
        return self.rows * self.usable / max(self.encoded, 1)


def survey(cfg: JobConfig, tokenizer: Any) -> Survey:
    """Read and encode the job's training rows as `train` will. Raises DataError when the data is unusable: no
    usable row, or a bad row under data.on_bad_row: error (named with its file:line, as training would)."""
    data = cfg.data
    found = Survey(path=data.path, format=data.format)
    objective = cfg.train.objective
    rows, _ = sources(data, objective)
    remaining = iter(rows)
    head = _counted(islice(remaining, SURVEY_ROWS), found, objective)
    first_at = found.first_dropped.setdefault
    encoded = encode_rows(head, tokenizer, data, found.dropped, on_skip=lambda where, why: first_at(why, where),
                          truncation=found.truncation, objective=objective)
    for example in encoded:
        _add(found, example, tokenizer, data.max_length)
        check_objective_fits(cfg.train.objective, "seq_lens" in example, data.path)
    found.rows = found.encoded + sum(1 for _ in remaining)
    if not found.usable:
        reasons = ", ".join(f"{reason} ({count}, first at {found.first_dropped[reason]})"
                            for reason, count in found.dropped.items())
        raise DataError(
            f"data.path: {data.path} has no usable row ({reasons or 'it is empty'})",
            fix=no_rows_fix(objective),
        )
    return found


def prepared_documents(dataset: Any) -> tuple[int, ...]:
    """The token lengths of a prepared dataset's documents, in row order (a packed row's or a pair's `seq_lens`): what
    the trainer checks its fit by, as the dry run does by the survey's."""
    import pyarrow.compute  # the prepared cache is Arrow

    table = dataset.with_format("arrow")
    if "seq_lens" in dataset.column_names:
        return tuple(pyarrow.compute.list_flatten(table["seq_lens"]).to_pylist())
    return tuple(pyarrow.compute.list_value_length(table["input_ids"]).to_pylist())


def _counted(rows: Iterator[tuple[str, Any]], found: Survey, objective: Objective) -> Iterator[tuple[str, Any]]:
    for where, row in rows:
        found.encoded += 1
        found.last_where = where
        if found.format == "auto" and not isinstance(row, BadRow):
            found.format = detect_format(row, where, objective)
        yield where, row


def _add(found: Survey, example: dict[str, Any], tokenizer: Any, max_length: int) -> None:
    ids, labels = example["input_ids"], example["labels"]
    found.lengths.append(len(ids))
    found.documents += example.get("seq_lens") or [len(ids)]
    found.targets += sum(label != IGNORE_INDEX for label in labels)
    if "seq_lens" in example:  # a preference pair: each of its documents is cut at max_length on its own
        found.truncated += any(length >= max_length for length in example["seq_lens"])
    else:  # a document: its length before the cut, which encode_row recorded last (one that fits exactly is whole)
        found.truncated += found.truncation.lengths[-1] > max_length
    if not found.example:
        found.example, found.example_where = marked_row(tokenizer, example), found.last_where


def marked_row(tokenizer: Any, example: dict[str, Any]) -> str:
    """A row's documents as text, trained spans marked; a preference pair's as `chosen:` then `rejected:`."""
    ids, labels = example["input_ids"], example["labels"]
    if "seq_lens" not in example:
        return marked(tokenizer, ids, labels)
    chosen = example["seq_lens"][0]
    return (f"chosen:   {marked(tokenizer, ids[:chosen], labels[:chosen])}\n"
            f"rejected: {marked(tokenizer, ids[chosen:], labels[chosen:])}")


def marked(tokenizer: Any, ids: list[int], labels: list[int]) -> str:
    """The example as text, the trained spans between «»."""
    parts, span, trained = [], [], False
    for token, label in zip(ids, labels):
        is_target = label != IGNORE_INDEX
        if is_target != trained and span:
            parts.append(_span(tokenizer, span, trained))
            span = []
        span.append(token)
        trained = is_target
    if span:
        parts.append(_span(tokenizer, span, trained))
    return "".join(parts)


def _span(tokenizer: Any, ids: list[int], trained: bool) -> str:
    text = tokenizer.decode(ids, skip_special_tokens=False)
    return f"{MARK_OPEN}{text}{MARK_CLOSE}" if trained else text


def percentiles(lengths: list[int]) -> dict[str, int]:
    """p50, p90, p99 and max of the documents' token lengths."""
    if len(lengths) < 2:
        return {"p50": lengths[0], "p90": lengths[0], "p99": lengths[0], "max": lengths[0]}
    cuts = statistics.quantiles(lengths, n=100, method="inclusive")
    return {"p50": round(cuts[49]), "p90": round(cuts[89]), "p99": round(cuts[98]), "max": max(lengths)}


def _worst_batch_line(found: Survey, cfg: JobConfig) -> str:
    tokens, longest = largest_micro_batch(found.lengths, cfg)
    read = "" if found.encoded >= found.rows else f" of the {found.encoded:,} rows read"
    shape = f"{tokens:,} tokens, rows up to {longest:,}{read}"
    context = cfg.dist.context_parallel
    if isinstance(context, int) and context > 1:  # the collator pads each row to a multiple of N: ceil
        shape += f", each rank of a context-parallel group {-(-tokens // context):,} of them"
    if cfg.train.worst_batch_first:
        return f"first step       every rank's largest micro-batch: {shape} (train.worst_batch_first)"
    return f"first step       in the sampler's order; the largest micro-batch, {shape}, comes when it comes"


def describe(found: Survey, cfg: JobConfig, samples_per_step: int) -> list[str]:
    """The dry run's data lines: rows and drops, token lengths, epochs the steps make, one marked example."""
    data, steps = cfg.data, cfg.train.max_steps
    read = f"{found.rows:,} rows" + (f" (the first {found.encoded:,} encoded)" if found.encoded < found.rows else "")
    lines = [f"data             {data.path} ({found.format}): {read}, {found.usable:,} usable"]
    for reason, count in found.dropped.items():
        lines.append(f"  dropped        {count:,} x {reason} (first at {found.first_dropped[reason]})")
    cuts = percentiles(found.lengths)
    tokens = sum(found.lengths)
    pairs = cfg.train.objective == "dpo"
    per = "pair (chosen and rejected, each with its prompt)" if pairs else "document"
    lines.append(
        f"tokens           per {per} p50 {cuts['p50']:,}, p90 {cuts['p90']:,}, p99 {cuts['p99']:,}, max "
        f"{cuts['max']:,} (data.max_length {data.max_length:,}: {found.truncated:,} truncated); "
        f"{found.targets / max(tokens, 1):.0%} of the tokens trained"
    )
    warning = truncation_warning(found.truncation.summary(), data.max_length)
    if warning:
        lines.append(f"  WARNING        {warning}")
    lines.append(_worst_batch_line(found, cfg))
    usable = found.usable_rows_estimate()
    if data.packing:
        rows = tokens * (found.rows / max(found.encoded, 1)) / data.max_length
        unit = f"{rows:,.0f} packed rows of {data.max_length:,} tokens"
    else:
        rows, unit = usable, f"{usable:,.0f} {'pairs' if pairs else 'documents'}"
    epochs = steps * samples_per_step / max(rows, 1)
    lines.append(f"epochs           {steps:,} steps x {samples_per_step:,} samples = {epochs:,.3g} epochs of {unit}")
    lines.append(f"example          {found.example_where}, trained tokens between {MARK_OPEN}{MARK_CLOSE}:")
    lines += [f"  {line}" for line in found.example.splitlines()[:12]]
    return lines
