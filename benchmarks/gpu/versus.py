"""trainyard at its defaults against HF Trainer at its best, on one GPU, the same tokens and the same FLOP count.

    python benchmarks/gpu/versus.py                         # the three jobs below, ~6-9 minutes on one H100
    python benchmarks/gpu/versus.py --jobs llama-8b-lora    # one job
    python benchmarks/gpu/versus.py --smoke                 # tiny shapes of the same families, on a CPU
    python benchmarks/gpu/versus.py --dry-run --jobs llama-8b-lora   # trainyard's plan for an H100, nothing trained
    python benchmarks/gpu/versus.py --jobs llama-8b-lora llama-1b-full --variants --steps 100 --set train.precision=fp8
                                                            # trainyard alone, with overrides (issue 51's fp8 runs)

The jobs (issue 49 item 6), each built from its config (random init, nothing downloaded), trained on real text:
llama-1b-full (Llama-3.2-1B's shape, full fine-tuning), llama-8b-lora (Llama-3.1-8B's shape, LoRA r=16 on every
linear layer of the blocks) and qwen3-moe-lora (Qwen3-30B-A3B's shape cut to 8 of its 48 layers, LoRA on the
attention and the 128 routed experts; trainyard: lora.moe_adapter=grouped). Vocabularies are the real models'
(128256, 151936): the byte tokenizer uses 262 of the ids, the head costs what a real job's does.

The text: the repository's own documentation (README.md, docs/**/*.md) cut into documents of whole paragraphs,
200-2048 tokens long (log-uniform), one JSONL file per job that both stacks read; exactly steps x rows-per-step rows,
so both train the same documents once. Token ids: trainyard's byte tokenizer (`builtin:bytes`), which the HF worker
loads and encodes rows with from trainyard itself: the same ids and labels.

trainyard: `trainyard train JOB.yaml` under `torchrun --nproc-per-node 1`, the job file holding only what a user sets
for the job (model.path, data, LoRA, steps, rows per micro-batch and per step, lr; eval, checkpoints and the progress
bar off; a train event every step): attention, compile, precision, batching and checkpointing at their defaults.
The weights: each job's model is drawn once on the device from its config (hf_versus_worker.py --save-weights,
bf16 for LoRA's frozen base, fp32 for full fine-tuning) and saved as a model folder that both stacks load, as a
fine-tune loads its checkpoint: the same starting weights (so the first losses agree), and no minute of drawing an
8B model on the host's CPU. The folder goes to /dev/shm where it has room, else the job's folder, and is removed
after the job.
HF Trainer at its best (hf_versus_worker.py, one process per variant): bf16, sdpa, fused AdamW, and either
`flatten` (DataCollatorWithFlattening, padding-free) or `padded` (padded rows, group_by_length); the faster one is
HF's best. Both take the same micro-batch, accumulation, optimizer steps, lr schedule and LoRA.

Figures per run, over the optimizer steps after the first: real (non-padding) tokens/s, MFU (model FLOPs from
trainyard.hardware.training_flops over each step's documents, for the HF model as for trainyard's, over
device_peak_flops; null on a CPU), the peak of torch.cuda.max_memory_allocated (on a CPU: peak RSS), step 1's
seconds (compile and the allocator's first growth), the median step, and launch to the end of step 1; per job the
ratios trainyard / HF's best for tokens/s and peak memory (target: >= 2x at <= 1x). One JSON line per run, then a
markdown table for RESULTS.md. A run that fails or runs out of time prints its error and the rest go on; an HF
variant that runs out of memory runs again with gradient checkpointing (`gradient_checkpointing` says so). Run
outputs go to runs/benchmarks/versus-<utc time>/. No assertions: a benchmark, never run by the test suite.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import yaml
from versus_jobs import JOBS, REPO, SMOKE, Job, documents, job_file, weight_bytes

WORKER = Path(__file__).resolve().parent / "hf_versus_worker.py"
GIB = 2**30
OOM_EXIT = 3
"""hf_versus_worker.py's exit status when the variant ran out of memory."""

