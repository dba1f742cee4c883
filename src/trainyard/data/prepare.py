"""Tokenize a job's data once into a fingerprinted cache that every rank then memory-maps.

Every process calls `prepare_datasets`; one per shared cache folder tokenizes (see cache.py),
the others load its result. The fingerprint covers everything that changes the tokens, so a
changed file, tokenizer or setting never reuses a stale cache, and an unchanged job never
tokenizes twice. `datasets` (and pandas with it) is imported where a cache is built or read, so a job whose data
never comes here (a mixture's token shards) does not pay for it.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from trainyard.config import DataConfig
from trainyard.data.cache import build_once
from trainyard.data.chat import chat_template_for
from trainyard.data.formats import IGNORE_INDEX, BadRow, Truncation, encode_rows, read_rows, truncation_warning
from trainyard.data.preference import check_objective_fits
from trainyard.data.shapes import Objective, no_rows_fix, source_fix
from trainyard.data.synthetic import builtin_rows, is_builtin
from trainyard.errors import DataError

if TYPE_CHECKING:
    import datasets

CODE_VERSION = 2
"""Bump when a change here or in formats.py changes the tokens of the same input."""
SEED = 0
"""Fixed, not train.seed: the split, packing order and built-in rows do not change with the
training seed, so runs that differ only in seed share one cache and one eval set."""
CHUNK_ROWS = 10_000

GRADING_COLUMNS = ["prompt_ids", "answer"]

Source = Iterable[tuple[str, dict[str, Any] | BadRow]]


@dataclass
class PreparedData:
    """The tokenized splits, memory-mapped from `cache_dir`, the same in every process.

    stats: rows (read from the sources), skipped ({reason: count}), train_documents, train_rows
    (packed rows when packing), eval_rows, tokens and target_tokens (of the train split).
    """

    train: datasets.Dataset | None
    """None for a pretraining mixture, which is read from token shards (data/pretraining.py)."""
    eval: datasets.Dataset | None
    fingerprint: str
    cache_dir: Path
    stats: dict[str, Any]
    tokenized_here: bool


# ---------------------------------------------------------------- fingerprint


def _hash_file(digest: Any, path: Path) -> None:
    with path.open("rb") as file:
        while block := file.read(1 << 20):
            digest.update(block)


def source_hash(path: str, field: str = "data.path", objective: Objective = None) -> str:
    """Content hash of a data file or folder (every file in it), so moving data keeps its cache."""
    if is_builtin(path):
        return path
    root = Path(path)
    if not root.exists():
        raise DataError(f"{field}: {path} does not exist", fix=source_fix(field, objective))
    digest = hashlib.sha256()
    if root.is_file():
        _hash_file(digest, root)
        return digest.hexdigest()
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(str(file.relative_to(root)).encode())
        _hash_file(digest, file)
    return digest.hexdigest()


def tokenizer_hash(tokenizer: Any) -> str:
    """Vocabulary, merges, normalisation, special tokens and chat template: all that sets ids."""
    if tokenizer.is_fast:
        core = tokenizer.backend_tokenizer.to_str()
    else:
        core = json.dumps(sorted(tokenizer.get_vocab().items()))
    identity = {
        "class": type(tokenizer).__name__,
        "core": core,
        "special": tokenizer.special_tokens_map,
        "chat_template": getattr(tokenizer, "chat_template", None),
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()


def data_fingerprint(cfg: DataConfig, tokenizer: Any, objective: Objective = None) -> str:
    """The cache key: changes whenever the prepared tokens could change (not with the objective, which only decides
    whether they are usable; prepare_datasets checks that)."""
    parts = {
        "code": CODE_VERSION,
        "data": source_hash(cfg.path, "data.path", objective),
        "eval_data": source_hash(cfg.eval_path, "data.eval_path", objective) if cfg.eval_path else None,
        "tokenizer": tokenizer_hash(tokenizer),
        "format": cfg.format,
        "max_length": cfg.max_length,
        "packing": cfg.packing,
        "train_on_prompt": cfg.train_on_prompt,
        "chat_template": chat_template_for(cfg).text,
        "chat_template_kwargs": cfg.chat_template_kwargs,
        "on_bad_row": cfg.on_bad_row,
        "eval_fraction": cfg.eval_fraction,
        "synthetic_train_size": cfg.synthetic_train_size,
        "synthetic_eval_size": cfg.synthetic_eval_size,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


# ---------------------------------------------------------------- building


def _features(packed: bool) -> datasets.Features:
    """The cache's columns: documents (with the grading columns) or packed rows."""
    import datasets

    tokens = datasets.List(datasets.Value("int32"))
    if packed:
        return datasets.Features({"input_ids": tokens, "labels": tokens, "seq_lens": tokens})
    return datasets.Features(
        {"input_ids": tokens, "labels": tokens, "prompt_ids": tokens, "answer": datasets.Value("string")}
    )


