"""`trainyard doctor` on this machine: it passes here, and planted faults fail with a fix."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import trainyard
from trainyard.doctor.run import run_doctor
from trainyard.doctor.checks import check_environment, gpu_links
from trainyard.doctor.network import check_master, check_nic, check_port_free, matching_interfaces
from trainyard.doctor.options import DoctorOptions
from trainyard.errors import OptionError
from trainyard.redaction import REDACTED


def doctor_json(*args: str, cwd: Path, env: dict[str, str] | None = None) -> tuple[int, dict[str, dict[str, Any]]]:
    result = trainyard("doctor", "--json", *args, cwd=cwd, env=env, timeout=120)
    rows = {row["name"]: row for row in json.loads(result.stdout)["checks"]}
    return result.returncode, rows


def failed(rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {name: row for name, row in rows.items() if row["status"] == "fail"}


def test_doctor_passes_on_this_machine(tmp_path: Path) -> None:
    result = trainyard("doctor", cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    for row in ("python", "torch", "cuda", "hf cache", "environment"):
        assert row in result.stdout
    assert " 0 failed" in result.stdout


def test_busy_master_port_fails_with_a_fix(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, rows = doctor_json("--master", f"127.0.0.1:{port}", "--node-rank", "0", cwd=tmp_path)
        assert code == 1
        assert list(failed(rows)) == [f"master port {port}"]
        row = rows[f"master port {port}"]
        assert "in use" in row["detail"] and "another port" in row["fix"]
    assert check_port_free("127.0.0.1", port, multi_node=False).status == "pass"


def test_worker_node_checks_the_master_is_reachable() -> None:
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        master = f"127.0.0.1:{listening.getsockname()[1]}"
        assert [c.status for c in check_master(master, node_rank=1, nnodes=None)] == ["pass"]
    [refused] = check_master(master, node_rank=1, nnodes=None)
    assert refused.status == "fail" and "refused" in refused.detail and "start node 0 first" in refused.fix


def test_unwritable_dirs_fail_and_a_writable_one_passes(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where a directory should be")
    good = tmp_path / "shared"
    good.mkdir()
    read_only = "/sys/trainyard-doctor-test"  # sysfs refuses new files, even to root
    code, rows = doctor_json("--dir", str(blocker / "cache"), "--dir", read_only, "--dir", str(good), cwd=tmp_path)
    assert code == 1
    assert set(failed(rows)) == {f"writable {blocker / 'cache'}", f"writable {read_only}"}
    assert "is a file, not a directory" in rows[f"writable {blocker / 'cache'}"]["detail"]
    assert "cannot create a file in /sys" in rows[f"writable {read_only}"]["detail"]
    assert all(row["fix"] for row in failed(rows).values())
    assert rows[f"writable {good}"]["status"] == "pass"
    assert list(good.iterdir()) == []  # the probe file is gone again


def test_missing_nic_fails_and_lists_the_real_ones(tmp_path: Path) -> None:
    code, rows = doctor_json("--nic", "doesnotexist0", cwd=tmp_path)
    assert code == 1
    row = rows["nic doesnotexist0 (--nic / dist.nic)"]
    assert row["status"] == "fail"
    assert "lo (127.0.0.1)" in row["detail"] and "--nic" in row["fix"]
    assert [c.status for c in check_nic("lo", multi_node=False)] == ["pass"]
    assert [c.status for c in check_nic("lo", multi_node=True)] == ["fail"]


def test_nccl_interface_rules() -> None:
    names = ["lo", "eth0", "eth1", "docker0"]
    assert matching_interfaces("eth", names, prefix_match=True) == ["eth0", "eth1"]
    assert matching_interfaces("=eth", names, prefix_match=True) == []
    assert matching_interfaces("^docker,lo", names, prefix_match=True) == ["eth0", "eth1"]
    assert matching_interfaces("eth", names, prefix_match=False) == []


def test_config_supplies_dirs_and_nic(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(
        f"output_dir: {tmp_path / 'out'}\ndata:\n  cache_dir: {tmp_path / 'cache'}\ndist:\n  nic: doesnotexist0\n"
    )
    rows = {c.name: c for c in run_doctor(DoctorOptions(config=str(job)))}
    assert rows[f"writable {tmp_path / 'out'}"].status == "pass"
    assert rows[f"writable {tmp_path / 'cache'}"].status == "pass"
    assert rows["nic doesnotexist0 (--nic / dist.nic)"].status == "fail"


def test_risky_environment_warns_unless_a_preset_asked_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"NCCL_DEBUG": "TRACE", "CUDA_LAUNCH_BLOCKING": "1", "NCCL_IB_DISABLE": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    warned = {c.name for c in check_environment("default", ranks=4) if c.status == "warn"}
    assert warned == {"env NCCL_DEBUG", "env CUDA_LAUNCH_BLOCKING", "env NCCL_IB_DISABLE", "OMP_NUM_THREADS"}
    warned = {c.name for c in check_environment("socket", ranks=1) if c.status == "warn"}
    assert warned == {"env NCCL_DEBUG", "env CUDA_LAUNCH_BLOCKING"}


def test_output_never_shows_a_secret(tmp_path: Path) -> None:
    secret = "hf_s3cr3tvalue42"
    env = {"HF_TOKEN": secret, "NCCL_DEBUG_FILE": f"/tmp/{secret}.log", "NCCL_DEBUG": "TRACE"}
    result = trainyard("doctor", cwd=tmp_path, env=env, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert secret not in result.stdout + result.stderr
    assert REDACTED in result.stdout and "NCCL_DEBUG=TRACE" in result.stdout


def test_bad_options_are_user_errors() -> None:
    with pytest.raises(OptionError, match="--master"):
        run_doctor(DoctorOptions(nnodes=2))
    with pytest.raises(OptionError, match="HOST:PORT"):
        run_doctor(DoctorOptions(master="node0"))
    with pytest.raises(OptionError, match="--node-rank"):
        run_doctor(DoctorOptions(nnodes=2, master="10.0.0.1:29500", node_rank=2))


TOPO_PCIE_TWO_SOCKETS = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tNV12\tSYS\tSYS\tPXB\t0-23\t0\t\tN/A
GPU1\tNV12\t X \tSYS\tSYS\tPXB\t0-23\t0\t\tN/A
GPU2\tSYS\tSYS\t X \tPIX\tSYS\t24-47\t1\t\tN/A
GPU3\tSYS\tSYS\tPIX\t X \tSYS\t24-47\t1\t\tN/A
NIC0\tPXB\tPXB\tSYS\tSYS\t X \t\t\t\t

Legend:
  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes
"""


def test_gpu_links_read_from_nvidia_smi_topo() -> None:
    links = gpu_links(TOPO_PCIE_TWO_SOCKETS)
    assert links[(0, 1)] == "NV12" and links[(2, 3)] == "PIX"
    assert sorted(pair for pair, kind in links.items() if kind == "SYS") == [(0, 2), (0, 3), (1, 2), (1, 3)]
    assert len(links) == 6


def test_a_version_mismatch_between_nodes_fails() -> None:
    from trainyard.doctor.probe import version_row

    versions = {
        "python": "3.11.7",
        "torch": "2.13.0",
        "trainyard": "0.1.0",
        "transformers": "5.23.0",
        "cuda": "12.8",
        "nccl": "2.27.3",
    }
    ranks = [{"rank": r, "node": r // 2, "versions": dict(versions)} for r in range(4)]
    assert version_row(ranks).status == "pass"
    ranks[3]["versions"]["nccl"] = "2.21.5"
    row = version_row(ranks)
    assert row.status == "fail"
    assert row.detail == "nccl: 2.27.3 on node(s) 0, 1; 2.21.5 on node(s) 1" and "same versions" in row.fix
