"""DDP, FSDP2 and HSDP × LoRA and full fine-tuning in bf16-mixed: each trains with a falling loss, keeps fp32
master weights, and a run resumed from its mid-run checkpoint ends bitwise where the uninterrupted one ends."""

from __future__ import annotations

import json
import math
from pathlib import Path
from subprocess import CompletedProcess

import pytest
import torch

from tests.conftest import assert_ok, events
from tests.dist.checkpoint_helpers import COMMON, STEPS, assert_same_tensors, model_tensors, resumed_events
from tests.gpu.conftest import Device
from trainyard.checkpoint.save import step_dir

pytestmark = pytest.mark.gpu

STRATEGIES = ["ddp", "fsdp", "hsdp"]
TUNINGS = {"lora": ["lora.enabled=true"], "full": ["lora.enabled=false"]}
# A (strategy, tuning)'s two tests read one reference run: under pytest-xdist's `--dist loadgroup` they stay on
# one worker while the six pairs spread over the workers.
MATRIX = [pytest.param(strategy, tuning, marks=pytest.mark.xdist_group(f"{strategy}-{tuning}"))
          for strategy in STRATEGIES for tuning in TUNINGS]
RESUME_AT = STEPS // 2
# Eager attention: sdpa's fused CUDA backward kernels may accumulate in a varying order unless torch's
# deterministic mode is on, which a job cannot ask for; eager attention is matmuls and a softmax.
REPEATABLE = ["model.attn_implementation=eager", "checkpoint.keep_last=100"]


# HSDP on 2 ranks: 2 replicas of 1 shard, so the all-reduce between replicas runs; its default on one node,
# 1 replica of 2 shards, is FSDP's case again.
HSDP_SHAPE = {"hsdp": ["dist.shard_size=1"]}


def job(strategy: str, tuning: str) -> list[str]:
    return [*COMMON, *TUNINGS[tuning], f"dist.strategy={strategy}", *HSDP_SHAPE.get(strategy, []), *REPEATABLE]


@pytest.fixture(scope="module")
def reference(device: Device, tmp_path_factory: pytest.TempPathFactory):
    """The uninterrupted run of a (strategy, tuning), made when first asked for: its run dir."""
    runs: dict[tuple[str, str], tuple[CompletedProcess[str], Path]] = {}

    def run(strategy: str, tuning: str) -> Path:
        if (strategy, tuning) not in runs:
            out = tmp_path_factory.mktemp(f"{strategy}-{tuning}")
            runs[strategy, tuning] = device.train(out, *job(strategy, tuning)), out / "tiny"
        result, run_dir = runs[strategy, tuning]
        assert_ok(result)
        return run_dir

    return run


@pytest.mark.parametrize(("strategy", "tuning"), MATRIX)
def test_trains_with_a_falling_loss_on_fp32_master_weights(
    device: Device, reference, strategy: str, tuning: str
) -> None:
    run_dir = reference(strategy, tuning)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["strategy"], summary["world_size"]) == (strategy, device.nproc)  # honoured on one rank too
    if strategy == "hsdp":
        assert f"mesh replicate {device.nproc} x shard 1" in (run_dir / "logs" / "rank-0.log").read_text()
    train = events(run_dir, "train")
    losses = [e["loss"] for e in train]
    assert [e["step"] for e in train] == list(range(1, STEPS + 1))
    assert all(loss is not None and math.isfinite(loss) for loss in losses), losses
    assert losses[-1] < losses[0], losses
    assert all(e["peak_memory_bytes"] > 0 for e in train)
    weights = model_tensors(step_dir(run_dir / "checkpoints", STEPS))  # LoRA: the adapter only
    not_fp32 = {name: t.dtype for name, t in weights.items() if t.dtype != torch.float32}
    assert weights and not not_fp32, f"bf16-mixed keeps fp32 masters; saved otherwise: {list(not_fp32.items())[:3]}"


@pytest.mark.parametrize(("strategy", "tuning"), MATRIX)
def test_resumed_run_ends_bitwise_where_the_uninterrupted_one_ends(
    device: Device, reference, tmp_path: Path, strategy: str, tuning: str
) -> None:
    """Same device, same ranks: weights, AdamW moments, schedule, sampler and CUDA RNG restored exactly."""
    uninterrupted = reference(strategy, tuning)
    start = step_dir(uninterrupted / "checkpoints", RESUME_AT)
    assert_ok(device.train(tmp_path, *job(strategy, tuning), f"checkpoint.resume={start}"))
    run_dir = tmp_path / "tiny"
    assert [e["path"] for e in resumed_events(run_dir)] == [str(start)]
    losses = {e["step"]: e["loss"] for e in events(run_dir, "train")}
    want = {e["step"]: e["loss"] for e in events(uninterrupted, "train") if e["step"] > RESUME_AT}
    assert losses == want
    got = model_tensors(step_dir(run_dir / "checkpoints", STEPS))
    assert_same_tensors(got, model_tensors(step_dir(uninterrupted / "checkpoints", STEPS)))
