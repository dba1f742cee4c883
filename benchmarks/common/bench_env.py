"""The conditions a benchmark ran under: load average, the machine, software versions, the commit.

Other jobs on the same cores skew the figures, so bench.py waits (briefly) for a quiet machine and
records the load before, during and after; RESULTS.md gets the CPU model with the flags that decide
its matmul speed, the core count and the exact code measured.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Self

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "RESULTS.md"
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def sh(*command: str) -> str:
    try:
        done = subprocess.run(command, check=False, cwd=REPO, capture_output=True, text=True, timeout=30)
        return done.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "(unavailable)"


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def load1() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


class LoadSampler:
    """The 1-minute load average every few seconds while the runs go (they add about nproc)."""

    def __init__(self, every_s: float = 10.0) -> None:
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(every_s,), daemon=True)

    def _loop(self, every_s: float) -> None:
        while not self._stop.is_set():
            self.samples.append(load1())
            self._stop.wait(every_s)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def describe(self) -> str:
        if not self.samples:
            return "no samples"
        low, mean, high = min(self.samples), sum(self.samples) / len(self.samples), max(self.samples)
        return f"min {low:.2f}, mean {mean:.2f}, max {high:.2f} ({len(self.samples)} samples)"


def wait_for_quiet(threshold: float, max_wait_s: float) -> tuple[float, bool]:
    """Poll the 1-minute load until it is below threshold; (seconds waited, quiet reached)."""
    started = time.monotonic()
    while True:
        waited = time.monotonic() - started
        if load1() < threshold:
            print(f"load {loadavg()} (1-min below {threshold}) after {waited:.0f}s: starting", flush=True)
            return waited, True
        if waited >= max_wait_s:
            print(f"load {loadavg()} still at or above {threshold} after {waited:.0f}s: starting anyway", flush=True)
            return waited, False
        print(f"waiting for a quiet machine: load {loadavg()} ({waited:.0f}s so far)", flush=True)
        time.sleep(min(20.0, max(1.0, max_wait_s - waited)))


def cpu_description() -> str:
    """CPU model, the matmul-relevant flags it has (and lacks), cores."""
    text = Path("/proc/cpuinfo").read_text()
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    have = [flag for flag in CPU_FLAGS if flag in flags]
    lacks = [flag for flag in CPU_FLAGS if flag not in flags]
    return f"{model}, {sh('nproc')} cores; flags: {', '.join(have) or 'none'}" + (
        f" (no {', '.join(lacks)})" if lacks else ""
    )


def gpu_description() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"


def versions() -> str:
    import peft
    import torch
    import transformers

    try:
        import trl

        trl_version = trl.__version__
    except ImportError:
        trl_version = "not installed"
    parts = [f"torch {torch.__version__}", f"transformers {transformers.__version__}", f"peft {peft.__version__}"]
    return ", ".join([*parts, f"trl {trl_version}", f"python {sys.version.split()[0]}"])


def commit() -> str:
    dirty = bool(sh("git", "status", "--porcelain", "--untracked-files=no"))
    return sh("git", "rev-parse", "--short", "HEAD") + (" plus uncommitted changes" if dirty else "")


def results_head(title: str) -> list[str]:
    """A RESULTS.md section's first lines: its title and date, the machine and the exact code measured."""
    return ["", f"## {title} — {sh('date', '-u')}", "", f"- machine: {cpu_description()}; {gpu_description()}",
            f"- commit: {commit()}"]


def append_results(lines: list[str], path: Path = RESULTS) -> None:
    """Append a section to RESULTS.md (newest last)."""
    if not path.exists():
        path.write_text("# Benchmark results\n\nAppended by the scripts in this folder; newest last.\n\n")
    with open(path, "a") as handle:
        handle.write("\n".join(lines))
    print(f"appended to {path}")