VARIANTS = ("flatten", "padded")
RUNNING: set[int] = set()
"""The process groups of the runs going on: stopped with this process (a timeout's SIGTERM reaches only it)."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", nargs="+", default=list(JOBS), choices=list(JOBS))
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS,
                        help="HF Trainer's (none: trainyard alone, e.g. with --set train.precision=fp8)")
    parser.add_argument("--smoke", action="store_true", help="toy shapes on a CPU: the plumbing, not the figures")
    parser.add_argument("--dry-run", action="store_true",
                        help="write each job's files and print trainyard's dry-run plan for --gpu; train nothing")
    parser.add_argument("--gpu", default="h100-80gb", help="the device kind --dry-run plans for")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="trainyard overrides beyond its defaults, e.g. train.micro_batch_tokens=auto (the row's "
                        "`overrides` say so)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps of every job (default: the job's)")
    parser.add_argument("--budget-s", type=float, default=330.0,
                        help="wall-clock limit of the whole benchmark: each run's limit is cut to what is left")
    parser.add_argument("--weights", default="auto",
                        help="where each job's model folder is written, removed after the job: auto (/dev/shm when it "
                        "has room, else the job's folder) or a folder")
    parser.add_argument("--out", default=None, help="the run folder (default runs/benchmarks/versus-<utc time>)")
    return parser.parse_args()


def weights_folder(job: Job, folder: Path, choice: str) -> tuple[Path, str]:
    """Where the job's model folder goes: /dev/shm when it holds 1.3x the weights and the host keeps 2x free, else
    the job's folder; the reason, in words."""
    if choice != "auto":
        return Path(choice) / job.name, "as given"
    import psutil

    needed = weight_bytes(job)
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        free = shutil.disk_usage(shm).free
        if free > 1.3 * needed and psutil.virtual_memory().available > 2 * needed:
            return shm / f"trainyard-versus-{os.getpid()}" / job.name, f"/dev/shm ({needed / GIB:.1f} GiB)"
    free = shutil.disk_usage(folder).free
    return folder / "weights", f"the job's folder on disk ({needed / GIB:.1f} GiB, {free / GIB:.0f} GiB free)"


def remove_weights(weights: Path) -> None:
    """Up to 16 GB (the 8B's bf16 base): the next job needs the room."""
    shutil.rmtree(weights, ignore_errors=True)
    if weights.parent.name.startswith("trainyard-versus-"):
        with contextlib.suppress(OSError):
            weights.parent.rmdir()


def save_weights(job: Job, folder: Path, weights: Path, timeout_s: float) -> str | None:
    """The job's model drawn on the device from its config and saved to `weights`; None, or why it failed."""
    command = [sys.executable, str(WORKER), "--job", str(folder / "job.json"), "--save-weights", str(weights)]
    code, _, wall = launch(command, folder / "weights.log", timeout_s)
    print(json.dumps({"job": job.name, "weights": str(weights), "exit": code, "wall_s": round(wall, 1)}), flush=True)
    if code == 0:
        return None
    return f"{'timed out' if code is None else f'exit {code}'} drawing the weights: {tail(folder / 'weights.log')}"


