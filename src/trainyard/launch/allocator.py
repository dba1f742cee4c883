"""The workers' CPU memory allocator: a preloaded malloc library where the machine has one.

glibc's malloc keeps freed memory in its arenas; a training process frees and re-allocates the same large
tensors every step (FSDP2's gathered blocks, activations), and glibc hands little of it back, so RSS climbs well
above the live tensor bytes (benchmarks/RESULTS.md, issue 25). The launcher preloads PREFERRED's library into the
workers (LD_PRELOAD) when the system has it, chosen by measurement (benchmarks/step_memory.py); without one the
workers keep glibc's. TRAINYARD_ALLOCATOR=glibc turns the preload off; a path names another library; an
LD_PRELOAD the user set already is left alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from trainyard.errors import OptionError

SWITCH_ENV = "TRAINYARD_ALLOCATOR"
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


def preload_env(env: Mapping[str, str], dirs: tuple[str, ...] = LIBRARY_DIRS) -> dict[str, str]:
    """What to add to the workers' environment: LD_PRELOAD of the chosen allocator, or nothing (switched off, the
    user's own LD_PRELOAD, no library here)."""
    choice = env.get(SWITCH_ENV, PREFERRED).strip()
    if choice in ("glibc", "off", "") or env.get("LD_PRELOAD"):
        return {}
    if choice in LIBRARIES:
        path = find_library(choice, dirs)
        return {"LD_PRELOAD": path} if path else {}
    if not Path(choice).is_file():
        raise OptionError(f"{SWITCH_ENV}={choice} is neither an allocator trainyard knows nor a library file",
                          where=SWITCH_ENV, fix=f"set it to {', '.join(LIBRARIES)}, glibc (no preload) or a .so path")
    return {"LD_PRELOAD": choice}


def in_use(maps: Path = Path("/proc/self/maps")) -> str:
    """The malloc this process runs on, for its log and env.json: a mapped jemalloc or tcmalloc, else glibc."""
    try:
        text = maps.read_text()
    except OSError:
        return "unknown"
    return next((name for name, files in LIBRARIES.items() if any(f"/{file}" in text for file in files)), "glibc")
