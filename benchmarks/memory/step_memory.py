"""Memory as a training process holds it, phase by phase: FSDP2 + LoRA of the ~0.93B Llama of load_memory.py on
2 processes, bf16-mixed, micro-batch 1 x 128 tokens (issue 25's run).

    python benchmarks/memory/step_memory.py                  # 3 steps, glibc malloc as the launcher leaves it
    python benchmarks/memory/step_memory.py --trim           # also malloc_trim(0) at each point: what is retention
    python benchmarks/memory/step_memory.py --preload /usr/lib/x86_64-linux-gnu/libjemalloc.so.2

Each rank samples, after the load and after each step's forward, backward and optimizer step: VmRSS, RssAnon,
the live bytes of CPU tensor storages (estimate_accuracy.LiveBytes, tracking from before the build), and with
`--trim` RssAnon again after glibc's malloc_trim(0), so the gap between live bytes and RSS splits into what the
allocator keeps (trimmable) and what is not a tensor (imports, libraries' arenas). A thread samples RSS every
20 ms and VmHWM covers the whole run. One JSON line per rank; no assertions.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from load_memory import GB, RssSampler

REPO = Path(__file__).resolve().parents[2]
RUN = ["lora.enabled=true", "train.precision=bf16-mixed", "dist.strategy=fsdp", "train.micro_batch_size=1",
       "data.max_length=128", "model.gradient_checkpointing=false"]


def malloc_trim() -> bool:
    """glibc's malloc_trim(0): free pages back to the kernel; False where the allocator is not glibc's."""
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


def held_bytes(model: Any, optimizer: Any) -> int:
    """What the job keeps by name: this rank's parameters (local shards), their gradients and AdamW's state."""
    def local(tensor: Any) -> int:
        tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        return tensor.untyped_storage().nbytes() if tensor.device.type == "cpu" else 0

    params = list(model.parameters())
    state = [t for s in optimizer.state.values() for t in s.values() if hasattr(t, "untyped_storage")]
    return sum(local(p) for p in params) + sum(local(p.grad) for p in params if p.grad is not None) + sum(
        local(t) for t in state)


def point(name: str, live: Any, trim: bool, held: int | None = None) -> dict[str, Any]:
    """One phase's figures in GB: RSS, anonymous RSS, live tensor bytes (all, or the job's held state), and
    anonymous RSS after a trim."""
    now = RssSampler.read()
    row = {"at": name, "rss": now["VmRSS"] / GB, "anon": now.get("RssAnon", 0) / GB}
    if live is not None:
        row["live"] = live.current / GB
    if held is not None:
        row["held"] = held / GB
    if trim:
        malloc_trim()
        row["anon_trimmed"] = RssSampler.read().get("RssAnon", 0) / GB
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}


def worker(folder: str, out: str, steps: int, trim: bool, track: bool, extra: list[str]) -> None:
    """One rank: the job built as training builds it, then `steps` steps as the recipe runs them."""
    import torch

    from trainyard import dist, precision
    from trainyard.config_file import load_config
    from trainyard.loss import token_loss_sum
    from trainyard.model import source as source_room
    from trainyard.train import build
    from trainyard.train.optim import build_optimizer, grad_norm_and_clip

    points = [point("imports", None, trim)]
    overrides = ["model.config=null", f"model.path={folder}", "model.tokenizer=builtin:bytes", *RUN, *extra]
    cfg = load_config(str(REPO / "configs" / "tiny.yaml"), overrides)
    info = dist.init(cfg.dist)
    tokenizer = source_room.load_tokenizer(cfg.model, folder)
    resolved = precision.resolve(cfg, info.device)
    live = None
    if track:
        from estimate_accuracy import LiveBytes, follow_fsdp_storage_resizes

        live = LiveBytes()
        follow_fsdp_storage_resizes(live)
        live.__enter__()
    started = time.perf_counter()
    RssSampler.reset_high_water_mark()
    with RssSampler() as sampler:
        model, _, _ = build.build_and_wrap(cfg, info, resolved, folder, tokenizer)
        optimizer, _ = build_optimizer(model, cfg)
        points.append(point("load", live, trim, held_bytes(model, optimizer)))
        step_s = []
        for step in range(1, steps + 1):
            torch.manual_seed(step + info.rank)
            ids = torch.randint(3, 32000, (1, cfg.data.max_length * cfg.train.micro_batch_size))
            batch = {"input_ids": ids, "labels": ids.clone()}
            began = time.perf_counter()
            loss, _ = token_loss_sum(model, batch, info.device, cfg.train.loss_chunk_tokens)
            points.append(point(f"step{step}.forward", live, trim, held_bytes(model, optimizer)))
            loss.backward()
            points.append(point(f"step{step}.backward", live, trim, held_bytes(model, optimizer)))
            grad_norm_and_clip(model, cfg.train.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step_s.append(round(time.perf_counter() - began, 3))
            points.append(point(f"step{step}.optimizer", live, trim, held_bytes(model, optimizer)))
    if live is not None:
        live.__exit__(None, None, None)
    figures = {
        "rank": info.rank, "allocator": os.environ.get("LD_PRELOAD") or "glibc", "trim": trim,
        "env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
        "peak_rss": round(max(sampler.peak(), RssSampler.read().get("VmHWM", 0)) / GB, 3),
        "peak_anon": round(max(anon for _, _, anon, _ in sampler.samples) / GB, 3),
        "peak_live": round(live.peak / GB, 3) if live is not None else None,
        "seconds": round(time.perf_counter() - started, 1), "step_s": step_s, "points": points,
    }
    Path(f"{out}.rank{info.rank}").write_text(json.dumps(figures))
    dist.exit_process(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, default=Path(tempfile.gettempdir()) / "trainyard-bench-llama-0.9b")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--trim", action="store_true", help="malloc_trim(0) at each point (glibc only)")
    parser.add_argument("--no-live", action="store_true", help="do not track live tensor bytes (no dispatch mode)")
    parser.add_argument("--preload", help="a malloc library to LD_PRELOAD into the workers")
    parser.add_argument("--worker", nargs=2, metavar=("FOLDER", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="more config overrides, key=value")
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker[0], args.worker[1], args.steps, args.trim, not args.no_live, args.overrides)
    if not (args.folder / "config.json").is_file():
        args.folder.mkdir(parents=True, exist_ok=True)  # saved in a process of its own, as load_memory.py does
        maker = REPO / "benchmarks" / "memory" / "load_memory.py"
        subprocess.run([sys.executable, str(maker), "--make", str(args.folder)], check=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // 2))}
    if args.preload:
        env["LD_PRELOAD"] = args.preload
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "figures")
        here = str(Path(__file__).resolve())
        flags = [f"--steps={args.steps}", *(["--trim"] if args.trim else []), *(["--no-live"] if args.no_live else [])]
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", here,
                        *flags, "--worker", str(args.folder), out, *args.overrides], check=True, env=env, cwd=REPO)
        for rank in range(2):
            print(Path(f"{out}.rank{rank}").read_text(), flush=True)


if __name__ == "__main__":
    main()
