"""Fault-tolerant DiLoCo's inputs: a site that is not told which it is, a reduction torchft cannot do, or a lighthouse
asked of a job that is not fault-tolerant exit 2 naming the field; each site reads its own slice of the data. The
sites themselves run in tests/dist/test_diloco_ft.py."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import TINY, run_cli
from trainyard import config_file
from trainyard.diloco.ft import data_slice
from trainyard.dist import DistInfo

FT = ["dist.strategy=diloco", "diloco.fault_tolerant=true"]


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        (FT, ["diloco.site", "diloco.sites"]),
        ([*FT, "diloco.site=2", "diloco.sites=2"], ["diloco.site below diloco.sites"]),
        ([*FT, "diloco.site=0", "diloco.sites=2", "diloco.pseudo_grad_dtype=int8"], ["int8", "fp32 or bf16"]),
        (["dist.strategy=ddp", "diloco.fault_tolerant=true", "diloco.site=0", "diloco.sites=2"],
         ["dist.strategy: diloco"]),
    ],
)
def test_bad_fault_tolerant_settings_exit_2_naming_the_field(overrides: list[str], needles: list[str]) -> None:
    result = run_cli("train", TINY, *overrides, "--dry-run")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in result.stderr


@pytest.mark.parametrize("command", [
    ["launch", "--lighthouse", "--nnodes", "1", "--node-rank", "0", "--master", "127.0.0.1:29999", "--nproc", "1"],
    ["lighthouse"],
], ids=["launch", "lighthouse"])
def test_a_lighthouse_needs_a_fault_tolerant_job(tmp_path, command: list[str]) -> None:
    result = run_cli(command[0], TINY, f"output_dir={tmp_path}", *command[1:])
    assert result.returncode == 2, result.stderr
    assert "diloco.fault_tolerant" in result.stderr and "Traceback" not in result.stderr


def test_each_site_reads_its_slice_of_one_world_and_keeps_its_own_run_dir() -> None:
    cfg = config_file.load_config(TINY, [*FT, "diloco.site=1", "diloco.sites=3"])
    info = DistInfo(1, 2, 1, 2, torch.device("cpu"), "gloo")
    assert data_slice(cfg, info) == (3, 6)  # the second rank of the second site of 3 sites of 2
    assert cfg.run_dir.name == "site-1" and cfg.run_dir.parent.name == cfg.run_name


def test_a_site_outside_torchrun_is_told_to_launch_it(tmp_path) -> None:
    result = run_cli("train", TINY, f"output_dir={tmp_path}", *FT, "diloco.site=0", "diloco.sites=2",
                     "diloco.lighthouse=127.0.0.1:29999")
    assert result.returncode == 2, result.stderr
    assert "trainyard launch" in result.stderr and "Traceback" not in result.stderr
