"""The checks of one machine: versions, GPUs, storage and environment variables.

Each returns `Check` rows (pass, warn or fail, what was seen, how to fix it). Nothing here
changes the machine beyond temp files it removes again.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

import torch

from trainyard.network import network_env

Status = Literal["pass", "warn", "fail"]
GIB = 1024**3
DISK_FAIL_BYTES = 2 * GIB
DISK_WARN_BYTES = 20 * GIB
GPU_BUSY_SHARE = 0.10  # more than this share of a GPU's memory held by others: warn


@dataclass
class Check:
    name: str
    status: Status
    detail: str
    fix: str = ""
    cluster: bool = False
    """A row from the distributed probe: shown on node 0 only."""
    data: dict[str, Any] = field(default_factory=dict)


def ok(name: str, detail: str, **data: Any) -> Check:
    return Check(name, "pass", detail, data=data)


def warn(name: str, detail: str, fix: str, **data: Any) -> Check:
    return Check(name, "warn", detail, fix, data=data)


def fail(name: str, detail: str, fix: str, **data: Any) -> Check:
    return Check(name, "fail", detail, fix, data=data)


# ---------------------------------------------------------------- versions and devices


def package_versions() -> dict[str, str]:
    """What must match on every node; also what the local table shows."""
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for package in ("trainyard", "transformers"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = "missing"
    versions["cuda"] = torch.version.cuda or "none"
    if torch.cuda.is_available():
        versions["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return versions


def check_versions(versions: dict[str, str]) -> list[Check]:
    checks = []
    py = tuple(int(p) for p in versions["python"].split(".")[:2])
    if py < (3, 10):
        checks.append(fail("python", versions["python"], "use Python 3.10 or newer"))
    else:
        checks.append(ok("python", versions["python"]))
    checks.append(ok("torch", versions["torch"]))
    missing = [name for name in ("trainyard", "transformers") if versions[name] == "missing"]
    shown = ", ".join(f"{name} {versions[name]}" for name in ("trainyard", "transformers"))
    if missing:
        checks.append(fail("packages", shown, "install the project into this environment: pip install -e ."))
    else:
        checks.append(ok("packages", shown))
    return checks


def check_cuda(versions: dict[str, str]) -> list[Check]:
    has_smi = shutil.which("nvidia-smi") is not None
    if not torch.cuda.is_available():
        if has_smi:
            return [
                fail(
                    "cuda",
                    f"nvidia-smi is here but torch {torch.__version__} sees no GPU (built for CUDA {versions['cuda']})",
                    "install a CUDA build of torch matching the driver, and check CUDA_VISIBLE_DEVICES",
                )
            ]
        return [ok("cuda", "no GPU: jobs run on CPU with gloo")]
    nccl = versions.get("nccl", "none")
    checks = [ok("cuda", f"CUDA {versions['cuda']}, driver sees {torch.cuda.device_count()} GPU(s)")]
    if torch.distributed.is_nccl_available():
        checks.append(ok("nccl", nccl))
    else:
        checks.append(fail("nccl", "this torch build has no NCCL", "install a CUDA build of torch with NCCL"))
    return checks


def check_gpus(ranks: int) -> list[Check]:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        return []
    rows, busy = [], []
    for index in range(count):
        free, total = torch.cuda.mem_get_info(index)
        rows.append(f"{index}: {torch.cuda.get_device_name(index)} {total / GIB:.1f} GiB ({free / GIB:.1f} free)")
        if (total - free) / total > GPU_BUSY_SHARE:
            busy.append(f"GPU {index} has {(total - free) / GIB:.1f} GiB in use")
    checks = [ok("gpus", "; ".join(rows), count=count)]
    if busy:
        checks.append(
            warn("gpu memory", "; ".join(busy), "another process holds GPU memory: find it with nvidia-smi and stop it")
        )
    if ranks > count:
        checks.append(
            fail("gpus", f"{ranks} ranks asked for but {count} GPU(s) here", f"pass --nproc {count} or fewer")
        )
    return checks


def check_topology() -> list[Check]:
    """`nvidia-smi topo -m`: SYS links (GPU pairs across CPU sockets) halve all-reduce speed."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2 or not shutil.which("nvidia-smi"):
        return []
    try:
        text = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as err:
        return [warn("gpu topology", f"nvidia-smi topo -m failed: {err}", "check the driver with nvidia-smi")]
    links = gpu_links(text)
    kinds = sorted(set(links.values()))
    detail = f"GPU pairs linked by: {', '.join(kinds) or 'unknown'}"
    slow = sorted(pair for pair, kind in links.items() if kind in ("SYS", "NODE"))
    if slow:
        pairs = ", ".join(f"{a}-{b}" for a, b in slow[:6])
        return [
            warn(
                "gpu topology",
                f"{detail}; crossing CPU sockets: {pairs}",
                "expect lower all-reduce bandwidth; prefer NVLink-connected GPUs per job",
                matrix=text,
            )
        ]
    return [ok("gpu topology", detail, matrix=text)]


