"""The reference of full fine-tuning's DPO without a second model in memory: the initial model's log-probabilities
of every pair, computed once in one pass over the data before the first step, kept beside the tokenized cache, and
read back by any later job on the same model, data and template (a resume included).

The file is keyed by what sets the initial weights and how they compute (model section, seed, precision); the
cache folder it sits in already stands for the data, tokenizer and template. Each rank computes its share of the
rows, in lockstep (FSDP2 gathers weights for every forward), and one all-reduce gives every rank all of them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainyard.atomic import write_atomically
from trainyard.config import JobConfig
from trainyard.data import collate
from trainyard.dist import DistInfo, all_reduce_sum, is_fsdp
from trainyard.model import collation
from trainyard.parallel.parallelize import unwrap
from trainyard.precision import Precision
from trainyard.preference.loss import pair_logps, target_logps

if TYPE_CHECKING:
    import datasets

COLUMN = "ref_logps"
"""[chosen, rejected] summed log-probabilities of a pair under the initial model."""


def reference_file(cfg: JobConfig, precision: Precision, cache_dir: Path) -> Path:
    identity = {"model": cfg.model.model_dump(mode="json"), "seed": cfg.train.seed,
                "compute": str(precision.compute_dtype), "stored": str(precision.frozen_dtype)}
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir / f"reference-{key}.json"


def attach_reference(
    cfg: JobConfig, data: Any, model: torch.nn.Module, info: DistInfo, precision: Precision,
    autocast: Callable[[], contextlib.AbstractContextManager], log: Callable[[str], None],
) -> None:
    """Add the `ref_logps` column to data.train and data.eval: read from the cache file, or computed now with the
    model's initial weights (before a resume loads its own) and written there."""
    path = reference_file(cfg, precision, data.cache_dir)
    missing = torch.tensor([0.0 if path.exists() else 1.0], dtype=torch.float64, device=info.device)
    splits = {name: split for name, split in (("train", data.train), ("eval", data.eval)) if split is not None}
    if all_reduce_sum(missing).item() > 0:  # every rank computes when any lacks the file: the pass is collective
        values = {name: _pass(model, split, info, cfg, autocast) for name, split in splits.items()}
        if info.local_rank == 0:
            write_atomically(path, json.dumps(values))
        log(f"reference log-probabilities of {sum(map(len, values.values()))} pairs computed into {path}")
    else:
        values = json.loads(path.read_text())
        log(f"reusing reference log-probabilities {path}")
    data.train = _with_column(data.train, values["train"])
    if data.eval is not None:
        data.eval = _with_column(data.eval, values["eval"])


def _with_column(split: datasets.Dataset, values: list[list[float]]) -> datasets.Dataset:
    if COLUMN in split.column_names:
        split = split.remove_columns(COLUMN)
    return split.add_column(COLUMN, values)


@torch.no_grad()
def _pass(
    model: torch.nn.Module, split: datasets.Dataset, info: DistInfo, cfg: JobConfig,
    autocast: Callable[[], contextlib.AbstractContextManager],
) -> list[list[float]]:
    """[chosen, rejected] of every row, in row order; each rank computes rows rank, rank + world, ..."""
    sharded = is_fsdp(model)
    net = model if sharded else unwrap(model)
    was_training = net.training
    net.eval()
    size = cfg.train.micro_batch_size
    mine = list(range(info.rank, len(split), info.world_size))
    batches = -(-len(range(0, len(split), info.world_size)) // size)  # as many as rank 0 has: lockstep
    values = torch.zeros(len(split), 2, dtype=torch.float64, device=info.device)
    rows = split.select_columns(["input_ids", "labels", "seq_lens"])
    one_row = collation.model_one_row(unwrap(model), cfg.data)  # as training collates: padded rows for some families
    for start in range(0, batches * size, size):
        indices = mine[start : start + size]
        picked = rows[indices or [0]]
        examples = [{name: picked[name][i] for name in picked} for i in range(len(indices or [0]))]
        batch = collate(examples, 0, one_row)
        with autocast():
            logps = pair_logps(target_logps(net, batch, info.device), batch)
        if indices:
            values[indices] = torch.stack([logps.chosen, logps.rejected], dim=1).double()
    all_reduce_sum(values)
    net.train(was_training)
    return values.tolist()
