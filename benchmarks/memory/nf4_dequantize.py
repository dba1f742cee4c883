"""One NF4 weight's dequantization and product: torchao's against trainyard's chunked one (model/nf4_linear.py).

    python benchmarks/memory/nf4_dequantize.py                    # the 0.93B Llama's MLP weight, 6400 x 2048
    python benchmarks/memory/nf4_dequantize.py --shape 4096 4096 --tokens 1024

For each way, in a fresh process: the rise of the process's peak RSS (VmHWM, reset just before through
/proc/self/clear_refs) over one dequantization to bf16, the median seconds of a dequantization, and of a linear layer's forward
and backward on `--tokens` rows (torchao's F.linear on an NF4Tensor, linear_nf4; trainyard's NF4Linear). Checks that
both give the same values bit for bit. One JSON line per way; no assertions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # the shared helpers

from bench_env import commit, cpu_description, loadavg  # noqa: E402


def high_water_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def measure(way: str, shape: tuple[int, int], tokens: int, repeats: int) -> dict:
    import torch

    from trainyard.model import nf4_fast, nf4_linear

    torch.manual_seed(0)
    weight = nf4_fast.to_nf4(torch.randn(shape, dtype=torch.bfloat16))
    inputs = torch.randn(tokens, shape[1], dtype=torch.bfloat16, requires_grad=True)
    dequantize = (lambda: weight.to(torch.bfloat16)) if way == "torchao" else (
        lambda: nf4_linear.dequantize(weight, torch.bfloat16))
    layer = torch.nn.Linear(shape[1], shape[0], bias=False)
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    if way == "trainyard":
        layer.__class__ = nf4_linear.NF4Linear
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts from the RSS now
    before = high_water_kib()
    dense = dequantize()
    rise = (high_water_kib() - before) * 1024
    equal = torch.equal(dense, weight.get_original_weight())
    del dense
    seconds, step = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        dequantize()
        seconds.append(time.perf_counter() - started)
        started = time.perf_counter()
        layer(inputs).sum().backward()
        step.append(time.perf_counter() - started)
    return {"way": way, "shape": list(shape), "tokens": tokens, "equal_to_torchao": equal,
            "peak_rise_mib": round(rise / 2**20, 1), "dense_mib": round(shape[0] * shape[1] * 2 / 2**20, 1),
            "dequantize_ms": round(1e3 * statistics.median(seconds), 2),
            "forward_backward_ms": round(1e3 * statistics.median(step), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=2, default=[6400, 2048])
    parser.add_argument("--tokens", type=int, default=412)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--way", choices=["torchao", "trainyard"])
    args = parser.parse_args()
    if args.way:
        print(json.dumps(measure(args.way, tuple(args.shape), args.tokens, args.repeats)), flush=True)
        return
    print(json.dumps({"commit": commit(), "cpu": cpu_description(), "load_before": loadavg()}), flush=True)
    for way in ("torchao", "trainyard"):
        subprocess.run([sys.executable, __file__, "--way", way, "--shape", *map(str, args.shape), "--tokens",
                        str(args.tokens), "--repeats", str(args.repeats)], check=True)
    print(json.dumps({"load_after": loadavg()}), flush=True)


if __name__ == "__main__":
    main()
