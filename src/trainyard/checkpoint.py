"""Checkpoints that never lose work: lite (adapter) and full (DCP), async, atomic, rotated.

Layout of `checkpoints/step-00000100/`: DCP shards + `.metadata` (model, optimizer),
`trainer_state.json` (step, scheduler, loop figures, compatibility facts), `rank-<r>.json`
(sampler position and RNG states of each rank), `adapter/` (PEFT format) for LoRA jobs, and
`COMMITTED`, written last, after every rank's files are on disk. A directory without it is
never loaded and is removed on the next start. `LATEST` names the newest committed full one.

Seed 000's LoRA checkpoint called the wrapped model's state_dict() and all-gathered a 108B
base until NCCL timed out: here the adapter path touches only adapter tensors, and full
checkpoints skip frozen weights unless `checkpoint.save_frozen` asks for them.

Nothing here is unpickled except DCP's own `.metadata`, so checkpoints should come from
storage you trust; tensors are safetensors or DCP, everything else is JSON.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import re
import shutil
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from peft import PeftModel, get_peft_model_state_dict
from safetensors import SafetensorError
from safetensors.torch import save_file
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from trainyard.dist import DistInfo, all_reduce_sum, barrier
from trainyard.errors import CheckpointError
from trainyard.parallel import unwrap

MARKER = "COMMITTED"
STEP_DIR = re.compile(r"^step-(\d{8})$")


def step_dir(checkpoints: Path, step: int) -> Path:
    return checkpoints / f"step-{step:08d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, text: str) -> None:
    """Temp file, fsync, rename: readers see the old file or the new one, never half."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    tmp.replace(path)
    _fsync_dir(path.parent)


# ---------------------------------------------------------------- lite


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors on CPU, full size; one gather per adapter DTensor, nothing else."""
    state = get_peft_model_state_dict(unwrap(model))
    full = {}
    for name, tensor in state.items():
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        full[name] = tensor.detach().to("cpu").contiguous()
    return full


def save_adapter(model: torch.nn.Module, out_dir: Path, info: DistInfo) -> Path | None:
    """adapter_model.safetensors + adapter_config.json, as PeftModel.from_pretrained reads them."""
    peft_model = unwrap(model)
    if not isinstance(peft_model, PeftModel):
        return None
    state = adapter_state(model)
    if info.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        save_file(state, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
        peft_model.peft_config["default"].save_pretrained(str(out_dir))
        _fsync_dir(out_dir)
    return out_dir


# ---------------------------------------------------------------- state of every rank


def _encode_tensor(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.cpu().numpy().tobytes()).decode()


def _decode_bytes(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def rng_state() -> dict[str, Any]:
    numpy_state = np.random.get_state()
    state = {
        "torch": _encode_tensor(torch.get_rng_state()),
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy": [numpy_state[0], numpy_state[1].tolist(), *numpy_state[2:]],
    }
    if torch.cuda.is_available():
        state["cuda"] = [_encode_tensor(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(_decode_bytes(state["torch"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_decode_bytes(s) for s in state["cuda"]])


def model_signature(model: torch.nn.Module) -> str:
    """Names and shapes of every parameter: a resumed job must build the same model."""
    shapes = [f"{name}:{tuple(getattr(p, 'shape', ()))}" for name, p in unwrap(model).named_parameters()]
    return hashlib.sha256("\n".join(shapes).encode()).hexdigest()[:16]


def _state_options(cfg_save_frozen: bool, model: torch.nn.Module) -> StateDictOptions:
    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen and not cfg_save_frozen, strict=False)


# ---------------------------------------------------------------- saving


@dataclass
class PendingSave:
    """A full checkpoint whose shards are still being written in the background."""

    path: Path
    step: int
    future: Future | None

    def done_here(self) -> bool:
        return self.future is None or self.future.done()


def start_full_save(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    path: Path,
    *,
    trainer_state: dict[str, Any],
    rank_state: dict[str, Any],
    info: DistInfo,
    async_save: bool,
    save_frozen: bool,
    process_group: Any = None,
) -> PendingSave:
    """Write every rank's shard (in parallel); return before the write ends when async."""
    _write_own_files(model, path, trainer_state, rank_state, info)
    model_state, optim_state = get_state_dict(model, optimizer, options=_state_options(save_frozen, model))
    state = {"model": model_state, "optim": optim_state}
    if async_save:
        # Its own gloo group: the background thread's collectives never interleave with training's.
        future = dcp.async_save(state, checkpoint_id=str(path), process_group=process_group)
        return PendingSave(path, trainer_state["step"], future)
    try:
        dcp.save(state, checkpoint_id=str(path), process_group=process_group)
    except CheckpointException as err:  # a BaseException: turn it into an ordinary error
        raise RuntimeError(str(err)) from None
    return PendingSave(path, trainer_state["step"], None)


