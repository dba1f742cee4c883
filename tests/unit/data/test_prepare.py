"""The tokenized cache: one writer among racing processes, stale locks, fingerprints, splits."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from trainyard.atomic import process_identity
from trainyard.config import DataConfig
from trainyard.data import build_byte_tokenizer, data_fingerprint, prepare_datasets
from trainyard.data import prepare as prepare_module
from trainyard.errors import DataError


def write_rows(path: Path, count: int, word: str = "row") -> Path:
    rows = [{"instruction": f"Repeat {word} {i}.", "output": f"{word} {i}"} for i in range(count)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def prepare_in_child(data_path: str, cache_root: str, markers: str, barrier, results) -> None:
    """One 'rank': wait for the other, then prepare at the same moment.

    Every real tokenization leaves a marker file, whatever the process reports about itself.
    """
    tokenize_into = prepare_module.tokenize_into

    def marked_tokenize_into(*args, **kwargs):
        (Path(markers) / str(os.getpid())).touch()
        return tokenize_into(*args, **kwargs)

    prepare_module.tokenize_into = marked_tokenize_into
    lines: list[str] = []
    barrier.wait()
    prepared = prepare_datasets(
        DataConfig(path=data_path), build_byte_tokenizer(), Path(cache_root), log=lines.append
    )
    results.put((prepared.tokenized_here, lines, len(prepared.train), prepared.fingerprint))


def test_two_processes_at_once_tokenize_exactly_once(tmp_path):
    data = write_rows(tmp_path / "d.jsonl", 3000)
    markers = tmp_path / "markers"
    markers.mkdir()
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(2), context.Queue()
    children = [
        context.Process(
            target=prepare_in_child,
            args=(str(data), str(tmp_path / "cache"), str(markers), barrier, results),
        )
        for _ in range(2)
    ]
    for child in children:
        child.start()
    outcomes = [results.get(timeout=120) for _ in children]
    for child in children:
        child.join(timeout=60)
        assert child.exitcode == 0
    assert len(list(markers.iterdir())) == 1
    assert sorted(here for here, *_ in outcomes) == [False, True]
    for here, lines, rows, fingerprint in outcomes:
        cache_dir = tmp_path / "cache" / fingerprint
        if here:
            assert lines == [f"tokenized 3000 rows into {cache_dir}"]
        else:
            assert lines == [f"reusing tokenized cache {cache_dir}"]
        assert rows == 3000
    assert not list((tmp_path / "cache").glob("*.lock"))
    assert not list((tmp_path / "cache").glob("*.tmp-*"))


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def plant_lock(cache_root: Path, fingerprint: str, **holder) -> Path:
    cache_root.mkdir(parents=True, exist_ok=True)
    lock = cache_root / f"{fingerprint}.lock"
    lock.write_text(json.dumps(dict(process_identity(), **holder)))
    return lock


def test_lock_of_a_dead_process_on_this_host_is_taken_over(tmp_path):
    cfg = DataConfig(path=str(write_rows(tmp_path / "d.jsonl", 10)), prepare_timeout_s=5)
    tok = build_byte_tokenizer()
    fingerprint = data_fingerprint(cfg, tok)
    pid = dead_pid()
    lock = plant_lock(tmp_path / "cache", fingerprint, pid=pid)
    leftover = tmp_path / "cache" / f"{fingerprint}.tmp-{process_identity()['host']}-{pid}"
    leftover.mkdir()
    prepared = prepare_datasets(cfg, tok, tmp_path / "cache", log=lambda _: None)
    assert prepared.tokenized_here
    assert len(prepared.train) == 10
    assert not lock.exists() and not leftover.exists()


@pytest.mark.parametrize("holder", ["live pid here", "other host"])
def test_a_lock_that_cannot_be_judged_dead_times_out_naming_it(tmp_path, holder):
    cfg = DataConfig(path=str(write_rows(tmp_path / "d.jsonl", 10)), prepare_timeout_s=0.5)
    tok = build_byte_tokenizer()
    planted = {"pid": 1} if holder == "live pid here" else {"host": "elsewhere", "pid": dead_pid()}
    lock = plant_lock(tmp_path / "cache", data_fingerprint(cfg, tok), **planted)
    with pytest.raises(DataError) as err:
        prepare_datasets(cfg, tok, tmp_path / "cache", log=lambda _: None)
    assert str(lock) in str(err.value)
    assert "delete" in err.value.fix
    assert lock.exists()


def test_second_call_reuses_the_cache(tmp_path):
    cfg = DataConfig(path=str(write_rows(tmp_path / "d.jsonl", 10)))
    tok = build_byte_tokenizer()
    lines: list[str] = []
    first = prepare_datasets(cfg, tok, tmp_path / "cache", log=lines.append)
    second = prepare_datasets(cfg, tok, tmp_path / "cache", log=lines.append)
    assert (first.tokenized_here, second.tokenized_here) == (True, False)
    assert lines[1] == f"reusing tokenized cache {second.cache_dir}"
    assert second.stats == first.stats
    assert second.train["input_ids"] == first.train["input_ids"]


def test_fingerprint_follows_content_settings_and_tokenizer(tmp_path):
    tok = build_byte_tokenizer()
    data = write_rows(tmp_path / "d.jsonl", 10)
    base = data_fingerprint(DataConfig(path=str(data)), tok)
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(data.read_bytes())
    assert data_fingerprint(DataConfig(path=str(copy)), tok) == base
    assert data_fingerprint(DataConfig(path=str(data), max_length=256), tok) != base
    assert data_fingerprint(DataConfig(path=str(data), packing=True), tok) != base
    other_template = build_byte_tokenizer()
    other_template.chat_template = "{{ messages }}"
    assert data_fingerprint(DataConfig(path=str(data)), other_template) != base
    write_rows(data, 10, word="changed")
    assert data_fingerprint(DataConfig(path=str(data)), tok) != base


def test_changed_file_is_tokenized_again(tmp_path):
    tok = build_byte_tokenizer()
    cfg = DataConfig(path=str(write_rows(tmp_path / "d.jsonl", 10)))
    first = prepare_datasets(cfg, tok, tmp_path / "cache", log=lambda _: None)
    write_rows(tmp_path / "d.jsonl", 12)
    second = prepare_datasets(cfg, tok, tmp_path / "cache", log=lambda _: None)
    assert second.tokenized_here and second.fingerprint != first.fingerprint
    assert len(second.train) == 12


def test_eval_fraction_holds_out_a_deterministic_disjoint_share(tmp_path):
    tok = build_byte_tokenizer()
    cfg = DataConfig(path=str(write_rows(tmp_path / "d.jsonl", 40)), eval_fraction=0.25)
    first = prepare_datasets(cfg, tok, tmp_path / "a", log=lambda _: None)
    again = prepare_datasets(cfg, tok, tmp_path / "b", log=lambda _: None)
    assert (len(first.train), len(first.eval)) == (30, 10)
    train = {tok.decode(ids) for ids in first.train["input_ids"]}
    held = {tok.decode(ids) for ids in first.eval["input_ids"]}
    assert len(train | held) == 40 and not train & held
    assert again.eval["input_ids"] == first.eval["input_ids"]
    assert first.stats["eval_rows"] == 10


def test_no_eval_without_eval_path_fraction_or_builtin(tmp_path):
    cfg = DataConfig(path=str(write_rows(tmp_path / "d.jsonl", 5)))
    assert prepare_datasets(cfg, build_byte_tokenizer(), tmp_path / "c", log=print).eval is None


def test_packing_fills_rows_with_whole_documents(tmp_path):
    tok = build_byte_tokenizer()
    plain = DataConfig(path=str(write_rows(tmp_path / "d.jsonl", 50)), max_length=128)
    packed_cfg = plain.model_copy(update={"packing": True})
    docs = prepare_datasets(plain, tok, tmp_path / "c", log=lambda _: None)
    packed = prepare_datasets(packed_cfg, tok, tmp_path / "c", log=lambda _: None)
    assert packed.train.column_names == ["input_ids", "labels", "seq_lens"]
    assert len(packed.train) < len(docs.train)
    lengths = [len(ids) for ids in packed.train["input_ids"]]
    assert max(lengths) <= 128
    assert [sum(s) for s in packed.train["seq_lens"]] == lengths
    assert packed.stats["tokens"] == docs.stats["tokens"]
    assert packed.stats["target_tokens"] == docs.stats["target_tokens"]
    original = sorted(tuple(ids) for ids in docs.train["input_ids"])
    unpacked = []
    for row in packed.train:
        start = 0
        for size in row["seq_lens"]:
            unpacked.append(tuple(row["input_ids"][start : start + size]))
            assert row["labels"][start] == -100
            start += size
    assert sorted(unpacked) == original


def test_builtin_task_brings_its_own_graded_eval_rows(tmp_path):
    tok = build_byte_tokenizer()
    cfg = DataConfig(path="builtin:dates", synthetic_train_size=30, synthetic_eval_size=7)
    prepared = prepare_datasets(cfg, tok, tmp_path / "c", log=lambda _: None)
    assert (len(prepared.train), len(prepared.eval)) == (30, 7)
    row = prepared.eval[0]
    assert tok.decode(row["prompt_ids"]).endswith("Reply with the date only.<|assistant|>")
    assert tok.decode(row["input_ids"]).endswith(row["answer"] + "<|eos|>")


def test_rows_whose_answers_max_length_cuts_are_warned_about_with_the_length_that_keeps_them(tmp_path):
    """A data.max_length that cuts most of the dates' answers (configs/tiny.yaml's keeps them): training says so on
    every start (the cache built or reused) with the length that would keep 99% of the rows whole, and that length
    warns no more."""
    from tests.conftest import TINY
    from trainyard.config_file import load_config
    from trainyard.model import source as source_room

    assert not _cut_warnings(load_config(TINY), tmp_path / "tiny-cache"), "configs/tiny.yaml cuts its answers"
    cfg = load_config(TINY, ["data.max_length=96"])
    tokenizer = source_room.load_tokenizer(cfg.model, None)
    for _ in ("built", "reused"):
        said: list[str] = []
        prepare_datasets(cfg.data, tokenizer, tmp_path / "cache", log=said.append)
        warnings = [line for line in said if line.startswith("warning:")]
        assert len(warnings) == 1 and "rows (" in warnings[0], said
        assert f"lose target tokens to data.max_length {cfg.data.max_length}" in warnings[0]
    needed = int(re.search(r"data.max_length (\d+) keeps 99% of the rows whole", warnings[0])[1])
    assert needed > cfg.data.max_length
    whole = load_config(TINY, [f"data.max_length={needed}"])
    said = []
    prepare = prepare_datasets(whole.data, tokenizer, tmp_path / "cache", log=said.append)
    assert not [line for line in said if line.startswith("warning:")]
    assert prepare.stats["truncation"]["cut"] <= 0.01 * prepare.stats["truncation"]["rows"]


def _cut_warnings(cfg, cache) -> list[str]:
    from trainyard.model import source as source_room

    said: list[str] = []
    prepare_datasets(cfg.data, source_room.load_tokenizer(cfg.model, None), cache, log=said.append)
    return [line for line in said if line.startswith("warning:")]


def test_the_dry_run_warns_of_cut_answers() -> None:
    from tests.conftest import TINY, run_cli

    result = run_cli("train", TINY, "--dry-run", "data.max_length=96")
    assert result.returncode == 0, result.stderr[-2000:]
    warning = [line for line in result.stdout.splitlines() if "WARNING" in line]
    assert len(warning) == 1 and re.search(r"\d+ of \d+ rows \(\d+%\) lose target tokens", warning[0]), warning
