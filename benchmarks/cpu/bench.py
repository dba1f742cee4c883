"""`make bench`: trainyard vs HF Trainer + PEFT vs TRL SFTTrainer, back to back, one table of ratios.

    python benchmarks/cpu/bench.py                                 # 3 rounds of 12 steps, recorded (~45 min, 2 cores)
    python benchmarks/cpu/bench.py --steps 3 --rounds 1 --no-record   # a quick try
    python benchmarks/cpu/bench.py --only trainyard hf-best

Every row trains SmolLM2-135M-Instruct with LoRA (r=8, alpha=16, dropout 0, q/k/v/o/gate/up/down) on
the same generated alpaca rows (alpaca_data.py; steps x 8 rows, each trained on once), 8 samples per
optimizer step (2 processes x 4, or 2 x 1 x accumulation 4 for hf-seeds), same lr and schedule, with
cores / processes threads each. Rows (see README.md): trainyard (its defaults), hf-seeds, hf-best, trl.
hf-best and trl try their variants (bf16 or fp32, group_by_length, padding-free) in round 1 and keep
the fastest; later rounds run the kept one. Figures are medians over rounds (every second round runs
the rows in reverse order);
MFU is against this machine's measured matmul peak (roofline.py). The table and every miss against
the targets are printed and appended to RESULTS.md (bench_report.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from trainyard.precision import cpu_bf16_units

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # the shared helpers

import alpaca_data  # noqa: E402
import bench_report  # noqa: E402
import roofline  # noqa: E402
from bench_env import LoadSampler, loadavg, wait_for_quiet  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CONFIG = "benchmarks/configs/bench-smollm2.yaml"
SAMPLES_PER_STEP = 8
MAX_LENGTH = 512
ROWS = ("trainyard", "hf-seeds", "hf-best", "trl")


@dataclass
class Run:
    row: str
    variant: dict[str, Any]
    round: int
    argv: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    seconds: float = 0.0
    load: str = ""

    @property
    def label(self) -> str:
        return bench_report.variant_label(self.row, self.variant)

    @property
    def slug(self) -> str:
        """This run's file names: label and round, as plain characters."""
        return re.sub(r"[^A-Za-z0-9_.-]+", "-", self.label).strip("-") + f"-r{self.round + 1}"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run (the first is not timed)")
    parser.add_argument("--rounds", type=int, default=3, help="odd rounds run the rows in reverse; medians shown")
    parser.add_argument("--only", nargs="*", choices=ROWS, default=None, help="run only these rows")
    parser.add_argument("--nproc", type=int, default=2, help="processes per run on a CPU (1 on a GPU)")
    parser.add_argument("--eval-rows", type=int, default=64, help="held-out rows every stack evaluates")
    parser.add_argument("--out", default=None, help="run outputs (default: runs/benchmarks/bench-<utc time>)")
    parser.add_argument("--no-record", action="store_true", help="print only; do not append to RESULTS.md")
    parser.add_argument("--results", default="benchmarks/RESULTS.md")
    parser.add_argument("--quiet-load", type=float, default=1.0, help="start when the 1-minute load is below this")
    parser.add_argument("--max-wait-s", type=float, default=120.0, help="then start anyway, noting the load")
    parser.add_argument("--no-wait", action="store_true")
    parser.add_argument("--trainyard-set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="overrides for the trainyard row (a lever tried against its defaults)")
    return parser.parse_args()


def checkpoint_steps(steps: int) -> tuple[int, int]:
    """(lite_every, full_every): one lite save, then one full save before the last step (steps >= 6)."""
    lite = steps // 3 + 1
    return (lite, 2 * lite) if 2 * lite < steps else (1, 2)


def command(run: Run, ctx: dict[str, Any]) -> list[str]:
    out, steps, nproc = ctx["out"], ctx["steps"], ctx["nproc"]
    if run.row == "trainyard":
        lite, full = checkpoint_steps(steps)
        overrides = [
            f"run_name=trainyard-r{run.round + 1}",
            f"output_dir={out}",
            f"data.path={ctx['train']}",
            f"data.eval_path={ctx['eval']}",
            f"data.cache_dir={out}/cache-r{run.round + 1}",  # cold, like the HF stacks' tokenizing
            f"train.max_steps={steps}",
            f"eval.subset_size={ctx['eval_rows']}",
            f"checkpoint.lite_every_steps={lite}",
            f"checkpoint.every_steps={full}",
        ]
        if nproc == 1:
            overrides.append("dist.strategy=auto")
        overrides += ctx["trainyard_set"]
        return [sys.executable, "-m", "trainyard.cli", "train", CONFIG, "--nproc", str(nproc), *overrides]
    script = "benchmarks/cpu/trl_worker.py" if run.row == "trl" else "benchmarks/cpu/hf_trainer_baseline.py"
    tail = ["--data", ctx["train"], "--eval-data", ctx["eval"], "--steps", str(steps)]
    tail += ["--samples-per-step", str(SAMPLES_PER_STEP), "--out", f"{out}/{run.slug}.json"]
    if run.row != "trl":
        tail += ["--mode", run.row.removeprefix("hf-")]
    if run.variant.get("bf16"):
        tail.append("--bf16")
    if run.variant.get("sampling"):
        tail += ["--sampling", run.variant["sampling"]]
    if run.variant.get("padding_free"):
        tail += ["--padding-free", run.variant["padding_free"]]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    return [*torchrun, script, *tail]


def sample_peak(proc: subprocess.Popen, every_s: float = 0.5) -> int:
    """Wait for proc; the highest VmHWM (peak RSS) seen among its descendants, in bytes."""
    peaks: dict[int, int] = {}
    root = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            for child in root.children(recursive=True):
                try:
                    status = Path(f"/proc/{child.pid}/status").read_text()
                    found = re.search(r"VmHWM:\s+(\d+) kB", status)
                    if found:
                        peaks[child.pid] = max(peaks.get(child.pid, 0), int(found.group(1)) * 1024)
                except OSError:
                    pass
        except psutil.Error:
            pass
        time.sleep(every_s)
    return max(peaks.values(), default=0)


def trainyard_figures(run_dir: Path, started: float) -> dict[str, Any]:
    summary = json.loads((run_dir / "summary.json").read_text())
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [e for e in events if e["kind"] == "train"]
    times, previous = [], 0
    for event in train:  # log.every_steps is 1: one event per step
        times.append((event["tokens"] - previous) / event["tokens_per_s"])
        previous = event["tokens"]
    evals = [e for e in events if e["kind"] == "eval"]
    saves = {e["mode"]: e["stall_s"] for e in reversed([e for e in events if e["kind"] == "checkpoint"])}
    log = (run_dir / "logs" / "rank-0.log").read_text()
    compute = re.search(r"compute (\w+)", log)
    return {
        "tokens_per_s": summary["tokens_per_s"],
        "s_per_step": bench_report.median(times[1:]) if len(times) > 1 else None,
        "launch_s": train[0]["time"] - started,
        "eval_s": evals[-1]["eval_s"] if evals else None,
        "eval_loss": evals[-1].get("eval_loss") if evals else None,
        "lite_s": saves.get("lite"),
        "full_s": saves.get("full"),
        "params": summary["params"],
        "trainable_params": summary["trainable_params"],
        "dtype": compute.group(1) if compute else "fp32",
        "gpu_peak_bytes": max((e.get("peak_memory_bytes") or 0 for e in train), default=0),
        "tokens_real": summary["tokens"],
    }


def worker_figures(result: dict[str, Any], started: float) -> dict[str, Any]:
    return {
        "tokens_per_s": result["tokens_per_s"],
        "s_per_step": result["s_per_step"],
        "launch_s": result["first_step_wall_time"] - started,
        "eval_s": result["eval_s"],
        "eval_loss": result["eval_loss"],
        "lite_s": result["lite_save_s"],
        "full_s": result["full_save_s"],
        "params": result["params"],
        "trainable_params": result["trainable_params"],
        "dtype": "bf16" if result["bf16"] else "fp32",
        "gpu_peak_bytes": result.get("peak_gpu_bytes") or 0,
        "worker_rss_bytes": result["peak_rss_bytes"],
        "tokens_real": result["tokens_real"],
        "tokens_per_s_in_loop": result["tokens_per_s_in_loop"],
        "padding_share": result["padding_share"],
        "padding_free": result.get("padding_free"),
        "padding_free_check": result.get("padding_free_check"),
    }


def execute(run: Run, ctx: dict[str, Any], env: dict[str, str]) -> Run:
    run.argv = command(run, ctx)
    log = REPO / ctx["out"] / f"{run.slug}.log"
    print(f"\n== {run.label} (round {run.round + 1}): {shlex.join(run.argv[1:])}", flush=True)
    run.load = loadavg()
    started = time.time()
    with open(log, "w") as handle:
        proc = subprocess.Popen(run.argv, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT)
        peak = sample_peak(proc)
    run.seconds = time.time() - started
    run.load += f" -> {loadavg()}"
    if proc.returncode != 0:
        run.error = f"exit {proc.returncode}: " + " | ".join(log.read_text().splitlines()[-6:])[-600:]
        print(f"   FAILED ({run.error})", flush=True)
        return run
    try:
        if run.row == "trainyard":
            run.figures = trainyard_figures(REPO / ctx["out"] / f"trainyard-r{run.round + 1}", started)
        else:
            result = json.loads((REPO / ctx["out"] / f"{run.slug}.json").read_text())
            run.figures = worker_figures(result, started)
    except (OSError, ValueError, KeyError, TypeError) as err:
        run.error = f"no result: {err!r}"
        print(f"   FAILED ({run.error})", flush=True)
        return run
    f = run.figures
    if run.variant.get("padding_free") == "check":  # name what the check chose; later rounds skip the check
        run.variant = {**run.variant, "padding_free": "on" if f.get("padding_free") else "off"}
    f["peak_bytes"] = f["gpu_peak_bytes"] if ctx["gpu"] else max(peak, int(f.get("worker_rss_bytes") or 0))
    print(f"   {f['tokens_per_s']:.1f} real tokens/s, {f['s_per_step']:.2f} s/step, launch->step 1 "
          f"{f['launch_s']:.1f}s, eval {f['eval_s']:.1f}s, {run.seconds:.0f}s in all, load {run.load}", flush=True)
    return run


def variant_stages(row: str, gpu: bool) -> list[list[dict[str, Any]]]:
    """Round 1 tries each stage's candidates (relative to the best so far); later rounds run the winner.

    A CPU without bf16 matrix units (avx512_bf16, amx_bf16) runs bf16 products ~10x slower than fp32 ones, so
    there the HF and TRL rows are tried in fp32 only (their best on such a CPU), as trainyard's auto picks."""
    bf16 = gpu or cpu_bf16_units() is not None
    if row == "hf-seeds":
        return [[{"bf16": gpu}]]
    if row == "hf-best":
        if gpu:
            return [[{"bf16": True}]]
        precisions = [{"bf16": True}, {"bf16": False}] if bf16 else [{"bf16": False}]
        return [precisions, [{"sampling": "group_by_length"}]]
    if row == "trl":
        if gpu:
            return [[{"bf16": True, "padding_free": "check"}]]
        if not bf16:
            return [[{"bf16": False, "padding_free": "check"}, {"bf16": False, "padding_free": "off"}]]
        return [[{"bf16": True, "padding_free": "check"}, {"bf16": True, "padding_free": "off"}], [{"bf16": False}]]
    return [[{}]]


def run_row(row: str, round_: int, ctx: dict[str, Any], env: dict[str, str], chosen: dict[str, Any]) -> list[Run]:
    """Round 1: try the variants, keep the fastest in chosen[row]. Later rounds: the kept variant only."""
    if row in chosen:
        return [execute(Run(row, chosen[row], round_), ctx, env)]
    runs: list[Run] = []
    best: Run | None = None
    for stage in variant_stages(row, ctx["gpu"]):
        base = best.variant if best else {}
        for candidate in stage:
            variant = {**base, **candidate}
            tried = [r.variant for r in runs]  # a checked padding-free run is named "on" or "off" once run
            checked = variant.get("padding_free") == "check" and {**variant, "padding_free": "on"} in tried
            if variant in tried or checked:
                continue
            run = execute(Run(row, variant, round_), ctx, env)
            runs.append(run)
            if not run.error and (best is None or run.figures["tokens_per_s"] > best.figures["tokens_per_s"]):
                best = run
    chosen[row] = best.variant if best else runs[0].variant
    for run in runs:
        run.figures["kept"] = run is best
    return runs


def main() -> None:
    args = parse_args()
    os.chdir(REPO)
    import torch

    from trainyard.config import ModelConfig
    from trainyard.model.source import resolve_model_path

    gpu = torch.cuda.is_available()
    nproc = 1 if gpu else args.nproc
    model_path = resolve_model_path(ModelConfig(path="builtin:smollm2-135m-instruct"))
    out = args.out or f"runs/benchmarks/bench-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    (REPO / out).mkdir(parents=True, exist_ok=True)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    data: dict[str, Any] = {}
    for name, rows, seed in (("train", args.steps * SAMPLES_PER_STEP, 1), ("eval", args.eval_rows, 2)):
        generated = alpaca_data.make_rows(rows, seed)
        alpaca_data.write_jsonl(generated, REPO / out / f"{name}.jsonl")
        data[name] = alpaca_data.percentiles(alpaca_data.token_lengths(generated, tokenizer))
        print(f"{name}: {out}/{name}.jsonl, token lengths {json.dumps(data[name])}", flush=True)

    threads = str(max(1, (os.cpu_count() or 1) // nproc))
    env = {**os.environ, "OMP_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false"}
    wait = (0.0, True) if args.no_wait else wait_for_quiet(args.quiet_load, args.max_wait_s)
    load_start = loadavg()
    print("measuring the matmul roofline ...", flush=True)
    peak = roofline.roofline(nproc)
    print(json.dumps(peak), flush=True)
    ctx = {"out": out, "steps": args.steps, "nproc": nproc, "gpu": gpu, "eval_rows": args.eval_rows,
           "train": f"{out}/train.jsonl", "eval": f"{out}/eval.jsonl", "trainyard_set": args.trainyard_set}
    rows = [row for row in ROWS if not args.only or row in args.only]
    executed: list[Run] = []
    chosen: dict[str, Any] = {}
    with LoadSampler() as sampler:
        for round_ in range(args.rounds):
            for row in rows if round_ % 2 == 0 else list(reversed(rows)):
                executed += run_row(row, round_, ctx, env, chosen)
    bench_report.report(
        args=args, executed=executed, chosen=chosen, roofline=peak, data=data, model_path=model_path,
        nproc=nproc, threads=threads, gpu=gpu, wait=wait, load_start=load_start, load_end=loadavg(),
        load_during=sampler.describe(), out=out, repo=REPO,
    )


if __name__ == "__main__":
    main()
