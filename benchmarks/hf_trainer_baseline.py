"""The reference stack of the field notes (seed 002): HF Trainer + PEFT LoRA under torchrun.

Run it under torchrun, for example:

    torchrun --standalone --nproc-per-node 2 benchmarks/hf_trainer_baseline.py --mode seeds --steps 12
    torchrun --standalone --nproc-per-node 2 benchmarks/hf_trainer_baseline.py --mode tuned --steps 12

It trains the same SmolLM2-135M-Instruct safetensors folder trainyard's quickstart uses, with
the same LoRA (r=16, alpha=32, dropout 0, every linear projection of the blocks), on the same
`builtin:dates` rows rendered with the tokenizer's chat template, with `transformers.Trainer`:

  seeds  as seed 002 wrote it: padding="max_length" to 512, batch 1 per device,
         labels = a copy of input_ids, default_data_collator.
  tuned  dynamic padding with DataCollatorForSeq2Seq, labels masked to the response,
         batch 4 per device.

Throughput is measured the way trainyard's summary.json measures it: real (non-padding)
tokens, counted from attention_mask over every rank, per second of training-loop wall time,
the first optimizer step excluded. The loop's time is taken by a TrainerCallback between
on_step_begin and on_step_end on rank 0 (`tokens_per_s`); the time from one on_step_end to
the next, which also covers fetching the batch (trainyard's step time does), is reported as
`tokens_per_s_end_to_end`.

No assertions: this is a measurement, never part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist
import transformers
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    default_data_collator,
)

from trainyard.config import ModelConfig
from trainyard.data import builtin_rows
from trainyard.model import resolve_model_path

IGNORE_INDEX = -100
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MODES = {
    # mode: (per-device batch, pad to max_length?, labels masked to the response?)
    "seeds": (1, True, False),
    "tuned": (4, False, True),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=sorted(MODES), required=True)
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps (max_steps)")
    parser.add_argument("--batch", type=int, default=None, help="per-device batch (default: the mode's)")
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument(
        "--n-train", type=int, default=2000, help="builtin:dates train rows (data.synthetic_train_size)"
    )
    parser.add_argument("--n-eval", type=int, default=40, help="builtin:dates eval rows (data.synthetic_eval_size)")
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct", help="trainyard model.path to resolve")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--out", default=None, help="write the result JSON here (rank 0)")
    return parser.parse_args()


def render(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool = False) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def tokenize_seeds(rows: list[dict[str, Any]], tokenizer: Any, max_length: int) -> Dataset:
    """Seed 002: whole conversation, padded to max_length, labels = a copy of input_ids."""
    texts = [tokenizer.apply_chat_template(row["messages"], tokenize=False) for row in rows]
    enc = tokenizer(texts, add_special_tokens=False, truncation=True, max_length=max_length, padding="max_length")
    return Dataset.from_dict(
        {
            "input_ids": enc["input_ids"],
            "attention_mask": enc["attention_mask"],
            "labels": [list(ids) for ids in enc["input_ids"]],
        }
    )


def tokenize_tuned(rows: list[dict[str, Any]], tokenizer: Any, max_length: int) -> Dataset:
    """No padding here (the collator pads per batch); loss only on the assistant's reply."""
    columns: dict[str, list[list[int]]] = {"input_ids": [], "attention_mask": [], "labels": []}
    for row in rows:
        messages = row["messages"]
        full = render(tokenizer, messages)
        prompt = render(tokenizer, messages[:-1], generation_prompt=True)
        if full[: len(prompt)] != prompt:  # not prefix-stable: fall back to the whole sequence
            prompt = []
        labels = [IGNORE_INDEX] * len(prompt) + full[len(prompt) :]
        columns["input_ids"].append(full[:max_length])
        columns["attention_mask"].append([1] * len(full[:max_length]))
        columns["labels"].append(labels[:max_length])
    return Dataset.from_dict(columns)


