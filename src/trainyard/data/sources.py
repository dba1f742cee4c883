"""The documents of one `data.mixture` source, in a fixed order, from wherever the source lives.

A source is read through fsspec (local paths, globs, `file://`, `memory://`, `s3://`, ... all take the same code
path), through `datasets.load_from_disk` for a save_to_disk folder, or through `datasets.load_dataset(NAME,
streaming=True)` for `hf://NAME`. Two built-in sources hold real text every Python has, for from-scratch runs
with no download: `builtin:python-stdlib` (the standard library's top-level modules, one document per file) and
`builtin:pydoc-topics` (pydoc's English help topics, one document per topic). Files are read in sorted order
so every process and every rerun sees the same documents in the same order. Every problem is a DataError that
names `data.mixture[i].path`, the file and the line (or row) where known, and a fix.
"""

from __future__ import annotations

import hashlib
import json
import sys
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import fsspec

from trainyard.config import MixtureSource
from trainyard.errors import DataError

HF_PREFIX = "hf://"
JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
COMPRESSION_SUFFIXES = ("", ".gz", ".bz2", ".xz", ".zst")
SAVED_MARKERS = ("state.json", "dataset_dict.json")
BATCH_ROWS = 1024
STDLIB, PYDOC_TOPICS = "builtin:python-stdlib", "builtin:pydoc-topics"
Document = tuple[str, str]
"""(where: "file:line" or "file:row N", the document's text)."""


def field_of(index: int) -> str:
    return f"data.mixture[{index}].path"


def _readable(name: str) -> bool:
    return any(name.endswith(kind + packed) for kind in JSONL_SUFFIXES for packed in COMPRESSION_SUFFIXES) or any(
        name.endswith(kind) for kind in PARQUET_SUFFIXES
    )


def _nothing_there(path: str, index: int, detail: str) -> DataError:
    return DataError(
        f"{field_of(index)} {path} {detail}",
        fix=f"point {field_of(index)} at a .jsonl or .parquet file, a glob of them (data/*.jsonl), a folder of them, "
        "a save_to_disk folder, or hf://NAME for a dataset that datasets.load_dataset can stream",
    )


def _is_saved_dataset(fs: Any, root: str) -> bool:
    return any(fs.exists(f"{root.rstrip('/')}/{marker}") for marker in SAVED_MARKERS)


def resolve(source: MixtureSource, index: int) -> tuple[Any, list[str], bool]:
    """(filesystem, sorted files, is a save_to_disk folder) of a file, glob or folder source.

    A folder that is not a save_to_disk folder stands for the JSONL and Parquet files under it.
    """
    path = source.path
    try:
        fs, root = fsspec.core.url_to_fs(path)
        if any(char in root for char in "*?["):
            files = sorted(fs.glob(root))
        elif fs.isdir(root):
            if _is_saved_dataset(fs, root):
                return fs, [root], True
            files = sorted(name for name in fs.find(root) if _readable(name))
        elif fs.isfile(root):
            files = [root]
        else:
            raise _nothing_there(path, index, "does not exist")
    except (OSError, ValueError, ImportError) as err:
        raise _nothing_there(path, index, f"cannot be listed ({type(err).__name__}: {err})") from None
    if not files:
        raise _nothing_there(path, index, "matches no .jsonl or .parquet file")
    for name in files:
        if not _readable(name):
            raise _nothing_there(path, index, f"holds {name}, which is neither JSONL nor Parquet")
    return fs, files, False


def shown(fs: Any, name: str) -> str:
    """A file's name as the user wrote it: a plain path for local files, a URL (memory://, s3://) otherwise."""
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else fs.protocol
    return name if "file" in protocols else fs.unstrip_protocol(name)


def _stdlib_files() -> list[Path]:
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def _pydoc_topics() -> dict[str, str]:
    from pydoc_data.topics import topics

    return topics


def _builtin_identity(source: MixtureSource, index: int) -> list[Any]:
    if source.path == STDLIB:
        return [STDLIB, sys.version, *_stamps(fsspec.filesystem("file"), [str(p) for p in _stdlib_files()])]
    if source.path == PYDOC_TOPICS:
        text = json.dumps(_pydoc_topics(), sort_keys=True).encode()
        return [PYDOC_TOPICS, sys.version, hashlib.sha256(text).hexdigest()]
    raise DataError(
        f"{field_of(index)} {source.path} is not a built-in text source",
        fix=f"use {STDLIB} or {PYDOC_TOPICS}, or a file, glob, folder or hf://NAME",
    )


def _builtin_documents(source: MixtureSource) -> Iterator[Document]:
    if source.path == STDLIB:
        for path in _stdlib_files():
            yield str(path), path.read_text(encoding="utf-8", errors="replace")
    else:
        for name, text in sorted(_pydoc_topics().items()):
            yield f"{PYDOC_TOPICS}:{name}", text


def identity(source: MixtureSource, index: int) -> list[Any]:
    """What the prepared tokens depend on besides the tokenizer: every file's name, size and modification time.

    A streamed hub dataset (`hf://owner/name`) is known by its name only: its files are not listed without
    downloading. A local dataset folder streamed through `hf://` is stamped like any folder.
    """
    if source.path.startswith("builtin:"):
        return _builtin_identity(source, index)
    if source.path.startswith(HF_PREFIX):
        local = fsspec.filesystem("file")
        folder = source.path.removeprefix(HF_PREFIX)
        return [source.path, *_stamps(local, sorted(local.find(folder)))] if local.isdir(folder) else [source.path]
    fs, files, saved = resolve(source, index)
    return _stamps(fs, sorted(fs.find(files[0])) if saved else files)


