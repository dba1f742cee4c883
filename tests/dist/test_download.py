"""A hub download longer than dist.timeout_s does not fail the job: the first process of the node downloads while
the other waits on a file lock (with model.download_timeout_s), not in a collective whose timeout kills every rank."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.conftest import REPO, TINY

pytestmark = pytest.mark.dist

SCRIPT = REPO / "tests" / "dist" / "scripts" / "slow_hub_train.py"
COLLECTIVE_TIMEOUT_S = 4
DOWNLOAD_S = 8
"""Longer than the collective timeout: a rank waiting in a collective meanwhile would be killed."""


def tiny_hub_model(folder: Path) -> Path:
    """What the hub 'serves': a tiny Llama in the hub's layout."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=300, max_position_embeddings=256,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def test_a_download_longer_than_the_collective_timeout_does_not_fail_the_job(tmp_path: Path) -> None:
    folder = tiny_hub_model(tmp_path / "served")
    log = tmp_path / "downloads.log"
    args = [
        "train", TINY, f"output_dir={tmp_path / 'out'}", "model.config=null", "model.path=org/tiny-llama",
        "model.tokenizer=builtin:bytes", f"dist.timeout_s={COLLECTIVE_TIMEOUT_S}", "train.max_steps=2",
        "eval.every_steps=0", "eval.at_end=false", "log.progress=false", "log.tensorboard=false",
        "checkpoint.every_steps=0",
    ]
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(SCRIPT),
         str(folder), str(DOWNLOAD_S), str(log), *args],
        capture_output=True, text=True, timeout=300, cwd=REPO,
        env={**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "0"},  # offline takes no lock
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert sorted(log.read_text().split()) == ["cached", "slow"]  # one download for the node, one cache hit
    assert not list((tmp_path / "hub").rglob("*.lock"))
