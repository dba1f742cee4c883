"""Expert LoRA on one CUDA GPU: the grouped low-rank products (`lora.moe_adapter=grouped`) against PEFT's fold
(`peft`), the job of benchmarks/moe/moe_lora.py (configs/tiny-moe.yaml at GLM-4.5-Air's shape / 8: 128 routed experts,
8 per token, hidden 512) on one rank, with micro-batches sized for a GPU. Needs CUDA.

    python benchmarks/moe/moe_lora_cuda.py                                 # bf16-mixed and fp32, 20 steps each way
    python benchmarks/moe/moe_lora_cuda.py --precisions bf16-mixed --steps 40 --micro-batch 32

Figures per run: real tokens/s (summary.json), the median step after the first, the largest
`torch.cuda.max_memory_allocated` the train events report, and the largest relative loss difference between the
two adapters (same seed and data: equal up to rounding). `torch._grouped_mm` runs on sm90 and newer; elsewhere
transformers' fallback (a loop of matmuls over the experts) computes the grouped path, which the line's
`capability` shows. One JSON line per run and per comparison; RESULTS.md holds the recorded run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from moe_lora import SHAPE

REPO = Path(__file__).resolve().parents[2]
MODES = ("peft", "grouped")


def train(mode: str, precision: str, steps: int, micro_batch: int, out: Path) -> dict[str, Any]:
    overrides = [f"{key}={value}" for key, value in SHAPE.items()] + [
        f"lora.moe_adapter={mode}", "lora.r=16", "lora.alpha=32", f"train.precision={precision}",
        f"train.max_steps={steps}", f"train.micro_batch_size={micro_batch}", "eval.every_steps=0",
        "checkpoint.every_steps=0", "log.every_steps=1", f"output_dir={out}", f"run_name={mode}",
    ]
    command = [sys.executable, "-m", "trainyard.cli", "train", "src/trainyard/configs/tiny-moe.yaml", *overrides,
               "--nproc", "1"]
    started = time.perf_counter()
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    figures: dict[str, Any] = {"mode": mode, "precision": precision, "micro_batch": micro_batch,
                               "wall_s": round(time.perf_counter() - started, 1)}
    if result.returncode != 0:
        return {**figures, "error": f"exit {result.returncode}: {result.stderr[-3000:]}"}
    run_dir = out / mode
    summary = json.loads((run_dir / "summary.json").read_text())
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps_logged = [e for e in events if e["kind"] == "train"]
    seconds, previous = [], 0
    for event in steps_logged:
        seconds.append((event["tokens"] - previous) / event["tokens_per_s"])
        previous = event["tokens"]
    return {
        **figures, "tokens_per_s": round(summary["tokens_per_s"], 1),
        "s_per_step": round(statistics.median(seconds[1:]), 4),
        "peak_memory_gib": round(max(e["peak_memory_bytes"] for e in steps_logged) / 2**30, 3),
        "losses": [e["loss"] for e in steps_logged],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precisions", nargs="+", default=["bf16-mixed", "fp32"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--micro-batch", type=int, default=16)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA: benchmarks/moe/moe_lora.py measures the CPU")
    print(json.dumps({"device": torch.cuda.get_device_name(0), "capability": torch.cuda.get_device_capability(0),
                      "torch": torch.__version__}), flush=True)
    with tempfile.TemporaryDirectory(prefix="moe-lora-cuda-") as tmp:
        for precision in args.precisions:
            runs = {}
            for mode in MODES:
                runs[mode] = train(mode, precision, args.steps, args.micro_batch, Path(tmp) / precision)
                print(json.dumps({k: v for k, v in runs[mode].items() if k != "losses"}), flush=True)
            if any("error" in run for run in runs.values()):
                continue
            fold, grouped = runs["peft"], runs["grouped"]
            pairs = zip(fold["losses"], grouped["losses"], strict=True)
            print(json.dumps({
                "precision": precision, "speed_x": round(grouped["tokens_per_s"] / fold["tokens_per_s"], 2),
                "peak_memory_x": round(grouped["peak_memory_gib"] / fold["peak_memory_gib"], 2),
                "max_relative_loss_difference": max(abs(a - b) / abs(a) for a, b in pairs),
            }), flush=True)


if __name__ == "__main__":
    main()