def gpu_links(matrix: str) -> dict[tuple[int, int], str]:
    """{(i, j): link kind} for GPU pairs i < j, from `nvidia-smi topo -m` output."""
    lines = [line.split() for line in matrix.splitlines() if line.strip()]
    header = next((cols for cols in lines if cols and re.fullmatch(r"GPU\d+", cols[0])), None)
    if header is None:
        return {}
    gpus = [col for col in header if re.fullmatch(r"GPU\d+", col)]
    links = {}
    for cols in lines:
        if cols[0] in gpus and len(cols) > len(gpus):
            i = gpus.index(cols[0])
            for j, kind in enumerate(cols[1 : len(gpus) + 1]):
                if i < j:
                    links[(i, j)] = kind
    return links


# ---------------------------------------------------------------- storage


def nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_writable(path: Path) -> Check:
    """Write and remove a temp file: as root, permission bits alone prove nothing."""
    name = f"writable {path}"
    existing = nearest_existing(path)
    if not existing.is_dir():
        return fail(
            name, f"{existing} is a file, not a directory", f"remove or rename {existing}, or choose another directory"
        )
    try:
        fd, probe = tempfile.mkstemp(prefix=".trainyard-doctor-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        return fail(
            name,
            f"cannot create a file in {existing}: {err.strerror}",
            "fix the permissions or mount (read-only?), or point --dir / output_dir / cache_dir elsewhere",
        )
    if existing != path:
        return ok(name, f"does not exist yet; {existing} is writable, so it can be created")
    return ok(name, "writable")


def check_disk(path: Path) -> Check:
    usage = shutil.disk_usage(nearest_existing(path))
    free = usage.free
    detail = f"{free / GIB:.1f} GiB free of {usage.total / GIB:.0f} GiB"
    fix = "free space or point output_dir / cache_dir at a bigger volume: checkpoints and caches need room"
    if free < DISK_FAIL_BYTES:
        return fail(f"disk {path}", detail, fix, free_bytes=free)
    if free < DISK_WARN_BYTES:
        return warn(f"disk {path}", detail, fix, free_bytes=free)
    return ok(f"disk {path}", detail, free_bytes=free)


def check_hf_cache() -> Check:
    from huggingface_hub import constants

    set_by = [name for name in ("HF_HUB_CACHE", "HF_HOME") if os.environ.get(name)]
    origin = f"set by {set_by[0]}" if set_by else "default; set HF_HOME to move it"
    offline = " (offline mode)" if constants.HF_HUB_OFFLINE else ""
    return ok("hf cache", f"{constants.HF_HUB_CACHE} ({origin}){offline}")


# ---------------------------------------------------------------- environment

_RISKY_ENV = (
    (
        "NCCL_DEBUG",
        {"TRACE"},
        "logs every NCCL call: huge logs, slower collectives",
        "unset it, or NCCL_DEBUG=WARN (INFO while debugging)",
    ),
    (
        "CUDA_LAUNCH_BLOCKING",
        {"1"},
        "every kernel launch waits for the GPU: several times slower",
        "unset it outside a debugging session",
    ),
    (
        "TORCH_DISTRIBUTED_DEBUG",
        {"DETAIL"},
        "checks every collective with extra communication",
        "unset it in production, or use INFO",
    ),
    (
        "NCCL_P2P_DISABLE",
        {"1"},
        "GPUs stop using NVLink/PCIe peer-to-peer",
        "unset it; pick dist.network if the network needs a preset",
    ),
    (
        "NCCL_IB_DISABLE",
        {"1"},
        "InfiniBand is off: NCCL falls back to TCP sockets",
        "unset it, or choose dist.network: socket if that is intended",
    ),
    ("NCCL_SHM_DISABLE", {"1"}, "ranks on one node stop using shared memory", "unset it"),
    ("TORCH_NCCL_ASYNC_ERROR_HANDLING", {"0"}, "a failed rank leaves the others hanging until the timeout", "unset it"),
)


def check_environment(network: str, ranks: int) -> list[Check]:
    """Variables that quietly slow or break jobs; a network preset's own settings are fine."""
    preset = network_env(network, None)
    checks = []
    for name, bad, why, fix in _RISKY_ENV:
        value = os.environ.get(name)
        if value is not None and value.upper() in bad and preset.get(name) != value:
            checks.append(warn(f"env {name}", f"{name}={value}: {why}", fix))
    checks.append(check_omp_threads(ranks))
    shown = sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith(("NCCL_", "GLOO_", "TORCH_NCCL_")))
    checks.append(ok("environment", ", ".join(shown) or "no NCCL/Gloo variables set"))
    return checks


def check_omp_threads(ranks: int) -> Check:
    cores = os.cpu_count() or 1
    share = max(1, cores // ranks)
    value = os.environ.get("OMP_NUM_THREADS")
    fix = f"export OMP_NUM_THREADS={share} (cores / ranks on this node)"
    if value is None:
        if ranks > 1:
            return warn("OMP_NUM_THREADS", f"unset with {ranks} ranks on {cores} cores: torchrun forces 1 thread", fix)
        return ok("OMP_NUM_THREADS", f"unset; one rank uses all {cores} cores")
    if not value.isdigit() or int(value) < 1:
        return warn("OMP_NUM_THREADS", f"{value!r} is not a positive number", fix)
    if int(value) * ranks > cores:
        return warn("OMP_NUM_THREADS", f"{value} threads x {ranks} ranks > {cores} cores: oversubscribed", fix)
    return ok("OMP_NUM_THREADS", f"{value} threads x {ranks} rank(s) on {cores} cores")
