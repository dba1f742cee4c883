"""Rows of a data file -> token ids, with labels masked to the response.

Four shapes are understood: preference pairs (`chosen` + `rejected`, see preference.py), chat (`messages`, or
ShareGPT `conversations`, rendered by data.chat_template or the tokenizer's own chat template; see chat.py), alpaca
(`instruction` + `output`, optional `input`) and plain `text`. Every row carries where it came from ("file:line" for
JSONL, "file:row N" with N counted from 0 otherwise), so an error points at the exact row to fix.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainyard.config import DataConfig
from trainyard.data.chat import IGNORE_INDEX, BadRow, ChatTemplate, chat_template_for, check_chat_tokenizer, encode_chat
from trainyard.data.preference import encode_pair, is_preference
from trainyard.data.shapes import Objective, format_for, pair_under_sft, row_fix, source_fix, unknown_shape_fix
from trainyard.doctor.preflight import SNIFF_BYTES, check_text, parquet_file, parse_json
from trainyard.errors import DataError

__all__ = ["IGNORE_INDEX", "BadRow", "detect_format", "encode_row", "encode_rows", "read_rows"]

FORMATS = ("preference", "chat", "alpaca", "text")


# ---------------------------------------------------------------- readers


def read_rows(
    path: Path, field: str = "data.path", objective: Objective = None
) -> Iterator[tuple[str, dict[str, Any] | BadRow]]:
    """(location, row) for every row of a JSONL, JSON, Parquet or `save_to_disk` source."""
    if not path.exists():
        raise DataError(f"{field}: data file {path} does not exist", fix=source_fix(field, objective))
    if path.is_dir():
        return _read_saved_dataset(path, field)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _read_jsonl(path, field)
    if suffix == ".json":
        return _read_json(path, field)
    if suffix == ".parquet":
        return _read_parquet(path, field)
    raise DataError(
        f"{field}: cannot read {path}: unknown file type '{suffix}'",
        fix="use a .jsonl, .json or .parquet file, or a folder written by Dataset.save_to_disk",
    )


def _object_or_bad(row: Any) -> dict[str, Any] | BadRow:
    return row if isinstance(row, dict) else BadRow("not an object", type(row).__name__)


def _read_jsonl(path: Path, field: str) -> Iterator[tuple[str, dict[str, Any] | BadRow]]:
    with path.open("rb") as file:
        head = file.read(SNIFF_BYTES)
        if b"\0" in head:
            check_text(head, path, field, final=True)
        file.seek(0)
        for number, raw in enumerate(file, start=1):
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as err:
                detail = f"byte 0x{raw[err.start]:02x} at column {err.start + 1}; re-save the file as UTF-8"
                yield where, BadRow("not UTF-8 text", detail)
                continue
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                yield where, BadRow("malformed JSON", f"{err.msg} at column {err.colno}")
                continue
            yield where, _object_or_bad(row)


def _read_json(path: Path, field: str) -> Iterator[tuple[str, dict[str, Any] | BadRow]]:
    raw = path.read_bytes()
    check_text(raw, path, field, final=True)
    fix = "a .json file holds one list of objects; for one object per line use .jsonl"
    rows = parse_json(raw.decode("utf-8-sig"), path, DataError, f"{field}: not valid JSON", fix)
    if not isinstance(rows, list):
        raise DataError(f"{field}: expected a list of objects, found a {type(rows).__name__}", where=str(path), fix=fix)
    for index, row in enumerate(rows):
        where = f"{path}:row {index}"
        yield where, _object_or_bad(row)


def _read_parquet(path: Path, field: str) -> Iterator[tuple[str, dict[str, Any] | BadRow]]:
    import pyarrow

    index = 0
    try:
        for batch in parquet_file(path, field).iter_batches(batch_size=1024):
            for row in batch.to_pylist():
                yield f"{path}:row {index}", row
                index += 1
    except (pyarrow.ArrowException, OSError) as err:
        raise DataError(
            f"{field}: {path} is corrupt after row {index} ({err})",
            where=f"{path}:row {index}",
            fix="write the Parquet file again from its source",
        ) from None


def _read_saved_dataset(path: Path, field: str) -> Iterator[tuple[str, dict[str, Any] | BadRow]]:
    import datasets
    import pyarrow

    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError:
        raise DataError(
            f"{field}: {path} is a folder but not one written by Dataset.save_to_disk",
            fix=f"point {field} at a data file, or at a folder written by save_to_disk",
        ) from None
    except (ValueError, OSError, KeyError, TypeError, pyarrow.ArrowException) as err:
        raise DataError(
            f"{field}: the save_to_disk folder {path} cannot be read ({type(err).__name__}: {err})",
            fix="write it again with Dataset.save_to_disk, or point at the original data file",
        ) from None
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded and len(loaded) != 1:
            raise DataError(
                f"{field}: {path} holds the splits {sorted(loaded)} and none is called 'train'",
                fix="save one Dataset, or a DatasetDict with a 'train' split",
            )
        loaded = loaded["train"] if "train" in loaded else next(iter(loaded.values()))
    for index, row in enumerate(loaded):
        yield f"{path}:row {index}", row


# ---------------------------------------------------------------- format detection


def detect_format(row: dict[str, Any], where: str, objective: Objective = None) -> str:
    """The format a row's keys announce; a shape we do not know is an error, not a guess. Under dpo every row is a
    pair (one that is not says which of its fields is missing), under sft none is."""
    if objective == "dpo":
        return "preference"
    if is_preference(row):
        if objective == "sft":
            raise pair_under_sft(sorted(row), where)
        return "preference"
    if "messages" in row or "conversations" in row:
        return "chat"
    if "instruction" in row and "output" in row:
        return "alpaca"
    if "text" in row:
        return "text"
    raise DataError(
        f"cannot tell the data format from the keys {sorted(row)}",
        where=where,
        fix=unknown_shape_fix(objective),
    )


# ---------------------------------------------------------------- encoders


def alpaca_prompt(instruction: str, input_text: str) -> str:
    """The fixed alpaca prompt; the Input block only appears when there is input."""
    prompt = f"### Instruction:\n{instruction}\n\n"
    if input_text:
        prompt += f"### Input:\n{input_text}\n\n"
    return prompt + "### Response:\n"


def _required_text(row: dict[str, Any], key: str, reason: str = "missing field") -> str:
    value = row.get(key)
    if not isinstance(value, str) or not value.strip():
        raise BadRow(reason if key in row else "missing field", f"'{key}' is missing or empty")
    return value


def _eos_id(tokenizer: Any) -> int:
    if tokenizer.eos_token_id is None:
        raise DataError(
            "the tokenizer has no eos token, so documents cannot be terminated",
            fix="use a tokenizer that defines eos_token",
        )
    return tokenizer.eos_token_id


def _encode_alpaca(row: dict[str, Any], tokenizer: Any, train_on_prompt: bool) -> dict[str, Any]:
    instruction = _required_text(row, "instruction")
    output = _required_text(row, "output", reason="empty response")
    input_text = row.get("input") or ""
    if not isinstance(input_text, str):
        raise BadRow("missing field", "'input' must be a string")
    prompt_ids = tokenizer(alpaca_prompt(instruction, input_text))["input_ids"]
    response_ids = tokenizer(output, add_special_tokens=False)["input_ids"] + [_eos_id(tokenizer)]
    prompt_labels = list(prompt_ids) if train_on_prompt else [IGNORE_INDEX] * len(prompt_ids)
    return {
        "input_ids": prompt_ids + response_ids,
        "labels": prompt_labels + response_ids,
        "prompt_ids": prompt_ids,
        "response": output,
    }


def _encode_text(row: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    ids = tokenizer(_required_text(row, "text", reason="empty text"))["input_ids"]
    ids = [*ids, _eos_id(tokenizer)]
    return {"input_ids": ids, "labels": list(ids)}


CUT_SHARE = 0.05
"""More rows than this losing target tokens to data.max_length is a warning: the model never sees their ends."""


@dataclass
class Truncation:
    """Rows encoded, those that lost target tokens to data.max_length, and every row's length before the cut."""

    rows: int = 0
    cut: int = 0
    lengths: list[int] = field(default_factory=list)

    def record(self, length: int, lost_targets: int) -> None:
        self.rows += 1
        self.cut += lost_targets > 0
        self.lengths.append(length)

    def needed(self) -> int:
        """The data.max_length that keeps 99% of the rows whole (their p99 length)."""
        ordered = sorted(self.lengths)
        return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)] if ordered else 0

    def summary(self) -> dict[str, int]:
        return {"rows": self.rows, "cut": self.cut, "p99_length": self.needed()}


