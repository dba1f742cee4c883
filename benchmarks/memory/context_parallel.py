"""Context parallelism against one process on one long document (issue 50, item 6): a ~0.1B Llama (random init from its
config, the byte tokenizer), LoRA, fp32 (or --precision), activation checkpointing (or not), one 16,384-token
document of real text a step.

    python benchmarks/memory/context_parallel.py                   # 1 process, then CP 2 on 2 processes
    python benchmarks/memory/context_parallel.py --tokens 2048     # a quick check of the mechanics
    python benchmarks/memory/context_parallel.py --no-checkpointing  # every layer's activations held for the backward

Each process has one core (OMP_NUM_THREADS=1, as torchrun sets for each CP rank). Each run trains `--steps` steps of
the same document with `trainyard.train.recipe.run`, as `trainyard train` runs a rank. Per rank: the peak RSS
(VmHWM), the seconds spent in CP's all-to-alls (`dist.all_to_all_rows`, timed on the host: gloo's all-to-all returns
when the data has arrived; every step exchanges the same bytes, so a step's share is the run's over its steps), and
from metrics.jsonl the steps after the first (which carries one-time costs): tokens/s per process and seconds a
step. Prints one JSON line per run and the ratios; no assertions. Each process sets glibc's malloc as `trainyard train`
does (launch/allocator.return_freed_memory); TRAINYARD_ALLOCATOR=off measures glibc's malloc left as it is."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # the shared helpers

from bench_env import commit, cpu_description, loadavg  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
LLAMA = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
         "num_attention_heads": 16, "num_key_value_heads": 4, "max_position_embeddings": 32768,
         "tie_word_embeddings": True}
"""~0.1B parameters (94M in the blocks): Llama-3.2's proportions at a tenth of 1B's width x depth."""


def document(tokens: int) -> str:
    """At least `tokens` bytes of real text (one byte a token): the repository's own documentation, repeated."""
    text = "\n\n".join(p.read_text() for p in sorted((REPO / "docs").rglob("*.md")))
    return (text * (tokens // max(len(text.encode()), 1) + 1))[: tokens + 16]


def overrides(
    out: Path, data: Path, tokens: int, steps: int, context: int, precision: str, checkpointing: bool
) -> list[str]:
    return [
        f"output_dir={out}", "run_name=cp", f"model.config={json.dumps(LLAMA)}", "model.tokenizer=builtin:bytes",
        f"data.path={data}", f"data.max_length={tokens}", "data.padding_free=true", "lora.enabled=true",
        f"train.precision={precision}", "train.micro_batch_size=1", f"train.max_steps={steps}", "train.warmup_steps=0",
        f"model.gradient_checkpointing={str(checkpointing).lower()}", "eval.every_steps=0", "eval.at_end=false",
        "checkpoint.at_end=false",
        "log.every_steps=1", f"dist.strategy={'fsdp' if context > 1 else 'none'}", f"dist.context_parallel={context}",
    ]


def worker(out: Path, args: list[str]) -> None:
    """One rank: CP's all-to-alls timed, the recipe run, then this rank's peak RSS and all-to-all seconds."""
    from trainyard import dist
    from trainyard.config_file import load_config
    from trainyard.launch.allocator import return_freed_memory
    from trainyard.train.recipe import run

    spent = [0.0]
    exchange = dist.all_to_all_rows

    def timed(*a, **k):  # type: ignore[no-untyped-def]
        started = time.perf_counter()
        try:
            return exchange(*a, **k)
        finally:
            spent[0] += time.perf_counter() - started

    dist.all_to_all_rows = timed
    return_freed_memory()  # as `trainyard train` does in every training process
    run(load_config("configs/tiny.yaml", args))
    rank = int(os.environ.get("RANK", "0"))
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    peak_gb = int(status["VmHWM"].split()[0]) / 2**20
    (out / f"rank-{rank}.json").write_text(json.dumps({"peak_rss_gb": peak_gb, "all_to_all_s": spent[0]}))


def measure(tokens: int, steps: int, context: int, data: Path, root: Path, precision: str, checkpointing: bool) -> dict:
    out = root / f"cp{context}"
    out.mkdir()
    job = overrides(out, data, tokens, steps, context, precision, checkpointing)
    command = [sys.executable, __file__, "--worker", str(out), *job]
    if context > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(context),
                   "--master-port", "29731", *command[1:]]
    started = time.perf_counter()
    # One core a process, as torchrun gives each CP rank: tokens/s per process compares like with like.
    subprocess.run(command, cwd=REPO, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    wall = time.perf_counter() - started
    events = [json.loads(line) for line in (out / "cp" / "metrics.jsonl").read_text().splitlines()]
    trains = [e for e in events if e["kind"] == "train"]
    later = trains[1:]  # the first step carries one-time costs
    step_tokens = trains[0]["tokens"]  # the same document every step
    step_s = [step_tokens / e["tokens_per_s"] for e in later]
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(context)]
    a2a_per_step = max(r["all_to_all_s"] for r in ranks) / len(trains)  # every step exchanges the same bytes
    return {"context_parallel": context, "tokens": tokens, "precision": precision, "checkpointing": checkpointing,
            "wall_s": round(wall, 1),
            "tokens_per_s_per_process": sum(e["tokens_per_s_per_rank"] for e in later) / len(later),
            "step_s": [round(s, 2) for s in step_s],
            "peak_rss_gb": [round(r["peak_rss_gb"], 3) for r in ranks],
            "all_to_all_share": round(a2a_per_step / (sum(step_s) / len(step_s)), 4)}


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        worker(Path(sys.argv[2]), sys.argv[3:])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--precision", default="fp32", help="train.precision of both runs")
    parser.add_argument("--checkpointing", action=argparse.BooleanOptionalAction, default=True,
                        help="model.gradient_checkpointing of both runs")
    args = parser.parse_args()
    print(f"# {cpu_description()}; commit {commit()}; load before {loadavg()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = root / "long.jsonl"
        data.write_text(json.dumps({"text": document(args.tokens)}) + "\n")
        one = measure(args.tokens, args.steps, 1, data, root, args.precision, args.checkpointing)
        print(json.dumps(one), flush=True)
        two = measure(args.tokens, args.steps, 2, data, root, args.precision, args.checkpointing)
        print(json.dumps(two), flush=True)
    print(json.dumps({
        "peak_rss_per_rank_ratio": round(max(two["peak_rss_gb"]) / one["peak_rss_gb"][0], 3),
        "tokens_per_s_per_process_ratio": round(two["tokens_per_s_per_process"] / one["tokens_per_s_per_process"], 3),
        "all_to_all_share_of_step": two["all_to_all_share"], "load_after": loadavg(),
    }), flush=True)


if __name__ == "__main__":
    main()
