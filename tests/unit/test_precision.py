"""train.precision resolved for a device: what is stored, computed and reduced in which dtype."""

from __future__ import annotations

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
    assert resolved.name == ("bf16-mixed" if precision.cpu_bf16_units() else "fp32")
    assert resolved.why


def test_float16_without_a_loss_scaler_is_refused() -> None:
    with pytest.raises(ConfigError, match="model.dtype: float16 overflows without a loss scaler"):
        load_config("tiny", ["model.dtype=float16"])
