"""A step that logs nothing makes one collective of trainyard's own (the control all-reduce); a
logging step adds one all-gather. DDP's and FSDP2's gradient collectives are theirs, not counted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_script
from tests.world import World

pytestmark = [pytest.mark.dist, pytest.mark.worlds]


def preference_pairs(tmp_path: Path) -> Path:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": str(i + 2)}) + "\n"
                            for i in range(32)))
    return path


@pytest.mark.parametrize(("strategy", "objective"), [("ddp", "sft"), ("fsdp", "sft"), ("fsdp", "dpo")])
def test_off_log_steps_make_only_the_control_all_reduce(
    world: World, tmp_path: Path, strategy: str, objective: str
) -> None:
    """DPO's figures ride the same all-reduce and all-gather: its reference forward adds no collective of ours."""
    out = tmp_path / "calls.json"
    dpo = [f"data.path={preference_pairs(tmp_path)}", "train.objective=dpo", "lora.enabled=true"]
    run_script(world, "count_step_collectives", str(tmp_path), strategy, str(out), "4",
               *(dpo if objective == "dpo" else []))
    calls = {int(step): names for step, names in json.loads(out.read_text()).items()}
    for step in (1, 2, 3, 5, 6, 7):
        assert calls[step] == ["trainyard.dist.all_reduce"], (step, calls[step])
    for step in (4, 8):
        assert calls[step][:2] == ["trainyard.dist.all_reduce", "trainyard.dist.all_gather"], (step, calls[step])
    assert calls[4] == calls[4][:2]  # nothing else at a log step inside the run


def test_log_every_steps_defaults_to_ten() -> None:
    from trainyard.config import JobConfig

    assert JobConfig().log.every_steps == 10
