"""train.precision resolved for a device: what is stored, computed and reduced in which dtype."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from trainyard import precision
from trainyard.config_file import load_config
from trainyard.errors import ConfigError

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("name", "model_dtype", "trainable", "frozen", "compute"),
    [
        ("bf16-mixed", "auto", torch.float32, torch.bfloat16, torch.bfloat16),
        ("bf16-mixed", "float32", torch.float32, torch.float32, torch.bfloat16),
        ("fp32", "auto", torch.float32, torch.float32, torch.float32),
        ("bf16", "auto", torch.bfloat16, torch.bfloat16, torch.bfloat16),
    ],
)
def test_each_precision_keeps_masters_frozen_weights_and_compute_apart(
    name: str, model_dtype: str, trainable: torch.dtype, frozen: torch.dtype, compute: torch.dtype
) -> None:
    cfg = load_config("tiny", [f"train.precision={name}", f"model.dtype={model_dtype}"])
    resolved = precision.resolve(cfg, CPU)
    assert (resolved.trainable_dtype, resolved.frozen_dtype, resolved.compute_dtype) == (trainable, frozen, compute)
    assert resolved.mixed == (name == "bf16-mixed")
    autocast = precision.autocast(resolved, CPU)
    with autocast:
        product = torch.ones(2, 2) @ torch.ones(2, 2)
    assert product.dtype == (torch.bfloat16 if resolved.mixed else torch.float32)


def test_auto_on_cpu_follows_its_bf16_units() -> None:
    resolved = precision.resolve(load_config("tiny"), CPU)
    native = precision.cpu_bf16_units() and precision.torch_uses_bf16_units()
    assert resolved.name == ("bf16-mixed" if native else "fp32")
    assert resolved.why


def test_auto_trains_in_fp32_where_torch_s_matrix_library_is_held_below_the_bf16_units() -> None:
    """As on an avx2-only machine, where bf16 products take torch's fallback: ~80x slower than fp32."""
    script = (
        "import torch; from trainyard import precision; from trainyard.config_file import load_config; "
        "r = precision.resolve(load_config('tiny'), torch.device('cpu')); print(r.name, '|', r.why)"
    )
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True).stdout
    name, why = out.strip().split(" | ")
    assert name == "fp32", out
    if precision.cpu_bf16_units():
        assert "held below them" in why, out


def test_float16_without_a_loss_scaler_is_refused() -> None:
    with pytest.raises(ConfigError, match="model.dtype: float16 overflows without a loss scaler"):
        load_config("tiny", ["model.dtype=float16"])
