"""`trainyard estimate --trace`'s output: a traced step (train/trace.py) beside the formula's figures, for a person
or as JSON."""

from __future__ import annotations

from typing import Any

from trainyard.train.trace import Trace, held_between_steps


def to_json(result: Trace) -> dict[str, Any]:
    """Every figure in bytes; collectives summed per kind and group."""
    memory = result.formula
    return {
        "strategy": result.layout.strategy,
        "mesh": result.mesh,
        "world": result.layout.world,
        "layers": result.layers,
        "accumulation": result.accumulation,
        "traced": {"static_bytes": result.static_bytes, "peak_bytes": result.peak_bytes,
                   "gathered_peak_bytes": result.gathered_peak_bytes},
        "formula": {"static_bytes": held_between_steps(memory), "peak_tensor_bytes": memory.peak_tensor_bytes,
                    "peak_bytes_per_device": memory.peak},
        "collectives": [{"kind": kind, "group": group, "ranks": ranks, "calls": calls, "bytes_in": sent,
                         "bytes_out": received}
                        for (kind, group, ranks), (calls, sent, received) in result.collective_totals().items()],
        "notes": result.notes,
    }


def render(result: Trace) -> str:
    """The traced peak beside the formula's, then the step's collectives, for a person."""
    gib = 2**30
    memory = result.formula
    ratio = result.peak_bytes / memory.peak_tensor_bytes if memory.peak_tensor_bytes else float("nan")
    lines = [
        f"trace            one optimizer step on fake tensors: {result.layout.strategy} over {result.mesh}, "
        f"{result.layers} layers, {result.accumulation} micro-batch(es) per step; rank 0",
        f"{'memory per device (GiB)':34} {'traced':>10} {'formula':>10}",
        f"  {'held between steps':32} {result.static_bytes / gib:10.2f} {held_between_steps(memory) / gib:10.2f}",
        f"  {'peak of live tensors':32} {result.peak_bytes / gib:10.2f} {memory.peak_tensor_bytes / gib:10.2f}"
        f"   traced / formula {ratio:.2f}",
        f"  {'unsharded weights at once':32} {result.gathered_peak_bytes / gib:10.2f}",
        f"  {'process peak (+ slack, runtime)':32} {'':10} {memory.peak / gib:10.2f}",
        "collectives per step (MiB):",
        f"  {'kind':15} {'group':22} {'ranks':>5} {'calls':>6} {'in':>12} {'out':>12}",
    ]
    mib = 2**20
    for (kind, group, ranks), (calls, sent, received) in result.collective_totals().items():
        lines.append(f"  {kind:15} {group:22} {ranks:5d} {calls:6d} {sent / mib:12.1f} {received / mib:12.1f}")
    lines += [f"  note: {note}" for note in result.notes]
    return "\n".join(lines)
