"""What a run reports: per-rank logs, the console line, metrics.jsonl, TensorBoard, summary.

Only rank 0 writes shared files and prints; every rank keeps its own log file. Nothing
written here may carry a secret, so every line goes through `redact`.
"""

from __future__ import annotations

import json
import logging
import math
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import datasets
import peft
import torch
import transformers
from rich.console import Console

from trainyard.config import JobConfig, redact, redact_text
from trainyard.dist import DistInfo, host_summary
from trainyard.files import write_atomically

# Dense bf16 peaks (FLOP/s) for MFU; devices not listed report achieved FLOP/s only.
DEVICE_PEAK_FLOPS = {
    "H100": 989e12,
    "H200": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 125e12,
    "L4": 121e12,
}


class _RedactingFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return redact_text(super().format(record))


def setup_logging(run_dir: Path, info: DistInfo) -> logging.Logger:
    """logs/rank-<r>.log for every rank; the console only for rank 0."""
    logger = logging.getLogger("trainyard")
    logger.setLevel(logging.INFO)
    logger.handlers.clear()
    logger.propagate = False
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    file_handler = logging.FileHandler(run_dir / "logs" / f"rank-{info.rank}.log")
    file_handler.setFormatter(_RedactingFormatter(f"%(asctime)s rank{info.rank} %(levelname)s %(message)s"))
    logger.addHandler(file_handler)
    if info.is_main:
        console = logging.StreamHandler(sys.stderr)
        console.setFormatter(_RedactingFormatter("%(message)s"))
        logger.addHandler(console)
    return logger


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return psutil.Process().memory_info().rss


def device_peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in DEVICE_PEAK_FLOPS.items() if key in name), None)


def flops_per_token(total_params: int, trainable_params: int, n_layers: int, hidden: int, seq_len: int) -> float:
    """Forward 2N, backward 2N for activations plus 2N_trainable for weight grads; attention 12·L·H·T."""
    return 4 * total_params + 2 * trainable_params + 12 * n_layers * hidden * seq_len


class MetricsSink:
    """Fans one event out to metrics.jsonl, TensorBoard and the console (rank 0 only)."""

    def __init__(self, cfg: JobConfig, info: DistInfo, logger: logging.Logger) -> None:
        self.run_dir = cfg.run_dir
        self.info = info
        self.logger = logger
        self.console = Console(stderr=True)
        self.show_progress = cfg.log.progress and info.is_main
        self.max_steps = cfg.train.max_steps
        self.started = time.monotonic()
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a") if info.is_main else None
        self._tb = None
        if info.is_main and cfg.log.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
        self._wandb = start_wandb(cfg) if info.is_main and cfg.log.wandb else None

    def emit(self, kind: str, **fields: Any) -> None:
        if not self.info.is_main:
            return
        event = {"kind": kind, "time": round(time.time(), 3), **fields}
        assert self._jsonl is not None
        self._jsonl.write(json.dumps(redact(event)) + "\n")
        self._jsonl.flush()
        if self._tb is not None and "step" in fields:
            for name, value in fields.items():
                if isinstance(value, int | float) and name != "step" and math.isfinite(value):
                    self._tb.add_scalar(f"{kind}/{name}", value, fields["step"])
        if self._wandb is not None and "step" in fields:
            numbers = {f"{kind}/{k}": v for k, v in fields.items() if isinstance(v, int | float) and k != "step"}
            self._wandb.log(numbers, step=fields["step"])
        if kind == "train" and self.show_progress:
            self._print_train(fields)
        elif kind != "train":
            self.logger.info("%s: %s", kind, _brief(fields))

    def _print_train(self, fields: dict[str, Any]) -> None:
        step = fields["step"]
        elapsed = time.monotonic() - self.started
        eta = elapsed / step * (self.max_steps - step)
        done = int(24 * step / self.max_steps)
        bar = "█" * done + "·" * (24 - done)
        self.console.print(
            f"[{bar}] step {step}/{self.max_steps}  loss {fields['loss']:.4f}  lr {fields['lr']:.2e}  "
            f"grad {fields['grad_norm']:.3f}  {fields['tokens_per_s']:.0f} tok/s  ETA {eta:.0f}s",
            highlight=False,
            soft_wrap=True,
        )

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def start_wandb(cfg: JobConfig) -> Any:
    """Rank 0's W&B run. The key comes only from the environment (WANDB_API_KEY) or
    `wandb login`; WANDB_MODE=offline works. Command line and environment capture are off,
    since either can carry a secret."""
    import wandb

    settings = wandb.Settings(disable_code=True, disable_git=True, x_disable_meta=True, console="off")
    return wandb.init(
        project=cfg.log.wandb_project,
        name=cfg.run_name,
        dir=str(cfg.run_dir),
        config=redact(cfg.model_dump(mode="json", by_alias=True)),
        settings=settings,
        reinit="finish_previous",
    )


def _brief(fields: dict[str, Any]) -> str:
    return "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in fields.items())


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def environment_record(info: DistInfo) -> dict[str, Any]:
    """What env.json records: versions, every rank's host and device, the code's commit."""
    hosts: list[Any] = [host_summary(info)]
    if info.distributed:
        hosts = [None] * info.world_size
        torch.distributed.all_gather_object(hosts, host_summary(info))
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "datasets": datasets.__version__,
        "world_size": info.world_size,
        "device": str(info.device.type),
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "hosts": hosts,
        "git_commit": _git_commit(),
    }


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Redacted JSON, written atomically: readers never see half a file."""
    write_atomically(path, json.dumps(redact(data), indent=2, default=str) + "\n")
