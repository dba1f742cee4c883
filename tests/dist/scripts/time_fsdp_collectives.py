"""Run under torchrun with 2 ranks: which of FSDP2's collectives the comm timer counts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from trainyard.parallel import comm
from trainyard.parallel import parallelize as parallel
from trainyard.config_file import load_config
from trainyard.dist import exit_process, init, teardown
from trainyard.model.build import load_model
from trainyard.model.source import load_tokenizer
from wrapping import wrap_in_memory  # beside this script


def main() -> None:
    result_file = Path(sys.argv[1])
    cfg = load_config("tiny", ["dist.strategy=fsdp"])
    info = init(cfg.dist)
    tokenizer = load_tokenizer(cfg.model, None)
    model = load_model(cfg.model, None, tokenizer, torch.float32, 0)
    model = wrap_in_memory(model, "fsdp", info)
    timer = comm.attach_comm_timer(model)
    assert timer is not None
    batch = torch.randint(0, 200, (2, 16))

    def train_step() -> None:
        model.train()
        model(input_ids=batch, labels=batch).loss.backward()

    seconds = {}
    train_step()
    timer.end_step(keep=True)
    seconds["trained"] = timer.take()
    train_step()
    timer.end_step(keep=False)
    seconds["skipped"] = timer.take()
    model.eval()
    with torch.no_grad():
        model(input_ids=batch)
    timer.end_step(keep=True)
    seconds["evaluated"] = timer.take()
    if info.rank == 0:
        result_file.write_text(json.dumps(seconds))
    teardown()
    exit_process(0)


if __name__ == "__main__":
    main()