def _write_own_files(model: torch.nn.Module, path: Path, trainer_state: dict[str, Any], rank_state: dict[str, Any], info: DistInfo) -> None:
    """Adapter and JSON files beside the shards. Every rank learns whether any rank failed:
    one that went on alone would wait in DCP's collectives (or the next step's) forever."""
    error: Exception | None = None
    try:
        save_adapter(model, path / "adapter", info)
        path.mkdir(parents=True, exist_ok=True)
        write_atomically(path / f"rank-{info.rank}.json", json.dumps(rank_state))
        if info.is_main:
            write_atomically(path / "trainer_state.json", json.dumps(trainer_state, indent=2))
    except (OSError, SafetensorError) as err:  # safetensors' I/O errors are not OSErrors
        error = err
    if all_reduce_sum(torch.tensor([float(error is not None)], device=info.device)).item() > 0:
        raise OSError(str(error) if error is not None else "another rank could not write its files")


def finish_save(pending: PendingSave) -> None:
    """Wait for this rank's background write; a failure surfaces here, uncommitted."""
    if pending.future is not None:
        try:
            pending.future.result()
        except Exception as err:  # the writer thread's error, whatever it was
            raise CheckpointError(
                f"writing checkpoint {pending.path} failed: {err}",
                fix="check free space and permissions of the checkpoint dir; the previous checkpoint is intact",
            ) from None


def commit(checkpoints: Path, path: Path, kind: str, info: DistInfo) -> None:
    """Rank 0 writes the marker last, then points LATEST at it (full checkpoints only)."""
    if info.is_main:
        _fsync_dir(path)
        write_atomically(path / MARKER, json.dumps({"kind": kind}))
        if kind == "full":
            write_atomically(checkpoints / "LATEST", path.name + "\n")


def save_lite(model: torch.nn.Module, checkpoints: Path, step: int, info: DistInfo) -> Path | None:
    """Adapter only, committed at once: seconds, no optimizer, no base weights."""
    path = step_dir(checkpoints, step)
    if save_adapter(model, path / "adapter", info) is None:
        return None
    barrier()
    if info.is_main and not (path / MARKER).exists():
        commit(checkpoints, path, "lite", info)
    return path


# ---------------------------------------------------------------- finding, cleaning, rotating


def committed_kind(path: Path) -> str | None:
    try:
        return json.loads((path / MARKER).read_text())["kind"]
    except (OSError, ValueError, KeyError):
        return None


def committed(checkpoints: Path, kind: str = "full") -> list[Path]:
    """Committed checkpoints of one kind, oldest first."""
    if not checkpoints.is_dir():
        return []
    found = [p for p in checkpoints.iterdir() if STEP_DIR.match(p.name) and committed_kind(p) == kind]
    return sorted(found, key=lambda p: p.name)


def latest_full(checkpoints: Path) -> Path | None:
    named = checkpoints / "LATEST"
    if named.exists():
        candidate = checkpoints / named.read_text().strip()
        if committed_kind(candidate) == "full":
            return candidate
    found = committed(checkpoints, "full")
    return found[-1] if found else None


