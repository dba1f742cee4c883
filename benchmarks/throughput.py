"""trainyard vs the HF Trainer stack of the field notes, back to back in one invocation.

    python benchmarks/throughput.py                 # waits for a quiet machine, runs, records
    python benchmarks/throughput.py --steps 3 --no-wait --no-record   # a quick try

Every run trains the same SmolLM2-135M-Instruct safetensors folder with the same LoRA
(r=16, alpha=32, every linear projection), on the same builtin:dates rows (the train set is
exactly steps x samples-per-step rows, so each stack consumes every row once), for the same
number of optimizer steps, with 2 processes on the CPU and OMP_NUM_THREADS = cores / 2:

  hf-seeds       benchmarks/hf_trainer_baseline.py --mode seeds: pad to 512, batch 1/device
  hf-tuned       benchmarks/hf_trainer_baseline.py --mode tuned: dynamic padding, batch 4/device
  ty-mb4-gc      trainyard train quickstart, micro 4, global 8, activation checkpointing on
                 (model.gradient_checkpointing=true; the quickstart turns it off)
  ty-mb4         the same without activation checkpointing (HF does not checkpoint by default)
                 -- matched to hf-tuned: same samples per step
  ty-mb1         micro 1, global 2, no checkpointing -- matched to hf-seeds: same samples per step

trainyard runs with eval and the final checkpoint off. The figure compared is real
(non-padding) tokens/s over the steps after the first: summary.json `tokens_per_s` for
trainyard, the same count and the same exclusion for HF (see hf_trainer_baseline.py).

Results are printed as a table and appended to benchmarks/RESULTS.md (date, machine,
commit, commands, load average, figures, and every place trainyard is slower).
No assertions: a benchmark, never run by the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

REPO = Path(__file__).resolve().parent.parent
HF_SCRIPT = "benchmarks/hf_trainer_baseline.py"
EVAL_ROWS = 40  # the quickstart's data.synthetic_eval_size; part of how builtin rows are drawn
MAX_LENGTH = 512


@dataclass
class Run:
    name: str
    stack: str  # "hf" or "trainyard"
    samples_per_step: int
    micro: int
    checkpointing: bool
    what: str
    argv: list[str] = field(default_factory=list)
    shown: str = ""
    result: dict[str, Any] = field(default_factory=dict)
    load_before: str = ""
    load_after: str = ""
    seconds: float = 0.0
    error: str | None = None
    round: int = 0
    out: str = ""  # this run's output folder, relative to the repository


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--steps", type=int, default=12, help="optimizer steps per run (the first is excluded from tokens/s)"
    )
    parser.add_argument("--nproc", type=int, default=2, help="processes per run")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the list this many times, every other round in reverse order (ABBA); medians are reported",
    )
    parser.add_argument(
        "--only", nargs="*", default=None, help="run only these (hf-seeds hf-tuned ty-mb4-gc ty-mb4 ty-mb1)"
    )
    parser.add_argument(
        "--quiet-load", type=float, default=1.0, help="start when the 1-minute load average is below this"
    )
    parser.add_argument("--max-wait-s", type=float, default=1200.0, help="then start anyway, noting the load")
    parser.add_argument("--no-wait", action="store_true", help="do not wait for a quiet machine")
    parser.add_argument("--no-record", action="store_true", help="print only; do not append to RESULTS.md")
    parser.add_argument("--results", default="benchmarks/RESULTS.md", help="file to append to (relative to the repo)")
    parser.add_argument("--out-dir", default=None, help="run outputs (default: runs/benchmarks/throughput-<utc time>)")
    return parser.parse_args()


def sh(command: list[str]) -> str:
    try:
        return subprocess.run(command, check=False, cwd=REPO, capture_output=True, text=True, timeout=30).stdout.strip(
            "\n"
        )
    except (OSError, subprocess.SubprocessError):
        return "(unavailable)"


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def load1() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


class LoadSampler:
    """The 1-minute load average every few seconds while the runs go (they add ~nproc)."""

    def __init__(self, every_s: float = 10.0) -> None:
        import threading

        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(every_s,), daemon=True)

    def _loop(self, every_s: float) -> None:
        while not self._stop.is_set():
            self.samples.append(load1())
            self._stop.wait(every_s)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def describe(self) -> str:
        if not self.samples:
            return "no samples"
        mean = sum(self.samples) / len(self.samples)
        low, high, count = min(self.samples), max(self.samples), len(self.samples)
        return f"min {low:.2f}, mean {mean:.2f}, max {high:.2f} over {count} samples"


def wait_for_quiet(threshold: float, max_wait_s: float) -> tuple[float, bool]:
    """Poll the 1-minute load until it is below threshold; (seconds waited, quiet reached)."""
    started = time.monotonic()
    while True:
        current = load1()
        waited = time.monotonic() - started
        if current < threshold:
            print(f"load {loadavg()} (1-min below {threshold}) after {waited:.0f}s: starting", flush=True)
            return waited, True
        if waited >= max_wait_s:
            print(f"load {loadavg()} still at or above {threshold} after {waited:.0f}s: starting anyway", flush=True)
            return waited, False
        print(f"waiting for a quiet machine: load {loadavg()} ({waited:.0f}s so far)", flush=True)
        time.sleep(20)


def executable(name: str) -> list[str]:
    """The console script next to this interpreter (the venv's), or its module form."""
    script = Path(sys.executable).parent / name
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", {"torchrun": "torch.distributed.run", "trainyard": "trainyard.cli"}[name]]


def plan(args: argparse.Namespace, out_dir: str, round_: int = 0) -> list[Run]:
    steps, nproc = args.steps, args.nproc
    if args.rounds > 1:
        out_dir = f"{out_dir}/round-{round_ + 1}"
    runs = [
        Run(
            "hf-seeds",
            "hf",
            1 * nproc,
            1,
            False,
            "HF Trainer, seed 002 recipe: pad to 512, batch 1/device, labels = input_ids",
        ),
        Run(
            "hf-tuned",
            "hf",
            4 * nproc,
            4,
            False,
            "HF Trainer, dynamic padding (DataCollatorForSeq2Seq), response-only labels, batch 4/device",
        ),
        Run("ty-mb4-gc", "trainyard", 4 * nproc, 4, True, "trainyard quickstart, micro 4, activation checkpointing on"),
        Run(
            "ty-mb4",
            "trainyard",
            4 * nproc,
            4,
            False,
            "trainyard quickstart, micro 4, no activation checkpointing (matches hf-tuned)",
        ),
        Run(
            "ty-mb1",
            "trainyard",
            1 * nproc,
            1,
            False,
            "trainyard quickstart, micro 1, no activation checkpointing (matches hf-seeds)",
        ),
    ]
    if args.only:
        runs = [run for run in runs if run.name in args.only]
    for run in runs:
        run.round, run.out = round_, out_dir
        rows = steps * run.samples_per_step
        if run.stack == "hf":
            mode = run.name.removeprefix("hf-")
            tail = [
                "--nproc-per-node",
                str(nproc),
                HF_SCRIPT,
                "--mode",
                mode,
                "--steps",
                str(steps),
                "--max-length",
                str(MAX_LENGTH),
                "--n-train",
                str(rows),
                "--n-eval",
                str(EVAL_ROWS),
                "--out",
                f"{out_dir}/{run.name}.json",
            ]
            run.argv = [*executable("torchrun"), "--standalone", *tail]
            run.shown = shlex.join(["torchrun", "--standalone", *tail])
        else:
            tail = [
                "train",
                "quickstart",
                "--nproc",
                str(nproc),
                f"run_name={run.name}",
                f"output_dir={out_dir}",
                f"train.max_steps={steps}",
                f"train.micro_batch_size={run.micro}",
                f"train.global_batch_size={run.samples_per_step}",
                f"data.max_length={MAX_LENGTH}",
                f"data.synthetic_train_size={rows}",
                f"data.synthetic_eval_size={EVAL_ROWS}",
                "eval.baseline=false",
                "eval.at_end=false",
                "eval.every_steps=0",
                "checkpoint.at_end=false",
                f"model.gradient_checkpointing={'true' if run.checkpointing else 'false'}",
            ]
            run.argv = [*executable("trainyard"), *tail]
            run.shown = shlex.join(["trainyard", *tail])
    return runs


def trainyard_result(run_dir: Path) -> dict[str, Any]:
    summary = json.loads((run_dir / "summary.json").read_text())
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [e for e in events if e.get("kind") == "train"]
    step_times, previous = [], 0
    for event in train:  # log.every_steps is 1: each event is one step
        tokens = event["tokens"] - previous
        previous = event["tokens"]
        step_times.append(tokens / event["tokens_per_s"] if event.get("tokens_per_s") else None)
    steady = [t for t in step_times[1:] if t is not None]

    def mean(key: str) -> float | None:
        values = [e[key] for e in train[1:] if e.get(key) is not None]
        return sum(values) / len(values) if values else None

    return {
        "tokens_per_s": summary["tokens_per_s"],
        "s_per_step": sum(steady) / len(steady) if steady else None,
        "step_times_s": [round(t, 4) if t is not None else None for t in step_times],
        "tokens_real": summary["tokens"],
        "wall_time_s": summary["wall_time_s"],
        "comm_share": mean("comm_share"),
        "data_wait_share": mean("data_wait_share"),
        "final_train_loss": summary.get("final_train_loss"),
    }


def execute(run: Run, env: dict[str, str]) -> None:
    out_dir = REPO / run.out
    out_dir.mkdir(parents=True, exist_ok=True)
    log = out_dir / f"{run.name}.log"
    run.load_before = loadavg()
    print(f"\n== {run.name}: {run.shown}", flush=True)
    started = time.monotonic()
    with open(log, "w") as handle:
        proc = subprocess.run(run.argv, check=False, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT)
    run.seconds = time.monotonic() - started
    run.load_after = loadavg()
    if proc.returncode != 0:
        tail = log.read_text().splitlines()[-15:]
        run.error = f"exit {proc.returncode}: " + " | ".join(tail)
        print(f"   FAILED ({run.error})", flush=True)
        return
    try:
        if run.stack == "hf":
            run.result = json.loads((out_dir / f"{run.name}.json").read_text())
        else:
            run.result = trainyard_result(out_dir / run.name)
    except (OSError, ValueError, KeyError) as err:
        run.error = f"no result: {err}"
        print(f"   FAILED ({run.error})", flush=True)
        return
    print(
        f"   {run.result['tokens_per_s']:.1f} real tokens/s, {run.result['s_per_step']:.2f} s/step, "
        f"{run.seconds:.0f}s in all, load {run.load_before} -> {run.load_after}",
        flush=True,
    )


def median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def combine(executed: list[Run], rounds: int) -> list[Run]:
    """One Run per name: the median over its successful rounds (itself when rounds is 1)."""
    if rounds == 1:
        return executed
    combined = []
    for name in dict.fromkeys(run.name for run in executed):
        mine = [run for run in executed if run.name == name]
        good = [run for run in mine if not run.error]
        first = mine[0]
        merged = Run(first.name, first.stack, first.samples_per_step, first.micro, first.checkpointing, first.what)
        merged.seconds = sum(run.seconds for run in mine)
        merged.load_before = " / ".join(run.load_before for run in mine)
        merged.load_after = " / ".join(run.load_after for run in mine)
        if not good:
            merged.error = mine[0].error
        else:
            keys = [
                k
                for k, v in good[0].result.items()
                if isinstance(v, int | float) and all(isinstance(r.result.get(k), int | float) for r in good)
            ]
            merged.result = {k: median([r.result[k] for r in good]) for k in keys}
            merged.result["rounds_tokens_per_s"] = [round(r.result["tokens_per_s"], 1) for r in good]
            if len(good) < len(mine):
                merged.result["failed_rounds"] = len(mine) - len(good)
        combined.append(merged)
    return combined


def ratio(run: Run, base: Run | None) -> str:
    if base is None or run.error or base.error:
        return "-"
    return f"{run.result['tokens_per_s'] / base.result['tokens_per_s']:.2f}x"


def table(runs: list[Run]) -> list[str]:
    by_name = {run.name: run for run in runs}
    seeds, tuned = by_name.get("hf-seeds"), by_name.get("hf-tuned")
    lines = [
        "| run | samples/step | act. ckpt | real tokens/s | s/step | vs hf-seeds | vs hf-tuned |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for run in runs:
        if run.error:
            lines.append(
                f"| {run.name} | {run.samples_per_step} | {'on' if run.checkpointing else 'off'} | failed | - | - | - |"
            )
            continue
        lines.append(
            f"| {run.name} | {run.samples_per_step} | {'on' if run.checkpointing else 'off'} | "
            f"{run.result['tokens_per_s']:.1f} | {run.result['s_per_step']:.2f} | "
            f"{ratio(run, seeds)} | {ratio(run, tuned)} |"
        )
    return lines


def verdicts(runs: list[Run]) -> list[str]:
    """Plain sentences: where trainyard is slower than an HF mode, and the matched pairs."""
    by_name = {run.name: run for run in runs}
    lines = []
    matched = [("ty-mb4", "hf-tuned"), ("ty-mb1", "hf-seeds"), ("ty-mb4-gc", "hf-tuned")]
    for ours, theirs in matched:
        a, b = by_name.get(ours), by_name.get(theirs)
        if a is None or b is None or a.error or b.error:
            continue
        r = a.result["tokens_per_s"] / b.result["tokens_per_s"]
        if r < 1.0:
            lines.append(
                f"- MISS: {ours} is slower than {theirs} at the same samples per step: {r:.2f}x "
                f"({a.result['tokens_per_s']:.1f} vs {b.result['tokens_per_s']:.1f} real tokens/s)."
            )
        else:
            lines.append(
                f"- {ours} vs {theirs} (same samples per step): {r:.2f}x "
                f"({a.result['tokens_per_s']:.1f} vs {b.result['tokens_per_s']:.1f} real tokens/s)."
            )
    gc, plain = by_name.get("ty-mb4-gc"), by_name.get("ty-mb4")
    if gc and plain and not gc.error and not plain.error:
        r = gc.result["tokens_per_s"] / plain.result["tokens_per_s"]
        lines.append(
            f"- activation checkpointing costs trainyard {1 - r:.0%} of its throughput here "
            f"(ty-mb4-gc / ty-mb4 = {r:.2f}x): it recomputes every block's forward in the backward pass."
        )
    for run in runs:
        if run.stack != "trainyard" or run.error:
            continue
        for base in ("hf-seeds", "hf-tuned"):
            other = by_name.get(base)
            if other is None or other.error or (run.name, base) in matched:
                continue
            r = run.result["tokens_per_s"] / other.result["tokens_per_s"]
            if r < 1.0:
                lines.append(
                    f"- MISS: {run.name} is slower than {base} ({r:.2f}x), though not at the same samples per step "
                    f"({run.samples_per_step} vs {other.samples_per_step})."
                )
    for run in runs:
        if run.error:
            lines.append(f"- {run.name} FAILED: {run.error}")
    return lines


def machine() -> list[str]:
    import torch

    model_name = next(
        (line.split(":", 1)[1].strip() for line in sh(["lscpu"]).splitlines() if line.startswith("Model name")),
        "unknown",
    )
    gpu = "no GPU" if not torch.cuda.is_available() else f"GPU: {torch.cuda.get_device_name(0)} (not used)"
    return [f"{sh(['nproc'])} CPU cores ({model_name}), {gpu}", "", "```", "$ free -g", sh(["free", "-g"]), "```"]


def versions() -> str:
    import peft
    import torch
    import transformers

    versions = [f"torch {torch.__version__}", f"transformers {transformers.__version__}", f"peft {peft.__version__}"]
    return ", ".join([*versions, f"python {sys.version.split()[0]}"])


def record(
    path: Path,
    args: argparse.Namespace,
    runs: list[Run],
    executed: list[Run],
    env_threads: str,
    date: str,
    wait: tuple[float, bool],
    load_start: str,
    load_end: str,
    load_during: str,
) -> None:
    dirty = bool(sh(["git", "status", "--porcelain", "--untracked-files=no"]))
    commit = sh(["git", "rev-parse", "--short", "HEAD"]) + (" (plus uncommitted changes)" if dirty else "")
    waited, quiet = wait
    load_note = (
        f"1-minute load below {args.quiet_load} after waiting {waited:.0f}s"
        if quiet
        else f"the machine never got quiet: 1-minute load still at or above {args.quiet_load} "
        f"after {waited:.0f}s; ran anyway"
    )
    if args.no_wait:
        load_note = "did not wait for a quiet machine (--no-wait)"
    lines = [
        f"## Throughput vs HF Trainer — {date}",
        "",
        f"- date: {date}",
        f"- machine: {machine()[0]}",
        *machine()[1:],
        f"- commit: {commit}",
        f"- software: {versions()}",
        (
            f"- processes per run: {args.nproc}, OMP_NUM_THREADS={env_threads}; {args.steps} optimizer steps per run; "
            + (f"{args.rounds} rounds, every other one in reverse order, medians shown; " if args.rounds > 1 else "")
            + f"builtin:dates, train rows = steps x samples/step (each row once), {EVAL_ROWS} eval rows held out"
        ),
        f"- load average (1/5/15 min): {load_start} at the start, {load_end} at the end; {load_note}",
        f"- 1-minute load during the runs (every 10 s; the benchmark's own {args.nproc} processes add about "
        f"{args.nproc}): {load_during}",
        "",
        "Real (non-padding) tokens/s over the steps after the first; ratios are trainyard / HF.",
        "",
        *table(runs),
        "",
        "Per run: load average before -> after, wall seconds of the whole command, extra figures.",
        "",
    ]
    for run in runs:
        extra = ""
        if not run.error and run.stack == "hf":
            extra = (
                f"; end-to-end (batch fetch included) {run.result['tokens_per_s_end_to_end']:.1f} tokens/s; "
                f"padded tokens/s {run.result['padded_tokens_per_s']:.1f}"
            )
        elif not run.error:
            cs, dw = run.result.get("comm_share"), run.result.get("data_wait_share")
            extra = (f"; comm share {cs:.1%}" if cs is not None else "") + (
                f"; data wait share {dw:.1%}" if dw is not None else ""
            )
        if not run.error and "rounds_tokens_per_s" in run.result:
            extra += f"; tokens/s per round {run.result['rounds_tokens_per_s']}"
        lines.append(f"- {run.name}: {run.what}; load {run.load_before} -> {run.load_after}; {run.seconds:.0f}s{extra}")
    lines += [
        "",
        "Findings:",
        "",
        *(verdicts(runs) or ["- (no comparable pairs)"]),
        "",
        "Commands (from the repository root):",
        "",
        "```",
    ]
    lines += [f"OMP_NUM_THREADS={env_threads} {run.shown}" for run in executed]
    lines += ["```", "", ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        path.write_text("# Benchmark results\n\nAppended by the scripts in this folder; newest last.\n\n")
    with open(path, "a") as handle:
        handle.write("\n".join(lines))
    print(f"\nappended to {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")


def main() -> None:
    args = parse_args()
    os.chdir(REPO)
    # The model folder is converted once from the GGUF before anything is timed.
    from trainyard.config import ModelConfig
    from trainyard.model import resolve_model_path

    resolve_model_path(ModelConfig(path="builtin:smollm2-135m-instruct"))

    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out_rel = args.out_dir or f"runs/benchmarks/throughput-{stamp}"
    out_dir = REPO / out_rel
    out_dir.mkdir(parents=True, exist_ok=True)
    threads = str(max(1, (os.cpu_count() or 1) // args.nproc))
    env = {**os.environ, "OMP_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false"}
    wait = (0.0, True) if args.no_wait else wait_for_quiet(args.quiet_load, args.max_wait_s)
    date = sh(["date", "-u"])
    load_start = loadavg()
    executed: list[Run] = []
    with LoadSampler() as sampler:
        for round_ in range(args.rounds):
            order = plan(args, out_rel, round_)
            for run in order if round_ % 2 == 0 else reversed(order):
                execute(run, env)
                executed.append(run)
    runs = combine(executed, args.rounds)
    load_end = loadavg()
    print(f"1-minute load during the runs: {sampler.describe()}")

    print("\n" + "\n".join(table(runs)))
    print("\n" + "\n".join(verdicts(runs)))
    if not args.no_record:
        results = Path(args.results)
        record(
            results if results.is_absolute() else REPO / results,
            args,
            runs,
            executed,
            threads,
            date,
            wait,
            load_start,
            load_end,
            sampler.describe(),
        )


if __name__ == "__main__":
    main()
