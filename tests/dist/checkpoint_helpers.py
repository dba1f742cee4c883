"""Runs of the tiny job that checkpoint every few steps, and ways to interrupt them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests import warm
from tests.conftest import TINY
from tests.world import count_killed
from trainyard.parallel.expert_parallel import peft_layout

STEPS = 16
"""Full checkpoints at 4, 8, 12, 16: a kill or stop drawn in 5..12 lands between two of them (or in a save), the
resumed run trains at least 4 steps, and the tiny model's loss still falls over the run (test_moe)."""
EVERY = 4
COMMON = [
    f"train.max_steps={STEPS}",
    "train.micro_batch_size=8",
    "train.global_batch_size=16",
    "train.lr=3e-3",
    "log.every_steps=1",
    "log.progress=false",
    "log.tensorboard=false",
    "eval.every_steps=0",
    "eval.at_end=false",
    f"checkpoint.every_steps={EVERY}",
    "checkpoint.keep_last=2",
    "train.precision=bf16-mixed",  # fp32 masters, bf16 compute: resumed bitwise on any CPU
]
LORA_DDP = ["lora.enabled=true", "dist.strategy=ddp"]
FULL_FSDP = ["lora.enabled=false", "dist.strategy=fsdp"]
LORA_FSDP = ["lora.enabled=true", "dist.strategy=fsdp"]


def train_args(out: Path, *overrides: str, nproc: int = 2, config: str = TINY) -> list[str]:
    return ["train", config, f"output_dir={out}", *COMMON, *overrides, "--nproc", str(nproc)]


def start(args: list[str]) -> warm.Command | subprocess.Popen[str]:
    """The CLI in its own session, as a scheduler would start it."""
    return warm.start(args, new_session=True)


def last_step(run_dir: Path) -> int:
    """The newest train step in metrics.jsonl (0 before the first)."""
    return max((event["step"] for event in written_events(run_dir) if event["kind"] == "train"), default=0)


def written_events(run_dir: Path) -> list[dict[str, Any]]:
    """The events of metrics.jsonl so far, read while the run still writes it (none before the file exists)."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    return [event for event in map(_parse, lines) if event]


def _parse(line: str) -> dict[str, Any] | None:
    try:
        return json.loads(line)
    except ValueError:
        return None  # the line being written right now


def wait_for_step(proc: subprocess.Popen[str], run_dir: Path, step: int, timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen = last_step(run_dir)
        if seen >= step:
            return seen
        if proc.poll() is not None:
            _, err = proc.communicate()
            raise AssertionError(f"run ended (exit {proc.returncode}) before step {step}:\n{err[-3000:]}")
        time.sleep(0.005)
    kill_tree(proc)
    raise AssertionError(f"no step {step} within {timeout}s")


def kill_tree(proc: subprocess.Popen[str]) -> None:
    """SIGKILL the launcher and every worker at once: the agent puts workers in their own
    sessions, so killing the launcher's process group alone would leave them training."""
    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    # the launcher first, so that it reaps none of the others: init does, and their CPU would be lost to the tests'
    count_killed([process.pid for process in tree[1:]])
    for process in tree:
        try:
            os.kill(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.communicate()
    psutil.wait_procs(tree, timeout=10)


def resumed_events(run_dir: Path) -> list[dict[str, Any]]:
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [e for e in events if e.get("event") == "resumed"]


def events_of_last_run(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    """A rerun appends to metrics.jsonl: it begins at its `resumed` event or, when nothing was committed to resume
    from (an async save still in flight at the kill), where the train steps start again from 1."""
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    fresh = [i for i, e in enumerate(events) if e["kind"] == "train" and e["step"] == 1]
    starts = fresh + [i for i, e in enumerate(events) if e.get("event") == "resumed"]
    return [e for e in events[max(starts, default=0) :] if e["kind"] == kind]


def model_tensors(step_dir: Path) -> dict[str, torch.Tensor]:
    """The model entries of a full DCP checkpoint, consolidated into one file and read back; expert lora_B in PEFT's
    layout (DCP holds it as [out, r, experts])."""
    with tempfile.TemporaryDirectory() as scratch:
        target = Path(scratch) / "consolidated.pt"
        dcp_to_torch_save(step_dir, target)
        model = torch.load(target, weights_only=True)["model"]
    return {name: peft_layout(name, tensor) for name, tensor in model.items()}


def adapter_tensors(step_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(step_dir / "adapter" / "adapter_model.safetensors")


def dcp_adapter_tensors(step_dir: Path) -> dict[str, torch.Tensor]:
    """The LoRA weights as DCP saved them (each rank its shard), under PEFT's file names: an
    account of the live adapter at that step that owes nothing to the adapter writer."""
    model = model_tensors(step_dir)
    return {name.replace(".default.", "."): tensor for name, tensor in model.items() if ".lora_" in name}


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys() and want, (sorted(got)[:3], sorted(want)[:3])
    differing = [name for name in want if not torch.equal(got[name], want[name])]
    assert not differing, f"{len(differing)} of {len(want)} tensors differ, e.g. {differing[:3]}"