def environment() -> dict[str, str]:
    """Nothing is downloaded (builtin tokenizer, models from configs): the hub is never asked. One GPU: on a machine
    with more, Trainer in a plain process would spread its batch over all of them (DataParallel)."""
    return {"CUDA_VISIBLE_DEVICES": "0", **os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def launch(command: list[str], log: Path, timeout_s: float,
           extra_env: dict[str, str] | None = None) -> tuple[int | None, float, float]:
    """Run `command` with its output in `log`: (exit status or None on timeout, launch wall time, seconds)."""
    launched, started = time.time(), time.monotonic()
    with open(log, "w") as handle:
        proc = subprocess.Popen(command, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT,
                                env={**environment(), **(extra_env or {})}, start_new_session=True)
        RUNNING.add(proc.pid)
        try:
            code: int | None = proc.wait(timeout=max(timeout_s, 1.0))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its whole session: torchrun and its worker
            proc.wait()
            code = None
        finally:
            RUNNING.discard(proc.pid)
    return code, launched, time.monotonic() - started


def stop(signum: int, frame: object) -> None:
    """On SIGTERM or SIGINT: the run going on stops too (it has a session of its own), and the GPU is free."""
    for group in list(RUNNING):
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
    raise SystemExit(128 + signum)


def tail(log: Path, chars: int = 2500) -> str:
    return log.read_text(errors="replace")[-chars:] if log.is_file() else ""


def trainyard_run(job: Job, folder: Path, weights: Path, timeout_s: float, overrides: list[str]) -> dict[str, Any]:
    """`trainyard train JOB.yaml [overrides]` on one rank; its figures from the run dir's metrics.jsonl and
    summary.json."""
    config = folder / "trainyard.yaml"
    config.write_text(yaml.safe_dump(job_file(job, folder, folder / "docs.jsonl", weights), sort_keys=False))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
               "-m", "trainyard.cli", "train", str(config), *overrides]
    figures: dict[str, Any] = {"job": job.name, "stack": "trainyard", "overrides": overrides}
    code, launched, wall = launch(command, folder / "trainyard.log", timeout_s,
                                  {"TORCH_LOGS": "recompiles,graph_breaks"})
    figures["wall_s"] = round(wall, 1)
    if code != 0:
        why = f"timed out after {timeout_s:.0f}s" if code is None else f"exit {code}"
        return {**figures, "error": f"{why}: {tail(folder / 'trainyard.log')}"}
    run_dir = folder / "trainyard"
    summary = json.loads((run_dir / "summary.json").read_text())
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [e for e in events if e["kind"] == "train"]
    seconds, tokens, previous = [], [], 0
    for event in steps:  # one train event a step (log.every_steps 1): its tokens over its tokens/s are its seconds
        tokens.append(event["tokens"] - previous)
        seconds.append(tokens[-1] / event["tokens_per_s"])
        previous = event["tokens"]
    flops = [e["achieved_flops_per_rank"] * s for e, s in zip(steps, seconds)]
    mfus = [e["mfu"] for e in steps[1:] if e.get("mfu") is not None]
    steady_s = sum(seconds[1:])
    return {
        **figures,
        "tokens_per_s": summary["tokens_per_s"],
        "mfu": sum(m * s for m, s in zip(mfus, seconds[1:])) / steady_s if mfus and steady_s else None,
        "peak_memory_bytes": summary["peak_memory_bytes"],
        "first_step_s": seconds[0] if seconds else None,
        "median_step_s": statistics.median(seconds[1:]) if len(seconds) > 1 else None,
        "launch_to_first_step_s": steps[0]["time"] - launched if steps else None,
        "steps": len(steps),
        "tokens": summary["tokens"],
        "flops_per_token": sum(flops[1:]) / max(sum(tokens[1:]), 1),
        "step_seconds": [round(s, 4) for s in seconds],
        "params": summary["params"],
        "trainable_params": summary["trainable_params"],
        "strategy": summary["strategy"],
        "device": summary["device"],
        "first_loss": summary["first_train_loss"],
        "final_loss": summary["final_train_loss"],
        **what_it_said(folder / "trainyard.log"),
    }


def what_it_said(log: Path) -> dict[str, Any]:
    """What the run's log says of its speed, which only the figures would hide: trainyard's own lines (the plan,
    compile times, a block falling back to eager), and dynamo's recompiles and graph breaks (TORCH_LOGS), counted,
    with the first reasons. The run folders stay on the GPU machine; this comes back in the JSON line."""
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    verbose = [line for line in lines if line.startswith("[rank")]
    recompiles = [line for line in verbose if "Recompiling function" in line]
    breaks = [line for line in verbose if "Graph break" in line]
    reasons = [line.split("] ", 2)[-1][:300] for line in verbose if "guard failure" in line or "Reason:" in line]
    own = [line[:300] for line in lines if not line.startswith("[rank") and line.strip()]
    return {"log": own[:40], "recompiles": len(recompiles), "graph_breaks": len(breaks),
            "recompile_lines": [line.split("] ", 2)[-1][:300] for line in recompiles[:8]], "reasons": reasons[:8]}


