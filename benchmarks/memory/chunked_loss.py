"""The loss's peak memory and time, whole logits against chunks: the vocabulary projection and cross-entropy of one
micro-batch, forward and backward, at the from-scratch config's width (configs/scratch-1.5b.yaml, hidden 2048) with
a Llama-3-sized vocabulary (128,256), the head trained; fp32 (`--dtype bf16` as bf16-mixed computes them, where
the CPU has native bf16 matrix units).

Each variant runs in its own process: the peak is the process's RSS high-water mark over the first pass minus its
RSS before it (glibc keeps freed memory, so a later pass would read the first one's peak); the time is the median of
the passes after. `python benchmarks/memory/chunked_loss.py [--tokens 2048] [--passes 3]`.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import psutil
import torch
import torch.nn.functional as F

HIDDEN, VOCAB = 2048, 128_256


def one_pass(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int) -> None:
    from trainyard.loss import LOSS_CHUNK_BYTES, chunked_cross_entropy

    if chunk == 0:  # as transformers and trainyard's chunk 0 do: bf16 logits, then fp32 for the loss
        logits = F.linear(hidden, weight).float()
        loss = F.cross_entropy(logits, targets, reduction="sum")
    else:
        size = chunk if chunk > 0 else LOSS_CHUNK_BYTES // (4 * VOCAB)  # -1: trainyard's default
        loss = chunked_cross_entropy(hidden, weight, None, targets, size)
    loss.backward()
    hidden.grad = weight.grad = None


def measure(tokens: int, chunk: int, passes: int, dtype: torch.dtype) -> dict[str, float]:
    torch.manual_seed(0)
    hidden = (torch.randn(tokens, HIDDEN) * 0.5).to(dtype).requires_grad_()
    weight = (torch.randn(VOCAB, HIDDEN) * 0.02).to(dtype).requires_grad_()
    targets = torch.randint(0, VOCAB, (tokens,))
    before = psutil.Process().memory_info().rss
    start = time.perf_counter()
    one_pass(hidden, weight, targets, chunk)
    first = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        one_pass(hidden, weight, targets, chunk)
        times.append(time.perf_counter() - start)
    return {"peak_gib": peak / 2**30, "first_s": first, "median_s": statistics.median(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048, help="target tokens of the micro-batch (default 2048)")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--chunk", type=int, default=None, help=argparse.SUPPRESS)  # a worker's variant
    args = parser.parse_args()
    if args.chunk is not None:
        dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
        print(json.dumps(measure(args.tokens, args.chunk, args.passes, dtype)))
        return
    rows = []
    for chunk, name in ((0, "whole logits (loss_chunk_tokens: 0)"), (-1, "chunks (default: 256 MiB of fp32)")):
        worker = [sys.executable, __file__, "--tokens", str(args.tokens), "--passes", str(args.passes),
                  "--dtype", args.dtype, "--chunk", str(chunk)]
        out = subprocess.run(worker, capture_output=True, text=True, check=True).stdout
        rows.append((name, json.loads(out.strip().splitlines()[-1])))
    logits_gib = args.tokens * VOCAB * 4 / 2**30
    print(f"{args.tokens} tokens x {VOCAB} vocab, hidden {HIDDEN}, {args.dtype}; fp32 logits: {logits_gib:.2f} GiB")
    print("| loss | peak above the inputs, GiB | first pass, s | median pass, s |")
    print("|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r['peak_gib']:.2f} | {r['first_s']:.2f} | {r['median_s']:.2f} |")


if __name__ == "__main__":
    main()
