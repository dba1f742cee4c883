"""Check a job's paths before any process starts, so bad input fails in seconds with exit 2.

The trainer reads these paths much later (after the process group, the run dir and the
tokenizer); a folder that is a file or a corrupt data file found there costs minutes and,
worse, raises from deep inside a library. These checks are cheap (headers and footers, the
first bytes of text files) and name the field, the file and its line.
"""

from __future__ import annotations

import codecs
import json
import struct
from pathlib import Path
from typing import Any

from trainyard.config import JobConfig
from trainyard.config.data import PAIR_SHAPES, SFT_SHAPES
from trainyard.errors import CheckpointError, ConfigError, DataError, ModelError, TrainyardError

_MAX_SAFETENSORS_HEADER = 100 << 20
DATA_FIX = "set {field} to a JSONL, JSON or Parquet file or a save_to_disk folder{builtin}, each row {rows}"
SUFFIXES = (".jsonl", ".json", ".parquet")
SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
SNIFF_BYTES = 1 << 16


def data_fix(field: str, objective: str) -> str:
    """Where the rows go and what shape they take for the job's objective: the built-in tasks are SFT's only."""
    if objective == "dpo":
        return DATA_FIX.format(field=field, builtin="", rows=f"a preference pair, {PAIR_SHAPES}")
    return DATA_FIX.format(field=field, builtin=" or a built-in task (builtin:dates)", rows=SFT_SHAPES)


def check_source(path: Path, field: str = "data.path", skip_bad_rows: bool = False, objective: str = "sft") -> None:
    """Cheap checks of a data source before any process starts: it exists, has a known kind,
    is not empty, is text (JSON/JSONL) or has a readable footer (Parquet).

    With `skip_bad_rows` a JSONL line that is not UTF-8 is left to the reader, which skips it.
    """
    if not path.exists():
        raise DataError(f"{field}: {path} does not exist", fix=data_fix(field, objective))
    if path.is_dir():
        if not any((path / marker).is_file() for marker in SAVED_MARKERS):
            raise DataError(
                f"{field}: {path} is a folder but not one written by Dataset.save_to_disk",
                fix=f"point {field} at a data file, or at a folder written by save_to_disk",
            )
        return
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise DataError(
            f"{field}: cannot read {path}: unknown file type '{suffix}'",
            fix="use a .jsonl, .json or .parquet file, or a folder written by Dataset.save_to_disk",
        )
    if path.stat().st_size == 0:
        raise DataError(f"{field}: {path} is empty", fix=f"write rows into it, or {data_fix(field, objective)}")
    if suffix == ".parquet":
        parquet_file(path, field)
        return
    with path.open("rb") as file:
        head = file.read(SNIFF_BYTES)
    if skip_bad_rows and suffix == ".jsonl" and b"\0" not in head:
        return
    check_text(head, path, field, final=len(head) < SNIFF_BYTES)


def check_text(raw: bytes, path: Path, field: str, final: bool) -> None:
    """A JSON/JSONL file must be UTF-8 text: name the line of the first byte that is not."""
    if b"\0" in raw:
        line = raw[: raw.index(b"\0")].count(b"\n") + 1
        raise DataError(
            f"{field}: {path} is a binary file, not {path.suffix[1:].upper()} text",
            where=f"{path}:{line}",
            fix="point it at the data itself: JSONL/JSON saved as UTF-8, or Parquet named .parquet",
        )
    try:
        raw.decode("utf-8") if final else codecs.getincrementaldecoder("utf-8")().decode(raw)
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise DataError(
            f"{field}: {path} is not UTF-8 text (byte 0x{raw[err.start]:02x} at offset {err.start})",
            where=f"{path}:{line}",
            fix="re-save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)",
        ) from None


