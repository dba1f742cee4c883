"""Under torchrun on CUDA, dist.backend auto ("cpu:gloo,cuda:nccl"): the timeout each half of every mesh group
waits, NCCL's and Gloo's (rank 0 writes them as JSON, {"mesh.dim.half": seconds}).

    nccl_group_timeouts.py RESULT_FILE
"""

from __future__ import annotations

import json
import sys

import torch

from trainyard import dist
from trainyard.config import DistConfig


def main(out: str) -> None:
    info = dist.init(DistConfig(timeout_s=123))
    assert info.backend == "cpu:gloo,cuda:nccl", info.backend
    ranks = info.world_size
    meshes = {
        "fsdp": dist.build_mesh(info, "fsdp", None),
        "hsdp": dist.build_mesh(info, "hsdp", 1),
        "diloco": dist.build_mesh(info, "diloco", None, sites=ranks),
    }
    if ranks > 1:
        meshes["ep"] = dist.build_mesh(info, "fsdp", None, expert_parallel=ranks)
    found = {}
    for name, mesh in meshes.items():
        for one in (mesh, mesh._get_root_mesh()):
            for dim in one.mesh_dim_names:
                group = one.get_group(dim)
                for half in ("cuda", "cpu"):
                    backend = group._get_backend(torch.device(half))
                    found[f"{name}.{dim}.{half}"] = backend.options._timeout.total_seconds()
    if info.rank == 0:
        with open(out, "w") as handle:
            json.dump(found, handle)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