def hf_run(job: Job, folder: Path, weights: Path, variant: str, timeout_s: float,
           checkpointing: bool) -> tuple[dict[str, Any], bool]:
    """One HF Trainer variant in its own process: (its figures, whether it ran out of memory)."""
    name = f"hf-{variant}" + ("-checkpointed" if checkpointing else "")
    out = folder / f"{name}.json"
    command = [sys.executable, str(WORKER), "--job", str(folder / "job.json"), "--weights", str(weights),
               "--variant", variant, "--out", str(out), *(["--gradient-checkpointing"] if checkpointing else [])]
    code, launched, wall = launch(command, folder / f"{name}.log", timeout_s)
    figures: dict[str, Any] = {"job": job.name, "stack": f"hf-{variant}", "wall_s": round(wall, 1)}
    if code is None:
        return {**figures, "error": f"timed out after {timeout_s:.0f}s: {tail(folder / f'{name}.log')}"}, False
    if not out.is_file():
        return {**figures, "error": f"exit {code}: {tail(folder / f'{name}.log')}"}, False
    result = json.loads(out.read_text())
    if result.get("first_step_wall_time") is not None:
        result["launch_to_first_step_s"] = result.pop("first_step_wall_time") - launched
    return {**figures, **result}, code == OOM_EXIT


def compare(job: str, ours: dict[str, Any], theirs: list[dict[str, Any]]) -> dict[str, Any]:
    """trainyard against HF's faster variant: the ratios of tokens/s and peak memory, and the issue's target."""
    done = [r for r in theirs if r.get("tokens_per_s")]
    if not ours.get("tokens_per_s") or not done:
        return {"job": job, "versus": None, "why": "a run is missing"}
    best = max(done, key=lambda r: r["tokens_per_s"])
    speed = ours["tokens_per_s"] / best["tokens_per_s"]
    memory = ours["peak_memory_bytes"] / best["peak_memory_bytes"] if best.get("peak_memory_bytes") else None
    return {"job": job, "versus": best["stack"], "tokens_per_s_ratio": round(speed, 3),
            "peak_memory_ratio": round(memory, 3) if memory is not None else None,
            "target_met": speed >= 2.0 and memory is not None and memory <= 1.0}