def _dataset_from(
    examples: Iterable[dict[str, Any]], features: datasets.Features
) -> datasets.Dataset:
    """An Arrow dataset built in chunks, so a big file never sits in memory as Python lists."""
    import datasets

    chunks, columns = [], {name: [] for name in features}
    for example in examples:
        for name, values in columns.items():
            values.append(example.get(name))
        if len(columns["input_ids"]) == CHUNK_ROWS:
            chunks.append(datasets.Dataset.from_dict(columns, features=features))
            columns = {name: [] for name in features}
    if columns["input_ids"] or not chunks:
        chunks.append(datasets.Dataset.from_dict(columns, features=features))
    return datasets.concatenate_datasets(chunks)


def _counted(rows: Source, counter: Counter[str]) -> Source:
    for row in rows:
        counter["rows"] += 1
        yield row


def sources(cfg: DataConfig, objective: Objective = None) -> tuple[Source, Source | None]:
    """(train rows, eval rows or None) with their locations."""
    train_rows: Source
    eval_rows: Source | None = None
    if is_builtin(cfg.path):
        train, held_out = builtin_rows(
            cfg.path, cfg.synthetic_train_size, cfg.synthetic_eval_size, seed=SEED
        )
        train_rows = [(f"{cfg.path}:row {i}", row) for i, row in enumerate(train)]
        eval_rows = [(f"{cfg.path}:eval row {i}", row) for i, row in enumerate(held_out)]
    else:
        train_rows = read_rows(Path(cfg.path), "data.path", objective)
    if cfg.eval_path:
        eval_rows = read_rows(Path(cfg.eval_path), "data.eval_path", objective)
    return train_rows, eval_rows


def _encode(
    rows: Source,
    where: str,
    tokenizer: Any,
    cfg: DataConfig,
    read: Counter[str],
    skipped: Counter[str],
    truncation: Truncation | None = None,
    objective: Objective = None,
) -> datasets.Dataset:
    """Documents of one source; a source with no usable row is an error, not an empty run."""
    here: Counter[str] = Counter()
    encoded = encode_rows(_counted(rows, read), tokenizer, cfg, here, truncation=truncation, objective=objective)
    first = next(encoded, None)
    features = _features(packed=first is not None and "seq_lens" in first)  # a preference pair: 2 documents
    docs = _dataset_from(itertools.chain([first] if first is not None else [], encoded), features)
    skipped.update(here)
    if len(docs) == 0:
        raise DataError(
            f"no usable rows (skipped: {dict(here) or 'none, the source is empty'})",
            where=where,
            fix=no_rows_fix(objective),
        )
    return docs


def hold_out(docs: datasets.Dataset, fraction: float) -> tuple[datasets.Dataset, datasets.Dataset]:
    """A seeded, deterministic (train, eval) split of documents; both sides keep at least one."""
    if len(docs) < 2:
        raise DataError(
            f"data.eval_fraction={fraction} needs at least 2 rows, there is {len(docs)}",
            fix="add rows, set data.eval_path, or set data.eval_fraction: 0",
        )
    size = min(max(1, round(len(docs) * fraction)), len(docs) - 1)
    order = np.random.default_rng(SEED).permutation(len(docs))
    return docs.select(np.sort(order[size:])), docs.select(np.sort(order[:size]))


def _packed_rows(docs: datasets.Dataset, max_length: int) -> Iterator[dict[str, Any]]:
    row: dict[str, list[int]] = {"input_ids": [], "labels": [], "seq_lens": []}
    for batch in docs.iter(batch_size=1000):
        for ids, labels in zip(batch["input_ids"], batch["labels"], strict=True):
            if row["input_ids"] and len(row["input_ids"]) + len(ids) > max_length:
                yield row
                row = {"input_ids": [], "labels": [], "seq_lens": []}
            row["input_ids"] += ids
            row["labels"] += labels
            row["seq_lens"].append(len(ids))
    if row["input_ids"]:
        yield row


def pack(docs: datasets.Dataset, max_length: int) -> datasets.Dataset:
    """Fill rows of at most max_length tokens with whole documents, in a seeded shuffled order.

    Each document's first label is already -100, so no document learns to predict across a
    boundary; `seq_lens` lets collate isolate the documents' attention.
    """
    shuffled = docs.select(np.random.default_rng(SEED).permutation(len(docs)))
    return _dataset_from(_packed_rows(shuffled, max_length), _features(packed=True))


def _token_counts(ds: datasets.Dataset) -> tuple[int, int]:
    tokens = targets = 0
    for batch in ds.select_columns(["labels"]).iter(batch_size=1000):
        for labels in batch["labels"]:
            tokens += len(labels)
            targets += sum(label != IGNORE_INDEX for label in labels)
    return tokens, targets


