"""Run under torchrun with 4 ranks: the DiLoCo meshes at dist.context_parallel 2 (2 sites of hsdp replicate 1 x
shard 2 and of fsdp 2; one fault-tolerant site, a world of its own, of hsdp replicate 2 x shard 2 and of fsdp 4),
and the groups OuterSync takes from each. Writes per rank and case the global ranks of: its counterparts in the other
sites ("site"), its site ("within"), its FSDP shard group ("shard"), its CP group ("cp"), and the replicas that
split its shard's sync ("slicers", null where none)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from trainyard import dist
from trainyard.config import DilocoConfig, DistConfig
from trainyard.diloco.outer import OuterSync
from trainyard.parallel.context_parallel import context_mesh
from trainyard.parallel.parallelize import within_site

CASES = {"hsdp-2": ("hsdp", 2), "fsdp-2": ("fsdp", 2), "hsdp-1": ("hsdp", 1), "fsdp-1": ("fsdp", 1)}


def main() -> None:
    out = Path(sys.argv[1])
    info = dist.init(DistConfig(backend="gloo"))
    found = {}
    for case, (inner, sites) in CASES.items():
        mesh = dist.build_mesh(info, "diloco", 2 if inner == "hsdp" else None, sites, inner, context_parallel=2)
        outer = OuterSync(torch.nn.Linear(2, 1), DilocoConfig(inner=inner), mesh, info)
        site = within_site(mesh)
        shard = site[site.mesh_dim_names[-1]] if site.ndim > 1 else site
        found[case] = {
            "site": dist.group_ranks(outer.group), "within": dist.group_ranks(outer.within),
            "shard": dist.group_ranks(shard.get_group()), "cp": dist.group_ranks(context_mesh(mesh).get_group()),
            "slicers": None if outer.slicers is None else dist.group_ranks(outer.slicers),
        }
    (out / f"rank-{info.rank}.json").write_text(json.dumps(found))
    dist.teardown()
    dist.exit_process(0)


if __name__ == "__main__":
    main()
