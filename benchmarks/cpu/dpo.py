"""trainyard DPO against TRL's DPOTrainer at its best on this machine: LoRA, 2 processes, tokens/s and peak RSS.

    python benchmarks/cpu/dpo.py                                  # 3 rounds of 12 steps, SmolLM2-135M-Instruct
    python benchmarks/cpu/dpo.py --steps 3 --rounds 1 --model tiny --trl-variants fp32 --no-wait   # a quick try

Both stacks train the same model with the same LoRA (r=8, alpha=16, dropout 0, q/k/v/o/gate/up/down) on the same
pairs (prompt/chosen/rejected strings made from alpaca_data.py's rows: the alpaca prompt, its reply chosen, another
row's reply rejected; each completion + eos, as both tokenize it), dpo.loss sigmoid, beta 0.1, 4 pairs per process
per step, 2 processes (8 pairs a step), the same steps, lr and cosine schedule; no eval, no checkpoint. The reference
is the model with its adapters off on both sides, one forward without gradients per step (TRL's default; its
`precompute_ref_log_probs` would move that work before the timed steps).

trainyard runs at its defaults (`trainyard train --nproc 2`: padding-free pairs, bf16-mixed where the CPU has bf16
matrix units). TRL runs under torchrun (gloo) in the variants that can be its best: fp32 and bf16 autocast, tried in
round 1, the faster kept for later rounds; TRL's `padding_free` is asked for where its DPOConfig offers it, and the
result says whether it was used (TRL 1.16 warns that it is unavailable and pads). Figures per run: real (non-padding)
tokens/s over the steps after the first, timed step end to step end, the median step, and the peak RSS (VmHWM) of
each rank, sampled from /proc the same way for both stacks; medians over rounds (every second round runs the stacks
in reverse order). It prints JSON lines, then a table of ratios (trainyard / TRL); nothing is recorded.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # the shared helpers

import alpaca_data  # noqa: E402
from bench_env import commit, cpu_description, loadavg, wait_for_quiet  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MODELS = {
    "smollm2": ("benchmarks/configs/bench-smollm2.yaml", ["data.max_length=1024"]),
    "tiny": ("configs/tiny.yaml", ["data.max_length=4096", "model.config.max_position_embeddings=4096"]),
}
"""Each stack cuts a document (prompt + completion) at data.max_length, keeping its start: these pairs fit."""
NPROC, PAIRS_PER_RANK = 2, 4
LR, BETA = 2e-4, 0.1
TRL_VARIANTS = {"fp32": {"bf16": False}, "bf16": {"bf16": True}}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run (the first is not timed)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    parser.add_argument("--quiet-load", type=float, default=1.0, help="start when the 1-minute load is below this")
    parser.add_argument("--max-wait-s", type=float, default=120.0, help="then start anyway, noting the load")
    parser.add_argument("--no-wait", action="store_true")
    parser.add_argument("--trl-variants", nargs="+", choices=sorted(TRL_VARIANTS), default=sorted(TRL_VARIANTS),
                        help="TRL's variants tried in round 1 (the fastest is kept)")
    parser.add_argument("--trl-worker", default=None, help=argparse.SUPPRESS)  # JSON settings: a TRL rank
    return parser.parse_args()


def job(model: str, pairs: Path, steps: int, out: Path) -> tuple[str, list[str]]:
    """The trainyard job both stacks are measured on: its config file and overrides."""
    config, more = MODELS[model]
    return config, [
        *more, "train.objective=dpo", f"dpo.beta={BETA}", "dpo.loss=sigmoid", f"data.path={pairs}", "data.format=auto",
        "data.eval_path=null", "data.eval_fraction=0", "lora.enabled=true", "lora.r=8", "lora.alpha=16",
        "lora.dropout=0.0", f"lora.target_modules=[{','.join(LORA_TARGETS)}]", f"train.max_steps={steps}",
        f"train.micro_batch_size={PAIRS_PER_RANK}", f"train.global_batch_size={NPROC * PAIRS_PER_RANK}",
        f"train.lr={LR}", "train.schedule=cosine", "train.warmup_steps=0", "train.epochs=null",
        "eval.every_steps=0", "eval.at_end=false", "checkpoint.every_steps=0", "checkpoint.lite_every_steps=0",
        "checkpoint.every_minutes=0", "checkpoint.at_end=false", "log.every_steps=1", "log.tensorboard=false",
        f"output_dir={out}", "run_name=trainyard", f"data.cache_dir={out}/cache",
    ]


def write_pairs(path: Path, rows: int) -> None:
    """Alpaca rows as preference pairs: the row's reply chosen, the next row's rejected."""
    from trainyard.data.formats import alpaca_prompt

    made = alpaca_data.make_rows(rows + 1, seed=7)
    pairs = [{"prompt": alpaca_prompt(row["instruction"], row["input"]), "chosen": row["output"],
              "rejected": following["output"]} for row, following in zip(made, made[1:])]
    path.write_text("".join(json.dumps(pair) + "\n" for pair in pairs))


def environment() -> dict[str, str]:
    """This checkout's trainyard first on the path of every process."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"),
                                                                     os.environ.get("PYTHONPATH")]))}


