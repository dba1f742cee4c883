"""Activation checkpointing off / full / selective: step time and activation memory, one CPU thread.

    python benchmarks/memory/activation_checkpointing.py                # bf16 autocast and fp32, 1 timed step each
    python benchmarks/memory/activation_checkpointing.py --steps 5 --precision fp32  # a quiet machine

One model per mode, built once and trained under each precision: SmolLM2-135M-Instruct (trainyard's builtin
GGUF, dequantized to fp32 once) with LoRA r=8 on every linear projection (all but the head), on a batch of 4 x 256
seeded random tokens, AdamW on the adapters, checkpointing turned on exactly as `trainyard train` does
(`model.enable_activation_checkpointing`).

One untimed step first, which also measures the activations kept for the backward: the bytes of the storages
created during its forward and still alive when the forward ends (autograd's saved tensors, selective
checkpointing's cache, the logits), the peak that checkpointing lowers. saved_tensors_hooks would miss what a
checkpoint holds, as inside it only its own hooks run. Then the median wall time of the timed steps, and
their median CPU time: one thread, so the CPU time is the compute, and other jobs on the cores barely move it.

One JSON line per case. No assertions: a benchmark, never run by the test suite.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from trainyard.config import LoraConfig, ModelConfig
from trainyard.model import build as model_room
from trainyard.model import lora as lora_room
from trainyard.model import source as source_room
from trainyard.parallel import checkpointing

MODEL = "builtin:smollm2-135m-instruct"
MODES: dict[str, bool | str] = {"off": False, "full": True, "selective": "selective"}
BATCH, LENGTH, RANK = 4, 256, 8


class ForwardStorages(TorchDispatchMode):
    """Every storage an op creates, weakly held: those alive after the forward are what it kept."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                storage = leaf.untyped_storage()
                self.storages[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
        return out

    def live_bytes(self) -> int:
        return sum(nbytes for ref, nbytes in self.storages.values() if not ref.expired())


def build(model_path: str, mode: str) -> torch.nn.Module:
    """A fresh fp32 model with seeded adapters (B drawn too, so every adapter's gradient is real work)."""
    cfg = ModelConfig(path=model_path)
    tokenizer = source_room.load_tokenizer(cfg, model_path)
    model = model_room.load_model(cfg, model_path, tokenizer, torch.float32, seed=0)
    model = lora_room.apply_lora(model, LoraConfig(r=RANK, alpha=2 * RANK), seed=0)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    if MODES[mode]:
        checkpointing.enable_activation_checkpointing(model, selective=MODES[mode] == "selective")
    return model.train()


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any], bf16: bool,
         storages: ForwardStorages | None = None) -> int:
    """One optimizer step; the bytes the forward kept when `storages` watches it (else 0)."""
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with autocast, storages or contextlib.nullcontext():
        loss = model(**batch).loss
    kept = storages.live_bytes() if storages else 0
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return kept


def measure(models: dict[str, torch.nn.Module], precision: str, steps: int) -> list[dict[str, Any]]:
    """The modes take turns, step by step, so that a neighbour's load on the machine falls on all of them alike."""
    batch = seeded_batch(next(iter(models.values())).config.vocab_size)
    bf16 = precision == "bf16-autocast"
    optimizers = {mode: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad]) for mode, m in models.items()}
    kept = {mode: step(model, optimizers[mode], batch, bf16, ForwardStorages()) for mode, model in models.items()}
    wall: dict[str, list[float]] = {mode: [] for mode in models}
    cpu: dict[str, list[float]] = {mode: [] for mode in models}
    for _ in range(steps):
        for mode, model in models.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            step(model, optimizers[mode], batch, bf16)
            wall[mode].append(time.perf_counter() - start)
            cpu[mode].append(time.process_time() - start_cpu)
    return [
        {
            "mode": mode,
            "precision": precision,
            "step_s_median": round(statistics.median(wall[mode]), 3),
            "step_cpu_s_median": round(statistics.median(cpu[mode]), 3),
            "step_s": [round(t, 3) for t in wall[mode]],
            "activations_mib": round(kept[mode] / 2**20, 1),
            "batch": f"{BATCH}x{LENGTH}",
            "lora_r": RANK,
            "threads": torch.get_num_threads(),
        }
        for mode in models
    ]


def seeded_batch(vocab: int) -> dict[str, Any]:
    ids = torch.randint(0, vocab, (BATCH, LENGTH), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids, "use_cache": False}


def cpu_name() -> str:
    """The CPU model, as the timings depend on it (and on bf16 support: avx512_bf16, AMX)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1, help="timed steps per case, after one untimed")
    parser.add_argument("--precision", choices=["bf16-autocast", "fp32"], nargs="+", default=["bf16-autocast", "fp32"])
    parser.add_argument("--mode", choices=list(MODES), nargs="+", default=list(MODES))
    args = parser.parse_args()
    start = time.perf_counter()
    torch.set_num_threads(1)
    model_path = source_room.resolve_model_path(ModelConfig(path=MODEL))
    print(json.dumps({"cpu": cpu_name(), "torch": torch.__version__, "loadavg": os.getloadavg()}), flush=True)
    models = {mode: build(model_path, mode) for mode in args.mode}
    for precision in args.precision:
        for case in measure(models, precision, args.steps):
            print(json.dumps(case), flush=True)
    print(json.dumps({"wall_s": round(time.perf_counter() - start, 1), "loadavg": os.getloadavg()}), flush=True)


if __name__ == "__main__":
    main()
