"""Run under torchrun with 2 or 4 ranks (2 sites of 1 or 2): two rounds of OuterSync.sync on a small module whose weights
each site moves by its own amount; writes what went in and came out, for the test to recompute by hand. The sync walks
chunks of 3 values (4 where 2 ranks split each), so tensors straddle chunks and slices."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from trainyard import dist
from trainyard.config import DilocoConfig, DistConfig
from trainyard.diloco.outer import OuterSync


def main() -> None:
    out, lr, momentum, dtype = Path(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    info = dist.init(DistConfig(backend="gloo"))
    mesh = dist.build_mesh(info, "diloco", None, sites=2)
    torch.manual_seed(0)  # the same start on both sites
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    cfg = DilocoConfig(outer_lr=lr, outer_momentum=momentum, pseudo_grad_dtype=dtype, sync_chunk_mib=3 * 4 / 2**20)
    outer = OuterSync(model, cfg, mesh, info)
    site = info.rank // (info.world_size // 2)
    generator = torch.Generator().manual_seed(100 + site)  # each site's own inner progress, the same on its ranks
    rounds = []
    for _ in range(2):
        start = [p.detach().clone() for p in model.parameters()]
        with torch.no_grad():
            for param in model.parameters():
                param.sub_(0.1 * torch.randn(param.shape, generator=generator))
        before = [p.detach().clone() for p in model.parameters()]
        figures = outer.sync()
        rounds.append({
            "start": [t.tolist() for t in start], "before": [t.tolist() for t in before],
            "after": [p.detach().tolist() for p in model.parameters()], "bytes": figures["outer_sync_bytes"],
        })
    (out / f"rank-{info.rank}.json").write_text(json.dumps(rounds))
    dist.teardown()
    dist.exit_process(0)


if __name__ == "__main__":
    main()
