"""Bytes that cross the link between two hosts per optimizer step: FSDP2 vs HSDP (DDP for scale).

    python benchmarks/diloco/hsdp_link_bytes.py                        # as root: runs, prints, appends to RESULTS.md
    python benchmarks/diloco/hsdp_link_bytes.py --only tiny-full-fsdp tiny-full-hsdp --no-record

Two hosts are two network namespaces joined by a veth pair (`namespace_hosts` of
tests/e2e/test_multihost.py), each a node of 2 processes under `trainyard launch` (static
rendezvous, gloo over the veth). Before and after each run the veth's counters are read
(tx_bytes + rx_bytes of one end: every frame either way, headers included). Each setup runs twice,
with a short and a longer step count; (bytes(long) - bytes(short)) / (extra steps) is the link's cost
of one optimizer step, while startup (rendezvous, data preparation, sharding) cancels out.

HSDP's default shard group is a node, so its all-gathers and reduce-scatters stay inside each
namespace and only the all-reduce of gradient shards between the replicas crosses; FSDP2's shard
group spans both hosts, so every all-gather (forward, and again in backward) and reduce-scatter does.
Not run by the test suite; no assertions.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # the shared helpers

from bench_env import append_results, results_head  # noqa: E402
from netns_hosts import REPO, Host, namespace_hosts, run_on_both  # noqa: E402


COMMON = [
    "eval.every_steps=0", "eval.at_end=false", "eval.baseline=false", "checkpoint.at_end=false",
    "checkpoint.every_minutes=0", "log.every_steps=1000", "log.tensorboard=false", "log.progress=false",
    "dist.desync_check_steps=0",
]
# Full fine-tuning of the tiny Llama, 32 samples per step over 4 ranks.
TINY = ["configs/tiny.yaml", "lora.enabled=false", "train.global_batch_size=32"]
# Seed 000's shape in small: LoRA on a real model (SmolLM2-135M-Instruct, fp32, tied embeddings).
SMOL = ["quickstart", "train.micro_batch_size=2", "train.global_batch_size=8", "data.synthetic_train_size=200",
        "data.synthetic_eval_size=8"]
RUNS: dict[str, tuple[list[str], tuple[int, int]]] = {
    "tiny-full-ddp": ([*TINY, "dist.strategy=ddp", "train.micro_batch_size=8"], (2, 6)),
    "tiny-full-fsdp": ([*TINY, "dist.strategy=fsdp", "train.micro_batch_size=8"], (2, 6)),
    "tiny-full-hsdp": ([*TINY, "dist.strategy=hsdp", "train.micro_batch_size=8"], (2, 6)),
    "tiny-full-fsdp-accum2": ([*TINY, "dist.strategy=fsdp", "train.micro_batch_size=4"], (2, 6)),
    "tiny-full-hsdp-accum2": ([*TINY, "dist.strategy=hsdp", "train.micro_batch_size=4"], (2, 6)),
    "smol-lora-fsdp": ([*SMOL, "dist.strategy=fsdp"], (1, 3)),
    "smol-lora-hsdp": ([*SMOL, "dist.strategy=hsdp"], (1, 3)),
}
NODE_TIMEOUT_S = 900


def run_once(hosts: tuple[Host, Host], job: list[str], steps: int, out_dir: Path, port: int) -> tuple[int, dict]:
    """One 2-host run: (bytes that crossed the link, its summary.json)."""
    crossed, _, run_dir = run_on_both(hosts, [*job, *COMMON, f"train.max_steps={steps}"], out_dir, port,
                                      NODE_TIMEOUT_S)
    return crossed, json.loads((run_dir / "summary.json").read_text())


def measure(hosts: tuple[Host, Host], name: str, out_root: Path, port: int) -> dict[str, Any]:
    job, (short, long) = RUNS[name]
    started = time.monotonic()
    short_bytes, _ = run_once(hosts, job, short, out_root / f"{name}-{short}", port)
    long_bytes, summary = run_once(hosts, job, long, out_root / f"{name}-{long}", port + 1)
    per_step = (long_bytes - short_bytes) / (long - short)
    return {
        "name": name, "steps": (short, long), "bytes": (short_bytes, long_bytes), "per_step": per_step,
        "strategy": summary["strategy"], "accumulation": summary["accumulation"], "params": summary["params"],
        "trainable": summary["trainable_params"], "model": summary["model"], "seconds": time.monotonic() - started,
    }


def table(results: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| run | model | strategy | accumulation | params (trainable) | steps | link bytes per run | "
        "link bytes per step | ÷ fp32 bytes of all params | ÷ fp32 bytes of trainable params |",
        "|---|---|---|---:|---|---|---|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['name']} | {r['model']} | {r['strategy']} | {r['accumulation']} | "
            f"{r['params']:,} ({r['trainable']:,}) | {r['steps'][0]} / {r['steps'][1]} | "
            f"{r['bytes'][0]:,} / {r['bytes'][1]:,} | {r['per_step']:,.0f} | "
            f"{r['per_step'] / (4 * r['params']):.2f} | {r['per_step'] / (4 * r['trainable']):.2f} |"
        )
    return lines


def record(results: list[dict[str, Any]]) -> None:
    lines = [
        *results_head("Link bytes per step, FSDP2 vs HSDP across two hosts"),
        "- 2 network namespaces joined by a veth pair, 2 processes each (gloo over the veth); "
        "bytes = tx + rx of one veth end, Ethernet frames; per step = difference of the two runs / extra steps",
        "",
        *table(results),
        "",
        "Command: `python benchmarks/diloco/hsdp_link_bytes.py` (as root); overrides per run are in the script (RUNS).",
        "",
        "",
    ]
    append_results(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", choices=list(RUNS), default=list(RUNS))
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    out_root = REPO / "runs" / "benchmarks" / f"hsdp-link-bytes-{time.strftime('%Y%m%d-%H%M%S')}"
    results = []
    with namespace_hosts() as hosts:
        for index, name in enumerate(args.only):
            results.append(measure(hosts, name, out_root, 29900 + 2 * index))
            r = results[-1]
            print(f"{name}: {r['per_step']:,.0f} bytes per step ({r['seconds']:.0f} s)", flush=True)
    print("\n".join(table(results)))
    if not args.no_record:
        record(results)


if __name__ == "__main__":
    main()