def truncation_warning(summary: dict[str, int] | None, max_length: int) -> str | None:
    """The warning for a Truncation's summary, when more than CUT_SHARE of the rows lost target tokens."""
    if not summary or summary["cut"] <= CUT_SHARE * summary["rows"]:
        return None
    return (f"{summary['cut']:,} of {summary['rows']:,} rows ({summary['cut'] / summary['rows']:.0%}) lose target "
            f"tokens to data.max_length {max_length:,}: their answers are cut; data.max_length "
            f"{summary['p99_length']:,} keeps 99% of the rows whole")


def check_tokenizer_for(fmt: str, tokenizer: Any, template: ChatTemplate) -> None:
    """Fail once, before the first row, when the tokenizer cannot encode this format."""
    if fmt == "chat":
        check_chat_tokenizer(tokenizer, template)
    if fmt == "preference":
        _eos_id(tokenizer)  # standard completions end with it


def encode_row(
    row: dict[str, Any],
    fmt: str,
    tokenizer: Any,
    *,
    max_length: int,
    train_on_prompt: bool,
    template: ChatTemplate | None = None,
    truncation: Truncation | None = None,
) -> dict[str, Any]:
    """One row -> input_ids, labels (and prompt_ids + answer when the row can be graded).

    `template` renders chat rows (default: the tokenizer's own). Raises BadRow when the row cannot give at least
    one target token. `truncation` counts the rows whose target tokens data.max_length cut.
    """
    if fmt == "chat":
        example = encode_chat(row, tokenizer, template or ChatTemplate(), train_on_prompt)
    elif fmt == "alpaca":
        example = _encode_alpaca(row, tokenizer, train_on_prompt)
    else:
        example = _encode_text(row, tokenizer)
    if truncation is not None:
        lost = sum(label != IGNORE_INDEX for label in example["labels"][max_length:])
        truncation.record(len(example["input_ids"]), lost)
    input_ids = example["input_ids"][:max_length]
    labels = example["labels"][:max_length]
    labels[0] = IGNORE_INDEX  # nothing predicts a document's first token
    if all(label == IGNORE_INDEX for label in labels):
        raise BadRow(
            "no target token after truncation",
            f"{len(example['input_ids'])} tokens, data.max_length is {max_length}",
        )
    encoded: dict[str, Any] = {"input_ids": input_ids, "labels": labels}
    answer = row.get("answer") if isinstance(row.get("answer"), str) else None
    if "prompt_ids" in example and (answer is not None or fmt == "chat"):
        encoded["prompt_ids"] = example["prompt_ids"]
        encoded["answer"] = answer if answer is not None else example["response"]
    return encoded


