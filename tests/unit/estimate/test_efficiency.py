"""The MFU a step is priced at: the measured row of the job's path and GPU, else assumed, and --mfu over both."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import TINY, run_cli
from trainyard import estimate, hardware
from trainyard.config_file import load_config
from trainyard.estimate import efficiency

TINY_MOE = "src/trainyard/configs/tiny-moe.yaml"


def priced(config: str, overrides: list[str], gpu: str = "h200", mfu: float | None = None) -> estimate.Estimate:
    return estimate.estimate(load_config(config, overrides), estimate.Hardware(gpu), estimate.Assumptions(mfu=mfu))


@pytest.mark.parametrize(("config", "overrides", "path"), [
    (TINY, ["lora.enabled=false"], "full"),
    (TINY, ["lora.enabled=true"], "lora"),
    (TINY_MOE, ["lora.enabled=true"], "moe-lora"),
])
def test_a_measured_path_is_priced_at_its_measured_mfu_on_every_hopper_kind(config: str, overrides: list[str],
                                                                             path: str) -> None:
    row = efficiency.MEASURED[("hopper", path)]
    for gpu in ("h100-80gb", "h200"):
        result = priced(config, overrides, gpu)
        assert result.efficiency.measured == row and result.efficiency.mfu == row.mfu
        assert result.efficiency.path == path
        peak = hardware.kind_peak_flops(result.layout.gpu, torch.bfloat16)
        tokens = result.timing.tokens_per_step
        assert result.timing.compute_s == pytest.approx(result.timing.flops_per_token * tokens / (peak * row.mfu))
        assert result.timing.compile_s == row.compile_s
        words = estimate.render(result)
        assert f"an MFU of {row.mfu:g} measured for {efficiency.PATHS[path]}" in words
        assert f"commit {row.commit}" in words and "with compile (measured)" in words


@pytest.mark.parametrize(("gpu", "overrides"), [
    ("a100-80gb", ["lora.enabled=true"]),  # nothing measured on this architecture
    ("h200", ["lora.enabled=true", "train.precision=fp32"]),  # the rows ran at bf16-mixed
    ("h200", ["lora.enabled=true", "train.compile=false"]),  # and compiled
])
def test_a_path_not_measured_is_priced_at_the_assumed_mfu_and_says_so(gpu: str, overrides: list[str]) -> None:
    result = priced(TINY, overrides, gpu)
    assert result.efficiency.measured is None and result.efficiency.mfu == efficiency.DEFAULT_MFU
    assert result.efficiency.path == "lora"  # said even where it was not measured
    assert f"an assumed MFU of {efficiency.DEFAULT_MFU:g}, not measured" in estimate.render(result)
    compiles = "train.compile=false" not in overrides
    assert result.timing.compile_s == (efficiency.COMPILE_S if compiles else 0.0)


def test_mfu_given_prices_every_path_at_it() -> None:
    measured, given = priced(TINY, ["lora.enabled=true"]), priced(TINY, ["lora.enabled=true"], mfu=0.5)
    assert given.efficiency.measured is None and given.efficiency.mfu == 0.5
    assert given.timing.compute_s == pytest.approx(measured.timing.compute_s * measured.efficiency.mfu / 0.5)
    done = run_cli("estimate", TINY, "--gpu", "h200", "--mfu", "0.5", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["efficiency"]["mfu"] == 0.5
