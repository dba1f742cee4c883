"""What a run reports: per-rank logs, the console line, metrics.jsonl, TensorBoard, summary.

Only rank 0 writes shared files and prints; every rank keeps its own log file. Nothing
written here may carry a secret, so every line goes through `redact`.
"""

from __future__ import annotations

import json
import logging
import math
import platform
import secrets
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from importlib.metadata import version

import psutil
import torch
from rich.console import Console

from trainyard.atomic import write_atomically
from trainyard.config import JobConfig
from trainyard.dist import DistInfo, all_gather_rows, group_ranks, host_summary
from trainyard.launch import allocator
from trainyard.redaction import redact, redact_text
from trainyard.runs import layout as run_layout

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from trainyard.parallel.comm import CommTimer


class _RedactingFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return redact_text(super().format(record))


def setup_logging(run_dir: Path, info: DistInfo) -> logging.Logger:
    """logs/rank-<r>.log for every rank; the console only for rank 0."""
    logger = logging.getLogger("trainyard")
    logger.setLevel(logging.INFO)
    for handler in logger.handlers:  # a process that runs a second job (tests, notebooks) closes the first's log
        handler.close()
    logger.handlers.clear()
    logger.propagate = False
    (run_dir / run_layout.LOGS).mkdir(parents=True, exist_ok=True)
    file_handler = logging.FileHandler(run_dir / run_layout.LOGS / f"rank-{info.rank}.log")
    file_handler.setFormatter(_RedactingFormatter(f"%(asctime)s rank{info.rank} %(levelname)s %(message)s"))
    logger.addHandler(file_handler)
    if info.is_main:
        console = logging.StreamHandler(sys.stderr)
        console.setFormatter(_RedactingFormatter("%(message)s"))
        logger.addHandler(console)
    return logger


@dataclass(frozen=True)
class MemoryReading:
    """One rank's memory at a log point: `peak` for the log, `held` for the trend (what a leak grows), `headroom`
    for where it runs out (what the rank could still take at its peak)."""

    peak: float
    held: float
    headroom: float


def memory_reading(device: torch.device) -> MemoryReading:
    """On CPU: the process's RSS high-water mark so far (`cpu_peak`); its anonymous pages (RSS less its file-backed
    pages, which the kernel drops and reads back under pressure: RSS then falls while a leak goes on); the host's
    available memory (shared with the node's other processes). On CUDA: `cuda_reading` of the allocator's figures
    (LogWindow.figures then starts the next window's peak)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return cuda_reading(torch.cuda.max_memory_allocated(device), torch.cuda.memory_allocated(device),
                            free + torch.cuda.memory_reserved(device))
    memory = psutil.Process().memory_info()
    return MemoryReading(cpu_peak(memory.rss), memory.rss - memory.shared, psutil.virtual_memory().available)


def cpu_peak(rss: int, status: Path = Path("/proc/self/status")) -> int:
    """The process's RSS high-water mark so far (Linux's VmHWM): a CPU log's peak is then at least its steps', not
    the RSS between them, which is lower by a step's activations and gradients. Never reset: /proc/self/clear_refs
    would also lower what `time`, wait4's rusage and a user's monitor read. `rss` where /proc has none."""
    try:
        return max(rss, next(int(line.split()[1]) * 1024 for line in status.read_text().splitlines()
                             if line.startswith("VmHWM:")))
    except (OSError, StopIteration, ValueError):
        return rss


def cuda_reading(peak: float, allocated: float, capacity: float) -> MemoryReading:
    """The log window's allocator peak, for the log; for the trend the memory allocated at the log point, between
    steps, where a leak stays: the peak moves 5-10% either way with each window's longest batch, and five peaks in
    a row rise by chance. Headroom from the peak: a leak runs the device out at the step's peak, not between steps.
    `capacity`: the device's free memory and what the allocator holds."""
    return MemoryReading(peak, allocated, capacity - peak)


@dataclass(frozen=True)
class MemoryGrowth:
    """A steady rise of some ranks' memory (`MemoryTrend`): the worst of them, the one that runs out first."""

    step: int
    ranks: list[int]
    bytes_per_step: float
    memory_bytes: float
    available_bytes: float
    runs_out_at_step: int | None
    """Where the rise's line meets the memory the rank could still take; None if that was not measured. The ranks
    of a CPU node share its memory: ranks that leak together run out sooner."""


