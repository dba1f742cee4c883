"""The loop's state in and out of full checkpoints: what it is, when a full save is due (every_minutes, or
Young/Daly under auto), what a save holds, resuming from one, and the save that ends a preempted job.

checkpoint.py writes and reads; this room decides when and with what, so the loop in trainer.py stays a loop.
"""

from __future__ import annotations

import base64
import json
import logging
import random
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np
import torch

from trainyard import dist
from trainyard.batch import accumulation_steps
from trainyard.checkpoint import save as checkpoint
from trainyard.data.mixture import MixtureStream
from trainyard.diloco import ft as diloco_ft
from trainyard.errors import CheckpointError, Preempted
from trainyard.estimate.timing import young_daly_interval_s

if TYPE_CHECKING:
    from trainyard.train.job import Job


@dataclass
class LoopState:
    """Everything about the loop's progress a checkpoint must carry for an exact resume."""

    step: int = 0
    tokens: int = 0
    first_loss: float | None = None
    last_loss: float | None = None
    last_eval: dict[str, float] = field(default_factory=dict)
    baseline_eval: dict[str, float] = field(default_factory=dict)
    steady_tokens: int = 0
    steady_time: float = 0.0


SIGNALLED: list[str] = []


def install_preemption_handlers(names: list[str]) -> None:
    """Only note the signal: every rank agrees at the next step boundary, then saves."""
    for name in names:
        signal.signal(getattr(signal, name), lambda signum, _frame: SIGNALLED.append(signal.Signals(signum).name))


def timed_save_due(job: Job, last_full: float) -> bool:
    """checkpoint.every_minutes passed since the last full save (or the start)."""
    every = save_interval_minutes(job)
    return every > 0 and time.monotonic() - last_full > every * 60


FIRST_AUTO_SAVE_MINUTES = 10.0
"""every_minutes: auto, before any full save measured its stall."""