def encode_rows(
    rows: Iterable[tuple[str, dict[str, Any] | BadRow]],
    tokenizer: Any,
    cfg: DataConfig,
    skipped: Counter[str],
    on_skip: Callable[[str, str], None] | None = None,
    truncation: Truncation | None = None,
    objective: Objective = None,
) -> Iterator[dict[str, Any]]:
    """Encode rows in order; bad rows raise, or are skipped and counted by reason in `skipped` (and `on_skip` is
    told where and why). Every error names `objective`'s row shapes.

    The format is `cfg.format`, or what the first readable row's keys announce (under dpo: pairs).
    """
    fmt = format_for(cfg.format, objective)
    template = chat_template_for(cfg)
    if fmt is not None:
        check_tokenizer_for(fmt, tokenizer, template)
    for where, row in rows:
        try:
            if isinstance(row, BadRow):
                raise row
            if fmt is None:
                fmt = detect_format(row, where, objective)
                check_tokenizer_for(fmt, tokenizer, template)
            if fmt == "preference":
                yield encode_pair(row, tokenizer, template, cfg.max_length)
                continue
            yield encode_row(
                row,
                fmt,
                tokenizer,
                max_length=cfg.max_length,
                train_on_prompt=cfg.train_on_prompt,
                template=template,
                truncation=truncation,
            )
        except BadRow as bad:
            if cfg.on_bad_row == "error":
                raise DataError(str(bad), where=where, fix=row_fix(objective)) from None
            skipped[bad.reason] += 1
            if on_skip is not None:
                on_skip(where, bad.reason)
        except DataError as err:  # the tokenizer cannot encode the rows: name the first it failed on
            if err.where is None:
                err.where = where
                err.args = (err.render(),)
            raise
