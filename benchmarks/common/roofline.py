"""This machine's matmul FLOP/s in fp32 and bf16: the denominator of bench.py's MFU.

    python benchmarks/common/roofline.py                 # 2 processes x (cores / 2) threads, as training runs
    python benchmarks/common/roofline.py --nproc 1 --seconds 1

A nominal peak (cores x clock x FMA width) says little about a shared 2-core VM; the best the
matmul kernels reach here does. Each of `--nproc` processes, started together with cores / nproc
threads (as the training processes run), times torch.matmul on a square 2048 shape and on the
shapes of SmolLM2-135M's projections for a micro-batch of 4 x ~200 tokens; the machine total of a
shape is the sum over processes. `peak` is the best shape of each dtype. On a CUDA machine it
measures the GPU in one process instead. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time
from typing import Any

import torch

# (name, m, k, n): y[m, n] = x[m, k] @ w[k, n]
SHAPES = [
    ("square-2048", 2048, 2048, 2048),
    ("mlp-up-800x576x1536", 800, 576, 1536),
    ("mlp-down-800x1536x576", 800, 1536, 576),
    ("attn-q-800x576x576", 800, 576, 576),
]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def time_matmul(m: int, k: int, n: int, dtype: torch.dtype, device: str, seconds: float) -> float:
    """FLOP/s of x @ w repeated for about `seconds` after a warm-up."""
    x = torch.randn(m, k, device=device).to(dtype)
    w = torch.randn(k, n, device=device).to(dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(3):
        x @ w
    sync()
    reps, started = 0, time.perf_counter()
    while True:
        for _ in range(4):
            x @ w
        reps += 4
        sync()
        elapsed = time.perf_counter() - started
        if elapsed >= seconds:
            return 2.0 * m * k * n * reps / elapsed


def measure(threads: int, device: str, seconds: float, dtypes: list[str]) -> dict[str, dict[str, float]]:
    if device == "cpu":
        torch.set_num_threads(threads)
    return {
        dtype: {name: time_matmul(m, k, n, DTYPES[dtype], device, seconds) for name, m, k, n in SHAPES}
        for dtype in dtypes
    }


def _worker(threads: int, seconds: float, start: Any, queue: Any) -> None:
    start.wait()  # every process measures at the same time, sharing the cores as training does
    queue.put(measure(threads, "cpu", seconds, cpu_dtypes()))


def cpu_dtypes() -> list[str]:
    """bf16 only where the CPU has bf16 matrix units: elsewhere its products are emulated (minutes for the square
    shape) and nothing trains in it (trainyard's auto, bench's HF and TRL rows all run fp32 there)."""
    from trainyard.precision import cpu_bf16_units

    return list(DTYPES) if cpu_bf16_units() else ["fp32"]


def roofline(nproc: int = 2, seconds: float = 2.0) -> dict[str, Any]:
    """Machine totals per dtype and shape (FLOP/s), and each dtype's peak over the shapes."""
    if torch.cuda.is_available():
        totals = measure(1, "cuda", seconds, ["bf16"])
        where = {"device": torch.cuda.get_device_name(0), "processes": 1, "threads_per_process": None}
    else:
        threads = max(1, (os.cpu_count() or 1) // nproc)
        ctx = mp.get_context("spawn")
        start, queue = ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=_worker, args=(threads, seconds, start, queue)) for _ in range(nproc)]
        for proc in procs:
            proc.start()
        start.set()
        results = [queue.get() for _ in procs]
        for proc in procs:
            proc.join()
        totals = {
            dtype: {name: sum(r[dtype][name] for r in results) for name, *_ in SHAPES} for dtype in results[0]
        }
        where = {"device": "cpu", "processes": nproc, "threads_per_process": threads}
    return {
        **where,
        "flops": {dtype: {name: round(v / 1e9, 2) for name, v in shapes.items()} for dtype, shapes in totals.items()},
        "peak_gflops": {dtype: round(max(shapes.values()) / 1e9, 2) for dtype, shapes in totals.items()},
        "unit": "GFLOP/s, machine total",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="processes measuring at once (CPU)")
    parser.add_argument("--seconds", type=float, default=2.0, help="per shape and dtype")
    args = parser.parse_args()
    print(json.dumps(roofline(args.nproc, args.seconds)))


if __name__ == "__main__":
    main()
