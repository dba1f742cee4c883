"""Checkpoints that never lose work: lite (adapter) and full (DCP), async, committed, rotated.

Layout of `checkpoints/step-00000100/`: DCP shards + `.metadata` (model, optimizer),
`trainer_state.json` (step, scheduler, loop figures, compatibility facts), `rank-<r>.json`
(sampler position and RNG states of each rank), `adapter/` (PEFT format) for LoRA jobs, and
`COMMITTED`, written last, after every rank's files are on disk (see checkpoint_layout.py).

`Checkpointer` runs the saves of one job: at most one full save in flight, committed once
every rank has written its part, rotated, reported, and a failure handled as
`checkpoint.on_error` says, the same way on every rank. The trainer decides when to save.

Seed 000's LoRA checkpoint called the wrapped model's state_dict() and all-gathered a 108B
base until NCCL timed out: here the adapter path touches only adapter tensors, and full
checkpoints skip frozen weights unless `checkpoint.save_frozen` asks for them.

Nothing here is unpickled except DCP's own `.metadata`, so checkpoints should come from
storage you trust; tensors are safetensors or DCP, everything else is JSON.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from safetensors import SafetensorError
from safetensors.torch import save_file
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from trainyard.atomic import fsync_dir, write_atomically
from trainyard.checkpoint.layout import (  # noqa: F401  (the checkpoint room's names, importable from here)
    MARKER,
    STEP_DIR,
    check_compatible,
    check_intact,
    committed,
    committed_kind,
    damage,
    latest_full,
    newest_intact,
    read_trainer_state,
    remove_uncommitted,
    resolve_resume,
    rotate,
    set_aside,
    step_dir,
    write_marker,
)
from trainyard.checkpoint.failure import DISK_FIX, plain, save_error, state_bytes
from trainyard.config import CheckpointConfig
from trainyard.dist import DistInfo, all_reduce_sum, broadcast_text
from trainyard.errors import CheckpointError
from trainyard.model import nf4_experts
from trainyard.model.build import is_peft
from trainyard.parallel import expert_parallel
from trainyard.parallel.parallelize import unwrap


# ---------------------------------------------------------------- lite


def adapter_state(model: torch.nn.Module, info: DistInfo) -> dict[str, torch.Tensor]:
    """The adapter's tensors, full size on rank 0's host, and none on any other rank. Every rank joins each adapter
    DTensor's gather (one tensor at a time, nothing but the adapter) and only rank 0 keeps it, as torch's
    full_state_dict with cpu_offload does: a host copy on every rank cost 7.3 GB per rank (58 GB a node) for
    GLM-4.5-Air's 1.82B-parameter adapter. Under expert parallelism an expert adapter is gathered from every EP
    rank's experts."""
    from peft import get_peft_model_state_dict  # a LoRA job's: a full fine-tune never loads PEFT

    full = {}
    state = expert_parallel.whole_stacks(model, get_peft_model_state_dict(unwrap(model)))
    for name, tensor in state.items():
        if isinstance(tensor, DTensor):
            tensor = expert_parallel.peft_layout(name, tensor.full_tensor())
        if info.is_main:
            full[name] = tensor.detach().to("cpu").contiguous()
    return full


def save_adapter(model: torch.nn.Module, out_dir: Path, info: DistInfo, tokenizer: Any = None) -> Path | None:
    """adapter_model.safetensors + adapter_config.json, as PeftModel.from_pretrained reads them, and the job's
    tokenizer (its chat template as trained) when given. Every rank gathers (FSDP), rank 0 keeps and writes; None
    when the model has no adapter."""
    peft_model = unwrap(model)
    if not is_peft(peft_model):
        return None
    state = adapter_state(model, info)
    if info.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        save_file(state, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
        peft_model.peft_config["default"].save_pretrained(str(out_dir))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(out_dir))
        fsync_dir(out_dir)
    return out_dir


# ---------------------------------------------------------------- state of every rank


def model_signature(model: torch.nn.Module) -> str:
    """Names and shapes of every parameter: a resumed job must build the same model. An expert stack held apart
    by expert parallelism counts with its whole shape (an evaluation without EP reads the same checkpoint), and so
    does one model.quantize nf4 holds per expert."""
    model = unwrap(model)
    whole = expert_parallel.whole_shapes(model)
    entries = [(name, whole.get(name, tuple(getattr(p, "shape", ())))) for name, p in model.named_parameters()]
    entries = nf4_experts.as_whole_stacks(entries, expert_parallel.size_of(model) or 1)
    shapes = [f"{name}:{shape}" for name, shape in entries]
    return hashlib.sha256("\n".join(shapes).encode()).hexdigest()[:16]


