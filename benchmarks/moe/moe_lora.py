"""Expert LoRA, grouped low-rank products against PEFT's fold, at GLM-4.5-Air's proportions scaled to a CPU.

    python benchmarks/moe/moe_lora.py                     # 2 rounds of 12 steps each way + the MoE layer profile
    python benchmarks/moe/moe_lora.py --rounds 1 --steps 6 --no-profile
    python benchmarks/moe/moe_lora.py --expert-parallel --no-profile   # grouped under FSDP2 against EP=2

The job: configs/tiny-moe.yaml (glm4_moe from a config, byte tokenizer, builtin:dates) at GLM-4.5-Air's shape /8:
128 routed experts, 8 per token, hidden 512, moe_intermediate_size 176, a shared expert, a dense first layer
(intermediate 1368), 4 layers; micro-batches of 3 rows of 96 tokens (288); FSDP2 + LoRA (r=16), 2 processes, fp32;
no eval or checkpoint. Each round runs `lora.moe_adapter=peft` and `grouped` back to back (every second round in
reverse order); with --expert-parallel, the grouped adapter under FSDP2 against the same with
`dist.expert_parallel=2` (each rank holds 64 whole experts, tokens exchanged by all-to-all). Figures: real
tokens/s (summary.json), the median step after the first, the highest VmHWM (peak RSS, loading included) of any
rank and the highest RSS sampled while it trains, and the per-step losses of both (same seed and data: equal up to
rounding).

The profile: one MoE layer's experts module alone (300 tokens, random routing), forward + backward on one thread,
both ways, under torch.profiler: wall time per call, the largest tensor the adapter path allocates, top ops; and the
whole model's forward + backward in one process (one thread), each way twice.
It prints JSON lines; RESULTS.md holds the recorded run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # the shared helpers

from bench_env import commit, cpu_description, loadavg  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SHAPE = {
    "model.config.hidden_size": 512,
    "model.config.intermediate_size": 1368,
    "model.config.moe_intermediate_size": 176,
    "model.config.n_routed_experts": 128,
    "model.config.num_experts_per_tok": 8,
    "model.config.num_hidden_layers": 4,
    "model.config.num_attention_heads": 8,
    "model.config.num_key_value_heads": 2,
}
MODES = ("peft", "grouped")
EP_MODES = ("grouped", "ep")
MODE_OVERRIDES = {
    "peft": ["lora.moe_adapter=peft"],
    "grouped": ["lora.moe_adapter=grouped"],
    "ep": ["lora.moe_adapter=grouped", "dist.expert_parallel=2"],
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--expert-parallel", action="store_true", help="FSDP2 against EP=2, both grouped")
    parser.add_argument("--precision", default="fp32", help="train.precision of every run (bf16-mixed: bf16 products)")
    return parser.parse_args()


def train(mode: str, steps: int, out: Path, precision: str) -> dict[str, Any]:
    """One 2-process run of the job in `mode` (MODE_OVERRIDES): its figures."""
    overrides = [f"{key}={value}" for key, value in SHAPE.items()] + MODE_OVERRIDES[mode] + [
        "lora.r=16", "lora.alpha=32", f"train.precision={precision}", f"train.max_steps={steps}",
        "train.micro_batch_size=3", "eval.every_steps=0", "checkpoint.every_steps=0", "log.every_steps=1",
        f"output_dir={out}", f"run_name={mode}",
    ]
    command = [sys.executable, "-m", "trainyard.cli", "train", "src/trainyard/configs/tiny-moe.yaml", *overrides,
               "--nproc", "2"]
    started = time.perf_counter()
    run_dir = out / mode
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak, training_peak = sample_rss(proc, run_dir / "metrics.jsonl")
    if proc.returncode != 0:
        raise SystemExit(f"{mode}: exit {proc.returncode}\n{proc.stderr.read()[-3000:] if proc.stderr else ''}")
    summary = json.loads((run_dir / "summary.json").read_text())
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train_events = [e for e in events if e["kind"] == "train"]
    times, previous = [], 0
    for event in train_events:
        times.append((event["tokens"] - previous) / event["tokens_per_s"])
        previous = event["tokens"]
    return {
        "mode": mode, "tokens_per_s": round(summary["tokens_per_s"], 1),
        "s_per_step": round(statistics.median(times[1:]), 3), "peak_rss_gb": round(peak / 1e9, 3),
        "training_peak_rss_gb": round(training_peak / 1e9, 3),
        "wall_s": round(time.perf_counter() - started, 1), "losses": [e["loss"] for e in train_events],
    }


def sample_rss(proc: subprocess.Popen, metrics: Path, every_s: float = 0.2) -> tuple[int, int]:
    """Wait for proc: the highest VmHWM of any rank (loading included), and the highest VmRSS sampled once the
    first step has been logged (training alone)."""
    peak = training = 0
    root, children = psutil.Process(proc.pid), []
    while proc.poll() is None:
        stepping = metrics.is_file() and '"train"' in metrics.read_text()
        with contextlib.suppress(psutil.Error):
            children = root.children(recursive=True)
        for child in children:
            with contextlib.suppress(OSError):
                status = dict(re.findall(r"(VmHWM|VmRSS):\s+(\d+) kB", Path(f"/proc/{child.pid}/status").read_text()))
                peak = max(peak, int(status.get("VmHWM", 0)) * 1024)
                training = max(training, int(status.get("VmRSS", 0)) * 1024) if stepping else training
        time.sleep(every_s)
    return peak, training


def import_floor() -> int:
    """VmRSS of a fresh interpreter that imported what a rank of this job imports: the part of every rank's RSS
    that no way of placing the experts changes (libraries, not tensors)."""
    probe = ("import re, datasets, trainyard.train.recipe, trainyard.model.lora; from pathlib import Path; "
             "print(re.search(r'VmRSS:\\s+(\\d+) kB', Path('/proc/self/status').read_text()).group(1))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return int(out.split()[-1]) * 1024


def whole_step(mode: str) -> dict[str, Any]:
    """The whole model (4 layers), forward + backward of 288 tokens in one process on one thread."""
    from transformers import AutoModelForCausalLM

    from trainyard.config import LoraConfig
    from trainyard.model.lora import apply_lora

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = apply_lora(AutoModelForCausalLM.from_config(glm_config(), dtype=torch.float32),
                       LoraConfig(r=16, alpha=32, moe_adapter=mode), seed=0)
    ids = torch.randint(3, 262, (1, 288), generator=torch.Generator().manual_seed(1))
    seconds = []
    for _ in range(4):
        started = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        seconds.append(time.perf_counter() - started)
    return {"mode": mode, "whole_step_s": round(statistics.median(seconds[1:]), 3)}


def glm_config():  # -> PretrainedConfig
    from transformers import AutoConfig

    settings = {key.removeprefix("model.config."): value for key, value in SHAPE.items()}
    return AutoConfig.for_model("glm4_moe", vocab_size=262, first_k_dense_replace=1, n_shared_experts=1,
                                n_group=1, topk_group=1, head_dim=64, **settings)


def experts_profile(mode: str) -> dict[str, Any]:
    """One MoE layer's experts (GLM-shaped, LoRA r=16) forward + backward on 300 routed tokens, one thread."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM

    from trainyard.config import LoraConfig
    from trainyard.model.lora import apply_lora

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(glm_config(), dtype=torch.float32)
    model = apply_lora(model, LoraConfig(r=16, alpha=32, moe_adapter=mode), seed=0)
    experts = model.get_base_model().model.layers[1].mlp.experts
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(300, 512, generator=generator, requires_grad=True)
    index = torch.stack([torch.randperm(128, generator=generator)[:8] for _ in range(300)])
    weights = torch.rand(300, 8, generator=generator)
    grad = torch.randn(300, 512, generator=generator)

    def step() -> None:
        experts(hidden, index, weights).backward(grad)

    step()  # warm-up
    seconds = []
    for _ in range(5):
        started = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - started)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:6]
    largest = max((abs(e.self_cpu_memory_usage) for e in prof.key_averages()), default=0)
    return {
        "mode": mode, "experts_fwd_bwd_ms": round(1000 * statistics.median(seconds), 1),
        "largest_self_alloc_mb": round(largest / 1e6, 1),
        "top_ops_ms": {e.key: round(e.self_cpu_time_total / 1000, 1) for e in ops},
    }