def shown(value: Any, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def table(runs: list[dict[str, Any]], comparisons: list[dict[str, Any]]) -> str:
    """The markdown table for RESULTS.md: one row a run, the ratios on trainyard's row."""
    ratios = {c["job"]: c for c in comparisons}
    lines = ["| job | stack | tokens/s | MFU | peak GiB | step 1 s | median step s | launch -> step 1 s | "
             "vs HF best (tokens/s, memory) |", "|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        if run.get("error"):
            lines.append(f"| {run['job']} | {run['stack']} | {run['error'].splitlines()[0][:60]} | | | | | | |")
            continue
        stack = run["stack"] + (" (checkpointed)" if run.get("gradient_checkpointing") else "")
        stack += f" ({' '.join(run['overrides'])})" if run.get("overrides") else ""
        ratio = ratios.get(run["job"], {}) if run["stack"] == "trainyard" else {}
        versus = (f"{shown(ratio.get('tokens_per_s_ratio'), '.2f')}x, {shown(ratio.get('peak_memory_ratio'), '.2f')}x"
                  f" ({ratio.get('versus')})" if ratio.get("versus") else "")
        mfu = run.get("mfu")
        lines.append(
            f"| {run['job']} | {stack} | {shown(run.get('tokens_per_s'), ',.0f')} | "
            f"{shown(None if mfu is None else 100 * mfu, '.1f')}{'%' if mfu is not None else ''} | "
            f"{shown((run.get('peak_memory_bytes') or 0) / GIB, '.2f')} | {shown(run.get('first_step_s'), '.2f')} | "
            f"{shown(run.get('median_step_s'), '.3f')} | {shown(run.get('launch_to_first_step_s'), '.1f')} | "
            f"{versus} |")
    return "\n".join(lines)


def dry_run(job: Job, folder: Path, gpu: str, overrides: list[str]) -> None:
    """trainyard's plan for this job on `gpu` (strategy, memory, batching): whether it fits, before a GPU is held."""
    config = folder / "trainyard.yaml"
    weights = folder / "weights"  # the dry run reads its config.json alone
    weights.mkdir(exist_ok=True)
    (weights / "config.json").write_text(json.dumps(job.model_config))
    config.write_text(yaml.safe_dump(job_file(job, folder, folder / "docs.jsonl", weights), sort_keys=False))
    command = [sys.executable, "-m", "trainyard.cli", "train", str(config), *overrides, "--dry-run", "--gpu", gpu,
               "--gpus-per-node", "1"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=environment())
    print(f"== {job.name}: trainyard train --dry-run --gpu {gpu} (exit {done.returncode})")
    print(done.stdout[-6000:], done.stderr[-3000:], sep="\n", flush=True)


def run_job(job: Job, folder: Path, weights: Path, variants: list[str], overrides: list[str],
            left: Callable[[], float]) -> list[dict[str, Any]]:
    """The job's weights drawn once, then trainyard and each HF variant on them, each within the time `left()`
    gives: trainyard's figures first, then HF's (an HF variant out of memory runs again checkpointed)."""
    skipped = "skipped: the time budget is spent"
    failed = save_weights(job, folder, weights, min(120.0, left())) if left() >= 40 else skipped
    if failed:
        stacks = ["trainyard", *(f"hf-{variant}" for variant in variants)]
        runs = [{"job": job.name, "stack": stack, "error": failed} for stack in stacks]
        for run in runs:
            print(json.dumps(run), flush=True)
        return runs
    runs = [trainyard_run(job, folder, weights, min(job.trainyard_timeout_s, left()), overrides) if left() >= 30
            else {"job": job.name, "stack": "trainyard", "error": skipped}]
    print(json.dumps(runs[-1]), flush=True)
    for variant in variants:
        if left() < 20:
            runs.append({"job": job.name, "stack": f"hf-{variant}", "error": skipped})
        else:
            result, out_of_memory = hf_run(job, folder, weights, variant, min(job.hf_timeout_s, left()), False)
            if out_of_memory and left() >= 20:  # where HF needs activation checkpointing to fit at all
                print(json.dumps(result), flush=True)
                result, _ = hf_run(job, folder, weights, variant, min(job.hf_timeout_s, left()), True)
            runs.append(result)
        print(json.dumps(runs[-1]), flush=True)
    return runs


def main() -> None:
    args = parse_args()
    started = time.monotonic()
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    catalogue = SMOKE if args.smoke else JOBS
    out = Path(args.out) if args.out else REPO / "runs" / "benchmarks" / time.strftime(
        "versus-%Y%m%dT%H%M%SZ", time.gmtime())
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(REPO / "benchmarks" / "common"))
    from bench_env import commit, versions

    print(json.dumps({"versus": "start", "smoke": args.smoke, "out": str(out), "commit": commit(),
                      "versions": versions()}), flush=True)
    runs: list[dict[str, Any]] = []
    comparisons: list[dict[str, Any]] = []

    def left() -> float:
        return args.budget_s - (time.monotonic() - started)

    for name in args.jobs:
        job = catalogue[name] if args.steps is None else replace(catalogue[name], steps=args.steps)
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        docs = documents(job.steps * job.rows_per_step, job.min_tokens, job.max_tokens, job.seed)
        (folder / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
        (folder / "job.json").write_text(json.dumps({**asdict(job), "accumulation": job.accumulation,
                                                     "data": str(folder / "docs.jsonl")}, indent=1))
        lengths = sorted(len(d.encode()) + 1 for d in docs)
        print(json.dumps({"job": name, "rows": len(docs), "rows_per_step": job.rows_per_step,
                          "micro_batch_size": job.micro_batch_size, "accumulation": job.accumulation,
                          "steps": job.steps, "tokens": sum(lengths), "median_row": lengths[len(lengths) // 2],
                          "longest_row": lengths[-1]}), flush=True)
        if args.dry_run:
            dry_run(job, folder, args.gpu, args.set)
            continue
        weights, where = weights_folder(job, folder, args.weights)
        try:
            job_runs = run_job(job, folder, weights, args.variants, args.set, left)
        finally:
            remove_weights(weights)
        job_runs[0]["weights"] = where
        comparisons.append(compare(name, job_runs[0], job_runs[1:]))
        print(json.dumps(comparisons[-1]), flush=True)
        runs.extend(job_runs)
    if not args.dry_run:
        print(f"\nversus: {time.monotonic() - started:.0f}s in all\n")
        print(table(runs, comparisons), flush=True)


if __name__ == "__main__":
    main()