def _stamps(fs: Any, files: list[str]) -> list[Any]:
    stamps = []
    for name in files:
        info = fs.info(name)
        changed = info.get("mtime") or info.get("LastModified") or info.get("created") or info.get("ETag")
        stamps.append([name, info.get("size"), str(changed)])
    return stamps


def documents(source: MixtureSource, index: int) -> Iterator[Document]:
    """Every document's text, in order; the reader follows the kind of source."""
    if source.path.startswith("builtin:"):
        yield from _builtin_documents(source)
        return
    if source.path.startswith(HF_PREFIX):
        yield from _streamed_dataset(source, index)
        return
    fs, files, saved = resolve(source, index)
    if saved:
        yield from _saved_dataset(fs, files[0], source, index)
        return
    for name in files:
        if name.endswith(PARQUET_SUFFIXES):
            yield from _parquet(fs, name, source, index)
        else:
            yield from _jsonl(fs, name, source, index)


def _text_of(row: Any, where: str, source: MixtureSource, index: int) -> str:
    """The document in a row; a row without the text field stops the prepare (no silent holes in the data)."""
    value = row.get(source.text_field) if isinstance(row, dict) else None
    if isinstance(value, str):
        return value
    shape = f"keys {sorted(row)}" if isinstance(row, dict) else f"a {type(row).__name__}, not an object"
    raise DataError(
        f"data.mixture[{index}] ({source.path}): no text field '{source.text_field}' in this row ({shape})",
        where=where,
        fix=f"set data.mixture[{index}].text_field to the field that holds the text, or fix the row",
    )


def _jsonl(fs: Any, name: str, source: MixtureSource, index: int) -> Iterator[Document]:
    """JSON Lines, read by hand rather than by datasets' json builder: only a line-by-line reader can say which
    line of which file is broken, and fsspec still gives every filesystem and compression for free."""
    with fs.open(name, "rb", compression="infer") as file:
        for number, raw in enumerate(file, start=1):
            where = f"{shown(fs, name)}:{number}"
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.decode("utf-8-sig" if number == 1 else "utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                raise DataError(
                    f"data.mixture[{index}] ({source.path}): not a JSON line ({type(err).__name__}: {err})",
                    where=where,
                    fix="fix or remove that line; each line holds one JSON object, saved as UTF-8",
                ) from None
            yield where, _text_of(row, where, source, index)


def _rows_in_batches(batches: Iterable[Any], name: str, source: MixtureSource, index: int) -> Iterator[Document]:
    """Documents of Arrow-like batches of the text column, each where-tagged with its row number."""
    number = 0
    for batch in batches:
        for value in batch:
            where = f"{name}:row {number}"
            yield where, _text_of({source.text_field: value}, where, source, index)
            number += 1


def _missing_column(name: str, columns: list[str], source: MixtureSource, index: int) -> DataError:
    return DataError(
        f"data.mixture[{index}] ({source.path}): no column '{source.text_field}' (columns: {columns})",
        where=name,
        fix=f"set data.mixture[{index}].text_field to the column that holds the text",
    )


def _parquet(fs: Any, name: str, source: MixtureSource, index: int) -> Iterator[Document]:
    """Parquet through pyarrow on an fsspec file: only the text column is read, in row groups."""
    import pyarrow
    import pyarrow.parquet as pq

    with fs.open(name, "rb") as handle:
        try:
            parquet = pq.ParquetFile(handle)
            columns = parquet.schema_arrow.names
            if source.text_field not in columns:
                raise _missing_column(shown(fs, name), columns, source, index)
            batches = (b.column(0).to_pylist() for b in parquet.iter_batches(BATCH_ROWS, columns=[source.text_field]))
            yield from _rows_in_batches(batches, shown(fs, name), source, index)
        except (pyarrow.ArrowException, OSError) as err:
            raise DataError(
                f"data.mixture[{index}] ({source.path}): unreadable Parquet file ({err})",
                where=shown(fs, name),
                fix="write the Parquet file again from its source",
            ) from None


def _saved_dataset(fs: Any, root: str, source: MixtureSource, index: int) -> Iterator[Document]:
    import datasets

    url = fs.unstrip_protocol(root)
    try:
        loaded = datasets.load_from_disk(url)
    except (FileNotFoundError, ValueError, OSError, KeyError, TypeError) as err:
        raise DataError(
            f"data.mixture[{index}] ({source.path}): the save_to_disk folder cannot be read ({err})",
            where=shown(fs, root),
            fix="write it again with Dataset.save_to_disk",
        ) from None
    if isinstance(loaded, datasets.DatasetDict):
        loaded = loaded["train"] if "train" in loaded else loaded[sorted(loaded)[0]]
    if source.text_field not in loaded.column_names:
        raise _missing_column(shown(fs, root), loaded.column_names, source, index)
    column = loaded.select_columns([source.text_field])
    batches = (batch[source.text_field] for batch in column.iter(batch_size=BATCH_ROWS))
    yield from _rows_in_batches(batches, shown(fs, root), source, index)


def _streamed_dataset(source: MixtureSource, index: int) -> Iterator[Document]:
    """`hf://NAME`: a hub dataset, or a local dataset folder or script, streamed (never downloaded whole)."""
    import datasets

    name = source.path.removeprefix(HF_PREFIX)
    try:
        for number, row in enumerate(datasets.load_dataset(name, split="train", streaming=True)):
            where = f"{source.path}:row {number}"
            yield where, _text_of(row, where, source, index)
    except DataError:
        raise
    except Exception as err:  # hub, builder and file errors share no base class
        raise DataError(
            f"data.mixture[{index}] ({source.path}): datasets.load_dataset('{name}', streaming=True) failed "
            f"({type(err).__name__}: {err})",
            where=source.path,
            fix=f"check the dataset name or folder in {field_of(index)}, and that it has a train split",
        ) from None
