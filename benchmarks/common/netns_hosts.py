"""Two hosts on one machine for the multi-host benchmarks: network namespaces joined by a veth pair (the e2e tests'
`namespace_hosts`), `trainyard launch` in each, the bytes that crossed the link, and what the runs wrote so far.

Needs root. The one place these benchmarks reach into tests/, so each script imports its two-host helpers from here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from bench_env import sh

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.dist.checkpoint_helpers import kill_tree, last_step, written_events  # noqa: E402
from tests.e2e.test_multihost import HOST_ADDRESSES, Host, launch_on, namespace_hosts  # noqa: E402
from tests.e2e.test_multihost import _kill_namespace_processes as kill_namespace_processes  # noqa: E402

__all__ = [
    "HOST_ADDRESSES", "REPO", "Host", "kill_namespace_processes", "kill_tree", "last_step", "launch_logged",
    "link_bytes", "namespace_hosts", "run_on_both", "wait_until", "written_events",
]
Found = TypeVar("Found")


def launch_logged(host: Host, args: Sequence[str], log: Path, env: dict[str, str] | None = None,
                  new_session: bool = False) -> subprocess.Popen[bytes]:
    """`trainyard launch ARGS` in the host's namespace, gloo on its veth, its output appended to `log` (a pipe
    nobody reads would fill and stall it). `new_session` puts it in a session of its own, as a scheduler would."""
    command = ["ip", "netns", "exec", host.namespace, sys.executable, "-m", "trainyard.cli", "launch", *args]
    with open(log, "ab") as sink:
        return subprocess.Popen(command, cwd=REPO, env={**os.environ, "GLOO_SOCKET_IFNAME": host.nic, **(env or {})},
                                stdout=sink, stderr=subprocess.STDOUT, start_new_session=new_session)


def link_bytes(host: Host) -> int:
    """Bytes sent plus received by this host's end of the veth: everything that crossed the link."""
    counters = [f"/sys/class/net/{host.nic}/statistics/{name}" for name in ("tx_bytes", "rx_bytes")]
    return sum(int(sh("ip", "netns", "exec", host.namespace, "cat", path)) for path in counters)


def run_on_both(hosts: tuple[Host, Host], args: Sequence[str], out_dir: Path, port: int,
                timeout_s: float) -> tuple[int, float, Path]:
    """One run of `args` on both hosts, 2 processes each, host A the master at `port`: (the bytes that crossed the
    link, its seconds, its run dir under `out_dir`)."""
    args = [*args, f"output_dir={out_dir}"]
    master = f"{HOST_ADDRESSES[0]}:{port}"
    before, started = link_bytes(hosts[0]), time.monotonic()
    nodes = [
        launch_on(host, REPO, *args, "--nnodes", "2", "--node-rank", str(rank), "--master", master, "--nproc", "2")
        for rank, host in enumerate(hosts)
    ]
    outputs = [node.communicate(timeout=timeout_s)[0] for node in nodes]
    crossed, seconds = link_bytes(hosts[0]) - before, time.monotonic() - started
    for node, output in zip(nodes, outputs, strict=True):
        if node.returncode != 0:
            raise SystemExit(f"run failed ({' '.join(args)}):\n{output[-4000:]}")
    return crossed, seconds, next(out_dir.glob("*/summary.json")).parent


def wait_until(what: str, check: Callable[[], Found | None], watched: subprocess.Popen[bytes], log: Path,
               timeout_s: float) -> Found:
    """What `check` finds once it finds something; the benchmark stops if the `watched` launch (its output in
    `log`) ends first, or after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        if watched.poll() is not None:
            raise SystemExit(f"{log.stem} exited ({watched.returncode}) before {what}:\n" + log.read_text()[-4000:])
        time.sleep(0.2)
    raise SystemExit(f"no {what} within {timeout_s:.0f} s")