def _state_dicts(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, save_frozen: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Model and optimizer state as DCP writes and reads them; frozen weights only when asked
    (they come from model.path). torch's `ignore_frozen_params` misses a frozen weight tied
    under a second name (lm_head = embed_tokens: 113 of SmolLM2's 195 MB LoRA checkpoint),
    because named_parameters() names a shared Parameter once; here every name is dropped."""
    model_state, optim_state = get_state_dict(model, optimizer, options=StateDictOptions(strict=False))
    if not save_frozen:
        frozen = {name for name, p in unwrap(model).named_parameters(remove_duplicate=False) if not p.requires_grad}
        model_state = {name: value for name, value in model_state.items() if name not in frozen}
    return model_state, optim_state


# ---------------------------------------------------------------- writing a full checkpoint


@dataclass
class PendingSave:
    """A full checkpoint whose shards are still being written in the background."""

    path: Path
    step: int
    future: Future | None
    needed: int = 0
    """Bytes the whole save writes, for the message of a full disk."""

    def done_here(self) -> bool:
        return self.future is None or self.future.done()

    def failed_here(self) -> bool:
        return self.future is not None and self.future.done() and self.future.exception() is not None


Arrange = Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]]
"""(model state, optimizer state) -> what DCP writes and reads. The default is {"model": ..., "optim": ...};
DiLoCo (diloco/outer.py) nests each site's own weights and optimizer under the site, beside the shared weights."""


def default_arrangement(model_state: dict[str, Any], optim_state: dict[str, Any]) -> dict[str, Any]:
    return {"model": model_state, "optim": optim_state}


def _write_shards(state: dict[str, Any], path: Path, async_save: bool, process_group: Any) -> Future | None:
    """Every rank's DCP shard (in parallel). Async: started on DCP's background writer, its future returned
    before the write ends; else written when this returns (None)."""
    if async_save:
        return dcp.async_save(state, checkpoint_id=str(path), process_group=process_group)
    try:
        dcp.save(state, checkpoint_id=str(path), process_group=process_group)
    except CheckpointException as err:  # a BaseException: turn it into an ordinary error
        raise RuntimeError(plain(err)) from err
    return None


def _write_own_files(
    model: torch.nn.Module,
    path: Path,
    trainer_state: dict[str, Any],
    rank_state: dict[str, Any],
    info: DistInfo,
    tokenizer: Any = None,
) -> None:
    """Adapter and JSON files beside the shards. Every rank learns whether any rank failed:
    one that went on alone would wait in DCP's collectives (or the next step's) forever."""
    error: Exception | None = None
    try:
        save_adapter(model, path / "adapter", info, tokenizer)
        path.mkdir(parents=True, exist_ok=True)
        write_atomically(path / f"rank-{info.rank}.json", json.dumps(rank_state))
        if info.is_main:
            write_atomically(path / "trainer_state.json", json.dumps(trainer_state, indent=2))
    except (OSError, SafetensorError) as err:  # safetensors' I/O errors are not OSErrors
        error = err
    if all_reduce_sum(torch.tensor([float(error is not None)], device=info.device)).item() > 0:
        raise OSError(str(error) if error is not None else "another rank could not write its files") from error


def finish_save(pending: PendingSave) -> None:
    """Wait for this rank's background write; a failure surfaces here, uncommitted."""
    if pending.future is not None:
        try:
            pending.future.result()
        except (Exception, CheckpointException) as err:  # the writer thread's error, whatever it was
            raise save_error(pending.path, err, pending.needed) from None


def _write_failure(pending: PendingSave) -> CheckpointError:
    """What this rank reports for a save some rank failed to write: its own error, else that another rank's failed."""
    try:
        finish_save(pending)
    except CheckpointError as err:
        return err
    return CheckpointError(f"writing checkpoint {pending.path} failed on another rank", fix=DISK_FIX)


def commit(checkpoints: Path, path: Path, kind: str, info: DistInfo) -> None:
    """Every rank calls it; rank 0 writes the marker. If that fails, every rank raises the same
    error: a rank that went on alone would wait for the others in the next collective."""
    error = ""
    if info.is_main:
        try:
            write_marker(checkpoints, path, kind)
        except OSError as err:
            error = f"committing checkpoint {path} failed on rank 0: {err}"
    error = broadcast_text(error, info.device)
    if error:
        raise CheckpointError(error, fix=DISK_FIX)


# ---------------------------------------------------------------- the saves of one job


class Checkpointer:
    """Starts, settles, commits, rotates and reports the saves of one job; `emit` is the
    metrics sink's. `resumed_from` is never rotated away."""

    def __init__(
        self, cfg: CheckpointConfig, checkpoints: Path, info: DistInfo, emit: Callable[..., None], tokenizer: Any = None
    ) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        """Saved into every adapter folder: its chat template is the one the job trains with."""
        self.dir = checkpoints
        self.info = info
        self.emit = emit
        self.pending: PendingSave | None = None
        self.resumed_from: Path | None = None
        # Its own gloo group: the background writer's collectives never interleave with training's. It waits
        # dist.timeout_s like every other group (new_group's default would be 30 minutes).
        timeout = timedelta(seconds=info.timeout_s) if info.timeout_s else None
        own_group = info.distributed and cfg.async_save
        self.group = torch_dist.new_group(backend="gloo", timeout=timeout) if own_group else None
        self.arrange: Arrange = default_arrangement
        self.last_stall_s: float | None = None
        """How long the last full save held training (checkpoint.every_minutes: auto derives the interval)."""
        self.last_step = 0
        self.announced_interval_min: float | None = None

    def written_here(self) -> bool:
        """This rank's part of the save in flight is on disk (a vote for the step's all-reduce)."""
        return self.pending is not None and self.pending.done_here() and not self.pending.failed_here()

    def failed_here(self) -> bool:
        return self.pending is not None and self.pending.failed_here()

    def settle(self, written_everywhere: bool, failed_somewhere: bool) -> None:
        """After the ranks voted: commit the save every rank has written, or report the failed
        one (never silently missing). Nothing to do while it is still being written."""
        if self.pending is None or not (written_everywhere or failed_somewhere):
            return
        pending, self.pending = self.pending, None
        if failed_somewhere:
            self._failed(pending.step, _write_failure(pending))
        else:
            self._commit_or_report(pending)

    def wait(self) -> None:
        """Finish the save in flight (before another starts, or at the end), then settle it."""
        if self.pending is None:
            return
        try:
            finish_save(self.pending)
            failed_here = False
        except CheckpointError:
            failed_here = True
        failed = all_reduce_sum(torch.tensor([float(failed_here)], device=self.info.device)).item() > 0
        self.settle(written_everywhere=not failed, failed_somewhere=failed)

    def save_full(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        step: int,
        trainer_state: dict[str, Any],
        rank_state: dict[str, Any],
        async_save: bool,
    ) -> bool:
        """A full checkpoint of `step`; True once it is committed (now, or by an earlier save).
        Async: started here, committed by a later `settle`. At most one save is in flight."""
        self.wait()
        path = step_dir(self.dir, step)
        if self._saved_intact(path):
            return True  # this step is already saved (a preemption right after a save)
        started = time.monotonic()
        parts = _state_dicts(model, optimizer, self.cfg.save_frozen)
        state = self.arrange(*(expert_parallel.whole_stacks(model, part) for part in parts))
        needed = state_bytes(state)
        try:
            _write_own_files(model, path, trainer_state, rank_state, self.info, self.tokenizer)
            pending = PendingSave(path, step, _write_shards(state, path, async_save, self.group), needed)
        except (OSError, RuntimeError) as err:
            self._failed(step, save_error(path, err, needed))
            return False
        stall = time.monotonic() - started
        self.last_stall_s, self.last_step = stall, step
        if async_save:
            self.pending = pending
            self.emit("checkpoint", step=step, mode="full", path=str(path), async_save=True, stall_s=stall)
            return False
        return self._commit_or_report(pending, stall_s=stall)

    def _saved_intact(self, path: Path) -> bool:
        """A committed full checkpoint of this step whose files are as committed. Rank 0 reads them and decides for
        every rank; a damaged one is moved aside (kept, never deleted) so that the step is saved again in its place.
        Every rank sees the same marker here: only rank 0 writes one, after all ranks' files, in a collective."""
        if committed_kind(path) != "full":
            return False
        problem = damage(path) if self.info.is_main else None
        if not broadcast_text(problem or "", self.info.device):
            return True
        if self.info.is_main:
            aside = set_aside(path)
            logging.getLogger("trainyard").warning("checkpoint %s is damaged (%s): moved to %s, saving it again",
                                                   path, problem, aside.name)
        all_reduce_sum(torch.zeros(1, device=self.info.device))  # no rank writes into the folder before it moved
        return False

    def save_lite(self, model: torch.nn.Module, step: int) -> None:
        """The adapter alone, committed at once: seconds, no optimizer, no base weights."""
        started = time.monotonic()
        path = step_dir(self.dir, step)
        error = ""
        try:
            if save_adapter(model, path / "adapter", self.info, self.tokenizer) is None:
                return  # not a LoRA job: no rank has anything to save
        except (OSError, SafetensorError) as err:  # rank 0 writes; safetensors' I/O errors are not OSErrors
            trained = [p for p in unwrap(model).parameters() if p.requires_grad]
            error = save_error(path, err, state_bytes(trained), "lite checkpoint").what + " (on rank 0)"
        try:
            if error := broadcast_text(error, self.info.device):
                raise CheckpointError(error, fix=DISK_FIX)
            commit(self.dir, path, "lite", self.info)
        except CheckpointError as err:
            self._failed(step, err)
            return
        self.emit("checkpoint", step=step, mode="lite", path=str(path / "adapter"), stall_s=time.monotonic() - started)

    def _commit_or_report(self, pending: PendingSave, **figures: float) -> bool:
        """Commit a written save (sync: at once; async: once every rank wrote it); a failure is reported, not lost.
        True once committed."""
        try:
            self._commit(pending, **figures)
        except CheckpointError as err:
            self._failed(pending.step, err)
            return False
        return True

    def _commit(self, pending: PendingSave, **figures: float) -> None:
        commit(self.dir, pending.path, "full", self.info)
        if self.info.is_main:
            removed = rotate(self.dir, self.cfg.keep_last, self.resumed_from)
            self.emit(
                "checkpoint",
                step=pending.step,
                mode="full",
                path=str(pending.path),
                committed=True,
                removed=[p.name for p in removed],
                **figures,
            )

    def _failed(self, step: int, err: CheckpointError) -> None:
        """Every rank gets here with the same error: report it, then stop or go on."""
        self.emit("system", step=step, event="checkpoint_failed", error=err.what)
        logging.getLogger("trainyard").error("checkpoint at step %d failed: %s", step, err.what)
        if self.cfg.on_error == "stop":
            raise err


# ---------------------------------------------------------------- loading


def load_full(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    path: Path,
    info: DistInfo,
    save_frozen: bool,
    arrange: Arrange = default_arrangement,
) -> dict[str, Any]:
    """Load weights and optimizer (resharded by DCP to this world), return this rank's state. DCP fills the
    arranged state in place, so the model and optimizer dicts nested in it hold what was loaded."""
    model_state, optim_state = _state_dicts(model, optimizer, save_frozen)
    apart = expert_parallel.saved_apart(model, FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    if not apart and expert_parallel.meshes_of(model) is not None:
        raise CheckpointError(
            f"checkpoint {path} holds the expert adapters as PEFT lays them out (written without expert parallelism "
            "before checkpoints resumed across EP sizes): dist.expert_parallel cannot reshard it",
            fix="resume it with dist.expert_parallel: 1 once; its next checkpoint resumes at any EP size",
        )
    whole = (expert_parallel.whole_stacks(model, part, apart) for part in (model_state, optim_state))
    dcp.load(arrange(*whole), checkpoint_id=str(path))  # an expert stack's whole view shares its memory
    set_state_dict(
        model,
        optimizer,
        model_state_dict=model_state,
        optim_state_dict=optim_state,
        options=StateDictOptions(strict=False),
    )
    saved_world = read_trainer_state(path)["world_size"]
    own = path / f"rank-{info.rank}.json"
    if saved_world != info.world_size or not own.exists():
        own = path / f"rank-{info.rank % saved_world}.json"
    return json.loads(own.read_text())
