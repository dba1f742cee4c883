"""Resuming on another world size: the global batch it keeps, the sizes that cannot, the data position."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainyard.batch import accumulation_steps
from trainyard.checkpoint.save import check_compatible
from trainyard.config_file import load_config
from trainyard.errors import CheckpointError, ConfigError


def test_a_world_size_that_cannot_keep_the_global_batch_lists_those_that_can() -> None:
    cfg = load_config("tiny", ["train.micro_batch_size=4", "train.global_batch_size=48"])
    assert [accumulation_steps(cfg, w) for w in (1, 2, 3, 4, 6, 12)] == [12, 6, 4, 3, 2, 1]
    with pytest.raises(ConfigError) as err:
        accumulation_steps(cfg, 5)
    assert err.value.exit_code == 2
    assert "train.global_batch_size=48" in err.value.what
    assert "world sizes that keep it: 1, 2, 3, 4, 6, 12" in err.value.what


def test_global_batch_tokens_list_the_sizes_that_keep_them() -> None:
    cfg = load_config("tiny", ["train.micro_batch_size=2", "data.max_length=100", "train.global_batch_tokens=1600"])
    assert accumulation_steps(cfg, 4) == 2
    with pytest.raises(ConfigError, match="world sizes that keep it: 1, 2, 4, 8\n"):
        accumulation_steps(cfg, 3)


def test_a_global_batch_no_world_size_keeps_says_so() -> None:
    cfg = load_config("tiny", ["train.micro_batch_size=4", "train.global_batch_size=10"])
    with pytest.raises(ConfigError) as err:
        accumulation_steps(cfg, 1)
    assert "no world size keeps it" in err.value.what and "micro_batch_size" in (err.value.fix or "")


def test_without_a_global_batch_a_resume_keeps_the_checkpoints() -> None:
    """micro 4 on 4 ranks trained 16 samples per step: 2 ranks accumulate 2, 8 ranks cannot."""
    cfg = load_config("tiny", ["train.micro_batch_size=4"])
    assert accumulation_steps(cfg, 8) == 1  # a fresh start: micro x world
    assert accumulation_steps(cfg, 2, saved_samples=16) == 2
    assert accumulation_steps(cfg, 4, saved_samples=16) == 1
    with pytest.raises(ConfigError) as err:
        accumulation_steps(cfg, 8, saved_samples=16)
    assert "checkpoint's global batch" in err.value.what and "world sizes that keep it: 1, 2, 4" in err.value.what


def test_a_set_global_batch_wins_over_the_checkpoints() -> None:
    """A changed global_batch_size is then caught by check_compatible, naming both numbers."""
    cfg = load_config("tiny", ["train.micro_batch_size=4", "train.global_batch_size=32"])
    assert accumulation_steps(cfg, 2, saved_samples=16) == 4


def write_ranks(path: Path, samplers: list[dict[str, int]]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    for rank, sampler in enumerate(samplers):
        (path / f"rank-{rank}.json").write_text(json.dumps({"sampler": sampler, "rng": {}}))


FACTS = {"model_signature": "a", "lora": None, "data_fingerprint": "d", "global_batch_samples": 16}


def test_another_world_size_is_compatible_when_the_saved_ranks_agree(tmp_path: Path) -> None:
    write_ranks(tmp_path, [{"epoch": 1, "position": 32}] * 4)
    check_compatible({**FACTS, "world_size": 4}, dict(FACTS), tmp_path)


def test_saved_ranks_that_disagree_on_the_data_position_are_refused(tmp_path: Path) -> None:
    write_ranks(tmp_path, [{"epoch": 1, "position": 32}, {"epoch": 1, "position": 32}, {"epoch": 1, "position": 48}])
    with pytest.raises(CheckpointError) as err:
        check_compatible({**FACTS, "world_size": 3}, dict(FACTS), tmp_path)
    assert "ranks [0, 1] at" in err.value.what and "ranks [2] at" in err.value.what
    assert "global_batch_samples" not in err.value.what