def rank_peaks(proc: subprocess.Popen, every_s: float = 0.2) -> list[int]:
    """Wait for proc; each descendant's highest VmHWM (peak RSS, loading included), largest first: the ranks."""
    peaks: dict[int, int] = {}
    root = psutil.Process(proc.pid)
    while proc.poll() is None:
        with contextlib.suppress(psutil.Error):
            for child in root.children(recursive=True):
                with contextlib.suppress(OSError):
                    found = re.search(r"VmHWM:\s+(\d+) kB", Path(f"/proc/{child.pid}/status").read_text())
                    if found:
                        peaks[child.pid] = max(peaks.get(child.pid, 0), int(found.group(1)) * 1024)
        time.sleep(every_s)
    return sorted(peaks.values(), reverse=True)[:NPROC]


def steady(tokens: list[float], seconds: list[float]) -> dict[str, Any]:
    """Real tokens/s over the steps after the first, the median of those steps, and every step's tokens (the
    pairs make one epoch: both stacks train the same tokens in all)."""
    return {"tokens_per_s": sum(tokens[1:]) / sum(seconds[1:]) if len(seconds) > 1 else None,
            "s_per_step": statistics.median(seconds[1:]) if len(seconds) > 1 else None, "steps": len(seconds),
            "tokens_total": int(sum(tokens))}


def run(argv: list[str], log: Path) -> tuple[list[int], float]:
    started = time.perf_counter()
    with open(log, "w") as handle:
        proc = subprocess.Popen(argv, cwd=REPO, env=environment(), stdout=handle, stderr=subprocess.STDOUT)
        peaks = rank_peaks(proc)
    if proc.returncode != 0:
        raise SystemExit(f"{argv[:4]}... exit {proc.returncode}:\n{log.read_text()[-3000:]}")
    return peaks, time.perf_counter() - started


def trainyard(model: str, pairs: Path, steps: int, out: Path) -> dict[str, Any]:
    config, overrides = job(model, pairs, steps, out)
    peaks, wall = run([sys.executable, "-m", "trainyard.cli", "train", config, "--nproc", str(NPROC), *overrides],
                      out / "trainyard.log")
    run_dir = out / "trainyard"
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [e for e in events if e["kind"] == "train"]
    tokens = [float(e["tokens"]) - float(p["tokens"] if p else 0) for p, e in zip([None, *train], train)]
    log = (run_dir / "logs" / "rank-0.log").read_text()
    compute = re.search(r"compute (\w+)", log)
    return {"stack": "trainyard", "variant": compute.group(1) if compute else "fp32", "padding_free": True,
            **steady(tokens, [n / e["tokens_per_s"] for n, e in zip(tokens, train)]),
            "peak_rss_per_rank_gb": [round(p / 1e9, 3) for p in peaks], "wall_s": round(wall, 1),
            "losses": [e["loss"] for e in train]}


def trl(model: str, pairs: Path, steps: int, out: Path, variant: dict[str, Any]) -> dict[str, Any]:
    settings = {"model": model, "pairs": str(pairs), "steps": steps, "out": str(out), **variant}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(NPROC)]
    result = out / "trl.json"
    peaks, wall = run([*torchrun, __file__, "--trl-worker", json.dumps(settings)], out / "trl.log")
    figures = json.loads(result.read_text())
    return {"stack": "trl", "variant": "bf16" if variant["bf16"] else "fp32", **figures,
            "peak_rss_per_rank_gb": [round(p / 1e9, 3) for p in peaks], "wall_s": round(wall, 1)}


