"""A pretraining job's data: the mixture's token shards (prepared once) and its held-out eval rows."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainyard.config import JobConfig
from trainyard.data.prepare import PreparedData, prepare_datasets
from trainyard.data.shards import PreparedShards, prepare


def prepare_pretraining(
    cfg: JobConfig, tokenizer: Any, cache_root: Path, log: Callable[[str], None], show_progress: bool
) -> tuple[PreparedData, PreparedShards]:
    """The shards (tokenized here only if `trainyard prepare` has not run: one process writes, the others wait)
    and, from data.eval_path, eval rows packed like the training rows. `PreparedData.train` is None: training
    reads the shards through a MixtureStream."""
    shards = prepare(cfg, tokenizer, log=log, show_progress=show_progress)
    eval_rows = None
    if cfg.data.eval_path is not None:
        held_out = cfg.data.model_copy(
            update={"path": cfg.data.eval_path, "eval_path": None, "mixture": None, "format": "text", "packing": True}
        )
        eval_rows = prepare_datasets(held_out, tokenizer, cache_root, log=log, objective=cfg.train.objective).train
    stats = {
        "sources": [
            {"path": source.path, "documents": source.documents, "tokens": source.tokens} for source in shards.sources
        ],
        "eval_rows": len(eval_rows) if eval_rows is not None else 0,
    }
    data = PreparedData(
        train=None, eval=eval_rows, fingerprint=shards.fingerprint, cache_dir=shards.folder, stats=stats,
        tokenized_here=shards.built_here,
    )
    return data, shards
