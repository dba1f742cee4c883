"""A whole `trainyard train` run's memory per rank against what it planned (issue 47 item 2).

    python benchmarks/memory/whole_run.py                         # the 0.93B Llama, FSDP2 + LoRA, 2 processes
    python benchmarks/memory/whole_run.py --precision fp32 --steps 4 train.micro_batch_size=2
    python benchmarks/memory/whole_run.py --size 3b --precision bf16-mixed model.quantize=nf4

The ~0.93B Llama of load_memory.py (made once in --folder), the built-in dates rows, LoRA r=16, FSDP2 on 2 processes,
each precision given, launched as a user launches it. `--size 3b`: a 3.02B Llama of the same kind (hidden 3072,
intermediate 8192, 28 layers, 24 heads, 8 KV heads), where the blocks' weights outweigh the ~1 GiB a rank holds
beside them at any size (the runtime, the untied ends, the step), as they do in the models NF4 is for.

What it planned: its log's "planned peak" (the estimate by which `train` and its dry run decide that a job fits, for
the data's largest micro-batch). What ran: every worker's VmHWM (the kernel's RSS high-water mark: imports, load,
steps and the end), read from outside every 0.2 s while it lives, under the malloc the launcher chose, and
summary.json's own peak_memory_bytes. One JSON line per precision; no assertions.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
GIB = 2**30
JOB = ["quickstart", "model.tokenizer=builtin:bytes", "dist.strategy=fsdp", "lora.enabled=true", "lora.r=16",
       "model.gradient_checkpointing=false", "eval.baseline=false", "eval.generate=false",
       "eval.subset_size=16"]
LLAMA_3B = {"hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28, "num_attention_heads": 24,
            "num_key_value_heads": 8}
"""Overrides of load_memory.py's 0.93B Llama for `--size 3b`: 3.02B parameters, 12.1 GB in fp32."""
PLANNED = re.compile(r"planned peak ([\d,]+) MiB a rank")


def arguments(folder: Path, precision: str, steps: int, out: Path, extra: list[str]) -> list[str]:
    return [*JOB, f"model.path={folder}", f"train.precision={precision}", f"train.max_steps={steps}",
            f"output_dir={out}", f"run_name={precision}", *extra]


def planned_peak(run_dir: Path) -> float:
    """What the run planned a rank's peak at, in bytes, from its log."""
    match = PLANNED.search((run_dir / "logs" / "rank-0.log").read_text())
    if match is None:
        raise SystemExit(f"no planned peak in {run_dir / 'logs' / 'rank-0.log'}")
    return float(match[1].replace(",", "")) * 2**20


def train_events(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [event for event in map(json.loads, lines) if event["kind"] == "train"]


def high_water(pid: int) -> int:
    """VmHWM of a live process in bytes (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_and_watch(args: list[str], nproc: int) -> dict[int, int]:
    """Launch the run; every descendant's VmHWM at its last reading, by PID (the workers are the largest)."""
    launcher = subprocess.Popen([sys.executable, "-m", "trainyard.cli", "train", *args, "--nproc", str(nproc)],
                                cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peaks: dict[int, int] = {}
    root = psutil.Process(launcher.pid)
    while launcher.poll() is None:
        try:
            for child in root.children(recursive=True):
                peaks[child.pid] = max(peaks.get(child.pid, 0), high_water(child.pid))
        except psutil.Error:
            pass
        time.sleep(0.2)
    if launcher.returncode:
        raise SystemExit(f"the run exited {launcher.returncode}:\n{launcher.stderr.read()[-3000:]}")
    return peaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=["0.9b", "3b"], default="0.9b")
    parser.add_argument("--folder", type=Path, help="where the model is made once (default: in the temp dir)")
    parser.add_argument("--precision", nargs="+", default=["bf16-mixed", "fp32"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("overrides", nargs="*", help="more config overrides, key=value")
    args = parser.parse_args()
    args.folder = args.folder or Path(tempfile.gettempdir()) / f"trainyard-bench-llama-{args.size}"
    if not (args.folder / "config.json").is_file():
        args.folder.mkdir(parents=True, exist_ok=True)
        shape = ["--shape", json.dumps(LLAMA_3B)] if args.size == "3b" else []
        subprocess.run([sys.executable, str(REPO / "benchmarks" / "memory" / "load_memory.py"), "--make",
                        str(args.folder), *shape], check=True)
    with tempfile.TemporaryDirectory() as tmp:
        for precision in args.precision:
            job = arguments(args.folder, precision, args.steps, Path(tmp), args.overrides)
            started = time.perf_counter()
            peaks = sorted(run_and_watch(job, args.nproc).values(), reverse=True)[: args.nproc]
            run_dir = Path(tmp) / precision
            planned = planned_peak(run_dir)
            summary = json.loads((run_dir / "summary.json").read_text())
            print(json.dumps({
                "precision": precision, "steps": args.steps, "overrides": args.overrides,
                "planned_gib": round(planned / GIB, 3), "measured_gib": [round(p / GIB, 3) for p in peaks],
                "measured_over_planned": [round(p / planned, 3) for p in peaks],
                "summary_peak_over_planned": round(summary["peak_memory_bytes"] / planned, 3),
                "losses": [round(e["loss"], 4) for e in train_events(run_dir)],
                "tokens_per_s": summary["tokens_per_s"],
                "seconds": round(time.perf_counter() - started, 1)}), flush=True)


if __name__ == "__main__":
    main()
