"""Run under torchrun as one site of 2 (one process, its own world): two rounds of the fault-tolerant outer sync
(torchft, through the lighthouse named by TORCHFT_LIGHTHOUSE) on the small module diloco_outer_step.py uses, each
site moving its weights by its own amount; writes what went in and came out for the test to recompute. Both sites'
managers exist before either asks for a quorum (a file each, waited for), and the test's lighthouse wants both."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from trainyard import dist
from trainyard.config import JobConfig
from trainyard.diloco.ft import FaultTolerantSync
from trainyard.diloco.outer import OuterSync


def main() -> None:
    out, site = Path(sys.argv[1]), int(sys.argv[2])
    cfg = JobConfig.model_validate({
        "dist": {"strategy": "diloco", "backend": "gloo", "timeout_s": 60},
        "diloco": {"fault_tolerant": True, "site": site, "sites": 2, "outer_lr": 0.7, "outer_momentum": 0.9,
                   "sync_chunk_mib": 3 * 4 / 2**20},
    })
    info = dist.init(cfg.dist)
    across = FaultTolerantSync(cfg, info)
    mesh = dist.build_mesh(info, "diloco", None, sites=1)
    torch.manual_seed(0)  # the same start on both sites
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    across.attach(OuterSync(model, cfg.diloco, mesh, info), dict, torch.optim.AdamW(model.parameters()))
    (out / f"ready-{site}").touch()
    deadline = time.monotonic() + 120
    while not all((out / f"ready-{s}").exists() for s in range(2)) and time.monotonic() < deadline:
        time.sleep(0.05)
    generator = torch.Generator().manual_seed(100 + site)  # each site's own inner progress
    rounds = []
    for step in (2, 4):
        start = [p.detach().clone() for p in model.parameters()]
        with torch.no_grad():
            for param in model.parameters():
                param.sub_(0.1 * torch.randn(param.shape, generator=generator))
        before = [p.detach().clone() for p in model.parameters()]
        figures = across.sync(step)
        assert across.healed is None, "a site healed from a peer at the same step"
        rounds.append({
            "start": [t.tolist() for t in start], "before": [t.tolist() for t in before],
            "after": [p.detach().tolist() for p in model.parameters()], "sites": figures["outer_sites"],
        })
    (out / f"site-{site}.json").write_text(json.dumps(rounds))
    across.shutdown()
    dist.teardown()
    dist.exit_process(0)


if __name__ == "__main__":
    main()
