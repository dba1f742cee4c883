"""prepare(): sources of every kind tokenized once into fingerprinted shards that read back exactly, reused as they
are, resumed after a kill, and never shared between tokenizers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets
import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trainyard.config_file import load_config
from trainyard.data import shards as shards_room
from trainyard.data.shards import open_shards, prepare, token_dtype
from trainyard.data.tokenizer import build_byte_tokenizer
from trainyard.errors import DataError

TEXTS = [f"document {i}: " + "words and more words " * (i % 7) for i in range(120)]


class WideTokenizer:
    """A tokenizer with a 70,000-id vocabulary (ids above uint16), one id per character."""

    is_fast = False
    name_or_path = "wide"
    eos_token_id = 69_999
    special_tokens_map = {"eos_token": "<eos>"}

    def __len__(self) -> int:
        return 70_000

    def get_vocab(self) -> dict[str, int]:
        return {"<eos>": 69_999}

    def __call__(self, texts: list[str], **_: Any) -> dict[str, Any]:
        return {"input_ids": [[66_000 + ord(c) for c in text] for text in texts]}


def job(root: Path, *sources: str) -> Any:
    """A job with one mixture entry per source (path or path|text_field), writing under root."""
    entries = []
    for source in sources:
        path, _, field = source.partition("|")
        entries.append({"path": path, "weight": 1, **({"text_field": field} if field else {})})
    config = {
        "output_dir": str(root / "runs"),
        "model": {"config": {"model_type": "llama"}, "tokenizer": "builtin:bytes"},
        "data": {"mixture": entries},
    }
    (root / "job.yaml").write_text(json.dumps(config))
    return load_config(str(root / "job.yaml"))


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: text, "id": i}) + "\n" for i, text in enumerate(texts)))
    return path


def expected(tokenizer: Any, texts: list[str]) -> list[int]:
    return [token for text in texts for token in [*tokenizer([text])["input_ids"][0], tokenizer.eos_token_id]]


def tokens_of(source: Any) -> list[int]:
    return source.read(0, source.tokens).tolist()


def folder_snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    files = [p for p in folder.rglob("*") if p.is_file()]
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns) for p in files}


def test_tokens_read_back_equal_the_tokenizer_output_plus_eos(tmp_path: Path) -> None:
    tokenizer = build_byte_tokenizer()
    write_jsonl(tmp_path / "a.jsonl", TEXTS[:60])
    write_jsonl(tmp_path / "b.jsonl", TEXTS[60:])
    cfg = job(tmp_path, str(tmp_path / "*.jsonl"), str(tmp_path / "b.jsonl"))
    prepared = prepare(cfg, tokenizer, shard_tokens=500, show_progress=False)
    assert prepared.built_here and prepared.dtype == "uint16"
    assert tokens_of(prepared.sources[0]) == expected(tokenizer, TEXTS)  # the glob, in sorted file order
    assert tokens_of(prepared.sources[1]) == expected(tokenizer, TEXTS[60:])
    assert prepared.sources[0].documents == 120 and len(prepared.sources[0].shards) > 3
    index = json.loads((prepared.folder / "source-000" / "index.json").read_text())
    assert sum(shard["documents"] for shard in index["shards"]) == 120
    assert all(shard["tokens"] == 500 for shard in index["shards"][:-1])
    assert prepared.folder.parent == tmp_path / "runs" / ".cache" / "shards"


def test_a_vocabulary_past_uint16_is_stored_as_uint32(tmp_path: Path) -> None:
    assert token_dtype(50_257) == np.uint16 and token_dtype(65_536) == np.uint16 and token_dtype(65_537) == np.uint32
    tokenizer = WideTokenizer()
    cfg = job(tmp_path, str(write_jsonl(tmp_path / "a.jsonl", TEXTS[:5])))
    prepared = prepare(cfg, tokenizer, show_progress=False)
    assert prepared.dtype == "uint32" and prepared.sources[0].shards[0].dtype == np.uint32
    assert tokens_of(prepared.sources[0]) == expected(tokenizer, TEXTS[:5])


def test_a_second_prepare_reuses_the_folder_untouched(tmp_path: Path) -> None:
    tokenizer = build_byte_tokenizer()
    cfg = job(tmp_path, str(write_jsonl(tmp_path / "a.jsonl", TEXTS)))
    first = prepare(cfg, tokenizer, shard_tokens=700, show_progress=False)
    before = folder_snapshot(first.folder)
    second = prepare(cfg, tokenizer, shard_tokens=700, show_progress=False)
    assert not second.built_here and second.folder == first.folder
    assert folder_snapshot(second.folder) == before


def test_a_killed_prepare_keeps_finished_shards_and_a_rerun_completes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenizer = build_byte_tokenizer()
    source = str(write_jsonl(tmp_path / "a.jsonl", TEXTS))
    cfg = job(tmp_path, source, source + "|text")
    publish = shards_room._publish_shard
    published: list[Path] = []

    def die_after_the_first_shard(path: Path, *args: Any) -> None:
        if published:
            raise KeyboardInterrupt("killed")
        publish(path, *args)
        published.append(path)

    monkeypatch.setattr(shards_room, "_publish_shard", die_after_the_first_shard)
    with pytest.raises(KeyboardInterrupt):
        prepare(cfg, tokenizer, shard_tokens=600, show_progress=False)
    target = shards_room.shards_folder(cfg, tokenizer)
    assert not target.exists() and published[0].exists()
    kept = published[0].stat().st_mtime_ns
    monkeypatch.setattr(shards_room, "_publish_shard", publish)
    resumed = prepare(cfg, tokenizer, shard_tokens=600, show_progress=False)
    first_shard = target / published[0].relative_to(published[0].parents[1])
    assert resumed.folder == target and first_shard.stat().st_mtime_ns == kept  # kept, not written again
    assert not target.with_name(target.name + ".work").exists()
    (tmp_path / "fresh").mkdir()
    whole = prepare(job(tmp_path / "fresh", source, source + "|text"), tokenizer, shard_tokens=600, show_progress=False)
    assert {k: v[0] for k, v in folder_snapshot(resumed.folder).items()} == {
        k: v[0] for k, v in folder_snapshot(whole.folder).items()
    }


def test_another_tokenizer_gets_another_folder_and_the_old_one_stays(tmp_path: Path) -> None:
    cfg = job(tmp_path, str(write_jsonl(tmp_path / "a.jsonl", TEXTS[:10])))
    first = prepare(cfg, build_byte_tokenizer(), show_progress=False)
    before = folder_snapshot(first.folder)
    second = prepare(cfg, WideTokenizer(), show_progress=False)
    assert second.folder != first.folder and second.built_here
    assert folder_snapshot(first.folder) == before


def test_a_changed_file_gets_another_folder(tmp_path: Path) -> None:
    tokenizer = build_byte_tokenizer()
    path = write_jsonl(tmp_path / "a.jsonl", TEXTS[:10])
    cfg = job(tmp_path, str(path))
    first = prepare(cfg, tokenizer, show_progress=False)
    write_jsonl(path, TEXTS[:11])
    second = prepare(cfg, tokenizer, show_progress=False)
    assert second.folder != first.folder and second.sources[0].documents == 11


def test_memory_file_parquet_saved_and_streamed_sources(tmp_path: Path) -> None:
    tokenizer = build_byte_tokenizer()
    with fsspec.open("memory://trainyard-test/mem.jsonl", "w") as file:
        file.write("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:7]))
    write_jsonl(tmp_path / "local.jsonl", TEXTS[7:20])
    pq.write_table(pa.table({"body": TEXTS[20:30]}), tmp_path / "p.parquet")
    datasets.Dataset.from_dict({"text": TEXTS[30:40]}).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "hub").mkdir()
    pq.write_table(pa.table({"text": TEXTS[40:55]}), tmp_path / "hub" / "train.parquet")
    cfg = job(
        tmp_path,
        "memory://trainyard-test/mem.jsonl",
        f"file://{tmp_path}/local.jsonl",
        f"{tmp_path}/p.parquet|body",
        f"{tmp_path}/saved",
        f"hf://{tmp_path}/hub",
    )
    prepared = prepare(cfg, tokenizer, show_progress=False)
    spans = [TEXTS[:7], TEXTS[7:20], TEXTS[20:30], TEXTS[30:40], TEXTS[40:55]]
    for source, texts in zip(prepared.sources, spans, strict=True):
        assert tokens_of(source) == expected(tokenizer, texts), source.path
    assert open_shards(prepared.folder).fingerprint == prepared.fingerprint == prepared.folder.name.split("-", 1)[1]
    fsspec.filesystem("memory").rm("/trainyard-test", recursive=True)


def test_a_streamed_dataset_goes_through_load_dataset_streaming(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[dict[str, Any]] = []
    real = datasets.load_dataset

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", spy)
    (tmp_path / "hub").mkdir()
    write_jsonl(tmp_path / "hub" / "part.jsonl", TEXTS[:4])
    prepared = prepare(job(tmp_path, f"hf://{tmp_path}/hub"), build_byte_tokenizer(), show_progress=False)
    assert calls and calls[0]["streaming"] is True
    assert prepared.sources[0].documents == 4


def test_the_job_stream_reads_the_prepared_documents_back(tmp_path: Path) -> None:
    from trainyard.data.mixture import mixture_stream

    tokenizer = build_byte_tokenizer()
    cfg = job(tmp_path, str(write_jsonl(tmp_path / "a.jsonl", TEXTS)))
    cfg.data.max_length = 64
    prepared = prepare(cfg, tokenizer, show_progress=False)
    rows = [row for _, row in zip(range(10), mixture_stream(cfg, prepared, rank=0, world_size=1))]
    text = tokenizer.decode([t for row in rows for t in row["input_ids"]])
    assert text.startswith("<|eos|>".join(TEXTS[:5]))
    cfg.data.mixture = [*cfg.data.mixture, cfg.data.mixture[0].model_copy(update={"path": "other.jsonl"})]
    with pytest.raises(DataError, match="not this job's data.mixture"):
        mixture_stream(cfg, prepared)


@pytest.mark.parametrize(
    ("damage", "needles"),
    [
        ("truncated-shard", ["data.mixture[1]", "source-001/shard-00000.bin", "the index says"]),
        ("missing-shard", ["data.mixture[1]", "source-001/shard-00000.bin", "missing"]),
        ("broken-index", ["data.mixture[0]", "source-000/index.json", "JSONDecodeError"]),
        ("broken-manifest", ["its manifest", "manifest.json", "JSONDecodeError"]),
    ],
)
def test_damaged_shards_stop_naming_the_source_and_file_and_are_kept(
    tmp_path: Path, damage: str, needles: list[str]
) -> None:
    small, large = write_jsonl(tmp_path / "a.jsonl", TEXTS[:10]), write_jsonl(tmp_path / "b.jsonl", TEXTS)
    cfg = job(tmp_path, str(small), str(large))
    folder = prepare(cfg, build_byte_tokenizer(), show_progress=False).folder
    shard = folder / "source-001" / "shard-00000.bin"
    if damage == "truncated-shard":
        shard.write_bytes(shard.read_bytes()[:-2])
    elif damage == "missing-shard":
        shard.unlink()
    elif damage == "broken-index":
        (folder / "source-000" / "index.json").write_text('{"shards": [')
    else:
        (folder / "manifest.json").write_text("{")
    with pytest.raises(DataError) as err:
        prepare(cfg, build_byte_tokenizer(), show_progress=False)
    shown = err.value.render()
    for needle in [*needles, "trainyard prepare"]:
        assert needle in shown, shown
    assert folder.is_dir(), "a damaged folder is the user's to remove"
