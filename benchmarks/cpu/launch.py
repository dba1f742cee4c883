"""Launch -> first step and launch -> exit of `trainyard train`, against `import torch`, at two commits.

    python benchmarks/cpu/launch.py                                   # this tree against the issue's commit, 5 trials
    python benchmarks/cpu/launch.py --before 292e8a6 --trials 7 --jobs tiny

Each trial runs, in turn: `python -c "import torch"`, then every job with this tree's code, then with the code of
`--before` (a detached worktree of that commit, run from its folder with its `src` first on PYTHONPATH, so its
workers run it too),
each into a fresh output folder (so each tokenizes its data, as a first run does). Figures per job and tree:
launch -> the first train event's time (`metrics.jsonl`), launch -> exit, and the median's ratio to `import
torch`'s median. Trials alternate the trees' order. Not run by the test suite; no assertions.

Jobs (2 processes, one step, no checkpoint at the end):
- tiny: `configs/tiny.yaml`;
- quickstart: the built-in quickstart as `trainyard train` runs it (SmolLM2-135M, LoRA), baseline eval with
  generation before its first step included, no eval at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # the shared helpers

from bench_env import commit, cpu_description, loadavg  # noqa: E402


REPO = Path(__file__).resolve().parents[2]
JOBS = {
    "tiny": ["configs/tiny.yaml", "train.max_steps=1"],
    "quickstart": ["quickstart", "train.max_steps=1", "eval.at_end=false", "checkpoint.at_end=false"],
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default="edd4f9b", help="the commit to compare with (the issue's: edd4f9b)")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--jobs", nargs="*", choices=list(JOBS), default=list(JOBS))
    return parser.parse_args()


def timed(command: list[str], env: dict[str, str], cwd: Path = REPO) -> float:
    started = time.perf_counter()
    subprocess.run(command, cwd=cwd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - started


def launch(job: str, tree: Path, out: Path) -> dict[str, float]:
    """One 2-process launch of `job` with the code and configs of `tree`: seconds to its first step and to its
    exit."""
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    name = f"{job}-{time.monotonic_ns()}"
    command = [sys.executable, "-m", "trainyard.cli", "train", *JOBS[job], "--nproc", "2", f"output_dir={out}",
               f"run_name={name}"]
    started = time.time()
    exit_s = timed(command, env, cwd=tree)
    events = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines() if line.strip()]
    first = next(event for event in events if event["kind"] == "train")
    return {"first_step_s": first["time"] - started, "exit_s": exit_s}


def main() -> None:
    args = parse_args()
    print(json.dumps({"cpu": cpu_description(), "commit": commit(), "before": args.before, "load": loadavg()}))
    with tempfile.TemporaryDirectory(prefix="launch-") as tmp:
        before_tree = Path(tmp) / "before"
        subprocess.run(["git", "worktree", "add", "--detach", str(before_tree), args.before], cwd=REPO, check=True,
                       capture_output=True)
        trees = {"now": REPO, "before": before_tree}
        figures: dict[str, list[float]] = {}
        try:
            for trial in range(args.trials):
                torch_s = timed([sys.executable, "-c", "import torch"], dict(os.environ))
                figures.setdefault("import_torch_s", []).append(torch_s)
                order = list(trees) if trial % 2 == 0 else list(reversed(trees))
                for job in args.jobs:
                    for tree in order:
                        result = launch(job, trees[tree], Path(tmp) / "out" / f"{tree}-{trial}")
                        for key, value in result.items():
                            figures.setdefault(f"{job}.{tree}.{key}", []).append(value)
                        line = {"trial": trial, "job": job, "tree": tree, "import_torch_s": round(torch_s, 2)}
                        line.update({k: round(v, 2) for k, v in result.items()}, load=loadavg())
                        print(json.dumps(line), flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(before_tree)], cwd=REPO, capture_output=True)
    medians = {key: round(statistics.median(values), 2) for key, values in figures.items()}
    torch_s = medians["import_torch_s"]
    ratios = {key.removesuffix("_s") + "_x": round(value / torch_s, 2) for key, value in medians.items() if "." in key}
    print(json.dumps({"medians": medians, "x_import_torch": ratios, "load_after": loadavg()}))


if __name__ == "__main__":
    main()
