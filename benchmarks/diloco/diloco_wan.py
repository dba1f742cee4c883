"""DDP vs DiLoCo across two hosts joined by a slow link: bytes on the link per step, tokens/s, loss at equal tokens.

    python benchmarks/diloco/diloco_wan.py                      # as root: 100 Mbit/s, H = 50; appends to RESULTS.md
    python benchmarks/diloco/diloco_wan.py --rate 50mbit --sync-every 25 --no-record

Two hosts are two network namespaces joined by a veth pair (`namespace_hosts` of tests/e2e/test_multihost.py),
each a site of 2 processes under `trainyard launch` (gloo over the veth). Both ends of the veth are rate-limited
with `tc qdisc ... tbf` (this kernel has no netem: no added delay). The job is the from-scratch pretraining run
(configs/scratch-stdlib.yaml: a 3.2M-parameter Llama on stdlib code and pydoc text) with the same global batch,
seed and data for both strategies.

Each strategy runs twice, `short` and `long` steps: bytes per optimizer step = (bytes(long) - bytes(short)) /
(extra steps), so startup (rendezvous, the first weight broadcast) cancels out; tokens/s and the loss come from
the long run (steady tokens/s from summary.json; the loss at equal tokens is the mean train loss of the last
`--loss-window` steps of both long runs, which saw the same token stream). Not run by the test suite.
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
from netns_hosts import REPO, Host, namespace_hosts, run_on_both  # noqa: E402


JOB = [
    "configs/scratch-stdlib.yaml", "train.total_tokens=null", "train.micro_batch_size=4", "eval.at_end=false",
    "checkpoint.at_end=false",
    "checkpoint.every_steps=0", "checkpoint.every_minutes=0", "log.every_steps=5", "log.tensorboard=false",
    "log.progress=false", "dist.desync_check_steps=0",
]
NODE_TIMEOUT_S = 1800


def shape(hosts: tuple[Host, Host], rate: str) -> None:
    """A token bucket on both ends of the veth: every byte either way waits for the link's rate."""
    for host in hosts:
        subprocess.run(
            ["ip", "netns", "exec", host.namespace, "tc", "qdisc", "replace", "dev", host.nic, "root", "tbf",
             "rate", rate, "burst", "64kb", "latency", "1s"],
            check=True, capture_output=True, text=True,
        )


def run_once(hosts: tuple[Host, Host], job: list[str], steps: int, out_dir: Path, port: int) -> dict[str, Any]:
    """One 2-site run: the link bytes it caused, its summary and its train events."""
    crossed, seconds, run_dir = run_on_both(hosts, [*job, f"train.max_steps={steps}"], out_dir, port, NODE_TIMEOUT_S)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    train = [event for event in map(json.loads, lines) if event["kind"] == "train"]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"bytes": crossed, "seconds": seconds, "summary": summary, "train": train}


def measure(hosts: tuple[Host, Host], name: str, job: list[str], steps: tuple[int, int], out_root: Path,
            port: int) -> dict[str, Any]:
    short, long = (run_once(hosts, job, count, out_root / f"{name}-{count}", port + i) for i, count in enumerate(steps))
    return {
        "name": name, "steps": steps, "bytes": (short["bytes"], long["bytes"]),
        "per_step": (long["bytes"] - short["bytes"]) / (steps[1] - steps[0]),
        "tokens_per_s": long["summary"]["tokens_per_s"], "tokens": long["summary"]["tokens"],
        "wall_s": long["seconds"], "train": long["train"],
    }


def mean_loss(result: dict[str, Any], window: int) -> float:
    last = result["train"][-1]["step"]
    losses = [event["loss"] for event in result["train"] if event["step"] > last - window]
    return sum(losses) / len(losses)


def table(results: list[dict[str, Any]], window: int) -> list[str]:
    ddp = results[0]
    lines = [
        f"| run | steps short / long | link bytes per step | ÷ DDP | tokens/s (long run) | × DDP | "
        f"mean loss, last {window} steps | vs DDP | wall s (long) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        loss = mean_loss(r, window)
        lines.append(
            f"| {r['name']} | {r['steps'][0]} / {r['steps'][1]} | {r['per_step']:,.0f} | "
            f"{ddp['per_step'] / max(r['per_step'], 1):.1f}x less | {r['tokens_per_s']:,.0f} | "
            f"{r['tokens_per_s'] / ddp['tokens_per_s']:.2f}x | {loss:.4f} | "
            f"{(loss / mean_loss(ddp, window) - 1) * 100:+.1f}% | {r['wall_s']:.0f} |"
        )
    return lines


def record(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    lines = [
        *results_head(f"DDP vs DiLoCo over a {args.rate} link"),
        f"- 2 network namespaces joined by a veth pair shaped with tc tbf {args.rate} (no added delay), "
        "2 processes each (gloo over the veth); configs/scratch-stdlib.yaml, 4096 tokens per global batch (micro 4)",
        f"- DiLoCo: sync_every {args.sync_every}, outer_lr {args.outer_lr}, Nesterov momentum {args.outer_momentum}, "
        "groups node (2 sites), inner ddp",
        "- bytes = tx + rx of one veth end; per step = difference of the short and long runs / extra steps",
        "",
        *table(results, args.loss_window),
        "",
        f"Command: `python benchmarks/diloco/diloco_wan.py --rate {args.rate} --sync-every {args.sync_every} "
        f"--outer-lr {args.outer_lr} --outer-momentum {args.outer_momentum}` (as root).",
        "",
        "",
    ]
    append_results(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--sync-every", type=int, default=50)
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--outer-momentum", type=float, default=0.9)
    parser.add_argument("--ddp-steps", type=int, nargs=2, default=(10, 300))
    parser.add_argument("--diloco-steps", type=int, nargs=2, default=(50, 300))
    parser.add_argument("--loss-window", type=int, default=25)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    out_root = REPO / "runs" / "benchmarks" / f"diloco-wan-{time.strftime('%Y%m%d-%H%M%S')}"
    runs = {
        "ddp": ([*JOB, "dist.strategy=ddp"], tuple(args.ddp_steps)),
        f"diloco H={args.sync_every}": (
            [*JOB, "dist.strategy=diloco", f"diloco.sync_every={args.sync_every}", f"diloco.outer_lr={args.outer_lr}",
             f"diloco.outer_momentum={args.outer_momentum}"],
            tuple(args.diloco_steps),
        ),
    }
    results = []
    with namespace_hosts() as hosts:
        shape(hosts, args.rate)
        for index, (name, (job, steps)) in enumerate(runs.items()):
            results.append(measure(hosts, name, job, steps, out_root, 29800 + 4 * index))
            r = results[-1]
            print(f"{name}: {r['per_step']:,.0f} bytes per step, {r['tokens_per_s']:,.0f} tokens/s", flush=True)
    print("\n".join(table(results, args.loss_window)))
    if not args.no_record:
        record(results, args)


if __name__ == "__main__":
    main()