def parse_json(text: str, path: Path, error: type[TrainyardError], what: str, fix: str) -> Any:
    """json.loads, its failure raised as `error` naming the reason and the file's line, not a bare traceback."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise error(f"{what} ({err.msg})", where=f"{path}:{err.lineno}", fix=fix) from None


def parquet_file(path: Path, field: str) -> Any:
    import pyarrow
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except (pyarrow.ArrowException, OSError) as err:
        raise DataError(
            f"{field}: {path} is not a readable Parquet file ({err})",
            fix="write it again (e.g. Dataset.to_parquet or pyarrow.parquet.write_table); "
            "a truncated copy has no footer",
        ) from None


def check_job_inputs(cfg: JobConfig) -> None:
    """Everything a train or eval run reads or creates from the config; raises on the first problem."""
    try:
        _check_dirs(cfg)
        for field, value in (("data.path", cfg.data.path), ("data.eval_path", cfg.data.eval_path)):
            if value and not value.startswith("builtin:"):
                check_source(Path(value), field, cfg.data.on_bad_row == "skip", cfg.train.objective)
        if cfg.model.path is not None:
            check_model_path(cfg.model.path, "model.path")
        if cfg.model.tokenizer and cfg.model.tokenizer != "builtin:bytes" and _looks_local(cfg.model.tokenizer):
            _check_local_folder(cfg.model.tokenizer, "model.tokenizer", ModelError)
        _check_resume(cfg.checkpoint.resume)
    except TrainyardError as err:
        field = _field_of(err)
        if err.where is None and field and cfg.where(field):
            err.where = cfg.where(field)
            err.args = (err.render(),)
        raise


def _field_of(err: TrainyardError) -> str | None:
    head = err.what.split(":", 1)[0]
    return head if head and " " not in head else None


def _check_dirs(cfg: JobConfig) -> None:
    writable_dir(cfg.output_dir, "output_dir")
    if cfg.run_dir.exists() and not cfg.run_dir.is_dir():
        raise ConfigError(
            f"output_dir: the run dir {cfg.run_dir} is a file",
            fix="move that file away, or set run_name or output_dir to somewhere else",
        )
    if cfg.data.cache_dir:
        writable_dir(cfg.data.cache_dir, "data.cache_dir")
    if cfg.model.cache_dir:
        writable_dir(cfg.model.cache_dir, "model.cache_dir")


def writable_dir(value: str, field: str) -> Path:
    """Create the folder (it would be created anyway) or say why it cannot be."""
    path = Path(value)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{field}: {path} is a file, not a folder", fix=f"set {field} to a folder (new or existing)")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        blocker = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
        reason = f"{blocker} is a file" if blocker else err.strerror
        raise ConfigError(
            f"{field}: cannot create {path} ({reason})", fix=f"set {field} to a folder you can write"
        ) from None
    return path


def _looks_local(value: str) -> bool:
    return value.startswith((".", "/", "~")) or Path(value).exists()


def _check_local_folder(value: str, field: str, error: type[TrainyardError]) -> Path:
    path = Path(value)
    if not path.exists():
        raise error(f"{field}: {path} does not exist", fix=f"set {field} to a model folder or a hub id")
    if not path.is_dir():
        raise error(f"{field}: {path} is a file, not a folder", fix=f"set {field} to the folder that holds it")
    return path


def check_model_path(value: str, field: str = "model.path") -> None:
    """A local model folder must hold a readable config.json and safetensors with whole headers."""
    if value.startswith("builtin:") or not _looks_local(value):
        return  # built-in models and hub ids are resolved by model.py
    path = Path(value)
    if value.endswith(".gguf"):
        if not path.is_file():
            raise ModelError(f"{field}: GGUF file {path} does not exist", fix="check the path")
        with path.open("rb") as file:
            if file.read(4) != b"GGUF":
                raise ModelError(f"{field}: {path} is not a GGUF file (no GGUF magic)", fix="download the file again")
        return
    if path.is_file():
        raise ModelError(
            f"{field}: {path} is a file; a model is a folder with config.json (or a .gguf file)",
            fix=f"set {field} to the folder that holds config.json and the weights",
        )
    folder = _check_local_folder(value, field, ModelError)
    config = folder / "config.json"
    if not config.is_file():
        raise ModelError(
            f"{field}: {folder} has no config.json", fix=f"set {field} to a folder saved by save_pretrained"
        )
    fix = "restore config.json from the model's source"
    try:
        text = config.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise ModelError(f"{field}: {config} is not UTF-8 text", fix=fix) from None
    parsed = parse_json(text, config, ModelError, f"{field}: {config} is not valid JSON", fix)
    if not isinstance(parsed, dict):
        raise ModelError(f"{field}: {config} is not a JSON object", fix=fix)
    for weights in sorted(folder.glob("*.safetensors")):
        _check_safetensors(weights, field)


def _check_safetensors(path: Path, field: str) -> None:
    """The header is an 8-byte length and JSON; every tensor's bytes must lie inside the file."""
    fix = "download or save the model again; this file is truncated or not safetensors"
    size = path.stat().st_size
    with path.open("rb") as file:
        head = file.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if length < 2 or length > min(size - 8, _MAX_SAFETENSORS_HEADER):
            raise ModelError(f"{field}: {path} is not a readable safetensors file (bad header length)", fix=fix)
        try:
            header = json.loads(file.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError):
            what = f"{field}: {path} is not a readable safetensors file (header is not JSON)"
            raise ModelError(what, fix=fix) from None
    ends = [
        entry["data_offsets"][1]
        for name, entry in header.items()
        if name != "__metadata__" and isinstance(entry, dict) and len(entry.get("data_offsets") or ()) == 2
    ]
    if ends and max(ends) > size - 8 - length:
        raise ModelError(
            f"{field}: {path} is truncated ({size} bytes, its header needs {8 + length + max(ends)})", fix=fix
        )


def _check_resume(resume: str) -> None:
    if resume in ("auto", "never"):
        return
    path = Path(resume)
    if not path.is_dir():
        raise CheckpointError(
            f"checkpoint.resume: {path} {'is a file' if path.exists() else 'does not exist'}",
            fix="point it at a run dir or a checkpoints/step-XXXXXXXX folder, or use auto or never",
        )

