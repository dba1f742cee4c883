"""Memory that keeps growing is reported while the job runs: a leak injected on one rank is named with its rate,
and a run without one never raises the alarm."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TINY, events, train_in
from tests.world import World
from trainyard.health import LEAK_BYTES
from trainyard.metrics import MemoryTrend

pytestmark = [pytest.mark.dist, pytest.mark.worlds]

SETTLED = MemoryTrend().settle_steps
JOB = [
    f"train.max_steps={SETTLED + 8}", "log.every_steps=1", "eval.every_steps=0", "eval.at_end=false", "checkpoint.at_end=false",
    "log.tensorboard=false", "log.progress=false", "train.precision=fp32",
]
"""fp32: bf16 products on a CPU compile a kernel for each new shape (oneDNN keeps up to 1024), so rows of varying
lengths grow a process by ~10 MB a step for a while: a real rise, which this test is not about."""


def run(world: World, out: Path, env: dict[str, str]) -> Path:
    train_in(world, TINY, f"output_dir={out}", *JOB, env=env)
    return out / "tiny"


def growth_events(run_dir: Path) -> list[dict[str, Any]]:
    return [e for e in events(run_dir, "system") if e.get("event") == "memory_growth"]


def test_a_leak_on_one_rank_is_named_with_its_rate_and_a_flat_run_raises_nothing(
    world: World, tmp_path: Path
) -> None:
    leaking = run(world, tmp_path / "leak", {"TRAINYARD_FAULT": f"leak@rank1:step{SETTLED + 2}"})
    flat = run(world, tmp_path / "flat", {})
    alarms = growth_events(leaking)
    # Windows after the settling steps, +2..+5, each held one more leak than the one before: the 5th window rising
    # raises it, once in 8 steps.
    assert [(e["step"], e["ranks"]) for e in alarms] == [(SETTLED + 5, [1])], alarms
    assert alarms[0]["bytes_per_step"] == pytest.approx(LEAK_BYTES, rel=0.25)
    assert alarms[0]["runs_out_at_step"] > SETTLED + 5
    assert "memory grew over the last log windows on rank(s) [1]" in (leaking / "logs" / "rank-0.log").read_text()
    assert growth_events(flat) == []
    memory = [e["peak_memory_bytes"] for e in events(flat, "train")]
    assert len(memory) == SETTLED + 8 and min(memory) > 0
