"""The cluster probe: a small job on every node under the elastic agent, gloo on CPU, nccl on GPU.

Each rank reports its host and versions, checks that a file written by rank 0 shows up in
every shared dir on its node, and times all-reduce at a few sizes. Collectives here call
torch.distributed directly: measuring the raw collective is the point.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as tdist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from trainyard import dist, network
from trainyard.config import DistConfig
from trainyard.doctor.checks import Check, fail, ok, package_versions, warn
from trainyard.doctor.network import parse_master

if TYPE_CHECKING:
    from trainyard.doctor.options import DoctorOptions, JobTargets

MIB = 1024**2
CPU_SIZES = (1 * MIB, 16 * MIB, 64 * MIB)
GPU_SIZES = (16 * MIB, 256 * MIB, 1024 * MIB)
WARMUP, ITERS = 2, 5
MARKER_WAIT_S = 5.0  # NFS attribute caches can hide a new file for a few seconds
MATCHED_VERSIONS = ("python", "torch", "trainyard", "transformers", "cuda", "nccl")


# ---------------------------------------------------------------- launcher side


def probe_cluster(opts: DoctorOptions, job: JobTargets, nproc: int) -> list[Check]:
    """Run the probe on this node's ranks; every node gets the gathered report back."""
    network.apply_network_preset(DistConfig(network=job.network, nic=job.nic))
    dirs = [str(path) for path in job.shared_dirs]
    try:
        outputs = elastic_launch(launch_config(opts, nproc), entrypoint=probe_worker)(dirs, opts.timeout_s)
    except ChildFailedError as err:
        rank, first = next(iter(err.failures.items()))
        return [_probe_failed(f"rank {rank} failed: {failure_reason(first.message, first.exitcode)}")]
    except Exception as err:  # the agent's rendezvous errors have no common base class
        return [_probe_failed(f"rendezvous failed: {type(err).__name__}: {err}")]
    report = next(value for value in outputs.values() if value is not None)
    return cluster_checks(report)


def launch_config(opts: DoctorOptions, nproc: int) -> LaunchConfig:
    """Static rendezvous at --master (as torchrun --node-rank does); one node alone needs none."""
    nnodes = opts.nnodes
    common = dict(
        min_nodes=nnodes,
        max_nodes=nnodes,
        nproc_per_node=nproc,
        max_restarts=0,
        monitor_interval=0.5,
        start_method="spawn",
    )
    if opts.master:
        _, port = parse_master(opts.master)
        return LaunchConfig(
            **common,
            run_id=f"trainyard-doctor-{port}",  # the same on every node
            rdzv_backend="static",
            rdzv_endpoint=opts.master,
            rdzv_configs={"rank": opts.node_rank, "timeout": int(opts.timeout_s)},
        )
    return LaunchConfig(
        **common,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        rdzv_configs={"timeout": int(opts.timeout_s)},
    )


def failure_reason(message: Any, exitcode: int) -> str:
    """The exception line of a worker's recorded error, not its whole traceback."""
    if isinstance(message, dict):
        message = message.get("message", "")
    lines = [line for line in str(message or "").splitlines() if line.strip()]
    return lines[-1][-300:] if lines else f"exit code {exitcode}"


def _probe_failed(detail: str) -> Check:
    """This node's own probe failed: a row every node shows, not only node 0."""
    return fail(
        "cluster probe",
        detail,
        "start doctor on every node with the same --nnodes and --master, each with its own --node-rank; "
        "check the port is open between nodes and --nic names the cluster network",
    )


# ---------------------------------------------------------------- worker side


def probe_worker(dirs: list[str], timeout_s: float) -> dict[str, Any] | None:
    """One rank of the probe; local rank 0 of each node returns the gathered report."""
    info = dist.init(DistConfig(timeout_s=timeout_s))
    try:
        token, root_dirs = _from_rank0((uuid.uuid4().hex, dirs) if info.is_main else None)
        # Dirs go by position: a node that resolves the same --dir to another path should fail.
        written = _from_rank0(write_markers(dirs, token) if info.is_main else None)
        seen = (
            [why is None and marker_seen(d, token) for d, why in zip(dirs, written)] if info.local_rank == 0 else None
        )
        tdist.barrier()
        if info.is_main:
            remove_markers(dirs, token)
        bandwidth = [time_all_reduce(size, info) for size in _sizes(info)] if info.world_size > 1 else []
        me = {
            "rank": info.rank,
            "node": int(os.environ.get("GROUP_RANK", "0")),
            "hostname": socket.gethostname(),
            "device": torch.cuda.get_device_name(info.device) if info.device.type == "cuda" else "cpu",
            "versions": package_versions(),
            "seen": seen,
            "sum_ok": all_reduce_sums_right(info),
        }
        ranks: list[Any] = [None] * info.world_size
        tdist.all_gather_object(ranks, me)
    finally:
        dist.teardown()
    if info.local_rank != 0:
        return None
    return {
        "ranks": ranks,
        "dirs": root_dirs,
        "written": written,
        "bandwidth": bandwidth,
        "world_size": info.world_size,
    }


def _from_rank0(value: Any) -> Any:
    box = [value]
    tdist.broadcast_object_list(box, src=0)
    return box[0]


def _marker(directory: str, token: str) -> Path:
    return Path(directory) / f".trainyard-doctor-{token}"


def write_markers(dirs: list[str], token: str) -> list[str | None]:
    """Per dir, None if written, else why not: rank 0 writes one small file per shared dir."""
    return [_write_marker(directory, token) for directory in dirs]


def _write_marker(directory: str, token: str) -> str | None:
    if not Path(directory).is_dir():
        return "does not exist on node 0"
    try:
        _marker(directory, token).write_text(token)
    except OSError as err:
        return f"node 0 cannot write there: {err.strerror}"
    return None


