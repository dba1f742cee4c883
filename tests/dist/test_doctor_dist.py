"""The cluster probe of `trainyard doctor`: real ranks, gloo, rendezvous, shared-dir marker."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests import warm
from tests.conftest import trainyard
from tests.world import free_port

pytestmark = pytest.mark.dist




def rows_of(stdout: str) -> dict[str, dict[str, Any]]:
    return {row["name"]: row for row in json.loads(stdout)["checks"]}


def non_loopback_ipv4() -> str | None:
    for addrs in psutil.net_if_addrs().values():
        for addr in addrs:
            if addr.family == socket.AF_INET and not addr.address.startswith("127."):
                return addr.address
    return None


def test_one_node_two_ranks_reports_bandwidth(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    result = trainyard(
        "doctor", "--nnodes", "1", "--nproc", "2", "--dir", str(shared), "--json", cwd=tmp_path, timeout=180
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = rows_of(result.stdout)
    bandwidth = [row for name, row in rows.items() if name.startswith("all-reduce ") and "MiB" in name]
    assert len(bandwidth) == 3
    for row in bandwidth:
        assert row["status"] == "pass" and row["data"]["busbw_gbps"] > 0
        assert row["data"]["busbw_gbps"] == pytest.approx(row["data"]["algbw_gbps"])  # 2(n-1)/n = 1 for n = 2
        assert "GB/s" in row["detail"]
    assert rows["all-reduce result"]["status"] == "pass"
    assert rows["versions"]["status"] == "pass"
    assert rows[f"shared {shared}"]["detail"].endswith("seen on all 1 node(s)")
    assert "2 rank(s)" in next(row["detail"] for name, row in rows.items() if name.startswith("node 0 "))
    assert list(shared.iterdir()) == []  # rank 0 removed its marker


def test_two_nodes_on_one_host_find_a_dir_that_is_not_shared(tmp_path: Path) -> None:
    """Node 0 and node 1 as two doctor processes with static rendezvous. A relative --dir
    resolves to a different folder on each node, like a mount missing on one machine."""
    address = non_loopback_ipv4()
    if address is None:
        pytest.skip("needs a non-loopback IPv4 address for a two-node rendezvous")
    shared = tmp_path / "shared"
    shared.mkdir()
    common = [
        "doctor",
        "--nnodes",
        "2",
        "--nproc",
        "1",
        "--master",
        f"{address}:{free_port()}",
        "--timeout",
        "60",
        "--json",
    ]
    workers = []
    for rank in (0, 1):
        cwd = tmp_path / f"node{rank}"
        (cwd / "local").mkdir(parents=True)
        args = [*common, "--node-rank", str(rank), "--dir", str(shared), "--dir", "local"]
        workers.append(warm.start(args, cwd=cwd))
    outputs = [worker.communicate(timeout=180) for worker in workers]
    assert [worker.returncode for worker in workers] == [1, 1], outputs[0][0][-3000:] + outputs[0][1][-3000:]
    rows = rows_of(outputs[0][0])
    not_shared = f"shared {tmp_path / 'node0' / 'local'}"
    assert [name for name, row in rows.items() if row["status"] == "fail"] == [not_shared]
    assert "not seen on node(s) 1" in rows[not_shared]["detail"] and "mount" in rows[not_shared]["fix"]
    assert rows[f"shared {shared}"]["detail"].endswith("seen on all 2 node(s)")
    assert rows["versions"]["detail"] == "identical on all 2 node(s)"
    assert {f"node {n} ({socket.gethostname()})" for n in (0, 1)} <= set(rows)
    assert any(name.startswith("all-reduce ") and "MiB" in name for name in rows)
    assert not any(row["cluster"] for row in rows_of(outputs[1][0]).values())  # the table is node 0's
    assert list(shared.iterdir()) == []
