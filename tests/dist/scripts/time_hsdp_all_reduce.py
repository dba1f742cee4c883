"""Run under torchrun: whether the comm timer counts HSDP's replicate all-reduce, which FSDP2 issues itself.
Each all-reduce is slowed by a known delay, so the timed seconds show whether it was inside a timed span."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as torch_dist
from torch.distributed.fsdp import FSDPModule

from trainyard import dist, precision
from trainyard.config_file import load_config
from trainyard.dist import exit_process, init, teardown
from trainyard.model import weights
from trainyard.model.build import load_model
from trainyard.model.source import load_tokenizer
from trainyard.parallel import comm
from trainyard.parallel import parallelize as parallel

DELAY_S = 0.2


def slowed(all_reduce):  # type: ignore[no-untyped-def]
    """The all-reduce FSDP2 calls, DELAY_S longer: a span that holds it holds the delay too."""
    def all_reduce_slowly(*args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(DELAY_S)
        return all_reduce(*args, **kwargs)

    return all_reduce_slowly


def main() -> None:
    result_file, shard_size = Path(sys.argv[1]), int(sys.argv[2])
    cfg = load_config("tiny", ["dist.strategy=hsdp", f"dist.shard_size={shard_size}", "train.precision=fp32"])
    info = init(cfg.dist)
    model = load_model(cfg.model, None, load_tokenizer(cfg.model, None), torch.float32, 0)
    state = {weights.checkpoint_key(name): tensor.detach().clone() for name, tensor in model.state_dict().items()}
    mesh = dist.build_mesh(info, "hsdp", shard_size)
    model = parallel.apply(model, "hsdp", info, precision.resolve(cfg, info.device), weights.InMemory(state), mesh)
    timer = comm.attach_comm_timer(model)
    assert timer is not None
    batch = torch.randint(0, 200, (2, 16))
    model.train()
    torch_dist.all_reduce = slowed(torch_dist.all_reduce)
    model(input_ids=batch, labels=batch).loss.backward()
    timer.end_step(keep=True)
    units = sum(isinstance(module, FSDPModule) for module in model.modules())
    if info.rank == 0:
        result_file.write_text(json.dumps({"seconds": timer.take(), "all_reduce_delay": units * DELAY_S}))
    teardown()
    exit_process(0)


if __name__ == "__main__":
    main()
