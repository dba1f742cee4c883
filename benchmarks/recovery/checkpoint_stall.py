"""How long lite, synchronous full and asynchronous full checkpoints stall training.

    python benchmarks/recovery/checkpoint_stall.py               # waits for a quiet machine, runs, records
    python benchmarks/recovery/checkpoint_stall.py --only tiny-lora-sync --no-wait --no-record

Six 2-process CPU runs (about 4 minutes on 2 cores): the tiny config and the real
SmolLM2-135M-Instruct, LoRA with lite + full checkpoints, sync and async, and full
fine-tuning with `checkpoint.save_frozen: true` (every weight and AdamW moment), sync and async.

Two figures per checkpoint kind, both from metrics.jsonl:
  stall_s     what the trainer reports: seconds the loop was blocked in the save call
  step delta  (time between the train events of step k and k+1) - median step time, for a
              save after step k: the whole cost as the loop sees it (commit, rotation included)
Async saves also report `until commit`: seconds from the save call to its commit, and the
excess step time summed over the steps that ran while the background write was going on.

Results are printed and appended to benchmarks/RESULTS.md under "Checkpoint stall".
Not run by the test suite; no assertions.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # the shared helpers

from bench_env import REPO, append_results, loadavg, results_head, wait_for_quiet  # noqa: E402


TINY = [
    "configs/tiny.yaml",
    "lora.enabled=true",
    "train.max_steps=20",
    "checkpoint.every_steps=6",
    "checkpoint.lite_every_steps=3",
]
SMOL = [
    "quickstart",
    "model.gradient_checkpointing=false",
    "data.synthetic_train_size=400",
    "data.synthetic_eval_size=8",
]
RUNS: dict[str, list[str]] = {
    "tiny-lora-sync": TINY,
    "tiny-lora-async": [*TINY, "checkpoint.async=true"],
    "smol-lora-sync": [
        *SMOL,
        "train.micro_batch_size=2",
        "train.global_batch_size=4",
        "train.max_steps=9",
        "checkpoint.every_steps=4",
        "checkpoint.lite_every_steps=2",
    ],
    "smol-lora-async": [
        *SMOL,
        "train.micro_batch_size=2",
        "train.global_batch_size=4",
        "train.max_steps=9",
        "checkpoint.every_steps=4",
        "checkpoint.lite_every_steps=2",
        "checkpoint.async=true",
    ],
    "smol-full-sync": [
        *SMOL,
        "lora.enabled=false",
        "checkpoint.save_frozen=true",
        "train.micro_batch_size=1",
        "train.global_batch_size=2",
        "train.max_steps=7",
        "checkpoint.every_steps=3",
    ],
    "smol-full-async": [
        *SMOL,
        "lora.enabled=false",
        "checkpoint.save_frozen=true",
        "train.micro_batch_size=1",
        "train.global_batch_size=2",
        "train.max_steps=7",
        "checkpoint.every_steps=3",
        "checkpoint.async=true",
    ],
}
COMMON = [
    "log.every_steps=1",
    "log.progress=false",
    "log.tensorboard=false",
    "eval.baseline=false",
    "eval.every_steps=0",
    "eval.at_end=false",
    "checkpoint.at_end=false",
    "checkpoint.keep_last=1",
]


def wait_note(args: argparse.Namespace) -> str:
    """Other jobs on 2 cores would be measured as checkpoint stall: wait for them to end (unless --no-wait)."""
    if args.no_wait:
        return "did not wait (--no-wait)"
    waited, quiet = wait_for_quiet(args.quiet_load, args.max_wait_s)
    state = "below" if quiet else "still at or above"
    return f"1-minute load {state} {args.quiet_load} after {waited:.0f}s of waiting"


def run(name: str, out_dir: Path, nproc: int) -> tuple[Path, float]:
    argv = [
        sys.executable,
        "-m",
        "trainyard.cli",
        "train",
        *RUNS[name],
        f"run_name={name}",
        f"output_dir={out_dir}",
        *COMMON,
        "--nproc",
        str(nproc),
    ]
    print(f"== {name}: trainyard {' '.join(argv[4:])}", flush=True)
    started = time.monotonic()
    with open(out_dir / f"{name}.log", "w") as log:
        code = subprocess.run(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    if code != 0:
        raise SystemExit(f"{name} failed (exit {code}); see {out_dir / f'{name}.log'}")
    return out_dir / name, time.monotonic() - started


def dir_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 1e6


def figures(run_dir: Path) -> dict[str, Any]:
    """Per checkpoint kind: count, stall_s, step delta, until-commit figures, size."""
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = {e["step"]: e["time"] for e in events if e["kind"] == "train"}
    gaps = {k: train[k + 1] - train[k] for k in train if k + 1 in train}
    saves = [e for e in events if e["kind"] == "checkpoint" and "stall_s" in e]
    saved_steps = {e["step"] for e in saves}
    clean = [gap for k, gap in gaps.items() if k >= 2 and k not in saved_steps]
    step_s = statistics.median(clean)
    commits = {e["step"]: e["time"] for e in events if e["kind"] == "checkpoint" and e.get("committed")}
    result: dict[str, Any] = {"step_s": step_s}
    for kind in ("lite", "full"):
        mine = [e for e in saves if e["mode"] == kind and e["step"] in gaps]
        if not mine:
            continue
        row = {
            "count": len(mine),
            "stall_s": statistics.median(e["stall_s"] for e in mine),
            "delta_s": statistics.median(gaps[e["step"]] - step_s for e in mine),
        }
        if any(e.get("async_save") for e in mine):
            row["commit_s"] = statistics.median(commits[e["step"]] - e["time"] for e in mine if e["step"] in commits)
            row["overlap_s"] = statistics.median(
                sum(gap - step_s for k, gap in gaps.items() if e["step"] < k and train[k] < commits.get(e["step"], 0))
                for e in mine
            )
        result[kind] = row
    checkpoints = sorted((run_dir / "checkpoints").glob("step-*"))
    lite = [p / "adapter" for p in checkpoints if json.loads((p / "COMMITTED").read_text())["kind"] == "lite"]
    full = [p for p in checkpoints if json.loads((p / "COMMITTED").read_text())["kind"] == "full"]
    if "lite" in result and lite:
        result["lite"]["mb"] = dir_mb(lite[-1])
    if "full" in result and full:
        result["full"]["mb"] = dir_mb(full[-1])
    return result


def _mb(mb: float | None) -> str:
    return "-" if mb is None else f"{mb:,.0f}" if mb >= 100 else f"{mb:.3g}"


def table(results: dict[str, dict[str, Any]]) -> list[str]:
    lines = [
        "| run | median step (s) | checkpoint | n | size (MB) | stall_s (median) | step delta (s, median) "
        "| async: save→commit (s) | async: excess step time while writing (s) |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, result in results.items():
        for kind in ("lite", "full"):
            row = result.get(kind)
            if row is None:
                continue
            mode = kind if kind == "lite" else ("full async" if "commit_s" in row else "full sync")
            commit = f"{row['commit_s']:.2f}" if "commit_s" in row else "-"
            overlap = f"{row['overlap_s']:.2f}" if "overlap_s" in row else "-"
            lines.append(
                f"| {name} | {result['step_s']:.3f} | {mode} | {row['count']} | {_mb(row.get('mb'))} | "
                f"{row['stall_s']:.3f} | {row['delta_s']:.3f} | {commit} | {overlap} |"
            )
    return lines


def record(lines: list[str], notes: list[str]) -> None:
    header = [
        *results_head("Checkpoint stall"),
        *notes,
        "",
        *lines,
        "",
        "Command: `python benchmarks/recovery/checkpoint_stall.py`; per-run overrides are in the script "
        "(RUNS, COMMON).",
        "",
        "",
    ]
    append_results(header)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", choices=list(RUNS), default=list(RUNS))
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument(
        "--quiet-load", type=float, default=1.0, help="start when the 1-minute load average is below this"
    )
    parser.add_argument("--max-wait-s", type=float, default=600.0)
    parser.add_argument("--no-wait", action="store_true")
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    os.chdir(REPO)
    if any(RUNS[name][0] == "quickstart" for name in args.only):  # convert the GGUF once, untimed
        from trainyard.config import ModelConfig
        from trainyard.model.source import resolve_model_path

        resolve_model_path(ModelConfig(path="builtin:smollm2-135m-instruct"))
    out_dir = REPO / "runs" / "benchmarks" / time.strftime("checkpoint-stall-%Y%m%dT%H%M%SZ", time.gmtime())
    out_dir.mkdir(parents=True)
    waited = wait_note(args)
    load_start, started = loadavg(), time.monotonic()
    results, seconds = {}, {}
    for name in args.only:
        run_dir, seconds[name] = run(name, out_dir, args.nproc)
        results[name] = figures(run_dir)
        shutil.rmtree(run_dir / "checkpoints")  # measured; full fine-tuning leaves GBs behind
        print(json.dumps(results[name]), flush=True)
    notes = [
        f"- {args.nproc} processes per run (DDP), OMP_NUM_THREADS = cores / processes; {waited}",
        (
            f"- load average (1/5/15 min): {load_start} at the start, {loadavg()} at the end; "
            f"{time.monotonic() - started:.0f}s in all ({', '.join(f'{n} {s:.0f}s' for n, s in seconds.items())})"
        ),
    ]
    lines = table(results)
    print("\n".join(lines))
    if not args.no_record:
        record(lines, notes)


if __name__ == "__main__":
    main()