class CountingCollator:
    """The mode's collator, noting the real and padded tokens of each batch in order.

    The DataLoader collates in this process (no workers) in the order the Trainer consumes
    batches, so batch k of the list is the k-th micro-batch trained on, even when the
    loader prefetches one batch ahead.
    """

    def __init__(self, collate: Any) -> None:
        self.collate = collate
        self.real: list[int] = []
        self.padded: list[int] = []

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = self.collate(features)
        self.real.append(int(batch["attention_mask"].sum()))
        self.padded.append(int(batch["input_ids"].numel()))
        return batch


class StepTimer(TrainerCallback):
    """Wall time of every optimizer step: begin -> end, and end -> next end."""

    def __init__(self) -> None:
        self.begin: list[float] = []
        self.end: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self.begin.append(time.monotonic())

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self.end.append(time.monotonic())


def main() -> None:
    args = parse_args()
    batch_size, pad_to_max, _masked = MODES[args.mode]
    batch_size = args.batch or batch_size
    transformers.utils.logging.set_verbosity_error()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))

    # The safetensors folder trainyard converts once from the GGUF (every rank resolves the
    # same cached folder; run `trainyard train --dry-run` or the quickstart first if missing).
    model_path = resolve_model_path(ModelConfig(path=args.model))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    train_rows, _eval_rows = builtin_rows("builtin:dates", args.n_train, args.n_eval)
    if pad_to_max:
        dataset = tokenize_seeds(train_rows, tokenizer, args.max_length)
        collator = CountingCollator(default_data_collator)
    else:
        dataset = tokenize_tuned(train_rows, tokenizer, args.max_length)
        collator = CountingCollator(
            DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=IGNORE_INDEX, return_tensors="pt")
        )

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model = get_peft_model(
        model,
        LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type="CAUSAL_LM"),
    )
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)

    timer = StepTimer()
    with tempfile.TemporaryDirectory(prefix="hf-baseline-") as output_dir:
        training_args = TrainingArguments(
            output_dir=output_dir,
            per_device_train_batch_size=batch_size,
            gradient_accumulation_steps=1,
            max_steps=args.steps,
            learning_rate=1e-3,
            eval_strategy="no",
            save_strategy="no",
            report_to="none",
            logging_steps=args.steps,
            disable_tqdm=True,
            use_cpu=True,
            ddp_backend="gloo",
            dataloader_num_workers=0,
            seed=args.seed,
        )
        trainer = Trainer(
            model=model,
            args=training_args,
            train_dataset=dataset,
            data_collator=collator,
            callbacks=[timer],
        )
        wall_start = time.monotonic()
        output = trainer.train()
        wall = time.monotonic() - wall_start

    steps = len(timer.end)
    real = torch.tensor(collator.real[:steps], dtype=torch.float64)
    padded = torch.tensor(collator.padded[:steps], dtype=torch.float64)
    if torch_dist.is_available() and torch_dist.is_initialized():
        torch_dist.all_reduce(real)
        torch_dist.all_reduce(padded)
    step_time = [e - b for b, e in zip(timer.begin, timer.end)]
    end_to_end = [timer.end[i] - timer.end[i - 1] for i in range(1, steps)]
    steady_time = sum(step_time[1:])
    steady_real = float(real[1:].sum())
    steady_padded = float(padded[1:].sum())
    result = {
        "stack": "hf_trainer",
        "mode": args.mode,
        "world_size": world,
        "per_device_batch": batch_size,
        "samples_per_step": batch_size * world,
        "steps": steps,
        "max_length": args.max_length,
        "pad_to_max_length": pad_to_max,
        "train_rows": len(dataset),
        "trainable_params": trainable,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "torch_threads": torch.get_num_threads(),
        "tokens_real": float(real.sum()),
        "tokens_padded": float(padded.sum()),
        "steady_time_s": steady_time,
        "tokens_per_s": steady_real / steady_time if steady_time else None,
        "tokens_per_s_end_to_end": steady_real / sum(end_to_end) if end_to_end else None,
        "padded_tokens_per_s": steady_padded / steady_time if steady_time else None,
        "s_per_step": steady_time / max(steps - 1, 1),
        "step_times_s": [round(t, 4) for t in step_time],
        "train_runtime_s": output.metrics.get("train_runtime"),
        "train_loss": output.metrics.get("train_loss"),
        "wall_time_s": wall,
    }
    if rank == 0:
        print(json.dumps(result, indent=2))
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
