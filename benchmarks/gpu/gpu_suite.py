"""The ~1B Llama full fine-tune of the GPU suite (configs/llama-1b.yaml) on one GPU, once per strategy:
tokens/s, MFU and peak memory, one JSON line per run. The suite asserts only that these are reported.

    python benchmarks/gpu/gpu_suite.py                                   # ddp and fsdp, 12 steps each
    python benchmarks/gpu/gpu_suite.py --strategies fsdp --steps 30 --micro-batch 4
    python benchmarks/gpu/gpu_suite.py --strategies fsdp --set model.attn_implementation=sdpa   # any job override

Each run is `trainyard train configs/llama-1b.yaml` under `torchrun --nproc-per-node 1` (a 1-rank NCCL group),
random init, packed 2048-token rows of builtin:text, bf16-mixed. Figures leave out step 1 (kernel selection and
the allocator's first growth): tokens/s is summary.json's, step time and MFU the medians of the train events
after step 1, peak memory the largest `torch.cuda.max_memory_allocated` they report. Run outputs go to
runs/benchmarks/gpu-suite-<utc time>/. No assertions: a benchmark, never run by the test suite.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "llama-1b.yaml"


def run(strategy: str, steps: int, micro_batch: int, out: Path, overrides: list[str]) -> dict[str, Any]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
               "-m", "trainyard.cli", "train", str(CONFIG), f"output_dir={out}", f"dist.strategy={strategy}",
               "train.precision=bf16-mixed", f"train.max_steps={steps}", f"train.micro_batch_size={micro_batch}",
               *overrides]
    started = time.monotonic()
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    figures: dict[str, Any] = {"strategy": strategy, "steps": steps, "micro_batch": micro_batch,
                               "overrides": overrides, "wall_s": round(time.monotonic() - started, 1)}
    if result.returncode != 0:
        return {**figures, "error": f"exit {result.returncode}: {result.stderr[-2000:]}"}
    run_dir = out / "llama-1b"
    summary = json.loads((run_dir / "summary.json").read_text())
    job = yaml.safe_load((run_dir / "config.yaml").read_text())
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = [e for e in events if e["kind"] == "train" and e["step"] > 1]
    mfus = [e["mfu"] for e in steady if e["mfu"] is not None]  # null on a device without a listed peak
    seconds = [(e["tokens"] - before["tokens"]) / e["tokens_per_s"]
               for before, e in zip(events, events[1:]) if e in steady and before["kind"] == "train"]
    return {
        **figures,
        "device": summary["device"],
        "params": summary["params"],
        "seq_len": job["data"]["max_length"],
        "tokens_per_s": summary["tokens_per_s"],
        "s_per_step": round(statistics.median(seconds), 4) if seconds else None,
        "step_seconds": [round(s, 3) for s in seconds],  # summary's tokens/s is their mean's: a slow step shows here
        "mfu": statistics.median(mfus) if mfus else None,
        "peak_memory_gib": max(e["peak_memory_bytes"] for e in steady) / 2**30,
        "torch": summary["torch"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", nargs="+", default=["ddp", "fsdp"], choices=["ddp", "fsdp", "hsdp"])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a job override (repeatable)")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2: step 1 is left out of the figures")
    out_dir = REPO / "runs" / "benchmarks" / time.strftime("gpu-suite-%Y%m%dT%H%M%SZ", time.gmtime())
    for strategy in args.strategies:
        print(json.dumps(run(strategy, args.steps, args.micro_batch, out_dir / strategy, args.set)), flush=True)


if __name__ == "__main__":
    main()
