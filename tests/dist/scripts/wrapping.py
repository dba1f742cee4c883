"""Wrap a model already in memory (built and edited by a test script) the way a job wraps one."""

from __future__ import annotations

import torch

from trainyard import dist
from trainyard import precision
from trainyard.model import weights
from trainyard.parallel import parallelize as parallel
from trainyard.config_file import load_config


def wrap_in_memory(model: torch.nn.Module, strategy: str, info: dist.DistInfo) -> torch.nn.Module:
    """`parallel.apply` in fp32, its weights taken from the model itself."""
    cfg = load_config("tiny", ["train.precision=fp32"])
    state = {weights.checkpoint_key(name): tensor.detach().clone() for name, tensor in model.state_dict().items()}
    mesh = dist.build_mesh(info, strategy, None)
    return parallel.apply(model, strategy, info, precision.resolve(cfg, info.device), weights.InMemory(state), mesh)
