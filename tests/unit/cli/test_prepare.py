"""`trainyard prepare` as a user runs it: through the CLI's entry point, one case (REAL_PROCESS) in a real process.

Bad input ends with exit 2, a message naming data.mixture[i] and the file (and line), no traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import run_cli, trainyard

WIDE = {"COLUMNS": "1000"}


def write_job(root: Path, name: str, data: dict) -> str:
    config = {
        "output_dir": str(root / "runs"),
        "model": {"config": {"model_type": "llama"}, "tokenizer": "builtin:bytes"},
        "data": data,
    }
    (root / name).write_text(json.dumps(config))
    return str(root / name)


def mixture(*paths: str, field: str = "text") -> dict:
    return {"mixture": [{"path": path, "weight": 1, "text_field": field} for path in paths]}


def make_inputs(root: Path) -> dict[str, tuple[list[str], list[str]]]:
    """{case: (argv, words the error must contain)}, files written under root."""
    (root / "good.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
    (root / "no_field.jsonl").write_text('{"text": "one"}\n{"body": "two"}\n')
    (root / "bad_json.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n{"text": oops}\n')
    pq.write_table(pa.table({"body": ["x", "y"]}), root / "columns.parquet")
    (root / "random.parquet").write_bytes(bytes(range(256)) * 4)
    (root / "many.jsonl").write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(30)))
    good = str(root / "good.jsonl")
    return {
        "train-token-budget-without-global-batch": (
            ["train", write_job(root, "t.yaml", mixture(good)), "train.total_tokens=1000"],
            ["train.total_tokens", "train.global_batch_tokens"],
        ),
        "train-a-source-that-matches-nothing": (
            ["train", write_job(root, "u.yaml", mixture(good, str(root / "none" / "*.jsonl")))],
            ["data.mixture[1].path", "none/*.jsonl", "matches no"],
        ),
        "nothing-matches": ([write_job(root, "a.yaml", mixture(good, str(root / "none" / "*.jsonl")))],
                            ["data.mixture[1].path", "none/*.jsonl", "matches no"]),
        "text-field-missing-in-a-row": ([write_job(root, "b.yaml", mixture(str(root / "no_field.jsonl")))],
                                        ["data.mixture[0]", "no_field.jsonl:2", "text_field", "'text'"]),
        "text-field-missing-in-parquet": ([write_job(root, "c.yaml", mixture(good, str(root / "columns.parquet")))],
                                          ["data.mixture[1]", "columns.parquet", "text_field", "['body']"]),
        "bad-json-line": ([write_job(root, "d.yaml", mixture(str(root / "bad_json.jsonl")))],
                          ["data.mixture[0]", "bad_json.jsonl:3", "JSON"]),
        "unreadable-parquet": ([write_job(root, "e.yaml", mixture(str(root / "random.parquet")))],
                               ["data.mixture[0]", "random.parquet", "Parquet"]),
        "weight-zero": ([write_job(root, "f.yaml", mixture(good)), "data.mixture=[{path: x, weight: 0}]"],
                        ["data.mixture[0].weight", "greater than 0"]),
        "weight-negative-in-file": ([write_job(root, "g.yaml", {"mixture": [{"path": good, "weight": -1}]})],
                                    ["data.mixture[0].weight", "g.yaml"]),
        "no-mixture": ([write_job(root, "h.yaml", {"path": good})], ["data.mixture", "prepare"]),
        "good": ([write_job(root, "ok.yaml", mixture(str(root / "many.jsonl")))], []),
    }


REAL_PROCESS = "bad-json-line"


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("prepare-cli")
    found = {}
    for name, (argv, needles) in make_inputs(root).items():
        command = argv if argv[0] == "train" else ["prepare", *argv]
        run = trainyard if name == REAL_PROCESS else run_cli
        found[name] = (run(*command, env=WIDE), needles)
    return found


CASES = [
    "train-token-budget-without-global-batch",
    "train-a-source-that-matches-nothing",
    "nothing-matches",
    "text-field-missing-in-a-row",
    "text-field-missing-in-parquet",
    "bad-json-line",
    "unreadable-parquet",
    "weight-zero",
    "weight-negative-in-file",
    "no-mixture",
]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_exits_2_naming_the_source_and_file(results: dict, case: str) -> None:
    result, needles = results[case]
    assert result.returncode == 2, f"exit {result.returncode}\n{result.stderr[-3000:]}"
    assert "Traceback" not in result.stderr + result.stdout, result.stderr[-3000:]
    for needle in needles:
        assert needle in result.stderr, f"{needle!r} not in:\n{result.stderr[-3000:]}"


def test_prepare_prints_the_folder_and_each_source(results: dict) -> None:
    first, _ = results["good"]
    assert first.returncode == 0, first.stderr[-3000:]
    folder = Path(first.stdout.splitlines()[0])
    assert folder.parent.name == "shards" and (folder / "manifest.json").is_file()
    assert "data.mixture[0]" in first.stdout and "30 documents" in first.stdout and "(uint16)" in first.stdout
    manifest = json.loads((folder / "manifest.json").read_text())
    assert f"{manifest['sources'][0]['tokens']:,} tokens" in first.stdout
    assert "prepared token shards" in first.stderr  # reuse is tested on prepare() itself, in test_shards.py
