"""Fault-tolerant DiLoCo (torchft) across two hosts: one site lost and back, against a run without failures.

    python benchmarks/diloco/diloco_ft.py                 # as root; appends to RESULTS.md
    python benchmarks/diloco/diloco_ft.py --steps 120 --kill-at 30 --return-at 60 --no-record

Two hosts are two network namespaces joined by a veth pair (`namespace_hosts` of tests/e2e/test_multihost.py),
each a site of 2 processes under its own `trainyard launch` (diloco.fault_tolerant, gloo over the veth; site 0's
launch hosts the lighthouse). The job is configs/scratch-stdlib.yaml (a 3.2M-parameter Llama on stdlib code and
pydoc text). Run 1 has no failure. Run 2 is the same job, except that site 1's launch is SIGKILLed once site 0 has
logged step --kill-at, and started again (fresh: no checkpoint) once site 0 has logged step --return-at; it heals
from site 0 at site 0's next sync and both go on to --steps.

Reported, from the sites' train events (times and cumulative tokens): each phase's tokens/s of site 0 and of the
job (the sites present), with both sites, while site 1 is gone and after it returned; the steps site 0 lost
(steps it should have logged and did not, or logged twice); the loss of site 0 at the end of run 2 against run 1 at
equal job tokens (the train loss averaged over --loss-window logged steps). Not run by the test suite.
"""

from __future__ import annotations

import argparse
import json
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
    kill_tree,
    last_step,
    launch_logged,
    namespace_hosts,
    wait_until,
    written_events,
)


JOB = [
    "configs/scratch-stdlib.yaml", "train.total_tokens=null", "train.micro_batch_size=4", "eval.at_end=false",
    "eval.every_steps=0", "checkpoint.at_end=false", "checkpoint.every_steps=0", "checkpoint.every_minutes=0",
    "log.every_steps=1", "log.tensorboard=false", "log.progress=false", "dist.desync_check_steps=0",
    "dist.strategy=diloco", "diloco.fault_tolerant=true", "diloco.sites=2",
]
LIGHTHOUSE = f"{HOST_ADDRESSES[0]}:29950"
RUN_TIMEOUT_S = 3600


def launch(host: Host, site: int, args: list[str], log: Path) -> subprocess.Popen[bytes]:
    """One site's `trainyard launch` in its host's namespace; its output to a file."""
    flags = ["--nnodes", "1", "--node-rank", "0", "--master", f"{host.address}:{29900 + site}", "--nproc", "2"]
    site_args = [f"diloco.site={site}", f"diloco.lighthouse={LIGHTHOUSE}", *(["--lighthouse"] if site == 0 else [])]
    return launch_logged(host, [*args, *flags, *site_args], log, new_session=True)


def wait_for(run_dir: Path, step: int, site: subprocess.Popen[bytes], log: Path) -> None:
    wait_until(f"site 0's step {step}", lambda: last_step(run_dir) >= step, site, log, RUN_TIMEOUT_S)


def run(hosts: tuple[Host, Host], out: Path, steps: int, fail: tuple[int, int] | None) -> dict[str, Any]:
    """Both sites to `steps`; with `fail`, site 1 is lost at site 0's first step and back at its second."""
    out.mkdir(parents=True)
    args = [*JOB, f"output_dir={out}", f"train.max_steps={steps}"]
    dirs = [out / "scratch-stdlib" / f"site-{s}" for s in range(2)]
    sites = [launch(host, s, args, out / f"site-{s}.out") for s, host in enumerate(hosts)]
    marks: dict[str, float] = {}
    if fail is not None:
        wait_for(dirs[0], fail[0], sites[0], out / "site-0.out")
        kill_tree(sites[1])  # the launch, its agent and workers at once, as a lost host
        marks["killed"] = time.time()
        wait_for(dirs[0], fail[1], sites[0], out / "site-0.out")
        sites[1] = launch(hosts[1], 1, args, out / "site-1.out")
        marks["restarted"] = time.time()
    codes = [site.wait(timeout=RUN_TIMEOUT_S) for site in sites]
    if any(codes):
        raise SystemExit(f"a site failed (exit codes {codes}): see {out}")
    return {"events": [written_events(d) for d in dirs], "marks": marks}


def rate(train: list[dict[str, Any]], low: float, high: float) -> float | None:
    """Tokens per second over the train events logged between two times."""
    inside = [e for e in train if low <= e["time"] <= high]
    if len(inside) < 2:
        return None
    return (inside[-1]["tokens"] - inside[0]["tokens"]) / (inside[-1]["time"] - inside[0]["time"])


def phases(result: dict[str, Any]) -> dict[str, tuple[float | None, float | None]]:
    """(site 0's, the job's) tokens/s with both sites, while site 1 is gone, after it returned (its heal)."""
    train = [[e for e in site if e["kind"] == "train"] for site in result["events"]]
    healed = next(e["time"] for e in result["events"][1] if e.get("event") == "healed")
    bounds = {"both sites": (train[0][1]["time"], result["marks"]["killed"]),
              "site 1 gone": (result["marks"]["killed"], healed), "after the return": (healed, train[0][-1]["time"])}
    figures = {}
    for name, (low, high) in bounds.items():
        own = rate(train[0], low, high)
        other = rate(train[1], low, high) if name != "site 1 gone" else 0.0
        figures[name] = (own, own + other if own is not None and other is not None else None)
    return figures


