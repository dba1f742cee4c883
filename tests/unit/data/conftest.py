"""What the data tests share: the byte tokenizer, rows written as JSONL, the trained spans of an example."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainyard.config import DataConfig
from trainyard.data import IGNORE_INDEX, build_byte_tokenizer, prepare_datasets


@pytest.fixture(scope="session")
def tok():
    return build_byte_tokenizer()


def write_jsonl(path: Path, rows: list) -> Path:
    """One row a line; a string row is written as it is (a broken line on purpose)."""
    path.write_text("".join(r if isinstance(r, str) else json.dumps(r) + "\n" for r in rows))
    return path


def target_runs(tokenizer, labels: list[int]) -> list[str]:
    """Decoded contiguous runs of target tokens."""
    runs, current = [], []
    for label in [*labels, IGNORE_INDEX]:
        if label != IGNORE_INDEX:
            current.append(label)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return runs


def prepare(tmp_path: Path, tokenizer, **data):
    return prepare_datasets(DataConfig(**data), tokenizer, tmp_path / "cache", log=lambda _: None)
