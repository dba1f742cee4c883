"""The GPU suite's device: CUDA with NCCL where there is one; elsewhere every test skips, saying why.

`TRAINYARD_GPU_SUITE_ON_CPU=1` runs the same tests on the CPU with gloo (2 ranks), checking only what does
not depend on the device, so the suite's own logic can be checked where no GPU is at hand.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, TINY

ON_CPU = "TRAINYARD_GPU_SUITE_ON_CPU"
# bf16 compute over fp32 master weights and AdamW moments: what the suite checks on every strategy.
PRECISION = "train.precision=bf16-mixed"


@dataclass(frozen=True)
class Device:
    kind: str
    nproc: int
    """Ranks per run: up to 2 GPUs (one still forms a 1-rank NCCL group), 2 CPU processes."""

    @property
    def cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def overrides(self) -> list[str]:
        return [PRECISION, f"dist.backend={'nccl' if self.cuda else 'gloo'}"]

    def env(self) -> dict[str, str]:
        if self.cuda:
            # cuBLAS may pick its split of a reduction by the workspace at hand; a fixed one makes repeated
            # matmuls on the same GPU give the same bits, which a bitwise resume needs.
            return {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
        return {"OMP_NUM_THREADS": "1"}  # 2 ranks share the cores instead of oversubscribing them

    def torchrun(self, *argv: str, nproc: int | None = None, timeout: float = 900) -> subprocess.CompletedProcess[str]:
        """`argv` under bare torchrun on this machine, as a cluster starts workers (a 1-rank group included)."""
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={nproc or self.nproc}", *argv]
        return subprocess.run(command, cwd=REPO, env={**os.environ, **self.env()}, capture_output=True, text=True,
                              timeout=timeout)

    def train(self, out: Path, *overrides: str, config: str = TINY, nproc: int | None = None
              ) -> subprocess.CompletedProcess[str]:
        """`trainyard train` of `config` into `out`, on this device, in bf16-mixed."""
        return self.torchrun("-m", "trainyard.cli", "train", config, f"output_dir={out}", *self.overrides, *overrides,
                             nproc=nproc)


@pytest.fixture(scope="session")
def device() -> Device:
    if torch.cuda.is_available():
        return Device("cuda", nproc=min(torch.cuda.device_count(), 2))
    if os.environ.get(ON_CPU) == "1":
        return Device("cpu", nproc=2)
    pytest.skip(f"no CUDA device: run `make test-gpu` on a GPU machine ({ON_CPU}=1 checks the suite on CPU)")
