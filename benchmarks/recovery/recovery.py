"""Time from a host's death to the next new training step, split where it goes.

    python benchmarks/recovery/recovery.py                              # as root: tiny + SmolLM2 LoRA, 3 trials each
    python benchmarks/recovery/recovery.py --jobs tiny --trials 1 --no-record
    python benchmarks/recovery/recovery.py --elastic                    # host B stays dead: --nnodes 1:2 goes on alone

Two hosts are two network namespaces joined by a veth pair (`namespace_hosts` of tests/e2e/test_multihost.py),
each a node of 2 processes under `trainyard launch --rdzv c10d --max-restarts 3`, checkpointing every few steps.
Mid-run every process of host B (its launcher too) gets SIGKILL; the benchmark then starts host B's launch again
at once, as a scheduler restarting the node would (or, with --elastic, never). Each trial is split as:

- detection: the kill -> host A's agent sees its worker group fail (its "Worker group FAILED" log line);
- rendezvous: -> the agents' next rendezvous completes ("Rendezvous complete");
- startup: -> the workers have started, joined the process group and built the job (resumed event - load_s);
- load: the checkpoint load itself (the resumed event's load_s);
- redone: -> the first step after the last one trained before the kill (steps since the checkpoint, redone).

Not run by the test suite; no assertions. Writes under runs/benchmarks/recovery-<time>/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # the shared helpers

from bench_env import append_results, results_head  # noqa: E402
from netns_hosts import (  # noqa: E402
    HOST_ADDRESSES,
    REPO,
    Host,
    kill_namespace_processes,
    last_step,
    launch_logged,
    namespace_hosts,
    wait_until,
    written_events,
)


COMMON = [
    "eval.every_steps=0", "eval.at_end=false", "eval.baseline=false", "checkpoint.at_end=false",
    "checkpoint.every_minutes=0", "log.every_steps=1", "log.tensorboard=false", "log.progress=false",
    "dist.desync_check_steps=0", "train.max_steps=100000",
]
JOBS: dict[str, dict[str, Any]] = {
    # (overrides, checkpoint every N steps, steps trained before the kill at least)
    "tiny": {"args": ["configs/tiny.yaml", "train.global_batch_size=32", "checkpoint.every_steps=10"],
             "every": 10, "kill_after": 15},
    "smollm2-lora": {"args": ["quickstart", "train.micro_batch_size=2", "train.global_batch_size=8",
                              "data.synthetic_train_size=400", "checkpoint.every_steps=3"],
                     "every": 3, "kill_after": 4},
}
PARTS = ("detection", "rendezvous", "startup", "load", "redone")
GLOG = re.compile(r"^[IWE](\d{4}) (\d\d:\d\d:\d\d\.\d+) +\d+ [^\]]*\] (.*)$")
WAIT_S = 900


def launch(host: Host, log: Path, args: list[str]) -> subprocess.Popen[bytes]:
    """`trainyard launch` in the host's namespace, its output into a file, at log level INFO: the agent's times."""
    return launch_logged(host, args, log, env={"LOGLEVEL": "INFO"})


def glog_lines(log: Path) -> list[tuple[float, str]]:
    """(epoch seconds, message) of torch's agent log lines (glog format: month-day and local time, no year)."""
    year = datetime.date.today().year
    lines = []
    for line in log.read_text(errors="replace").splitlines():
        found = GLOG.match(line)
        if found:
            stamp = datetime.datetime.strptime(f"{year}{found[1]} {found[2]}", "%Y%m%d %H:%M:%S.%f")
            lines.append((stamp.timestamp(), found[3]))
    return lines


def first_after(lines: list[tuple[float, str]], since: float, text: str) -> float:
    return next(stamp for stamp, message in lines if stamp >= since and text in message)


