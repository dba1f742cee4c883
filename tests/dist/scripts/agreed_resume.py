"""Run under torchrun (2 ranks): each rank looks at its own copy of a checkpoints folder, as ranks on nodes whose
views of a file system differ would (a stale cache, a flush not yet seen). Rank 0's copy holds an intact step 20;
rank 1's copy has step 20 truncated, so on its own it would choose step 10. Then rank 0 is given a missing folder
by name while rank 1 is given its intact step 10.

argv: OUT_DIR. Each rank writes OUT_DIR/rank-<r>.json: `auto` (the checkpoint it would load) and `named` (the
error it raised for the explicit path, or the path).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

from trainyard import dist
from trainyard.checkpoint.layout import step_dir, write_marker
from trainyard.config.dist import DistConfig
from trainyard.errors import CheckpointError
from trainyard.train.state import _agreed_resume


def checkpoints_of(root: Path, rank: int) -> Path:
    folder = root / f"view-{rank}" / "checkpoints"
    for step in (10, 20):
        path = step_dir(folder, step)
        path.mkdir(parents=True)
        (path / "__0_0.distcp").write_bytes(b"shard bytes")
        (path / "trainer_state.json").write_text("{}")
        write_marker(folder, path, "full")
    if rank == 1:
        (step_dir(folder, 20) / "__0_0.distcp").write_bytes(b"shard")  # this rank's view: cut short
    return folder


def job_for(info: dist.DistInfo, checkpoints: Path, resume: str) -> SimpleNamespace:
    cfg = SimpleNamespace(checkpoint=SimpleNamespace(resume=resume))
    return SimpleNamespace(info=info, checkpoints=checkpoints, cfg=cfg)


def main(out: Path) -> None:
    info = dist.init(DistConfig())
    checkpoints = checkpoints_of(out, info.rank)
    auto = _agreed_resume(job_for(info, checkpoints, "auto"))
    named = str(out / "missing" / "step-00000020") if info.rank == 0 else str(step_dir(checkpoints, 10))
    try:
        chosen = str(_agreed_resume(job_for(info, checkpoints, named)))
    except CheckpointError as err:
        chosen = f"CheckpointError: {err.what}"
    (out / f"rank-{info.rank}.json").write_text(json.dumps({"auto": auto.name if auto else None, "named": chosen}))
    dist.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
