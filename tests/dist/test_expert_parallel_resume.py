"""A full checkpoint resumes at another EP size: tiny-moe with LoRA on the grouped expert adapter, fp32, stopped at
step 2 with dist.expert_parallel 2 and resumed with 1, and the other way, on 2 ranks and on 4; and one written by 2
ranks at EP 2 resumed by one process. Each ends where the run without EP ends, to the fp32 rounding EP's own run differs by
(tests/dist/test_expert_parallel_training.py: 1e-5 after 4 AdamW steps at lr 3e-3; measured here: at most 5.4e-7,
while steps 3-4 move the experts' adapters by 6e-3). Expert adapters or moments read into the wrong experts, or
moments lost (AdamW starting afresh at step 3), move the weights by a share of lr, orders of magnitude more. And one of
4 ranks at dist.context_parallel 2 x dist.expert_parallel 2 (2 data ranks, as the plain run's 2: the same rows per
step), stopped at step 2 and resumed at the same layout, ends where the plain run ends."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import TINY_MOE, events, train_in
from tests.dist.checkpoint_helpers import adapter_tensors
from tests.world import World
from trainyard.checkpoint.save import step_dir

pytestmark = [pytest.mark.dist, pytest.mark.worlds]

STEPS, STOP = 4, 2
JOB = [
    f"train.max_steps={STEPS}", f"checkpoint.every_steps={STOP}", "checkpoint.keep_last=4", "eval.every_steps=0",
    "eval.at_end=false", "log.every_steps=1", "log.progress=false", "log.tensorboard=false", "train.precision=fp32",
    "train.global_batch_size=16", "train.micro_batch_size=4",
]
WEIGHT_ABS = 1e-5
CP_EP = ["dist.context_parallel=2", "dist.expert_parallel=2", "data.padding_free=true",
         "model.attn_implementation=varlen"]


def train(world: World, run: Path, *overrides: str) -> Path:
    train_in(world, TINY_MOE, f"output_dir={run}", *JOB, *overrides)
    return run / "tiny-moe"


def resumed(first: World, then: World, run: Path, before: str, after: str) -> Path:
    """Steps 1-2 in `first` at EP `before`, then a resume from step 2's full checkpoint in `then` at `after`."""
    train(first, run, f"dist.expert_parallel={before}", f"train.max_steps={STOP}")
    return train(then, run, f"dist.expert_parallel={after}")


@pytest.fixture(scope="module")
def plain(world: World, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run without EP on 2 ranks, uninterrupted."""
    return train(world, tmp_path_factory.mktemp("ep-plain") / "plain")


@pytest.fixture(scope="module")
def runs(worlds, plain: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """On 4 ranks EP 2 leaves 2 ranks of the shard dimension, over which FSDP2 shards each EP rank's experts again:
    DCP reshards those strided shards too."""
    world, solo, four = worlds(2), worlds(1), worlds(4)
    out = tmp_path_factory.mktemp("ep-resize")
    return {
        "plain": plain,
        "2 -> 1": resumed(world, world, out / "two-to-one", "2", "1"),
        "1 -> 2": resumed(world, world, out / "one-to-two", "1", "2"),
        "2 ranks at 2 -> 1 process": resumed(world, solo, out / "to-solo", "2", "1"),
        "4 ranks: 2 -> 1": resumed(four, four, out / "four", "2", "1"),
    }


@pytest.mark.parametrize("change", ["2 -> 1", "1 -> 2", "2 ranks at 2 -> 1 process", "4 ranks: 2 -> 1"])
def test_a_checkpoint_resumes_at_another_ep_size_and_ends_as_the_run_without_ep(runs: dict, change: str) -> None:
    resumes = [e for e in events(runs[change], "system") if e.get("event") == "resumed"]
    assert [e["step"] for e in resumes] == [STOP], resumes
    want = adapter_tensors(step_dir(runs["plain"] / "checkpoints", STEPS))
    got = adapter_tensors(step_dir(runs[change] / "checkpoints", STEPS))
    assert got.keys() == want.keys() and any(".experts." in name for name in want)
    for name, tensor in want.items():
        assert (got[name] - tensor).abs().max().item() <= WEIGHT_ABS, (name, change)
    moved = max((got[name] - adapter_tensors(step_dir(runs[change] / "checkpoints", STOP))[name]).abs().max().item()
                for name in want if ".experts." in name)
    assert moved > 100 * WEIGHT_ABS, "the experts' adapters must train after the resume"


def test_a_cp_x_ep_checkpoint_on_4_ranks_resumes_and_ends_as_the_run_without_either(
    worlds, plain: Path, tmp_path: Path
) -> None:
    four = worlds(4)
    train(four, tmp_path, *CP_EP, f"train.max_steps={STOP}")
    run = train(four, tmp_path, *CP_EP)
    resumes = [e for e in events(run, "system") if e.get("event") == "resumed"]
    assert [(e["step"], e["accumulation"]) for e in resumes] == [(STOP, 2)], resumes
    want = adapter_tensors(step_dir(plain / "checkpoints", STEPS))
    got = adapter_tensors(step_dir(run / "checkpoints", STEPS))
    assert got.keys() == want.keys() and any(".experts." in name for name in want)
    for name, tensor in want.items():
        assert (got[name] - tensor).abs().max().item() <= WEIGHT_ABS, name