def trial(job: str, index: int, out: Path, elastic: bool, extra: list[str]) -> dict[str, Any]:
    """One kill and recovery; returns the parts in seconds."""
    spec = JOBS[job]
    out_dir = out / f"{job}-{index}"
    out_dir.mkdir(parents=True)
    run_dir = out_dir / ("tiny" if job == "tiny" else "quickstart")
    logs = [out_dir / "launch-a.log", out_dir / "launch-b.log"]
    where = ["--rdzv", "c10d", "--rdzv-id", f"recovery-{job}-{index}", "--master", f"{HOST_ADDRESSES[0]}:29960",
             "--nnodes", "1:2" if elastic else "2", "--nproc", "2", "--max-restarts", "3", *extra]
    args = [*spec["args"], *COMMON, f"output_dir={out_dir}", *where]
    with namespace_hosts() as hosts:
        nodes = [launch(host, log, [*args, "--node-rank", str(rank)])
                 for rank, (host, log) in enumerate(zip(hosts, logs, strict=True))]
        wait_until(f"step {spec['kill_after']}", lambda: last_step(run_dir) >= spec["kill_after"], nodes[0], logs[0],
                   WAIT_S)
        time.sleep(0.1)
        last = last_step(run_dir)
        killed = time.time()
        kill_namespace_processes(hosts[1].namespace)
        if not elastic:
            nodes[1] = launch(hosts[1], logs[1], [*args, "--node-rank", "1"])

        def first_new() -> dict[str, Any] | None:
            """The first step past `last` trained after the resume (one logged before it finished before the kill)."""
            found = written_events(run_dir)
            starts = [i for i, e in enumerate(found) if e.get("event") == "resumed" and e["time"] > killed]
            later = found[starts[0]:] if starts else []
            return next((e for e in later if e["kind"] == "train" and e["step"] > last), None)

        new = wait_until("a new step after the kill", first_new, nodes[0], logs[0], WAIT_S)
        for host in hosts:
            kill_namespace_processes(host.namespace)
    resumed = next(e for e in written_events(run_dir) if e.get("event") == "resumed" and e["time"] > killed)
    agent = glog_lines(logs[0])
    failed = first_after(agent, killed, "Worker group FAILED")
    rendezvous = first_after(agent, failed, "Rendezvous complete")
    load_start = resumed["time"] - resumed["load_s"]
    return {
        "job": job, "trial": index, "total": new["time"] - killed, "detection": failed - killed,
        "rendezvous": rendezvous - failed, "startup": load_start - rendezvous, "load": resumed["load_s"],
        "redone": new["time"] - resumed["time"], "redone_steps": last - resumed["step"],
        "world": resumed.get("world_size"), "accumulation": resumed["accumulation"],
    }


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| job | trial | kill -> next new step | detection | rendezvous | startup | load | redone (steps) "
             "| world after |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        parts = " | ".join(f"{r[p]:.1f}" for p in PARTS[:-1])
        lines.append(f"| {r['job']} | {r['trial']} | {r['total']:.1f} | {parts} | {r['redone']:.1f} "
                     f"({r['redone_steps']}) | {r['world']} |")
    for job in dict.fromkeys(r["job"] for r in rows):
        mine = [r for r in rows if r["job"] == job]
        medians = " | ".join(f"{statistics.median(r[p] for r in mine):.1f}" for p in ("total", *PARTS))
        lines.append(f"| {job} | median | {medians} | |")
    return lines


def record(rows: list[dict[str, Any]], title: str, note: str) -> None:
    append_results([*results_head(title), f"- {note}", "", *table(rows), "", ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", nargs="*", choices=list(JOBS), default=list(JOBS))
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--elastic", action="store_true", help="--nnodes 1:2 and host B is not restarted")
    parser.add_argument("--launch-arg", action="append", default=[], help="extra `trainyard launch` argument")
    parser.add_argument("--title", default="Recovery from a killed host")
    parser.add_argument("--note", default="2 namespace hosts x 2 processes, c10d, --max-restarts 3")
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    out = REPO / "runs" / "benchmarks" / f"recovery-{time.strftime('%Y%m%d-%H%M%S')}"
    rows = []
    for job in args.jobs:
        for index in range(1, args.trials + 1):
            rows.append(trial(job, index, out, args.elastic, args.launch_arg))
            print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in rows[-1].items()}),
                  flush=True)
    (out / "rows.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(table(rows)))
    if not args.no_record:
        record(rows, args.title, args.note)


if __name__ == "__main__":
    main()