class MemoryTrend:
    """Each rank's memory over the last log windows, to catch a leak while the job still runs.

    The rule: a rank's memory grew steadily when each of its last `windows` log windows held more than the one
    before (noise goes both ways, a leak only up) and they grew by at least `min_growth` of the first of them in
    all (an allocator settling in, and a fresh process's first steps, rise by a few MB on hundreds). The rate is
    the least-squares slope of memory over step across those windows, the run-out step where that line meets what
    the rank could still take. After an alarm the rank's count starts again: a leak that goes on is reported every
    `windows` windows, not every window. Windows up to `settle_steps` past `start_step` (where this process took
    over: 0, or the step it resumed at) are not counted: a process's memory settles in over its first tens of steps
    (the allocator's arenas, kernels for each new row length under bf16 on a CPU: the quickstart rises ~6% over
    steps 2-24 and raised the alarm at every log step), and no job runs out of memory slowly in them."""

    def __init__(self, windows: int = 5, min_growth: float = 0.05, settle_steps: int = 50, start_step: int = 0) -> None:
        self.windows = windows
        self.min_growth = min_growth
        self.settle_steps = settle_steps
        self.start_step = start_step
        self.seen: dict[int, deque[tuple[int, float]]] = {}

    def observe(self, step: int, memory: dict[int, MemoryReading]) -> MemoryGrowth | None:
        """One log window's memory, by rank: the trend follows each rank's held memory, the run-out step its
        headroom. The alarm, if any."""
        if step <= self.start_step + self.settle_steps:
            return None
        rising = {}
        for rank, reading in memory.items():
            seen = self.seen.setdefault(rank, deque(maxlen=self.windows))
            seen.append((step, reading.held))
            if self._steady_rise(seen):
                rising[rank] = _slope(seen)
                seen.clear()
        if not rising:
            return None
        runs_out = {rank: _runs_out_at(step, rate, memory[rank].headroom) for rank, rate in rising.items()}
        worst = min(rising, key=lambda rank: (runs_out[rank] is None, runs_out[rank] or 0, -rising[rank]))
        return MemoryGrowth(step, sorted(rising), rising[worst], memory[worst].held, memory[worst].headroom,
                            runs_out[worst])

    def _steady_rise(self, seen: deque[tuple[int, float]]) -> bool:
        memory = [value for _, value in seen]
        return (
            len(memory) == self.windows
            and all(later > earlier for earlier, later in zip(memory, memory[1:]))
            and memory[-1] - memory[0] >= self.min_growth * memory[0]
        )


def _slope(points: deque[tuple[int, float]]) -> float:
    """Least-squares bytes per step."""
    steps, values = zip(*points)
    mean_step, mean_value = sum(steps) / len(steps), sum(values) / len(values)
    spread = sum((s - mean_step) ** 2 for s in steps)
    return sum((s - mean_step) * (v - mean_value) for s, v in zip(steps, values)) / spread if spread else 0.0


def _runs_out_at(step: int, bytes_per_step: float, available: float | None) -> int | None:
    if not available or bytes_per_step <= 0:
        return None
    return step + math.ceil(available / bytes_per_step)


