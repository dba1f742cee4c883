"""What the HF Trainer and TRL workers share: the alpaca rows, step timing, and the after-training figures.

Both workers run under torchrun (2 CPU processes with gloo, or 1 process on a GPU) and end with
`finish`, which measures on the trained model what trainyard reports in metrics.jsonl, the same way
for both: the eval subset's wall time, a lite save (the adapter, `trainer.save_model`), a full save
(`trainer._save_checkpoint`: adapter + optimizer + scheduler + rng), and peak memory per rank;
then rank 0 writes one JSON result for bench.py.
"""

from __future__ import annotations

import json
import os
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist
from transformers import TrainerCallback

from trainyard.data.formats import alpaca_prompt

IGNORE_INDEX = -100
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def read_rows(path: str) -> list[dict[str, str]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def encode_alpaca(row: dict[str, str], tokenizer: Any, max_length: int) -> tuple[list[int], list[int]]:
    """(input_ids, labels) exactly as trainyard's alpaca encoder: prompt + response + eos, prompt masked."""
    prompt_ids = tokenizer(alpaca_prompt(row["instruction"], row.get("input") or ""))["input_ids"]
    response_ids = tokenizer(row["output"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = (prompt_ids + response_ids)[:max_length]
    labels = ([IGNORE_INDEX] * len(prompt_ids) + response_ids)[:max_length]
    labels[0] = IGNORE_INDEX
    return ids, labels


def shared_training_args(args: Any, accumulation: int, cuda: bool) -> dict[str, Any]:
    """What HF Trainer's and TRL's runs are told alike: the job's steps and schedule, nothing saved or reported
    in the loop, loss-only evaluation (else evaluate() also gathers every logit: 64 x 512 x 49152 floats)."""
    return {
        "per_device_eval_batch_size": 8,
        "prediction_loss_only": True,
        "gradient_accumulation_steps": accumulation,
        "max_steps": args.steps,
        "learning_rate": args.lr,
        "lr_scheduler_type": "cosine",
        "warmup_steps": args.warmup_steps,
        "bf16": args.bf16,
        "eval_strategy": "no",
        "save_strategy": "no",
        "report_to": "none",
        "logging_steps": args.steps,
        "disable_tqdm": True,
        "use_cpu": not cuda,
        "ddp_backend": None if cuda else "gloo",
        "dataloader_num_workers": 0,
        "seed": args.seed,
    }


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def distributed() -> bool:
    return torch_dist.is_available() and torch_dist.is_initialized()


def barrier() -> None:
    if distributed():
        torch_dist.barrier()


def all_reduce(values: list[float], op: str = "sum") -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64)
    if distributed():
        torch_dist.all_reduce(tensor, op=torch_dist.ReduceOp.MAX if op == "max" else torch_dist.ReduceOp.SUM)
    return tensor.tolist()


class CountingCollator:
    """Wraps the stack's collator and notes each micro-batch's real (non-padding) and padded tokens, in order.

    Batches are collated in this process (no loader workers) in the order they are trained on, so with
    accumulation A, micro-batches [A*k, A*(k+1)) make optimizer step k+1. A padding-free batch has no
    attention_mask: every token in it is real.
    """

    def __init__(self, collate: Any) -> None:
        self.collate = collate
        self.real: list[int] = []
        self.padded: list[int] = []

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.collate(features)
        mask = batch.get("attention_mask")
        self.real.append(int(mask.sum()) if mask is not None else int(batch["input_ids"].numel()))
        self.padded.append(int(batch["input_ids"].numel()))
        return batch


class StepTimer(TrainerCallback):
    """Monotonic times of each optimizer step's begin and end; wall-clock time of step 1's end."""

    def __init__(self) -> None:
        self.begin: list[float] = []
        self.end: list[float] = []
        self.first_step_wall: float | None = None

    def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self.begin.append(time.monotonic())

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self.end.append(time.monotonic())
        if self.first_step_wall is None:
            self.first_step_wall = time.time()


def throughput(timer: StepTimer, collator: CountingCollator, accumulation: int) -> dict[str, Any]:
    """Real tokens/s over the steps after the first, timed step end to step end (batch fetch included,
    as trainyard's step time includes it); the in-loop figure (on_step_begin -> on_step_end) beside it."""
    steps = len(timer.end)
    per_step = [sum(collator.real[k * accumulation : (k + 1) * accumulation]) for k in range(steps)]
    padded = [sum(collator.padded[k * accumulation : (k + 1) * accumulation]) for k in range(steps)]
    real = all_reduce([float(n) for n in per_step])
    padded = all_reduce([float(n) for n in padded])
    intervals = [timer.end[k] - timer.end[k - 1] for k in range(1, steps)]
    in_loop = [e - b for b, e in zip(timer.begin[1:], timer.end[1:])]
    steady_tokens = sum(real[1:])
    ordered = sorted(intervals)
    return {
        "steps": steps,
        "tokens_real": sum(real),
        "tokens_padded": sum(padded),
        "tokens_per_s": steady_tokens / sum(intervals) if intervals else None,
        "tokens_per_s_in_loop": steady_tokens / sum(in_loop) if in_loop else None,
        "padding_share": 1 - sum(real) / sum(padded) if sum(padded) else None,
        "s_per_step": ordered[len(ordered) // 2] if ordered else None,
        "step_times_s": [round(t, 4) for t in intervals],
    }


def _timed_on_rank0(action: Any) -> float:
    """Seconds rank 0 spends in action (what a save at that point would block the loop for)."""
    barrier()
    started = time.monotonic()
    action()
    seconds = time.monotonic() - started
    barrier()
    return seconds


def finish(
    trainer: Any,
    timer: StepTimer,
    collator: CountingCollator,
    eval_dataset: Any,
    out: str | None,
    facts: dict[str, Any],
) -> None:
    """After trainer.train(): throughput, eval time, lite/full save stalls, peak memory; rank 0 writes JSON."""
    accumulation = trainer.args.gradient_accumulation_steps
    figures = throughput(timer, collator, accumulation)
    started = time.monotonic()
    metrics = trainer.evaluate(eval_dataset=eval_dataset)
    eval_s = time.monotonic() - started
    with tempfile.TemporaryDirectory(prefix="bench-save-") as scratch:
        trainer.args.output_dir = scratch  # _save_checkpoint writes under output_dir/checkpoint-<step>
        lite_s = _timed_on_rank0(lambda: trainer.save_model(os.path.join(scratch, "adapter")))
        full_s = _timed_on_rank0(lambda: trainer._save_checkpoint(trainer.model, trial=None))
        barrier()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
    gpu = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    peak_rss, peak_gpu = all_reduce([float(rss), float(gpu)], op="max")
    model = trainer.model
    result = {
        **facts,
        **figures,
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "per_device_batch": trainer.args.per_device_train_batch_size,
        "accumulation": accumulation,
        "bf16": bool(trainer.args.bf16),
        "sampling": trainer.args.train_sampling_strategy,
        "params": sum(p.numel() for p in model.parameters()),
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "first_step_wall_time": timer.first_step_wall,
        "eval_s": eval_s,
        "eval_loss": metrics.get("eval_loss"),
        "eval_rows": len(eval_dataset),
        "lite_save_s": lite_s,
        "full_save_s": full_s,
        "peak_rss_bytes": peak_rss,
        "peak_gpu_bytes": peak_gpu or None,
        "torch_threads": torch.get_num_threads(),
    }
    if rank() == 0:
        text = json.dumps(result, indent=2)
        print(text)
        if out:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            Path(out).write_text(text + "\n")