def _without_unusable_grading(eval_docs: datasets.Dataset) -> datasets.Dataset:
    """Grading columns stay only when every eval row defines an answer."""
    if "answer" in eval_docs.column_names and eval_docs.data.column("answer").null_count:
        return eval_docs.remove_columns(GRADING_COLUMNS)
    return eval_docs


def _stats(
    read: Counter[str],
    skipped: Counter[str],
    train: datasets.Dataset,
    eval_docs: datasets.Dataset | None,
    documents: int,
) -> dict[str, Any]:
    tokens, targets = _token_counts(train)
    return {
        "rows": read["rows"],
        "skipped": dict(skipped),
        "train_documents": documents,
        "train_rows": len(train),
        "eval_rows": 0 if eval_docs is None else len(eval_docs),
        "tokens": tokens,
        "target_tokens": targets,
    }


def tokenize_into(
    folder: Path, cfg: DataConfig, tokenizer: Any, fingerprint: str, objective: Objective = None
) -> None:
    """Write train/, eval/ (when there is an eval split) and meta.json into `folder`."""
    read: Counter[str] = Counter()
    skipped: Counter[str] = Counter()
    train_rows, eval_rows = sources(cfg, objective)
    truncation = Truncation()
    train = _encode(train_rows, cfg.path, tokenizer, cfg, read, skipped, truncation, objective)
    eval_docs = None
    if eval_rows is not None:
        eval_docs = _encode(eval_rows, cfg.eval_path or cfg.path, tokenizer, cfg, read, skipped, objective=objective)
    elif cfg.eval_fraction > 0:
        train, eval_docs = hold_out(train, cfg.eval_fraction)
    documents = len(train)
    train = train.remove_columns([name for name in GRADING_COLUMNS if name in train.column_names])
    if cfg.packing:
        train = pack(train, cfg.max_length)
    stats = {**_stats(read, skipped, train, eval_docs, documents), "truncation": truncation.summary()}
    folder.mkdir(parents=True)
    with _quiet_progress_bars():
        train.save_to_disk(str(folder / "train"))
        if eval_docs is not None:
            _without_unusable_grading(eval_docs).save_to_disk(str(folder / "eval"))
    meta = {"fingerprint": fingerprint, "stats": stats}
    (folder / "meta.json").write_text(json.dumps(meta, indent=2))


@contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    import datasets

    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


def load_prepared(cache_dir: Path, tokenized_here: bool) -> PreparedData:
    import datasets

    meta = json.loads((cache_dir / "meta.json").read_text())
    eval_dir = cache_dir / "eval"
    return PreparedData(
        train=datasets.load_from_disk(str(cache_dir / "train")),
        eval=datasets.load_from_disk(str(eval_dir)) if eval_dir.exists() else None,
        fingerprint=meta["fingerprint"],
        cache_dir=cache_dir,
        stats=meta["stats"],
        tokenized_here=tokenized_here,
    )


def _check_objective(prepared: PreparedData, cfg: DataConfig, tokenizer: Any, objective: Objective) -> None:
    """A cache that a run of the other objective built from the same data and settings fails as a fresh prepare
    would: at the first row, which decides the format, with this objective's shapes."""
    if objective is None or prepared.train is None:
        return
    pairs = "seq_lens" in prepared.train.column_names and not cfg.packing
    if pairs == (objective == "dpo"):
        return
    strict = cfg.model_copy(update={"on_bad_row": "error"})
    rows, _ = sources(cfg, objective)
    for _ in encode_rows(itertools.islice(rows, 1), tokenizer, strict, Counter(), objective=objective):
        pass
    check_objective_fits(objective, pairs, cfg.path)


def prepare_datasets(
    cfg: DataConfig,
    tokenizer: Any,
    cache_root: Path,
    log: Callable[[str], None] = print,
    objective: Objective = None,
) -> PreparedData:
    """Tokenized train (and eval) datasets for this job, built once per cache folder; every data error names the
    rows `objective` (train.objective) trains on.

    Safe to call from every rank at once, with a cache shared by all nodes or local to each.
    """
    cache_root = Path(cache_root)
    cache_root.mkdir(parents=True, exist_ok=True)
    fingerprint = data_fingerprint(cfg, tokenizer, objective)
    cache_dir = cache_root / fingerprint
    tokenized_here = build_once(
        cache_dir,
        lambda folder: tokenize_into(folder, cfg, tokenizer, fingerprint, objective),
        timeout_s=cfg.prepare_timeout_s,
    )
    prepared = load_prepared(cache_dir, tokenized_here)
    _check_objective(prepared, cfg, tokenizer, objective)
    if tokenized_here:
        documents = prepared.stats["train_documents"] + prepared.stats["eval_rows"]
        log(f"tokenized {documents} rows into {cache_dir}")
    else:
        log(f"reusing tokenized cache {cache_dir}")
    warning = truncation_warning(prepared.stats.get("truncation"), cfg.max_length)
    if warning:
        log(f"warning: {warning}")
    return prepared