def remove_uncommitted(checkpoints: Path) -> list[Path]:
    """Partial checkpoints from a run that died mid-save: never loadable, so removed."""
    removed = []
    if checkpoints.is_dir():
        for path in checkpoints.iterdir():
            if STEP_DIR.match(path.name) and committed_kind(path) is None:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


def rotate(checkpoints: Path, keep_last: int, protected: Path | None) -> list[Path]:
    """Drop the oldest full checkpoints beyond keep_last; never the newest or `protected`."""
    full = committed(checkpoints, "full")
    removed = []
    for path in full[: max(0, len(full) - keep_last)]:
        if protected is not None and path.resolve() == protected.resolve():
            continue
        (path / MARKER).unlink()  # uncommit first: a half-deleted dir is never loaded
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def resolve_resume(resume: str, checkpoints: Path) -> Path | None:
    """`auto`: the newest committed full checkpoint (or None); `never`; or an explicit path."""
    if resume == "never":
        return None
    if resume == "auto":
        return latest_full(checkpoints)
    path = Path(resume)
    if path.is_dir() and STEP_DIR.match(path.name) is None and (path / "checkpoints").is_dir():
        path = latest_full(path / "checkpoints") or path  # a run dir: its newest checkpoint
    if committed_kind(path) != "full":
        raise CheckpointError(
            f"checkpoint.resume: {path} is not a committed full checkpoint (no {MARKER} marker of kind full)",
            fix="point it at a checkpoints/step-XXXXXXXX folder of a finished save, or use auto",
        )
    return path


# ---------------------------------------------------------------- loading


def read_trainer_state(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / "trainer_state.json").read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"cannot read {path / 'trainer_state.json'}: {err}", fix="resume from another checkpoint") from None


def check_compatible(saved: dict[str, Any], current: dict[str, Any], path: Path) -> None:
    """Name every fact that differs between the checkpoint and this job.

    The world size may differ: the global batch may not (accumulation is re-derived to keep
    it), and every saved rank must hold the same global data position, the one resumed from.
    """
    differences = [
        f"{key}: checkpoint has {saved.get(key)!r}, this job has {current[key]!r}"
        for key in ("model_signature", "lora", "data_fingerprint", "global_batch_samples")
        if saved.get(key) != current[key]
    ]
    differences += _sampler_disagreements(path, int(saved.get("world_size", 1)))
    if differences:
        raise CheckpointError(
            f"checkpoint {path} does not match this job:\n  " + "\n  ".join(differences),
            fix="resume with the job that wrote it, or set checkpoint.resume: never to start fresh",
        )


def _sampler_disagreements(path: Path, saved_world: int) -> list[str]:
    """Each saved rank's data position; they must agree, or resuming would skip or repeat rows.
    (A missing rank file is load_full's to report, on the rank that needs it.)"""
    positions: dict[str, list[int]] = {}
    for rank in range(saved_world):
        try:
            sampler = json.loads((path / f"rank-{rank}.json").read_text())["sampler"]
        except FileNotFoundError:
            continue
        except (OSError, ValueError, KeyError) as err:
            return [f"rank-{rank}.json: unreadable data position ({err})"]
        positions.setdefault(json.dumps(sampler, sort_keys=True), []).append(rank)
    if len(positions) <= 1:
        return []
    return ["sampler: the saved ranks disagree on the data position: " + "; ".join(
        f"ranks {ranks} at {position}" for position, ranks in positions.items()
    )]


def load_full(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path, info: DistInfo, save_frozen: bool
) -> dict[str, Any]:
    """Load weights and optimizer (resharded by DCP to this world), return this rank's state."""
    model_state, optim_state = get_state_dict(model, optimizer, options=_state_options(save_frozen, model))
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
        options=_state_options(save_frozen, model),
    )
    saved_world = read_trainer_state(path)["world_size"]
    own = path / f"rank-{info.rank}.json"
    if saved_world != info.world_size or not own.exists():
        own = path / f"rank-{info.rank % saved_world}.json"
    return json.loads(own.read_text())
