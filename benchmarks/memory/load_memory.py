"""Peak RSS per rank, and time, while `build.build_and_wrap` loads a ~0.93B Llama from safetensors.

    python benchmarks/memory/load_memory.py                          # all cases (~4 GB in the temp dir, a few min)
    python benchmarks/memory/load_memory.py --only fsdp-fp32 --folder DIR --out DIR2

Issue 9's goal: with FSDP2 on 2 processes, each rank's peak RSS while loading stays
<= 0.6 x the full fp32 model + 0.5 GB (the old whole-model load peaked at 1.26 x). Under DDP each
rank holds one copy, never two. The reference is one `from_pretrained` in one process.

The model (hidden 2048, intermediate 6400, 16 layers, 32 heads, 8 KV heads, vocabulary 32000,
untied head: 0.93B parameters, 3.7 GB in fp32) is random, saved once with `save_pretrained` in
fp32 and reused from `--folder`. Its files are read once before the cases, so every case reads
from the page cache, not the disk.

Each case runs in fresh processes. A thread samples the process's RSS every 20 ms from just
before the call until it returns; the kernel's own high-water mark (VmHWM, reset just before
the call) also sees peaks shorter than a sample; the peak is the larger of the two. "baseline" is the
RSS right before the call (Python, torch, transformers, the process group); the goal is
checked against the total peak, baseline included. One JSON line per case; no assertions.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
GB = 1e9
LLAMA = {
    "hidden_size": 2048,
    "intermediate_size": 6400,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}
CASES: dict[str, dict[str, Any]] = {
    "fsdp-fp32": {"strategy": "fsdp", "overrides": ["lora.enabled=false", "train.precision=fp32"]},
    "fsdp-lora-bf16mixed": {"strategy": "fsdp", "overrides": ["lora.enabled=true", "train.precision=bf16-mixed"]},
    "fsdp-lora-bf16mixed-nf4": {
        "strategy": "fsdp",
        "overrides": ["lora.enabled=true", "train.precision=bf16-mixed", "model.quantize=nf4"],
    },
    "ddp-lora-fp32-nf4": {
        "strategy": "ddp",
        "overrides": ["lora.enabled=true", "train.precision=fp32", "model.dtype=float32", "model.quantize=nf4"],
    },
    "ddp-lora-fp32": {
        "strategy": "ddp",
        "overrides": ["lora.enabled=true", "train.precision=fp32", "model.dtype=float32"],
    },
    # Refused for training (weights, gradients and AdamW need ~13.8 GiB a rank here), so the
    # fit check is skipped: this measures the load alone.
    "ddp-fp32": {
        "strategy": "ddp",
        "overrides": ["lora.enabled=false", "train.precision=fp32"],
        "skip_fit_check": True,
    },
    # transformers maps the safetensors file and its tensors are views of it: the call itself
    # reads (almost) nothing. "+read" also reads every weight once, as a first step would.
    "from_pretrained": {"strategy": None, "overrides": []},
    "from_pretrained+read": {"strategy": None, "overrides": []},
}


class RssSampler:
    """Samples this process's RSS (and its anonymous / file-backed parts) in a thread, so the
    peak is seen while the loading code runs, not only after it."""

    def __init__(self, every_s: float = 0.02) -> None:
        self.every_s = every_s
        self.samples: list[tuple[float, int, int, int]] = []  # (s since start, rss, anon, file)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._t0 = 0.0

    @staticmethod
    def read() -> dict[str, int]:
        """VmRSS, RssAnon, RssFile and VmHWM in bytes (from /proc; psutil's RSS elsewhere)."""
        try:
            fields = {}
            for line in Path("/proc/self/status").read_text().splitlines():
                key, _, value = line.partition(":")
                if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
                    fields[key] = int(value.split()[0]) * 1024
            return fields
        except OSError:
            import psutil

            return {"VmRSS": psutil.Process().memory_info().rss}

    @staticmethod
    def reset_high_water_mark() -> bool:
        """Reset VmHWM to the current RSS (Linux >= 4.0), so it covers only what follows."""
        try:
            Path("/proc/self/clear_refs").write_text("5")
            return True
        except OSError:
            return False

    def __enter__(self) -> RssSampler:
        self._t0 = time.monotonic()
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _sample(self) -> None:
        now = self.read()
        self.samples.append((time.monotonic() - self._t0, now["VmRSS"], now.get("RssAnon", 0), now.get("RssFile", 0)))

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self._sample()

    def peak(self) -> int:
        return max(rss for _, rss, _, _ in self.samples)

    def trace(self, points: int = 40) -> list[list[float]]:
        """About `points` samples spread over the run, plus the peak: [s, rss, anon, file] in GB."""
        step = max(1, len(self.samples) // points)
        chosen = set(range(0, len(self.samples), step)) | {len(self.samples) - 1}
        chosen.add(max(range(len(self.samples)), key=lambda i: self.samples[i][1]))
        return [[round(self.samples[i][0], 2), *(round(v / GB, 3) for v in self.samples[i][1:])]
                for i in sorted(chosen)]


def measure(call: Any) -> tuple[Any, dict[str, Any]]:
    """Run `call()` under the sampler; RSS before, peaks and seconds."""
    import gc

    gc.collect()
    baseline = RssSampler.read()["VmRSS"]
    hwm_reset = RssSampler.reset_high_water_mark()
    start = time.perf_counter()
    with RssSampler() as sampler:
        result = call()
    seconds = time.perf_counter() - start
    after = RssSampler.read()
    return result, {
        "baseline_rss": baseline,
        "peak_rss": sampler.peak(),
        "hwm_rss": after.get("VmHWM") if hwm_reset else None,
        "after_rss": after["VmRSS"],
        "seconds": seconds,
        "samples": len(sampler.samples),
        "trace": sampler.trace(),
    }


def make_model(folder: Path, shape: dict[str, Any] | None = None) -> None:
    """The random fp32 Llama (LLAMA, with `shape`'s overrides), saved once (a process of its own, so its memory is
    gone after)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**{**LLAMA, **(shape or {})}), dtype=torch.float32)
    model.save_pretrained(str(folder))
    print(f"saved {sum(p.numel() for p in model.parameters()):,} parameters to {folder}", flush=True)


def model_bytes(folder: Path) -> tuple[int, int]:
    """(elements, bytes) of every tensor in the folder's safetensors files."""
    from safetensors import safe_open

    elements = size = 0
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                sliced = handle.get_slice(key)
                count = 1
                for dim in sliced.get_shape():
                    count *= dim
                elements += count
                size += count * {"F32": 4, "BF16": 2, "F16": 2}[sliced.get_dtype()]
    return elements, size


def worker(case: str, folder: str, out: Path) -> None:
    """One rank under torchrun: dist.init, tokenizer and precision first, then build_and_wrap measured."""
    from trainyard import dist, precision
    from trainyard.config_file import load_config
    from trainyard.model import source as source_room
    from trainyard.train import build

    spec = CASES[case]
    if spec.get("skip_fit_check"):
        build.plan.check_fits = lambda *args, **kwargs: None
    overrides = [
        "model.config=null",
        f"model.path={folder}",
        "model.tokenizer=builtin:bytes",
        "model.gradient_checkpointing=false",
        f"dist.strategy={spec['strategy']}",
        *spec["overrides"],
    ]
    cfg = load_config(str(REPO / "configs" / "tiny.yaml"), overrides)
    info = dist.init(cfg.dist)
    tokenizer = source_room.load_tokenizer(cfg.model, folder)
    resolved = precision.resolve(cfg, info.device)
    (model, strategy, _), figures = measure(lambda: build.build_and_wrap(cfg, info, resolved, folder, tokenizer))
    held = sum(p.to_local().nbytes if hasattr(p, "to_local") else p.nbytes for p in model.parameters())
    figures.update(rank=info.rank, strategy=strategy, held_param_bytes=held, precision=resolved.name)
    (out / f"{case}-rank{info.rank}.json").write_text(json.dumps(figures))
    dist.exit_process(0)


def reference(case: str, folder: str, out: Path) -> None:
    """One process, one from_pretrained in fp32: what loading costs without trainyard."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))  # as many threads as one rank gets

    def load() -> torch.nn.Module:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        if case.endswith("+read"):
            with torch.no_grad():
                for param in model.parameters():
                    param.sum()
        return model

    model, figures = measure(load)
    figures.update(rank=0, held_param_bytes=sum(p.nbytes for p in model.parameters()))
    (out / f"{case}-rank0.json").write_text(json.dumps(figures))


def warm_page_cache(folder: Path) -> None:
    """Read every weight file once, so each case reads from memory rather than the disk."""
    for file in folder.glob("*.safetensors"):
        with file.open("rb") as handle:
            while handle.read(1 << 24):
                pass


def run_case(case: str, folder: Path, out: Path, nproc: int) -> list[dict[str, Any]]:
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // nproc))}
    here = str(Path(__file__).resolve())
    if CASES[case]["strategy"] is None:
        command = [sys.executable, here, "--reference", case, str(folder), str(out)]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                   here, "--worker", case, str(folder), str(out)]
    subprocess.run(command, check=True, env=env, cwd=REPO)
    return [json.loads(path.read_text()) for path in sorted(out.glob(f"{case}-rank*.json"))]


def summary(case: str, ranks: list[dict[str, Any]], size: int) -> dict[str, Any]:
    """One line per case, in GB. FSDP2: the goal against the total peak (baseline included).
    DDP: whether the increment stays under two copies of what a rank holds."""
    goal = 0.6 * size + 0.5 * GB
    peaks = [max(r["peak_rss"], r["hwm_rss"] or 0) for r in ranks]
    line: dict[str, Any] = {
        "case": case,
        "model_bytes_fp32": size,
        "baseline_gb": [round(r["baseline_rss"] / GB, 3) for r in ranks],
        "peak_gb": [round(peak / GB, 3) for peak in peaks],  # the larger of the samples' and VmHWM
        "after_gb": [round(r["after_rss"] / GB, 3) for r in ranks],
        "peak_over_model": [round(peak / size, 3) for peak in peaks],
        "increment_over_model": [round((peak - r["baseline_rss"]) / size, 3) for peak, r in zip(peaks, ranks)],
        "held_param_gb": [round(r["held_param_bytes"] / GB, 3) for r in ranks],
        "seconds": [round(r["seconds"], 2) for r in ranks],
    }
    strategy = CASES[case]["strategy"]
    if strategy == "fsdp":
        line.update(goal_gb=round(goal / GB, 3), meets_goal_total_peak=max(peaks) <= goal)
    elif strategy == "ddp":
        line["under_two_copies"] = all(
            peak - r["baseline_rss"] < 2 * r["held_param_bytes"] for peak, r in zip(peaks, ranks)
        )
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, default=Path(tempfile.gettempdir()) / "trainyard-bench-llama-0.9b")
    parser.add_argument("--only", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out", type=Path, help="write the per-rank JSON (with RSS traces) here")
    parser.add_argument("--worker", nargs=3, metavar=("CASE", "FOLDER", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--reference", nargs=3, metavar=("CASE", "FOLDER", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--make", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--shape", type=json.loads, help=argparse.SUPPRESS)  # --make's overrides of LLAMA
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker[0], args.worker[1], Path(args.worker[2]))
    if args.reference:
        return reference(args.reference[0], args.reference[1], Path(args.reference[2]))
    if args.make:
        return make_model(args.make, args.shape)

    if not (args.folder / "config.json").is_file():
        args.folder.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "--make", str(args.folder)], check=True)
    elements, size = model_bytes(args.folder)
    print(json.dumps({"model": str(args.folder), "parameters": elements, "bytes": size}), flush=True)
    out = args.out or Path(tempfile.mkdtemp(prefix="load-memory-"))
    out.mkdir(parents=True, exist_ok=True)
    for case in args.only:
        warm_page_cache(args.folder)
        ranks = run_case(case, args.folder, out, args.nproc)
        print(json.dumps(summary(case, ranks, size)), flush=True)
    print(json.dumps({"per_rank_json": str(out)}), flush=True)


if __name__ == "__main__":
    main()
