"""The workers' CPU memory allocator: a preloaded malloc library where the machine has one.

glibc's malloc keeps freed memory in its arenas; a training process frees and re-allocates the same large
tensors every step (FSDP2's gathered blocks, activations), and glibc hands little of it back, so RSS climbs well
above the live tensor bytes (benchmarks/RESULTS.md, issue 25). The launcher preloads PREFERRED's library into the
workers (LD_PRELOAD) when the system has it, chosen by measurement (benchmarks/memory/step_memory.py); without one the
workers keep glibc's. TRAINYARD_ALLOCATOR=glibc turns the preload off; a path names another library; an
LD_PRELOAD the user set already is left alone.

A system library preloaded into another environment can break it: Debian's jemalloc links the system libstdc++,
which then loads before a conda environment's newer one, and extensions fail with "GLIBCXX_3.4.x not found". So the
first launch in an environment imports torch once with the preload, in a child; where that fails the workers keep
glibc's malloc and their first log line says why. The verdict is kept per interpreter and library.

A process left on glibc's malloc (no library here, or TRAINYARD_ALLOCATOR=glibc) hands freed tensors back instead:
every training process sets glibc's mmap threshold once (`return_freed_memory`), so each allocation of
GLIBC_MMAP_THRESHOLD or more is its own mapping, unmapped when freed. glibc's own threshold starts at 128 KiB but
rises with each large free up to 32 MiB, after which a step's activations and gathered blocks come from the heap
arenas and stay there. TRAINYARD_ALLOCATOR=off leaves malloc entirely as it is; a MALLOC_MMAP_THRESHOLD_ of the
user's own is kept.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

from trainyard.errors import OptionError

SWITCH_ENV = "TRAINYARD_ALLOCATOR"
OFF = "off"
"""TRAINYARD_ALLOCATOR's value that neither preloads a library nor tunes glibc's malloc."""
SKIPPED_ENV = "TRAINYARD_ALLOCATOR_SKIPPED"
"""Set for the workers when the preferred library was found but breaks this environment: why it was not preloaded."""
CHECKS = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "trainyard" / "allocator-checks.json"
PREFERRED = "jemalloc"
# Where Debian/Ubuntu (libjemalloc2, libtcmalloc-minimal4) and RHEL put them, per architecture.
LIBRARIES = {
    "jemalloc": ("libjemalloc.so.2",),
    "tcmalloc": ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"),
}
LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")


def find_library(name: str, dirs: tuple[str, ...] = LIBRARY_DIRS) -> str | None:
    """The first file of allocator `name` in the system's library folders, or None."""
    for folder in dirs:
        for file in LIBRARIES[name]:
            path = Path(folder) / file
            if path.is_file():
                return str(path)
    return None


def preload_env(
    env: Mapping[str, str], dirs: tuple[str, ...] = LIBRARY_DIRS, problem: Callable[[str], str | None] | None = None
) -> dict[str, str]:
    """What to add to the workers' environment: LD_PRELOAD of the chosen allocator, or nothing (switched off, the
    user's own LD_PRELOAD, no library here), or why a library found here is not preloaded. `problem` says what
    breaks with a library preloaded (None: nothing); by default `import torch` is tried once (`preload_problem`)."""
    choice = env.get(SWITCH_ENV, PREFERRED).strip()
    if choice in ("glibc", OFF, "") or env.get("LD_PRELOAD"):
        return {}
    if choice in LIBRARIES:
        path = find_library(choice, dirs)
    elif Path(choice).is_file():
        path = choice
    else:
        raise OptionError(f"{SWITCH_ENV}={choice} is neither an allocator trainyard knows nor a library file",
                          where=SWITCH_ENV, fix=f"set it to {', '.join(LIBRARIES)}, glibc (no preload) or a .so path")
    if path is None:
        return {}
    broken = (problem or preload_problem)(path)
    if broken:
        return {SKIPPED_ENV: f"{path} not preloaded: with it {broken}"}
    return {"LD_PRELOAD": path}


def preload_problem(path: str, checks: Path | None = None) -> str | None:
    """What fails when this interpreter imports torch with `path` preloaded, or None. Tried once per interpreter,
    library and torch, then read back (a launch must not pay an import of torch each time)."""
    checks = checks or CHECKS
    key = f"{sys.executable}|{path}|{Path(path).stat().st_mtime_ns}|{_torch_version()}"
    try:
        known = json.loads(checks.read_text())
    except (OSError, ValueError):
        known = {}
    if key not in known:
        child = subprocess.run([sys.executable, "-c", "import torch"], env={**os.environ, "LD_PRELOAD": path},
                               capture_output=True, text=True, timeout=300, check=False)
        lines = child.stderr.strip().splitlines()
        reason = lines[-1] if lines else f"exit {child.returncode}"
        known[key] = None if child.returncode == 0 else f"`import torch` fails ({reason})"
        try:
            checks.parent.mkdir(parents=True, exist_ok=True)
            checks.write_text(json.dumps(known, indent=1))
        except OSError:
            pass  # a read-only home: check again next time
    return known[key]


def _torch_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return "none"


GLIBC_MMAP_THRESHOLD = 1 << 20
"""Allocations of this many bytes or more are mmapped by glibc and unmapped when freed (`return_freed_memory`)."""
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
"""mallopt's parameters (glibc's malloc.h)."""
_tuned = False
"""Whether this process set glibc's thresholds (for its log line)."""


def return_freed_memory(env: Mapping[str, str] = os.environ) -> bool:
    """Under glibc's malloc, make each allocation of GLIBC_MMAP_THRESHOLD or more its own mapping, returned to the
    kernel when freed, and trim the heap's top at the same size. A fixed threshold also stops glibc from raising it
    (dynamically, up to 32 MiB) after the first large free. Measured on the CP benchmark's 0.1B Llama
    (benchmarks/RESULTS.md): a rank's peak RSS 0.5-0.6 GB lower, the step time unchanged. Returns whether it was
    set; not under another malloc, with TRAINYARD_ALLOCATOR=off, or where the user set the threshold."""
    if in_use() != "glibc" or env.get(SWITCH_ENV, "").strip() == OFF or "MALLOC_MMAP_THRESHOLD_" in env:
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)  # absent from a libc other than glibc (musl)
    if mallopt is None:
        return False
    global _tuned
    _tuned = bool(mallopt(M_MMAP_THRESHOLD, GLIBC_MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD,
                                                                                    GLIBC_MMAP_THRESHOLD))
    return _tuned


def describe(env: Mapping[str, str] = os.environ) -> str:
    """The malloc in use for the first log line, and why the preferred one is not, where the launcher said so."""
    skipped = env.get(SKIPPED_ENV)
    tuned = f", freed blocks of >= {GLIBC_MMAP_THRESHOLD >> 20} MiB returned" if _tuned else ""
    return in_use() + tuned + (f" ({skipped})" if skipped else "")


def in_use(maps: Path = Path("/proc/self/maps")) -> str:
    """The malloc this process runs on, for its log and env.json: a mapped jemalloc or tcmalloc, else glibc."""
    try:
        text = maps.read_text()
    except OSError:
        return "unknown"
    return next((name for name, files in LIBRARIES.items() if any(f"/{file}" in text for file in files)), "glibc")
