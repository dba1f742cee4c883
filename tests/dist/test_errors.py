"""User errors inside workers: one clear message and exit 2 from the launcher, no traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import TINY, assert_ok, trainyard

pytestmark = pytest.mark.dist

GOOD = {"instruction": "Say hi", "input": "", "output": "hi"}


def write_rows(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_malformed_row_fails_every_rank_with_file_and_line(tmp_path: Path) -> None:
    data = write_rows(
        tmp_path / "train.jsonl", [json.dumps(GOOD), json.dumps(GOOD), '{"instruction": "broken",', json.dumps(GOOD)]
    )
    result = trainyard("train", TINY, f"output_dir={tmp_path}", f"data.path={data}", "--nproc", "2")
    assert result.returncode == 2, result.stderr
    assert f"{data}:3" in result.stderr
    assert "on_bad_row" in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.count("trainyard: error") == 1


def test_skipped_rows_are_counted_in_the_summary(tmp_path: Path) -> None:
    rows = [json.dumps(GOOD)] * 40 + ['{"instruction": "broken",', json.dumps({**GOOD, "output": ""})]
    data = write_rows(tmp_path / "train.jsonl", rows)
    result = trainyard(
        "train",
        TINY,
        f"output_dir={tmp_path}",
        f"data.path={data}",
        "data.on_bad_row=skip",
        "train.max_steps=2",
        "eval.at_end=false",
        "--nproc",
        "2",
    )
    assert_ok(result)
    summary = json.loads((tmp_path / "tiny" / "summary.json").read_text())
    assert sum(summary["data_stats"]["skipped"].values()) == 2
    assert summary["data_stats"]["train_documents"] == 40