class LogWindow:
    """The trained steps since the last train event, summed on each rank.

    A step skipped for a non-finite loss never enters it: its NaN, its tokens, its time and its
    communication would otherwise leak into the next logged figures.
    """

    def __init__(
        self, device: torch.device, comm_timer: CommTimer | None = None, peak: float | None = None,
        expert_load: Any = None, pair_figures: Any = None,
    ) -> None:
        self.device = device
        self.comm_timer = comm_timer
        self.peak = peak
        self.expert_load = expert_load
        """model.routing.ExpertLoad for an MoE: its counts ride the window's one all-gather."""
        self.pair_figures = pair_figures
        """objective.PairFigures under DPO: its sums ride the same all-gather."""
        self.memory_trend = MemoryTrend()
        self._memory: dict[int, MemoryReading] = {}
        """Each rank's held memory and its headroom (`memory_reading`) at the last `figures`."""
        self.reset()

    def reset(self) -> None:
        self.sums = torch.zeros(3, dtype=torch.float64, device=self.device)  # loss sum, targets, real tokens
        self.flops = 0.0  # this rank's model FLOPs (hardware.training_flops over the documents each step saw)
        self.seconds = 0.0  # training time only: eval and checkpoints do not dilute tokens/s
        self.data_wait = 0.0
        self.steps = 0
        if self.expert_load is not None:
            self.expert_load.reset()
        if self.pair_figures is not None:
            self.pair_figures.reset()

    def add(
        self, loss_sum: torch.Tensor, targets: torch.Tensor, real_tokens: torch.Tensor, flops: float, seconds: float,
        data_wait: float,
    ) -> None:
        """One trained step: this rank's own loss sum, target and real tokens and model FLOPs (`figures` sums them
        over the ranks it reports on)."""
        self.sums[0] += loss_sum
        self.sums[1] += targets
        self.sums[2] += real_tokens
        self.flops += flops
        self.seconds += seconds
        self.data_wait += data_wait
        self.steps += 1
        if self.pair_figures is not None:
            self.pair_figures.commit()
        if self.comm_timer is not None:
            self.comm_timer.end_step(keep=True)

    def skip(self) -> None:
        """A step that did not train: its collectives' timings (and DPO's figures) need dropping."""
        if self.pair_figures is not None:
            self.pair_figures.drop()
        if self.comm_timer is not None:
            self.comm_timer.end_step(keep=False)

    def figures(self, group: ProcessGroup | None = None) -> dict[str, Any]:
        """The interval's figures over the group's ranks (the world by default; a DiLoCo site's between outer syncs),
        with one all-gather: sums to add up, each rank's busy time to spot stragglers, its memory (`memory_reading`;
        the highest peak is `peak_memory_bytes`). Every rank of the group must call it. MFU: the steps' model FLOPs
        per rank-second over the peak."""
        memory = memory_reading(self.device)
        own = [self.seconds, self.flops, memory.peak, memory.headroom, memory.held]
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)  # each window's own peak: a leak shows as a rise
        mine = torch.cat([self.sums, torch.tensor(own, dtype=torch.float64, device=self.device)])
        if self.expert_load is not None:
            mine = torch.cat([mine, self.expert_load.row()])
        if self.pair_figures is not None:
            mine = torch.cat([mine, self.pair_figures.row()])
        every = all_gather_rows(mine, group)
        riders = every[:, 8:]  # the expert load's columns, then DPO's
        experts = riders.size(1) - (self.pair_figures.row().numel() if self.pair_figures is not None else 0)
        loss_sum, targets, real_tokens, _, flops = every[:, :5].sum(dim=0).tolist()
        ranks = group_ranks(group)
        self._memory = {rank: MemoryReading(peak, held, headroom)
                        for rank, (peak, headroom, held) in zip(ranks, every[:, 5:8].tolist(), strict=True)}
        times = every[:, 3]
        median = times.median().item()
        elapsed = max(self.seconds, 1e-9)
        tokens_per_s = real_tokens / elapsed
        achieved = flops / elapsed / len(ranks)
        return {
            "loss": loss_sum / max(targets, 1.0),
            ("target_tokens" if self.pair_figures is None else "pairs"): int(targets),  # what the loss averages
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_rank": tokens_per_s / len(ranks),
            "achieved_flops_per_rank": achieved,
            "mfu": achieved / self.peak if self.peak else None,
            "data_wait_share": self.data_wait / elapsed,
            "step_time_spread": (times.max() - times.min()).item() / max(median, 1e-9),
            "comm_share": self.comm_timer.take() / elapsed if self.comm_timer is not None else None,
            "stragglers": [r for r, t in zip(ranks, times.tolist(), strict=True) if median > 0 and t > 1.2 * median],
            "peak_memory_bytes": int(every[:, 5].max().item()),
            **(self.expert_load.figures(riders[:, :experts].sum(dim=0)) if self.expert_load is not None else {}),
            **(self.pair_figures.figures(riders[:, experts:].sum(dim=0)) if self.pair_figures is not None else {}),
        }

    def memory_growth(self, step: int) -> MemoryGrowth | None:
        """The last `figures`' memory, by rank, added to the trend: a steady rise over the last windows, if any."""
        return self.memory_trend.observe(step, self._memory)