def save_interval_minutes(job: Job) -> float:
    """every_minutes, or under auto Young/Daly from the last full save's measured stall and the job's MTBF."""
    ckpt, info = job.cfg.checkpoint, job.info
    if ckpt.every_minutes != "auto":
        return ckpt.every_minutes
    if job.saves.last_stall_s is None:
        return FIRST_AUTO_SAVE_MINUTES
    nodes = max(1, info.world_size // max(info.local_world_size, 1))
    minutes = young_daly_interval_s(job.saves.last_stall_s, ckpt.mtbf_hours * 3600 / nodes) / 60
    if job.saves.announced_interval_min is None or abs(minutes / job.saves.announced_interval_min - 1) > 0.1:
        job.saves.announced_interval_min = minutes
        job.sink.emit("system", step=job.saves.last_step, event="checkpoint_interval", minutes=minutes,
                      save_s=job.saves.last_stall_s, mtbf_hours=ckpt.mtbf_hours, nodes=nodes)
    return minutes


def _encode_tensor(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.cpu().numpy().tobytes()).decode()


def _decode_bytes(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def rng_state() -> dict[str, Any]:
    """This rank's random streams (dropout, sampling): Python's, NumPy's, torch's CPU generator and, with CUDA,
    the generator of this rank's own device only. Every visible device's would tie the checkpoint to how many
    GPUs each process sees."""
    numpy_state = np.random.get_state()
    state = {
        "torch": _encode_tensor(torch.get_rng_state()),
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy": [numpy_state[0], numpy_state[1].tolist(), *numpy_state[2:]],
    }
    if torch.cuda.is_available():
        state["cuda"] = _encode_tensor(torch.cuda.get_rng_state(torch.cuda.current_device()))
    return state


def own_cuda_state(saved: str | list[str], device_index: int) -> str:
    """This rank's device's CUDA generator state from a saved "cuda" entry. Checkpoints written before it held
    one device's state held a list, one per visible device: keep reading them, taking the current device's entry,
    or the first when this process sees fewer devices than the one that saved it."""
    if isinstance(saved, str):
        return saved
    return saved[device_index] if device_index < len(saved) else saved[0]


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` saved; a CUDA state is set on the current device, and skipped without CUDA."""
    torch.set_rng_state(_decode_bytes(state["torch"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        device = torch.cuda.current_device()
        torch.cuda.set_rng_state(_decode_bytes(own_cuda_state(state["cuda"], device)), device)


def save_full(job: Job, state: LoopState, async_save: bool) -> bool:
    """A full checkpoint of where the loop stands; True once it is committed."""
    trainer_state = {
        "step": state.step,
        "world_size": job.info.world_size,
        "scheduler": job.scheduler.state_dict(),
        "loop": asdict(state),
        **job.facts,
    }
    rank_state = {"sampler": job.sampler.state_dict(), "rng": rng_state()}
    return job.saves.save_full(job.model, job.optimizer, state.step, trainer_state, rank_state, async_save)


def stop_for_preemption(job: Job, state: LoopState) -> NoReturn:
    """Save where every rank stands, then leave: exit 75 (requeue me) only if it is committed."""
    by = (SIGNALLED or ["a signal on another rank"])[0]
    if save_full(job, state, async_save=False):
        raise Preempted(
            f"preempted by {by} after step {state.step}; checkpoint step-{state.step:08d} committed",
            fix="run the same command again to resume",
        )
    latest = checkpoint.latest_full(job.checkpoints)
    raise CheckpointError(
        f"stopped by {by} after step {state.step}, but its checkpoint could not be saved "
        "(logged as checkpoint_failed); "
        f"the newest committed checkpoint is {latest.name if latest else 'none: a rerun starts fresh'}",
        fix="free space in the checkpoint dir, then run the same command again to resume from there",
    )


def _agreed_resume(job: Job) -> Path | None:
    """Rank 0 reads the disk and every rank loads what it chose. Ranks that judged damage each on their own could
    pick different checkpoints (a file flushed between two reads, a node's stale cache) and load mismatched shards;
    a refusal reaches every rank too, instead of leaving the others waiting in a collective."""
    verdict = ""
    if job.info.is_main:
        try:
            path = checkpoint.resolve_resume(job.cfg.checkpoint.resume, job.checkpoints)
            verdict = json.dumps({"path": None if path is None else str(path)})
        except CheckpointError as err:
            verdict = json.dumps({"what": err.what, "where": err.where, "fix": err.fix})
    decided = json.loads(dist.broadcast_text(verdict, job.info.device))
    if "what" in decided:
        raise CheckpointError(decided["what"], where=decided["where"], fix=decided["fix"])
    return None if decided["path"] is None else Path(decided["path"])


def resume(job: Job) -> LoopState:
    """Clean partial saves, then load the checkpoint `checkpoint.resume` names (or start fresh)."""
    logger = logging.getLogger("trainyard")
    if job.info.is_main:
        for partial in checkpoint.remove_uncommitted(job.checkpoints):
            logger.info("removed partial checkpoint %s (no commit marker)", partial)
    dist.barrier()
    path = _agreed_resume(job)
    if path is None:
        if job.cfg.checkpoint.resume == "auto" and checkpoint.committed(job.checkpoints):
            logger.warning("starting fresh: every committed checkpoint in %s is damaged (named above, left in place)",
                           job.checkpoints)
        else:
            logger.info("starting fresh (checkpoint.resume: %s, no committed checkpoint)", job.cfg.checkpoint.resume)
        return LoopState()
    saved = checkpoint.read_trainer_state(path)
    world = job.info.world_size
    # Any world size keeps the global batch (the checkpoint's, if the config sets none): re-derive accumulation
    # for the ranks that read rows (a context-parallel group is one; the sampler's position is global).
    data_world = diloco_ft.data_slice(job.cfg, job.info)[1]
    job.accum = accumulation_steps(job.cfg, data_world, saved.get("global_batch_samples"))
    job.facts["global_batch_samples"] = job.cfg.train.micro_batch_size * job.accum * data_world
    checkpoint.check_compatible(saved, job.facts, path)
    loading = time.monotonic()
    rank_state = checkpoint.load_full(
        job.model, job.optimizer, path, job.info, job.cfg.checkpoint.save_frozen, arrange=job.saves.arrange
    )
    job.scheduler.load_state_dict(saved["scheduler"])
    if saved["world_size"] == world:  # per-rank streams (dropout) only fit the same ranks
        set_rng_state(rank_state["rng"])
    if isinstance(job.sampler, MixtureStream):
        job.sampler.load_state_dict(rank_state["sampler"])  # a global row: fits any world size
    else:
        job.sampler.load_state_dict(rank_state["sampler"], saved_world_size=saved["world_size"])  # global too
    job.saves.resumed_from = path  # never rotated away
    logger.info("resumed from %s at step %d (world %d, accumulation %d)", path, saved["step"], world, job.accum)
    job.sink.emit("system", step=saved["step"], event="resumed", path=str(path), saved_world_size=saved["world_size"],
                  world_size=world, accumulation=job.accum, load_s=round(time.monotonic() - loading, 3))
    return LoopState(**saved["loop"])
