"""On CUDA the default backend is "cpu:gloo,cuda:nccl": every mesh group's NCCL half, and its Gloo half, waits
dist.timeout_s (torch's DeviceMesh gave them its own 30 minutes). The Gloo-only case runs on CPU in
tests/dist/test_mesh_timeouts.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REPO, assert_ok
from tests.gpu.conftest import Device

pytestmark = pytest.mark.gpu

SCRIPT = REPO / "tests" / "gpu" / "scripts" / "nccl_group_timeouts.py"


def test_every_nccl_and_gloo_half_of_every_mesh_group_waits_the_job_timeout(device: Device, tmp_path: Path) -> None:
    if not device.cuda:
        pytest.skip("reads NCCL groups: needs CUDA (the Gloo case runs in tests/dist/test_mesh_timeouts.py)")
    result_file = tmp_path / "timeouts.json"
    assert_ok(device.torchrun(str(SCRIPT), str(result_file)))
    timeouts = json.loads(result_file.read_text())
    assert {"fsdp.shard.cuda", "hsdp.replicate.cuda", "hsdp.shard.cuda", "diloco.site.cuda", "diloco.local.cpu"} <= \
        set(timeouts)
    if device.nproc > 1:
        assert {"ep.shard.cuda", "ep.ep.cuda"} <= set(timeouts)
    assert timeouts == dict.fromkeys(timeouts, 123.0)