def json_safe(value: Any) -> Any:
    """NaN and infinities as null: JSON has no such numbers, and strict parsers reject them."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def _eta_s(step: int, max_steps: int, tokens: int | None, tokens_per_s: float | None) -> float | None:
    """Seconds left at the measured throughput: steps left x tokens per step / tokens per second. Unlike elapsed
    time over steps it holds after a resume (steps done before it took no time in this process)."""
    if not tokens or not tokens_per_s:
        return None
    return (max_steps - step) * (tokens / step) / tokens_per_s


class MetricsSink:
    """Fans one event out to metrics.jsonl, TensorBoard and the console (rank 0 only)."""

    def __init__(self, cfg: JobConfig, info: DistInfo, logger: logging.Logger) -> None:
        self.run_dir = cfg.run_dir
        self.info = info
        self.logger = logger
        self.console = Console(stderr=True)
        self.show_progress = cfg.log.progress and info.is_main
        self._train = cfg.train
        self._jsonl = open(self.run_dir / run_layout.METRICS, "a") if info.is_main else None
        self._tb = None
        if info.is_main and cfg.log.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / run_layout.TENSORBOARD))
        self._wandb = start_wandb(cfg) if info.is_main and cfg.log.wandb is not None else None
        self.peak_memory_bytes = 0
        """The highest peak_memory_bytes of the train events so far (every rank's), for summary.json."""

    @property
    def max_steps(self) -> int:
        """Read as it goes: train.epochs sets max_steps after the sink exists (trainer._size_by_epochs)."""
        return self._train.max_steps

    def emit(self, kind: str, **fields: Any) -> None:
        if not self.info.is_main:
            return
        fields = json_safe(fields)
        if kind == "train":
            self.peak_memory_bytes = max(self.peak_memory_bytes, fields.get("peak_memory_bytes") or 0)
        event = {"kind": kind, "time": round(time.time(), 3), **fields}
        assert self._jsonl is not None
        self._jsonl.write(json.dumps(redact(event), allow_nan=False) + "\n")
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
        eta = _eta_s(step, self.max_steps, fields.get("tokens"), fields.get("tokens_per_s"))
        done = int(24 * step / self.max_steps)
        bar = "█" * done + "·" * (24 - done)
        self.console.print(
            f"[{bar}] step {step}/{self.max_steps}  loss {_shown(fields['loss'], '.4f')}  "
            f"lr {_shown(fields['lr'], '.2e')}  grad {_shown(fields['grad_norm'], '.3f')}  "
            f"{_shown(fields['tokens_per_s'], '.0f')} tok/s  ETA {_shown(eta, '.0f')}s",
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


WANDB_ID_FILE = run_layout.WANDB_ID
"""In the run dir: the W&B run's id (no secret), so every start of this run dir logs to the same W&B run."""


def wandb_run_id(run_dir: Path) -> str:
    """The run dir's W&B run id, made and written once (by rank 0, the only rank that starts W&B).

    A requeued or resumed job used to start a new W&B run each time, splitting one curve in pieces."""
    path = run_dir / WANDB_ID_FILE
    if path.is_file():
        return path.read_text().strip()
    run_id = secrets.token_hex(6)  # W&B ids are [a-z0-9]
    write_atomically(path, run_id + "\n")
    return run_id


def start_wandb(cfg: JobConfig) -> Any:
    """Rank 0's W&B run, continued (resume="allow") when the run dir was started before. The key comes
    only from the environment (WANDB_API_KEY) or `wandb login`; WANDB_MODE=offline works. Command line and
    environment capture are off, since either can carry a secret."""
    import wandb

    assert cfg.log.wandb is not None
    settings = wandb.Settings(disable_code=True, disable_git=True, x_disable_meta=True, console="off")
    return wandb.init(
        project=cfg.log.wandb.project,
        entity=cfg.log.wandb.entity,
        group=cfg.log.wandb.group,
        id=wandb_run_id(cfg.run_dir),
        resume="allow",
        name=cfg.run_name,
        dir=str(cfg.run_dir),
        config=redact(cfg.model_dump(mode="json", by_alias=True)),
        settings=settings,
        reinit="finish_previous",
    )


def _shown(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _brief(fields: dict[str, Any]) -> str:
    return "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in fields.items())


def _git_commit() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def environment_record(info: DistInfo) -> dict[str, Any]:
    """What env.json records: versions, every rank's host and device, the code's commit."""
    own = {**host_summary(info), "malloc": allocator.in_use()}  # what the launcher preloaded, if anything
    hosts: list[Any] = [own]
    if info.distributed:
        hosts = [None] * info.world_size
        torch.distributed.all_gather_object(hosts, own)
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        **{package: version(package) for package in ("transformers", "peft", "datasets")},  # no import to say so
        "world_size": info.world_size,
        "device": str(info.device.type),
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "hosts": hosts,
        "git_commit": _git_commit(),
    }


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Redacted strict JSON (non-finite floats as null), written atomically: readers never see half a file."""
    write_atomically(path, json.dumps(json_safe(redact(data)), indent=2, default=str, allow_nan=False) + "\n")
