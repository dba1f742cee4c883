"""Under torchrun with 4 processes: the timeout every group of every mesh carries (one JSON line per mesh, rank 0)."""

from __future__ import annotations

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
    meshes = {
        "fsdp": dist.build_mesh(info, "fsdp", None),
        "hsdp": dist.build_mesh(info, "hsdp", 2),
        "diloco": dist.build_mesh(info, "diloco", None, sites=2),
        "diloco-hsdp": dist.build_mesh(info, "diloco", 1, sites=2, site_inner="hsdp"),
    }
    found = {"default": group_timeout_s(torch.distributed.group.WORLD)}
    for name, mesh in meshes.items():
        for dim in mesh.mesh_dim_names:
            found[f"{name}.{dim}"] = group_timeout_s(mesh.get_group(dim))
    if info.rank == 0:
        with open(out, "w") as handle:
            json.dump(found, handle)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