def main() -> None:
    args = parse_args()
    print(json.dumps({"cpu": cpu_description(), "commit": commit(), "load": loadavg()}), flush=True)
    if not args.no_profile:
        for mode in MODES:
            print(json.dumps(experts_profile(mode)), flush=True)
        for mode in (*MODES, *MODES):
            print(json.dumps(whole_step(mode)), flush=True)
    env_threads = os.environ.get("OMP_NUM_THREADS")
    modes = EP_MODES if args.expert_parallel else MODES
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory(prefix="moe-lora-") as tmp:
        for round_ in range(args.rounds):
            for mode in modes if round_ % 2 == 0 else reversed(modes):
                result = train(mode, args.steps, Path(tmp) / f"round-{round_}", args.precision)
                runs[mode].append(result)
                print(json.dumps({**result, "round": round_, "load": loadavg()}), flush=True)
    fold, grouped = ({key: statistics.median(r[key] for r in runs[mode]) for key in
                      ("tokens_per_s", "s_per_step", "peak_rss_gb", "training_peak_rss_gb")} for mode in modes)
    losses = zip(runs[modes[0]][0]["losses"], runs[modes[1]][0]["losses"], strict=True)
    floor = import_floor() / 1e9
    print(json.dumps({
        "precision": args.precision, "import_floor_gb": round(floor, 3),
        "training_peak_above_floor_x": round((grouped["training_peak_rss_gb"] - floor)
                                             / (fold["training_peak_rss_gb"] - floor), 2),
        modes[0]: fold, modes[1]: grouped, "speed_x": round(grouped["tokens_per_s"] / fold["tokens_per_s"], 2),
        "peak_memory_x": round(grouped["peak_rss_gb"] / fold["peak_rss_gb"], 2),
        "training_peak_memory_x": round(grouped["training_peak_rss_gb"] / fold["training_peak_rss_gb"], 2),
        "max_relative_loss_difference": max(abs(a - b) / abs(a) for a, b in losses),
        "omp_num_threads": env_threads, "load_after": loadavg(),
    }), flush=True)


if __name__ == "__main__":
    main()