def marker_seen(directory: str, token: str) -> bool:
    deadline = time.monotonic() + MARKER_WAIT_S
    while True:
        try:
            if _marker(directory, token).read_text() == token:
                return True
        except OSError:
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.25)


def remove_markers(dirs: list[str], token: str) -> None:
    for directory in dirs:
        _marker(directory, token).unlink(missing_ok=True)


def _sizes(info: dist.DistInfo) -> tuple[int, ...]:
    return GPU_SIZES if info.device.type == "cuda" else CPU_SIZES


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_all_reduce(nbytes: int, info: dist.DistInfo) -> dict[str, float]:
    """Seconds per all-reduce (slowest rank), algbw = bytes/s, busbw = algbw * 2(n-1)/n."""
    tensor = torch.zeros(nbytes // 4, dtype=torch.float32, device=info.device)
    for _ in range(WARMUP):
        tdist.all_reduce(tensor)
    _sync(info.device)
    tdist.barrier()
    start = time.perf_counter()
    for _ in range(ITERS):
        tdist.all_reduce(tensor)
    _sync(info.device)
    elapsed = torch.tensor([(time.perf_counter() - start) / ITERS], dtype=torch.float64, device=info.device)
    tdist.all_reduce(elapsed, op=tdist.ReduceOp.MAX)
    seconds = elapsed.item()
    algbw = nbytes / seconds / 1e9
    n = info.world_size
    return {"bytes": nbytes, "seconds": seconds, "algbw_gbps": algbw, "busbw_gbps": algbw * 2 * (n - 1) / n}


def all_reduce_sums_right(info: dist.DistInfo) -> bool:
    """Rank r contributes r+1; every element must come back as n(n+1)/2."""
    tensor = torch.full((4096,), float(info.rank + 1), device=info.device)
    tdist.all_reduce(tensor)
    n = info.world_size
    return bool(torch.all(tensor == n * (n + 1) / 2).item())


# ---------------------------------------------------------------- the rows


def cluster_checks(report: dict[str, Any]) -> list[Check]:
    ranks = report["ranks"]
    nodes = sorted({r["node"] for r in ranks})
    checks = [node_row(node, [r for r in ranks if r["node"] == node]) for node in nodes]
    checks.append(version_row(ranks))
    checks += [shared_dir_row(i, d, report["written"][i], ranks, len(nodes)) for i, d in enumerate(report["dirs"])]
    checks.append(sum_row(ranks))
    checks += bandwidth_rows(report["bandwidth"], report["world_size"])
    for check in checks:
        check.cluster = True
    return checks


def _host(ranks: list[dict[str, Any]], node: int) -> str:
    return next(r["hostname"] for r in ranks if r["node"] == node)


def node_row(node: int, ranks: list[dict[str, Any]]) -> Check:
    first = ranks[0]
    versions = ", ".join(f"{k} {v}" for k, v in first["versions"].items())
    return ok(f"node {node} ({first['hostname']})", f"{len(ranks)} rank(s) on {first['device']}; {versions}")


def version_row(ranks: list[dict[str, Any]]) -> Check:
    """Mismatched torch/NCCL/transformers between nodes hang or desync jobs in odd ways."""
    differences = []
    for key in MATCHED_VERSIONS:
        by_value: dict[str, set[int]] = {}
        for r in ranks:
            by_value.setdefault(r["versions"].get(key, "none"), set()).add(r["node"])
        if len(by_value) > 1:
            where = "; ".join(f"{value} on node(s) {', '.join(map(str, sorted(n)))}" for value, n in by_value.items())
            differences.append(f"{key}: {where}")
    if differences:
        return fail(
            "versions", " | ".join(differences), "install the same versions on every node (one image or lock file)"
        )
    return ok("versions", f"identical on all {len({r['node'] for r in ranks})} node(s)")


def shared_dir_row(index: int, directory: str, written: str | None, ranks: list[dict[str, Any]], nnodes: int) -> Check:
    name = f"shared {directory}"
    if written is not None:
        return fail(name, written, "create it, or fix its permissions, on node 0; or pass another --dir")
    checkers = [r for r in ranks if r["seen"] is not None]  # local rank 0 of each node
    missing = sorted({r["node"] for r in checkers if index >= len(r["seen"]) or not r["seen"][index]})
    if missing:
        hosts = ", ".join(f"{n} ({_host(ranks, n)})" for n in missing)
        return fail(
            name,
            f"a file rank 0 wrote there is not seen on node(s) {hosts}",
            "mount the same shared filesystem at this path on every node, or give each node its own cache dir",
        )
    return ok(name, f"a file rank 0 wrote there is seen on all {nnodes} node(s)")


def sum_row(ranks: list[dict[str, Any]]) -> Check:
    wrong = [r["rank"] for r in ranks if not r["sum_ok"]]
    if wrong:
        return fail(
            "all-reduce result",
            f"wrong sum on rank(s) {wrong}",
            "check NCCL/driver versions and NCCL_* variables; rerun with NCCL_DEBUG=INFO",
        )
    return ok("all-reduce result", f"correct on all {len(ranks)} rank(s)")


def bandwidth_rows(rows: list[dict[str, float]], world: int) -> list[Check]:
    if not rows:
        return [warn("all-reduce bandwidth", "one rank: nothing to measure", "pass --nproc 2 or more, or more nodes")]
    return [
        ok(
            f"all-reduce {row['bytes'] / MIB:.0f} MiB",
            f"busbw {row['busbw_gbps']:.2f} GB/s, algbw {row['algbw_gbps']:.2f} GB/s, "
            f"{row['seconds'] * 1e3:.2f} ms over {world} ranks",
            **row,
        )
        for row in rows
    ]
