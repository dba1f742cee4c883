"""Real 2-rank runs (torchrun, gloo) of the tiny model: DDP, FSDP2 and HSDP, LoRA and full."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import TINY, assert_ok, events, train_in, trainyard
from tests.world import World
from trainyard.launch import allocator

pytestmark = pytest.mark.dist

STEPS = 8
COMMON = [
    f"train.max_steps={STEPS}",
    "train.micro_batch_size=8",
    "train.global_batch_size=16",
    "train.lr=3e-3",
    "log.every_steps=1",
    "eval.every_steps=0",
    "eval.at_end=false",
    "checkpoint.at_end=false",
    "log.tensorboard=false",
    # The parallel arithmetic is what is compared here, to 2e-4: in fp32. bf16 products round
    # differently when FSDP2 casts gathered weights than under autocast (test_precision covers bf16-mixed).
    "train.precision=fp32",
]


# HSDP on 2 ranks as 2 replicas x 1 shard: its all-reduce across replicas (and, accumulating, the
# shards held back until the window's last micro-batch) on the cheapest group; 2 x 2 across hosts is
# in tests/e2e/test_multihost.py.
STRATEGIES = {
    "ddp": ["dist.strategy=ddp"],
    "fsdp": ["dist.strategy=fsdp"],
    "hsdp": ["dist.strategy=hsdp", "dist.shard_size=1"],
}


def train_events(world: World, out: Path, *overrides: str) -> list[dict]:
    """The tiny job on a shared world's ranks (tests/world.py): the same recipe a launch runs, without its start."""
    train_in(world, TINY, f"output_dir={out}", *COMMON, *overrides)
    return events(out / "tiny", "train")


@pytest.fixture(scope="module")
def single_process(solo: World, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """One process, one batch of 16 per step: the reference trajectory for each fine-tuning
    mode, with neither gradient accumulation nor reduction to share a bug with."""
    out = tmp_path_factory.mktemp("single")
    return {
        lora: train_events(solo, out / lora, f"lora.enabled={lora}", "dist.strategy=none", "train.micro_batch_size=16")
        for lora in ("true", "false")
    }


def assert_same_trajectory(got: list[dict], want: list[dict]) -> None:
    """Same losses and, because AdamW is blind to a scale on the whole gradient, same norms."""
    assert [e["step"] for e in got] == [e["step"] for e in want] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([e["loss"] for e in got], [e["loss"] for e in want], rtol=2e-4, atol=1e-5)
    np.testing.assert_allclose([e["grad_norm"] for e in got], [e["grad_norm"] for e in want], rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("lora", ["true", "false"])
def test_two_ranks_follow_the_single_process_trajectory(
    world: World, tmp_path: Path, single_process: dict[str, list[dict]], strategy: str, lora: str
) -> None:
    got = train_events(world, tmp_path, f"lora.enabled={lora}", *STRATEGIES[strategy])
    losses = [e["loss"] for e in got]
    assert losses[-1] < losses[0] - 0.1, f"loss did not go down: {losses}"
    assert_same_trajectory(got, single_process[lora])
    summary = json.loads((tmp_path / "tiny" / "summary.json").read_text())
    assert (summary["strategy"], summary["accumulation"]) == (strategy, 1)


@pytest.mark.parametrize(
    ("strategy", "lora", "defer"),
    [
        *((strategy, lora, "false") for strategy in STRATEGIES for lora in ("true", "false")),
        ("fsdp", "false", "true"),
        ("hsdp", "false", "true"),
    ],
)
def test_two_ranks_accumulating_follow_the_single_process_trajectory(
    world: World, tmp_path: Path, single_process: dict[str, list[dict]], strategy: str, lora: str, defer: str
) -> None:
    """2 ranks x 2 micro-batches of 4 see the same 16 samples per step as 1 process x 1 x 16, whether
    FSDP2/HSDP reduce every micro-batch (the default) or defer to the last (as DDP always does). A
    micro-batch's gradient lost or counted twice, or never reduced across ranks, moves the losses;
    a wrong scale moves the norms."""
    got = train_events(
        world, tmp_path, f"lora.enabled={lora}", *STRATEGIES[strategy], f"dist.defer_grad_sync={defer}",
        "train.micro_batch_size=4",
    )
    summary = json.loads((tmp_path / "tiny" / "summary.json").read_text())
    assert (summary["strategy"], summary["accumulation"], summary["world_size"]) == (strategy, 2, 2)
    assert_same_trajectory(got, single_process[lora])


def test_tokenization_runs_once_with_two_ranks(tmp_path: Path) -> None:
    """Also: the launcher's preloaded malloc reaches every worker where the library exists (glibc's stays where not);
    libjemalloc2 is a Debian package (`apt-get install libjemalloc2`)."""
    result = trainyard("train", TINY, f"output_dir={tmp_path}", "train.max_steps=2", *COMMON[1:], "--nproc", "2")
    assert_ok(result)
    hosts = json.loads((tmp_path / "tiny" / "env.json").read_text())["hosts"]
    expected = allocator.PREFERRED if allocator.find_library(allocator.PREFERRED) else "glibc"
    assert [host["malloc"] for host in hosts] == [expected, expected]
    logs = [(tmp_path / "tiny" / "logs" / f"rank-{r}.log").read_text() for r in (0, 1)]
    assert sum(len(re.findall(r"tokenized \d+ rows into", log)) for log in logs) == 1
    assert sum(log.count("reusing tokenized cache") for log in logs) == 1
    caches = [p for p in (tmp_path / ".cache" / "data").iterdir() if p.is_dir()]
    assert len(caches) == 1


def test_gradient_checkpointing_with_lora_and_ddp_trains(world: World, tmp_path: Path) -> None:
    got = train_events(world, tmp_path, "lora.enabled=true", "dist.strategy=ddp", "model.gradient_checkpointing=true")
    losses = [e["loss"] for e in got]
    assert losses[-1] < losses[0]
