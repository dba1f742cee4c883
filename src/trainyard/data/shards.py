"""Token shards of a data.mixture: every source tokenized once, then only memory-mapped.

Layout of `<data.shards_dir>/mixture-<fingerprint>/`:

    manifest.json             format version, fingerprint, eos id, dtype, and per source: path, documents, tokens
    source-000/index.json     dtype, shards [{file, tokens, documents}], documents, tokens
    source-000/shard-00000.bin  flat tokens, each document followed by EOS; uint16 when the vocabulary fits, else uint32

The fingerprint covers the tokenizer, each source's path, format, text field and file sizes and times, and
FORMAT_VERSION: a prepared folder is never reused for other tokens, and never deleted for them either (the weights
are not in it: they change which rows are drawn, not the tokens). One process among all that share the folder
writes it (cache.py `build_once`); it works in `mixture-<fingerprint>.work/`, publishing each finished shard there
atomically, so a killed prepare keeps its finished shards and a rerun goes on from the first unfinished one. The
work folder becomes the prepared folder only when every source is complete.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trainyard.config import JobConfig, MixtureSource
from trainyard.data.cache import build_once
from trainyard.data.prepare import tokenizer_hash
from trainyard.data.sources import documents, identity
from trainyard.errors import DataError

FORMAT_VERSION = 1
"""Bump when a change here changes the bytes written for the same input."""
SHARD_TOKENS = 1 << 27
"""Tokens per shard file: 256 MiB of uint16, small enough to copy and to resume at, few enough to list."""
TOKENIZE_BATCH = 256


@dataclass
class SourceTokens:
    """One source's token stream, memory-mapped from its shards (documents back to back, each ended by EOS)."""

    path: str
    documents: int
    tokens: int
    bytes: int
    shards: list[np.ndarray] = field(repr=False)
    starts: list[int] = field(repr=False)
    """Token offset of each shard in the stream."""

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the stream, which may span shards; start + length <= tokens."""
        pieces = []
        shard = bisect.bisect_right(self.starts, start) - 1
        while length > 0:
            offset = start - self.starts[shard]
            piece = self.shards[shard][offset : offset + length]
            pieces.append(piece)
            start, length, shard = start + len(piece), length - len(piece), shard + 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


@dataclass
class PreparedShards:
    folder: Path
    fingerprint: str
    eos_id: int
    dtype: str
    sources: list[SourceTokens]
    built_here: bool = False


# ---------------------------------------------------------------- where and what


def shards_root(cfg: JobConfig) -> Path:
    return Path(cfg.data.shards_dir) if cfg.data.shards_dir else Path(cfg.output_dir) / ".cache" / "shards"


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 halves the disk and page cache of every vocabulary up to 65,536 ids (GPT-2's 50,257 included)."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def eos_id(tokenizer: Any) -> int:
    if tokenizer.eos_token_id is None:
        raise DataError(
            "the tokenizer has no eos token, so the documents of a mixture cannot be separated",
            fix="use a tokenizer that defines eos_token (set model.tokenizer)",
        )
    return int(tokenizer.eos_token_id)


def mixture_of(cfg: JobConfig) -> list[MixtureSource]:
    if not cfg.data.mixture:
        raise DataError(
            "this job has no data.mixture: prepare tokenizes the sources of a pretraining mixture",
            fix="add data.mixture: [{path: ..., weight: ...}, ...] to the job (map-style data.path jobs are "
            "tokenized by train itself)",
        )
    return cfg.data.mixture


def check_sources(cfg: JobConfig) -> None:
    """Fail on a source that matches nothing before the tokenizer (and torch with it) is loaded: in seconds."""
    for i, source in enumerate(mixture_of(cfg)):
        identity(source, i)


def fingerprint(sources: list[MixtureSource], tokenizer: Any) -> str:
    """Changes whenever the tokens written could change: tokenizer, files, fields, or this code's format."""
    parts = {
        "format_version": FORMAT_VERSION,
        "tokenizer": tokenizer_hash(tokenizer),
        "tokenizer_name": getattr(tokenizer, "name_or_path", ""),
        "vocab_size": len(tokenizer),
        "special": tokenizer.special_tokens_map,
        "sources": [
            {"path": s.path, "format": s.format, "text_field": s.text_field, "files": identity(s, i)}
            for i, s in enumerate(sources)
        ],
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def shards_folder(cfg: JobConfig, tokenizer: Any) -> Path:
    """The prepared folder this job reads (it may not exist yet)."""
    return shards_root(cfg) / f"mixture-{fingerprint(mixture_of(cfg), tokenizer)}"


# ---------------------------------------------------------------- writing


def _write_json(path: Path, data: Any) -> None:
    """Atomic: a reader (or a rerun after a kill) sees the old file or the new one, never half of one."""
    temp = path.with_name(path.name + ".tmp")
    temp.write_text(json.dumps(data, indent=1))
    os.replace(temp, path)


def _publish_shard(path: Path, pieces: list[np.ndarray], dtype: np.dtype) -> None:
    temp = path.with_name(path.name + ".tmp")
    with temp.open("wb") as file:
        for piece in pieces:
            file.write(piece.astype(dtype, copy=False).tobytes())
    os.replace(temp, path)


class _ShardWriter:
    """Cuts one source's token stream into shards of exactly `shard_tokens` (the last one shorter).

    After each shard, progress.json records the shards so far and where the next one starts (document, token
    offset in it), which is all a rerun needs to continue.
    """

    def __init__(self, folder: Path, dtype: np.dtype, shard_tokens: int) -> None:
        self.folder, self.dtype, self.shard_tokens = folder, dtype, shard_tokens
        saved = folder / "progress.json"
        self.progress = json.loads(saved.read_text()) if saved.exists() else {"shards": [], "next": [0, 0]}
        self.pieces: list[np.ndarray] = []
        self.size = self.ended = 0

    @property
    def resume_at(self) -> tuple[int, int]:
        document, offset = self.progress["next"]
        return document, offset

    def add(self, document: int, ids: np.ndarray, first: int = 0) -> None:
        """Append tokens ids[first:] of document number `document`."""
        position = first
        while position < len(ids):
            take = min(len(ids) - position, self.shard_tokens - self.size)
            self.pieces.append(ids[position : position + take])
            self.size, position = self.size + take, position + take
            self.ended += position == len(ids)
            if self.size == self.shard_tokens:
                self._flush([document, position] if position < len(ids) else [document + 1, 0])

    def _flush(self, next_at: list[int]) -> None:
        name = f"shard-{len(self.progress['shards']):05d}.bin"
        _publish_shard(self.folder / name, self.pieces, self.dtype)
        self.progress["shards"].append({"file": name, "tokens": self.size, "documents": self.ended})
        self.progress["next"] = next_at
        _write_json(self.folder / "progress.json", self.progress)
        self.pieces, self.size, self.ended = [], 0, 0

    def finish(self, documents: int) -> dict[str, Any]:
        if self.size:
            self._flush([documents, 0])
        shards = self.progress["shards"]
        index = {
            "dtype": self.dtype.name,
            "shards": shards,
            "documents": documents,
            "tokens": sum(shard["tokens"] for shard in shards),
        }
        _write_json(self.folder / "index.json", index)
        (self.folder / "progress.json").unlink(missing_ok=True)  # index.json now says it all
        return index


def _token_documents(
    source: MixtureSource, index: int, tokenizer: Any, skip: int
) -> Iterator[tuple[int, list[int]]]:
    """(document number, its ids + EOS) from document `skip` on; those before are read but not tokenized."""
    eos = eos_id(tokenizer)
    batch: list[tuple[int, str]] = []
    number = -1
    for number, (_, text) in enumerate(documents(source, index)):
        if number < skip:
            continue
        batch.append((number, text))
        if len(batch) == TOKENIZE_BATCH:
            yield from _encoded(batch, tokenizer, eos)
            batch = []
    yield from _encoded(batch, tokenizer, eos)
    if number < 0:
        raise DataError(
            f"data.mixture[{index}] ({source.path}) has no documents",
            fix=f"point data.mixture[{index}].path at data with text, or remove the source",
        )


def _encoded(batch: list[tuple[int, str]], tokenizer: Any, eos: int) -> Iterator[tuple[int, list[int]]]:
    """The same ids as tokenizer(text)["input_ids"] (special tokens as the tokenizer adds them), plus EOS.

    verbose=False: documents longer than the model's context are expected here (rows cut them), not worth a warning.
    """
    if not batch:
        return
    encoded = tokenizer([text for _, text in batch], verbose=False)["input_ids"]
    for (number, _), ids in zip(batch, encoded, strict=True):
        yield number, [*ids, eos]


def _write_source(folder: Path, source: MixtureSource, index: int, tokenizer: Any, shard_tokens: int, bar: Any):
    """Tokenize one source into `folder`, going on from its last finished shard; index.json marks it complete."""
    if (folder / "index.json").exists():
        return json.loads((folder / "index.json").read_text())
    folder.mkdir(parents=True, exist_ok=True)
    writer = _ShardWriter(folder, token_dtype(len(tokenizer)), shard_tokens)
    resume_document, resume_offset = writer.resume_at
    documents_seen = resume_document
    bar.set_description(f"data.mixture[{index}]")
    for number, ids in _token_documents(source, index, tokenizer, resume_document):
        writer.add(number, np.asarray(ids), resume_offset if number == resume_document else 0)
        documents_seen = number + 1
        bar.update(len(ids))
    return writer.finish(documents_seen)


def _source_entry(source: MixtureSource, index: dict[str, Any], folder: str) -> dict[str, Any]:
    itemsize = np.dtype(index["dtype"]).itemsize
    return {
        "path": source.path,
        "format": source.format,
        "text_field": source.text_field,
        "folder": folder,
        "documents": index["documents"],
        "tokens": index["tokens"],
        "bytes": index["tokens"] * itemsize,
    }


def _build(work: Path, target: Path, sources: list[MixtureSource], tokenizer: Any, shard_tokens: int,
           show_progress: bool, mixture_fingerprint: str) -> None:
    """Fill `work` source by source (keeping what an earlier, killed run finished), then move it to `target`."""
    from tqdm import tqdm

    work.mkdir(parents=True, exist_ok=True)
    entries = []
    with tqdm(unit="tok", unit_scale=True, disable=not show_progress, file=sys.stderr) as bar:
        for i, source in enumerate(sources):
            index = _write_source(work / f"source-{i:03d}", source, i, tokenizer, shard_tokens, bar)
            entries.append(_source_entry(source, index, f"source-{i:03d}"))
    manifest = {
        "format_version": FORMAT_VERSION,
        "fingerprint": mixture_fingerprint,  # not target's name: build_once hands _build a temporary folder
        "tokenizer": getattr(tokenizer, "name_or_path", ""),
        "vocab_size": len(tokenizer),
        "eos_id": eos_id(tokenizer),
        "dtype": token_dtype(len(tokenizer)).name,
        "sources": entries,
    }
    _write_json(work / "manifest.json", manifest)
    work.rename(target)


def prepare(
    cfg: JobConfig,
    tokenizer: Any,
    *,
    shard_tokens: int = SHARD_TOKENS,
    log: Callable[[str], None] = print,
    show_progress: bool = True,
) -> PreparedShards:
    """The job's prepared shards, tokenized here if no process did it before. Safe to call on every rank."""
    sources = mixture_of(cfg)
    eos_id(tokenizer)
    stamp = fingerprint(sources, tokenizer)
    target = shards_root(cfg) / f"mixture-{stamp}"
    target.parent.mkdir(parents=True, exist_ok=True)
    work = target.with_name(target.name + ".work")
    built = build_once(
        target,
        lambda folder: _build(work, folder, sources, tokenizer, shard_tokens, show_progress, stamp),
        timeout_s=cfg.data.prepare_timeout_s,
    )
    log(f"{'prepared' if built else 'reusing prepared'} token shards {target}")
    prepared = open_shards(target)
    prepared.built_here = built
    return prepared


# ---------------------------------------------------------------- reading


def _corrupt(folder: Path, what: str, where: Path, detail: str) -> DataError:
    return DataError(
        f"the prepared shards {folder} are damaged: {what}: {detail}",
        where=str(where),
        fix=f"move {folder} aside (trainyard never deletes it) and run `trainyard prepare CONFIG` again",
    )


def _read_json(folder: Path, path: Path, what: str) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _corrupt(folder, what, path, f"{type(err).__name__}: {err}") from None


def _open_source(folder: Path, entry: dict[str, Any], number: int) -> SourceTokens:
    what = f"data.mixture[{number}] ({entry['path']})"
    index_path = folder / entry["folder"] / "index.json"
    index = _read_json(folder, index_path, what)
    shards, starts, start = [], [], 0
    try:
        itemsize = np.dtype(index["dtype"]).itemsize
        for shard in index["shards"]:
            path = folder / entry["folder"] / shard["file"]
            size = path.stat().st_size if path.exists() else None
            if size != shard["tokens"] * itemsize:
                found = "missing" if size is None else f"{size:,} bytes"
                raise _corrupt(folder, what, path, f"{found}, the index says {shard['tokens'] * itemsize:,}")
            shards.append(np.memmap(path, dtype=index["dtype"], mode="r", shape=(shard["tokens"],)))
            starts.append(start)
            start += shard["tokens"]
        source = SourceTokens(entry["path"], index["documents"], index["tokens"], entry["bytes"], shards, starts)
    except (KeyError, TypeError, ValueError) as err:
        raise _corrupt(folder, what, index_path, f"{type(err).__name__}: {err}") from None
    if start != source.tokens:
        raise _corrupt(folder, what, index_path, f"its shards hold {start:,} tokens, the index says {source.tokens:,}")
    return source


def open_shards(folder: Path) -> PreparedShards:
    """A prepared folder, memory-mapped: nothing is tokenized or read into memory here. Damage that a size check
    can see (a truncated or missing shard, a broken index) stops with exit 2 naming the source and the file."""
    folder = Path(folder)
    manifest_path = folder / "manifest.json"
    if not manifest_path.is_file():
        raise DataError(
            f"{folder} is not a prepared shards folder (no manifest.json)",
            fix="run `trainyard prepare CONFIG` for this job, or point data.shards_dir at where it wrote the shards",
        )
    manifest = _read_json(folder, manifest_path, "its manifest")
    try:
        return PreparedShards(
            folder=folder,
            fingerprint=manifest["fingerprint"],
            eos_id=manifest["eos_id"],
            dtype=manifest["dtype"],
            sources=[_open_source(folder, entry, i) for i, entry in enumerate(manifest["sources"])],
        )
    except (KeyError, TypeError) as err:
        raise _corrupt(folder, "its manifest", manifest_path, f"{type(err).__name__}: {err}") from None
