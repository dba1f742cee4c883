"""The MFU a step is priced at, and the compile its first step pays: measured where benchmarks/gpu/versus.py ran the
job's path on its GPU kind, else assumed (DEFAULT_MFU, COMPILE_S or --mfu), and the words say which.

A path is what sets a step's efficiency: full fine-tuning, LoRA on a dense model, or LoRA on a mixture of experts,
at bf16-mixed with train.compile on, on a GPU architecture. A figure is trainyard's own MFU (hardware.training_flops
over the device's peak, the count of ../shared/DESIGN.md) over the optimizer steps after the first, on one GPU:
communication is priced apart (estimate/timing.py's traffic). Each row names the run that measured it.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainyard.config import JobConfig
from trainyard.estimate.memory import Model
from trainyard.hardware import Gpu

DEFAULT_MFU = 0.4
"""Where nothing was measured: a well-tuned dense job's MFU on a Hopper GPU (torchtitan's Llama-3.1-8B: 33-39%)."""
COMPILE_S = 60.0
"""train.compile's first step where nothing was measured (stated): the blocks share one compiled code, so it hardly
grows with depth; on a 2-core CPU a SmolLM2-135M LoRA's first step compiled its 30 blocks for 49 s."""

ARCHITECTURES = {"h100-80gb": "hopper", "h100-pcie": "hopper", "h200": "hopper"}
"""GPU kinds whose measured rows apply to each other: the same chip and the same kernels (the H200 has the H100's
arithmetic and more memory bandwidth)."""

PATHS = {"full": "full fine-tuning", "lora": "LoRA", "moe-lora": "LoRA on a mixture of experts"}


@dataclass(frozen=True)
class Measured:
    """One measured path: its MFU, what its first step paid beyond a later one (compile, allocator growth), and
    the run that measured it."""

    mfu: float
    compile_s: float
    job: str
    gpu: str
    commit: str
    date: str


MEASURED: dict[tuple[str, str], Measured] = {
    # benchmarks/RESULTS.md "2026-12-04 (GPU)": versus.py at its defaults, one H200, 5-8 steps of ~16k-28k tokens.
    ("hopper", "full"): Measured(0.033, 20.1, "llama-1b-full", "h200", "0de8a46", "2026-12-04"),
    ("hopper", "lora"): Measured(0.237, 41.2, "llama-8b-lora", "h200", "0de8a46", "2026-12-04"),
    ("hopper", "moe-lora"): Measured(0.071, 78.8, "qwen3-moe-lora", "h200", "0de8a46", "2026-12-04"),
}


@dataclass(frozen=True)
class Efficiency:
    """The MFU and first-step compile a job is priced at; `measured`: the row they come from, None if assumed."""

    mfu: float
    compile_s: float
    path: str
    """One of PATHS."""
    measured: Measured | None = None

    def words(self) -> str:
        """How the step was priced, for the estimate and the dry run."""
        if self.measured is None:
            return f"an assumed MFU of {self.mfu:g}, not measured"
        row = self.measured
        return (f"an MFU of {self.mfu:g} measured for {PATHS[self.path]} (benchmarks/gpu/versus.py {row.job}, one "
                f"{row.gpu}, commit {row.commit})")

    def compile_words(self) -> str:
        return "measured" if self.measured else "stated"


def path(cfg: JobConfig, model: Model) -> str:
    """One of PATHS: what sets a step's efficiency beside the GPU."""
    if not cfg.lora.enabled:
        return "full"
    return "moe-lora" if model.shape.experts else "lora"


def efficiency(cfg: JobConfig, model: Model, gpu: Gpu, precision: str, compiles: bool,
               mfu: float | None) -> Efficiency:
    """`mfu` as given (--mfu), else the measured row of the job's path on its GPU's architecture, at bf16-mixed and
    compiled as the rows were; else DEFAULT_MFU, assumed."""
    compile_s, job_path = COMPILE_S if compiles else 0.0, path(cfg, model)
    if mfu is not None:
        return Efficiency(mfu, compile_s, job_path)
    architecture = ARCHITECTURES.get(gpu.name)
    row = MEASURED.get((architecture, job_path)) if architecture else None
    if row is None or precision != "bf16-mixed" or not compiles or cfg.model.quantize != "none":
        return Efficiency(DEFAULT_MFU, compile_s, job_path)
    return Efficiency(row.mfu, row.compile_s, job_path, row)
