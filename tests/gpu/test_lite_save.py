"""A lite save gathers the LoRA adapter and nothing else: no frozen base weight is all-gathered. Every
all-gather made while the save runs is counted, FSDP2's own and DTensor's alike.

It needs 2 ranks: on one, every mesh dimension has size 1, so DTensor gathers nothing even for a base weight
and a save that gathered the whole model would count as clean as one that gathers only the adapter.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REPO, assert_ok
from tests.dist.checkpoint_helpers import adapter_tensors
from tests.gpu.conftest import ON_CPU, Device
from trainyard.checkpoint.save import step_dir

pytestmark = pytest.mark.gpu

SCRIPT = REPO / "tests" / "gpu" / "scripts" / "count_lite_save_gathers.py"


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "hsdp"])
def test_lite_save_gathers_the_adapter_and_no_base_weight(device: Device, tmp_path: Path, strategy: str) -> None:
    if device.nproc < 2:
        pytest.skip(f"one {device.kind} rank gathers nothing, wrong or right: needs 2 GPUs ({ON_CPU}=1 runs it on 2 "
                    "CPU processes)")
    result_file = tmp_path / "gathers.json"
    assert_ok(device.torchrun(str(SCRIPT), str(tmp_path), str(result_file), *device.overrides,
                              f"dist.strategy={strategy}"))
    saves = json.loads(result_file.read_text())
    assert sorted(map(int, saves)) == [2, 4, 6]
    for step, gathers in saves.items():
        adapter = adapter_tensors(step_dir(tmp_path / "tiny" / "checkpoints", int(step)))
        elements = sum(t.numel() for t in adapter.values())
        gathered = sum(n for _, n in gathers)
        assert len(gathers) <= len(adapter) and gathered <= elements, (step, gathers, len(adapter), elements)
        if strategy != "ddp":
            # Each rank holds a shard of every adapter tensor: one gather each, which shows the count sees them.
            assert (len(gathers), gathered) == (len(adapter), elements), (step, gathers)
        else:  # replicas: nothing is sharded, nothing is gathered
            assert gathers == [], (step, gathers)
