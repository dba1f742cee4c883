"""Where one bench step goes: torch.profiler over trainyard's LoRA step of SmolLM2-135M-Instruct, one rank.

The step is `make bench`'s, as one of its two ranks runs it (one thread, micro-batch of 4 alpaca-shaped
documents, levers.py's `today` case): padding-free row, varlen attention, logits at targets, fused AdamW, at
the precision trainyard's `auto` picks on this machine (or `--precision`). Each operator's own (self) CPU time
goes to one share:

  matmul       the projections' products (mm/addmm whose every side is wider than LoRA's rank), the head's too
  lora         LoRA's rank-r products (mm/addmm with a side of width r)
  attention    per-document score products and softmax (bmm, baddbmm, _softmax and their backward, sdpa kernels)
  loss         log-softmax and NLL over the kept positions
  optimizer    everything under Optimizer.step (fused AdamW)
  elementwise  every other aten op: casts, copies, adds, SiLU, RMSNorm, RoPE, gathers, cat
  framework    the step's wall time minus every aten op's self time: Python, autograd's engine, dispatch

    python benchmarks/cpu/profile_step.py              # 3 profiled steps after 2 warm-ups; a table and one JSON line
    python benchmarks/cpu/profile_step.py --precision bf16 --rows 20

The profiler adds its own cost to every op (~5-10% here), so the shares are the figure; `step_s` (median of
unprofiled steps) is the speed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections import defaultdict
from typing import Any

import levers
import torch
from torch.profiler import ProfilerActivity, profile

from trainyard import loss as loss_room
from trainyard.precision import cpu_bf16_units

SHARES = ("matmul", "lora", "attention", "loss", "optimizer", "elementwise", "framework")
ATTENTION_OPS = {"aten::bmm", "aten::baddbmm", "aten::_softmax", "aten::_softmax_backward_data",
                 "aten::_scaled_dot_product_flash_attention_for_cpu",
                 "aten::_scaled_dot_product_flash_attention_for_cpu_backward"}
LOSS_OPS = {"aten::_log_softmax", "aten::_log_softmax_backward_data", "aten::nll_loss_forward",
            "aten::nll_loss_backward", "aten::nll_loss2d_forward", "aten::nll_loss2d_backward"}
MATMUL_OPS = {"aten::mm", "aten::addmm"}
LORA_RANK = 8


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto")
    parser.add_argument("--steps", type=int, default=3, help="profiled steps")
    parser.add_argument("--timed", type=int, default=5, help="unprofiled steps timed for step_s")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, default=15, help="top operators listed by self time")
    parser.add_argument("--op", action="append", default=[], help="also list this operator's time by input shapes")
    return parser.parse_args()


def resolve_precision(name: str) -> str:
    """trainyard's auto on a CPU: bf16 where the CPU has bf16 matrix units, else fp32."""
    if name != "auto":
        return name
    return "bf16" if cpu_bf16_units() else "fp32"


class Step:
    """levers.py's `today` case at one precision: the same model, batch and optimizer."""

    def __init__(self, precision: str) -> None:
        self.case = levers.Case("today" if precision == "bf16" else "fp32")
        self.autocast = precision == "bf16"

    def __call__(self) -> float:
        started = time.perf_counter()
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if self.autocast else contextlib.nullcontext()
        with autocast:
            loss, _ = loss_room.token_loss_sum(self.case.model, self.case.batch, torch.device("cpu"))
        loss.backward()
        self.case.optimizer.step()
        self.case.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - started


def share_of(event: Any, in_optimizer: bool) -> str:
    if in_optimizer:
        return "optimizer"
    name = event.name
    if name in MATMUL_OPS:
        shapes = [dims for dims in event.input_shapes if len(dims) == 2]
        return "lora" if any(LORA_RANK in dims for dims in shapes) else "matmul"
    if name in ATTENTION_OPS:
        return "attention"
    if name in LOSS_OPS:
        return "loss"
    return "elementwise"


def optimizer_ids(events: list[Any]) -> set[int]:
    """Ids of every event under an Optimizer.step range (the fused kernel and its helpers)."""
    found: set[int] = set()
    for event in events:
        parent = event
        while parent is not None:
            if parent.name.startswith("Optimizer.step"):
                found.add(id(event))
                break
            parent = parent.cpu_parent
    return found


def attribute(prof: Any, wall_us: float) -> tuple[dict[str, float], list[tuple[str, str, float]]]:
    """Self CPU microseconds per share over the profiled steps, and per (op, share)."""
    events = [event for event in prof.events() if event.name.startswith("aten::")]
    under_optimizer = optimizer_ids(list(prof.events()))
    shares: dict[str, float] = defaultdict(float)
    ops: dict[tuple[str, str], float] = defaultdict(float)
    for event in events:
        share = share_of(event, id(event) in under_optimizer)
        shares[share] += event.self_cpu_time_total
        ops[(event.name, share)] += event.self_cpu_time_total
    shares["framework"] = max(0.0, wall_us - sum(shares.values()))
    top = sorted(((name, share, us) for (name, share), us in ops.items()), key=lambda item: -item[2])
    return dict(shares), top


def matmul_flops(prof: Any) -> float:
    """FLOPs of every mm/addmm/bmm the profiler saw (its own per-op count)."""
    return sum(event.flops or 0 for event in prof.events() if event.name in MATMUL_OPS | {"aten::bmm"})


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    precision = resolve_precision(args.precision)
    step = Step(precision)
    step()
    step()
    step_s = statistics.median(step() for _ in range(args.timed))
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_flops=True) as prof:
        started = time.perf_counter()
        for _ in range(args.steps):
            step()
        wall_us = (time.perf_counter() - started) * 1e6
    shares, top = attribute(prof, wall_us)
    total = sum(shares.values())
    print(f"precision {precision}, {args.threads} thread(s); unprofiled step {step_s:.3f} s; "
          f"profiled {wall_us / 1e6 / args.steps:.3f} s/step")
    print("| share | s/step | % |\n|---|---:|---:|")
    for share in SHARES:
        seconds = shares.get(share, 0.0) / 1e6 / args.steps
        print(f"| {share} | {seconds:.3f} | {100 * shares.get(share, 0.0) / total:.1f} |")
    print(f"\ntop {args.rows} operators by self time:\n| op | share | ms/step |\n|---|---|---:|")
    for name, share, us in top[: args.rows]:
        print(f"| {name} | {share} | {us / 1e3 / args.steps:.1f} |")
    for op in args.op:
        print(f"\n{op} by input shapes:\n| shapes | calls/step | ms/step |\n|---|---:|---:|")
        rows = [row for row in prof.key_averages(group_by_input_shape=True) if row.key == op]
        for row in sorted(rows, key=lambda row: -row.self_cpu_time_total)[: args.rows]:
            ms = row.self_cpu_time_total / 1e3 / args.steps
            print(f"| {row.input_shapes} | {row.count / args.steps:.0f} | {ms:.1f} |")
    flops = matmul_flops(prof) / args.steps
    print(json.dumps({"precision": precision, "threads": args.threads, "step_s": round(step_s, 4),
                      "matmul_gflop_per_step": round(flops / 1e9, 2),
                      "matmul_gflops_achieved": round(flops / 1e9 / step_s, 1),
                      "shares_pct": {share: round(100 * shares.get(share, 0.0) / total, 1) for share in SHARES}}))


if __name__ == "__main__":
    main()
