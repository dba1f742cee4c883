"""Under torchrun with 4 processes: the timeout every group of every mesh carries (one JSON line per mesh, rank 0)."""

from __future__ import annotations

import dataclasses
import json
import sys

import torch

from trainyard import dist
from trainyard.config import DistConfig


def group_timeout_s(group: torch.distributed.ProcessGroup) -> float:
    """The timeout the group's CPU backend (Gloo) waits for a collective."""
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def main(out: str) -> None:
    info = dist.init(DistConfig(timeout_s=123, backend="gloo"))
    # dist.backend as device:backend pairs, the form of CUDA's default ("cpu:gloo,cuda:nccl"), on the same group
    pairs = dataclasses.replace(info, backend="cpu:gloo")
    meshes = {
        "fsdp": dist.build_mesh(info, "fsdp", None),
        "hsdp": dist.build_mesh(info, "hsdp", 2),
        "diloco": dist.build_mesh(info, "diloco", None, sites=2),
        "diloco-hsdp": dist.build_mesh(info, "diloco", 1, sites=2, site_inner="hsdp"),
        "pairs-hsdp": dist.build_mesh(pairs, "hsdp", 2),
        "pairs-ep": dist.build_mesh(pairs, "fsdp", None, expert_parallel=2),
        "hsdp-cp": dist.build_mesh(info, "hsdp", 2, context_parallel=2),
    }
    found = {"default": group_timeout_s(torch.distributed.group.WORLD)}
    for name, mesh in meshes.items():
        for one in (mesh, mesh._get_root_mesh()):  # EP, CP: "shard" flattened from the root's ("shard_mod_ep", "ep")
            for dim in one.mesh_dim_names:
                found[f"{name}.{dim}"] = group_timeout_s(one.get_group(dim))
    if info.rank == 0:
        with open(out, "w") as handle:
            json.dump(found, handle)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
