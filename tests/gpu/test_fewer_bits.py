"""Fewer bits on the device (issue 51): FP8 products where the GPU has FP8 units, and a LoRA over an NF4 base under
FSDP2. The CPU tests check FP8's module choice under torchao's emulation and NF4 on CPU ranks; these run the real
kernels. Where the device has no FP8 units (a GPU below compute capability 8.9, or the CPU under
TRAINYARD_GPU_SUITE_ON_CPU) fp8 must be refused with exit 2, naming the device, before any weight is read."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.conftest import assert_ok, events
from tests.gpu.conftest import Device
from trainyard.parallel import float8

pytestmark = pytest.mark.gpu

SHORT = ["train.max_steps=4", "eval.every_steps=0", "eval.at_end=false", "checkpoint.at_end=false",
         "log.every_steps=1", "dist.strategy=fsdp"]
BLOCK_LINEARS = 14
"""configs/tiny.yaml's 2 layers x (q, k, v, o, gate, up, down): every dimension a multiple of 16, so all take FP8."""


def finite_losses(run_dir: Path) -> list[float]:
    losses = [e["loss"] for e in events(run_dir, "train")]
    assert losses and all(math.isfinite(loss) for loss in losses), losses
    return losses


def test_fp8_computes_every_block_linear_in_fp8_where_the_device_has_fp8_units(device: Device,
                                                                                  tmp_path: Path) -> None:
    done = device.train(tmp_path, *SHORT, "train.precision=fp8")
    why = float8.refusal(torch.device("cuda", 0)) if device.cuda else "no FP8 matrix units"
    if why is not None:  # the rank exits 2 (bare torchrun itself then exits 1, naming the rank's exit code)
        said = done.stdout + done.stderr
        assert done.returncode != 0 and "exitcode  : 2" in said, said[-3000:]
        assert "trainyard: error" in said and "train.precision: fp8: " in said, said[-3000:]
        frames = [line for line in said.splitlines() if line.lstrip().startswith('File "')]
        ours = [line for line in frames if "src/trainyard/" in line or "site-packages/trainyard/" in line]
        assert not ours, frames  # torchrun's own report of the rank's exit only
        assert not (tmp_path / "tiny" / "metrics.jsonl").exists() or not events(tmp_path / "tiny", "train")
        return
    assert_ok(done)
    log = (tmp_path / "tiny" / "logs" / "rank-0.log").read_text()
    assert f"fp8 (tensorwise scales): {BLOCK_LINEARS} linear layers compute in FP8" in log, log[-3000:]
    finite_losses(tmp_path / "tiny")


def test_a_lora_over_an_nf4_base_trains_under_fsdp2(device: Device, tmp_path: Path) -> None:
    done = device.train(tmp_path, *SHORT, "model.quantize=nf4", "lora.enabled=true", "lora.r=8")
    assert_ok(done)
    run_dir = tmp_path / "tiny"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert 0 < summary["trainable_params"] < summary["params"]
    losses = finite_losses(run_dir)
    assert losses[-1] < losses[0]  # the adapters learn over the 4-bit base (lr 3e-3 on the dates task)
