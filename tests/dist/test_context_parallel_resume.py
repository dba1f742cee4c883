"""A full checkpoint of a context-parallel job resumes: tiny (llama), full fine-tuning, fsdp on 2 ranks at
dist.context_parallel 2 (one data rank: the global batch of 16 rows is 4 micro-batches of 4), fp32. Resumed from
step 2 at CP 2 it ends bitwise where the uninterrupted run ends; resumed at CP 1 (2 data ranks, 2 micro-batches
each) it trains on the same rows per step with the same loss, to the fp32 rounding of summing in another order
(measured: losses within 2.3e-8 of their value, weights within 7.5e-9, while steps 3-4 move them by 6e-3). A resume
that derived accumulation from the world (2) instead of the data ranks (1) took 8 rows a step at CP 2, not 16."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import TINY, events, train_in
from tests.dist.checkpoint_helpers import assert_same_tensors, model_tensors
from tests.world import World
from trainyard.checkpoint.save import step_dir

pytestmark = [pytest.mark.dist, pytest.mark.worlds]

STEPS, STOP = 4, 2
JOB = [
    f"train.max_steps={STEPS}", f"checkpoint.every_steps={STOP}", "checkpoint.keep_last=4", "eval.every_steps=0",
    "eval.at_end=false", "log.every_steps=1", "log.progress=false", "log.tensorboard=false", "train.precision=fp32",
    "train.global_batch_size=16", "train.micro_batch_size=4", "lora.enabled=false", "dist.strategy=fsdp",
    "model.attn_implementation=varlen",
]
REL = 1e-6


def train(world: World, out: Path, context: int, *overrides: str) -> Path:
    train_in(world, TINY, f"output_dir={out}", *JOB, f"dist.context_parallel={context}", *overrides)
    return out / "tiny"


def losses(run_dir: Path) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in events(run_dir, "train")}


@pytest.fixture(scope="module")
def runs(world: World, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The uninterrupted CP 2 run, and its step-2 checkpoint resumed at CP 2 and at CP 1."""
    out = tmp_path_factory.mktemp("cp-resume")
    plain = train(world, out / "plain", 2)
    start = f"checkpoint.resume={step_dir(plain / 'checkpoints', STOP)}"
    return {"plain": plain, "cp 2": train(world, out / "again", 2, start), "cp 1": train(world, out / "off", 1, start)}


def test_a_cp_checkpoint_resumed_at_the_same_cp_size_ends_bitwise_as_the_uninterrupted_run(runs: dict) -> None:
    resumed = [e for e in events(runs["cp 2"], "system") if e.get("event") == "resumed"]
    assert [(e["step"], e["accumulation"]) for e in resumed] == [(STOP, 4)], resumed
    plain = losses(runs["plain"])
    assert losses(runs["cp 2"]) == {step: plain[step] for step in range(STOP + 1, STEPS + 1)}
    got, want = (model_tensors(step_dir(runs[name] / "checkpoints", STEPS)) for name in ("cp 2", "plain"))
    assert_same_tensors(got, want)


def test_a_cp_2_checkpoint_resumed_at_cp_1_keeps_the_global_batch_and_the_loss(runs: dict) -> None:
    resumed = [e for e in events(runs["cp 1"], "system") if e.get("event") == "resumed"]
    assert [(e["step"], e["accumulation"]) for e in resumed] == [(STOP, 2)], resumed
    plain, got = losses(runs["plain"]), losses(runs["cp 1"])
    assert sorted(got) == list(range(STOP + 1, STEPS + 1))
    for step, loss in got.items():
        assert abs(loss - plain[step]) <= REL * abs(plain[step]), (step, loss, plain[step])
    want = model_tensors(step_dir(runs["plain"] / "checkpoints", STEPS))
    resumed = model_tensors(step_dir(runs["cp 1"] / "checkpoints", STEPS))
    assert resumed.keys() == want.keys()
    for name, tensor in want.items():
        assert (resumed[name] - tensor).abs().max().item() <= REL * max(tensor.abs().max().item(), 1.0), name