def trained_tokens(site: list[dict[str, Any]]) -> int:
    """The tokens a site trained over all its lives (a restarted site counts from 0 again)."""
    total, last = 0, 0
    for event in (e for e in site if e["kind"] == "train"):
        total += event["tokens"] - last if event["tokens"] >= last else event["tokens"]
        last = event["tokens"]
    return total


def mean_loss(train: list[dict[str, Any]], window: int) -> float:
    return sum(e["loss"] for e in train[-window:]) / len(train[-window:])


def loss_at(train: list[dict[str, Any]], tokens: float, window: int) -> float:
    """Site 0's train loss over `window` logged steps up to the job's `tokens` (both sites' tokens, each site's
    event counting its own: run 1's job tokens are twice site 0's)."""
    upto = [e for e in train if e["tokens"] * 2 <= tokens] or train[:1]
    return mean_loss(upto, window)


def report(clean: dict[str, Any], failed: dict[str, Any], args: argparse.Namespace) -> list[str]:
    train0 = [e for e in failed["events"][0] if e["kind"] == "train"]
    steps = [e["step"] for e in train0]
    lost = (args.steps - len(set(steps))) + (len(steps) - len(set(steps)))
    job_tokens = sum(trained_tokens(site) for site in failed["events"])
    clean_trains = [[e for e in site if e["kind"] == "train"] for site in clean["events"]]
    clean_rates = [rate(train, train[1]["time"], train[-1]["time"]) or 0.0 for train in clean_trains]
    lines = ["| run, phase | site 0 tokens/s | job tokens/s (sites present) |", "|---|---:|---:|",
             f"| run 1 (no failure), whole run | {clean_rates[0]:,.0f} | {sum(clean_rates):,.0f} |"]
    for name, (own, job) in phases(failed).items():
        lines.append(f"| run 2, {name} | {own or 0:,.0f} | {job or 0:,.0f} |")
    healed = next(e["step"] for e in failed["events"][1] if e.get("event") == "healed")
    lines += [
        "",
        f"- steps site 0 lost or repeated in run 2: {lost} (of {args.steps})",
        f"- site 1 healed at site 0's step {healed}; job tokens: run 2 {job_tokens:,}, run 1 "
        f"{sum(trained_tokens(site) for site in clean['events']):,}",
        f"- site 0's train loss, mean of the last {args.loss_window} logged steps: run 2 "
        f"{mean_loss(train0, args.loss_window):.4f}; run 1 at equal job tokens "
        f"{loss_at(clean_trains[0], job_tokens, args.loss_window):.4f}; run 1 at equal steps "
        f"{mean_loss(clean_trains[0], args.loss_window):.4f}",
    ]
    return lines


def record(lines: list[str], args: argparse.Namespace) -> None:
    text = [
        *results_head("Fault-tolerant DiLoCo (torchft): a site lost and back"),
        "- the machine was shared with other jobs while it ran (timings are indicative)",
        "- 2 network namespaces joined by a veth pair (no shaping), one site of 2 processes each under its own "
        "`trainyard launch` (gloo over the veth; site 0's launch hosts the lighthouse); configs/scratch-stdlib.yaml, "
        f"micro 4, {args.steps} steps, diloco.sync_every {args.sync_every}",
        f"- run 2: site 1 SIGKILLed after site 0's step {args.kill_at}, started again (fresh) after its step "
        f"{args.return_at}",
        "", *lines, "",
        f"Command: `python benchmarks/diloco/diloco_ft.py --steps {args.steps} --sync-every {args.sync_every} "
        f"--kill-at {args.kill_at} --return-at {args.return_at}` (as root).", "", "",
    ]
    append_results(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--sync-every", type=int, default=10)
    parser.add_argument("--kill-at", type=int, default=50)
    parser.add_argument("--return-at", type=int, default=100)
    parser.add_argument("--loss-window", type=int, default=20)
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("--clean-from", type=Path, help="reuse run 1 from this earlier no-failure output dir")
    args = parser.parse_args()
    JOB.append(f"diloco.sync_every={args.sync_every}")
    out_root = REPO / "runs" / "benchmarks" / f"diloco-ft-{time.strftime('%Y%m%d-%H%M%S')}"
    JOB.append(f"data.shards_dir={out_root / 'shards'}")  # prepared once here, not by both sites at once
    prepared = subprocess.run([sys.executable, "-m", "trainyard.cli", "prepare", *JOB, "diloco.site=0"], cwd=REPO,
                              check=False)
    if prepared.returncode:
        raise SystemExit("trainyard prepare failed")
    with namespace_hosts() as hosts:
        clean = (run(hosts, out_root / "no-failure", args.steps, None) if args.clean_from is None else
                 {"events": [written_events(args.clean_from / "scratch-stdlib" / f"site-{s}") for s in range(2)]})
        failed = run(hosts, out_root / "site-1-lost", args.steps, (args.kill_at, args.return_at))
    (out_root / "results.json").write_text(json.dumps({"clean": clean, "failed": failed}))
    lines = report(clean, failed, args)
    print("\n".join(lines))
    if not args.no_record:
        record(lines, args)


if __name__ == "__main__":
    main()
