"""Run under torchrun with 2 ranks: evaluate a tiny model and count the collectives it makes."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import torch.distributed as dist

from trainyard import evaluate as eval_room
from trainyard import parallel
from trainyard.config import load_config
from trainyard.data import prepare_datasets
from trainyard.dist import exit_process, init, teardown
from trainyard.model import load_model, load_tokenizer

COLLECTIVES = ["all_reduce", "all_gather", "all_gather_object", "broadcast", "reduce", "barrier",
               "reduce_scatter", "all_to_all", "gather", "scatter", "broadcast_object_list", "monitored_barrier"]


def main() -> None:
    out_dir, strategy, result_file = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    cfg = load_config("tiny", [f"output_dir={out_dir}", "data.synthetic_eval_size=37", f"dist.strategy={strategy}"])
    info = init(cfg.dist)
    tokenizer = load_tokenizer(cfg.model, None)
    data = prepare_datasets(cfg.data, tokenizer, out_dir / "cache")
    model = parallel.wrap(load_model(cfg.model, None, tokenizer, eval_room.torch.float32, 0), strategy, info)
    counts: Counter[str] = Counter()
    for name in COLLECTIVES:
        original = getattr(dist, name)

        def counting(*args, _name=name, _original=original, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counting)
    batches = len(eval_room._rank_batches(list(range(37)), info, 4))
    result = eval_room.evaluate(model, data.eval, subset_size=100, seed=1, batch_size=4, info=info, tokenizer=tokenizer)
    if info.rank == 0:
        result_file.write_text(json.dumps({"explicit_collectives": dict(counts), "batches_per_rank": batches,
                                           "examples": 37, "loss": result["eval_loss"]}))
    teardown()
    exit_process(0)


if __name__ == "__main__":
    main()