def trl_worker(settings: dict[str, Any]) -> None:
    """One TRL rank under torchrun: the job's model, LoRA and pairs, DPOTrainer's own collator, timed."""
    import datasets
    import torch
    import transformers
    import trl as trl_room
    from hf_common import StepTimer, all_reduce
    from peft import LoraConfig

    from trainyard.config_file import load_config
    from trainyard.model import source as source_room

    transformers.utils.logging.set_verbosity_error()
    config, overrides = job(settings["model"], Path(settings["pairs"]), settings["steps"], Path(settings["out"]))
    cfg = load_config(config, overrides)
    path = source_room.resolve_model_path(cfg.model) if cfg.model.path else None
    tokenizer = source_room.load_tokenizer(cfg.model, path)
    if path:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    else:  # built from model.config, with the tokenizer's vocabulary, as trainyard builds it
        model = transformers.AutoModelForCausalLM.from_config(source_room.architecture(cfg.model, tokenizer))
    fields = trl_room.DPOConfig.__dataclass_fields__
    offered = {"padding_free": True} if "padding_free" in fields else {}
    args = trl_room.DPOConfig(
        output_dir=str(Path(settings["out"]) / "trl"), per_device_train_batch_size=PAIRS_PER_RANK,
        max_steps=settings["steps"], learning_rate=LR, lr_scheduler_type="cosine", warmup_steps=0, beta=BETA,
        loss_type=["sigmoid"], max_length=cfg.data.max_length, bf16=settings["bf16"], fp16=False, use_cpu=True,
        ddp_backend="gloo", report_to="none", save_strategy="no", eval_strategy="no", logging_steps=1,
        disable_tqdm=True, dataloader_num_workers=0, ddp_find_unused_parameters=False, seed=cfg.train.seed,
        **offered,
    )
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    rows = [json.loads(line) for line in Path(settings["pairs"]).read_text().splitlines()]
    real: list[int] = []
    padded: list[int] = []

    class Counted(trl_room.DPOTrainer):
        """Notes the real (attended) and computed tokens of every micro-batch it trains on."""

        def training_step(self, model: Any, inputs: dict[str, Any], *rest: Any, **kwargs: Any) -> Any:
            real.append(int(inputs["attention_mask"].sum()))
            padded.append(int(inputs["input_ids"].numel()))
            return super().training_step(model, inputs, *rest, **kwargs)

    timer = StepTimer()
    trainer = Counted(model=model, args=args, processing_class=tokenizer, peft_config=lora,
                      train_dataset=datasets.Dataset.from_list(rows), callbacks=[timer])
    trainer.train()
    tokens, computed = all_reduce([float(n) for n in real]), all_reduce([float(n) for n in padded])
    seconds = [timer.end[0] - timer.begin[0]] + [b - a for a, b in zip(timer.end, timer.end[1:])]
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    if int(os.environ.get("RANK", "0")) == 0:
        Path(settings["out"], "trl.json").write_text(json.dumps({
            "trl": trl_room.__version__, "padding_free": bool(getattr(trainer, "padding_free", False)),
            "padding_free_offered": bool(offered), "padding_share": 1 - sum(tokens) / sum(computed),
            **steady(tokens, seconds), "losses": losses}))


def median_of(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def table(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> str:
    """trainyard's and TRL's medians over rounds, and their ratios."""
    rows = [("tokens/s (real)", "tokens_per_s", ",.1f"), ("s per step (median)", "s_per_step", ".3f"),
            ("peak RSS, largest rank (GB)", "peak_rss_gb", ".3f"), ("peak RSS, other rank (GB)", "other_rss_gb", ".3f"),
            ("tokens trained, all steps", "tokens_total", ",.0f")]
    for figures in (*ours, *theirs):
        figures["peak_rss_gb"], figures["other_rss_gb"] = (figures["peak_rss_per_rank_gb"] + [0.0, 0.0])[:2]
    lines = [f"{'':30} {'trainyard':>12} {'TRL':>12} {'ratio':>8}",
             f"{'variant':30} {ours[0]['variant']:>12} {theirs[0]['variant']:>12}"]
    for name, key, form in rows:
        a, b = median_of(ours, key), median_of(theirs, key)
        lines.append(f"{name:30} {a:>12{form}} {b:>12{form}} {a / b if b else float('nan'):>7.2f}x")
    lines.append(f"{'TRL padding-free':30} {'':>12} {str(theirs[0].get('padding_free')):>12}  "
                 f"(offered by DPOConfig: {theirs[0].get('padding_free_offered')}; padding share "
                 f"{theirs[0].get('padding_share') or 0:.1%})")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    if args.trl_worker:
        trl_worker(json.loads(args.trl_worker))
        return
    if not args.no_wait:
        wait_for_quiet(args.quiet_load, args.max_wait_s)
    print(json.dumps({"cpu": cpu_description(), "commit": commit(), "load": loadavg(), "model": args.model,
                      "steps": args.steps, "rounds": args.rounds}), flush=True)
    ours: list[dict[str, Any]] = []
    theirs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="dpo-bench-") as tmp:
        pairs = Path(tmp) / "pairs.jsonl"
        write_pairs(pairs, args.steps * NPROC * PAIRS_PER_RANK)
        best: dict[str, Any] | None = None
        for round_ in range(args.rounds):
            stacks = ["trainyard", "trl"] if round_ % 2 == 0 else ["trl", "trainyard"]
            for stack in stacks:
                variants = [TRL_VARIANTS[name] for name in args.trl_variants] if best is None else [best]
                for variant in ([{}] if stack == "trainyard" else variants):
                    out = Path(tmp) / f"round-{round_}-{stack}-{len(ours) + len(theirs)}"
                    out.mkdir()
                    if stack == "trainyard":
                        ours.append(trainyard(args.model, pairs, args.steps, out))
                        print(json.dumps({**ours[-1], "round": round_, "load": loadavg()}), flush=True)
                    else:
                        theirs.append({**trl(args.model, pairs, args.steps, out, variant), "settings": variant})
                        print(json.dumps({**theirs[-1], "round": round_, "load": loadavg()}), flush=True)
                if stack == "trl" and best is None:  # round 1 tried every variant: keep TRL's fastest
                    fastest = max(theirs, key=lambda r: r["tokens_per_s"] or 0.0)
                    best, theirs = fastest["settings"], [fastest]
    print(table(ours, theirs), flush=True)
    print(json.dumps({"load_after": loadavg()}), flush=True)


if __name__ == "__main__":
    main()
