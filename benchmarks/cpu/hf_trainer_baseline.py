"""The reference stack: HF Trainer + PEFT LoRA under torchrun, on an alpaca JSONL file (bench.py's hf rows).

    torchrun --standalone --nproc-per-node 2 benchmarks/cpu/hf_trainer_baseline.py --mode seeds \\
        --data train.jsonl --eval-data eval.jsonl --steps 12 --out seeds.json
    torchrun --standalone --nproc-per-node 2 benchmarks/cpu/hf_trainer_baseline.py --mode best --bf16 \\
        --data train.jsonl --eval-data eval.jsonl --steps 12 --out best.json

Same SmolLM2-135M-Instruct safetensors folder as trainyard, same LoRA (r=8, alpha=16, dropout 0, q/k/v/o/
gate/up/down), same rows tokenized exactly as trainyard's alpaca format (prompt + response + eos):

  seeds  as seed 002 wrote it: padding="max_length", batch 1 per device, labels = a copy of input_ids
         (padding and prompt included), default_data_collator; accumulation makes up the samples per step.
  best   dynamic padding (DataCollatorForSeq2Seq), labels masked to the response, batch 4 per device;
         --bf16 and --sampling group_by_length are what bench.py tries to find HF's best on the machine.

Both evaluate only the loss (prediction_loss_only: by default evaluate() also gathers every logit,
6 GB for 64 rows padded to 512, which made the seeds row's eval take minutes and risk the memory).
Figures (hf_common.finish): real tokens/s, eval time, lite/full save stall, peak memory; rank 0 writes JSON.
No assertions: a measurement, never part of the test suite.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    Trainer,
    TrainingArguments,
    default_data_collator,
)

from trainyard.config import ModelConfig
from trainyard.model.source import resolve_model_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # the shared helpers

from hf_common import (  # noqa: E402
    LORA_TARGETS,
    CountingCollator,
    StepTimer,
    encode_alpaca,
    finish,
    read_rows,
    shared_training_args,
)

IGNORE_INDEX = -100
MODES = {"seeds": 1, "best": 4}  # per-device batch


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=sorted(MODES), required=True)
    parser.add_argument("--data", required=True, help="alpaca JSONL train rows (each trained on once)")
    parser.add_argument("--eval-data", required=True, help="alpaca JSONL rows for the timed evaluation")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps (max_steps)")
    parser.add_argument("--samples-per-step", type=int, default=8, help="over all ranks; sets accumulation")
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (Trainer's bf16=True)")
    parser.add_argument(
        "--sampling", default="random", help="train_sampling_strategy: random, group_by_length (5.x's group_by_length)"
    )
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--warmup-steps", type=int, default=0)
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct", help="trainyard model.path to resolve")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--out", default=None, help="write the result JSON here (rank 0)")
    return parser.parse_args()


def dataset(rows: list[dict[str, str]], tokenizer: object, max_length: int, pad_to_max: bool) -> Dataset:
    """Seeds: padded to max_length, labels = input_ids. Best: unpadded, labels masked to the response."""
    columns: dict[str, list[list[int]]] = {"input_ids": [], "attention_mask": [], "labels": []}
    pad = tokenizer.pad_token_id  # type: ignore[attr-defined]
    for row in rows:
        ids, labels = encode_alpaca(row, tokenizer, max_length)
        mask = [1] * len(ids)
        if pad_to_max:
            fill = max_length - len(ids)
            ids, mask = ids + [pad] * fill, mask + [0] * fill
            labels = list(ids)
        columns["input_ids"].append(ids)
        columns["attention_mask"].append(mask)
        columns["labels"].append(labels)
    return Dataset.from_dict(columns)


def main() -> None:
    args = parse_args()
    launched = time.time()
    transformers.utils.logging.set_verbosity_error()
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else None
    world = world or int(__import__("os").environ.get("WORLD_SIZE", "1"))
    batch = MODES[args.mode]
    accumulation = max(1, args.samples_per_step // (batch * world))
    seeds = args.mode == "seeds"

    model_path = resolve_model_path(ModelConfig(path=args.model))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    train = dataset(read_rows(args.data), tokenizer, args.max_length, seeds)
    evaluation = dataset(read_rows(args.eval_data), tokenizer, args.max_length, seeds)
    if seeds:
        collator = CountingCollator(default_data_collator)
    else:
        collator = CountingCollator(
            DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=IGNORE_INDEX, return_tensors="pt")
        )

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model = get_peft_model(
        model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    )
    cuda = torch.cuda.is_available()
    timer = StepTimer()
    with tempfile.TemporaryDirectory(prefix="hf-baseline-") as output_dir:
        training_args = TrainingArguments(
            output_dir=output_dir,
            per_device_train_batch_size=batch,
            train_sampling_strategy=args.sampling,
            # A PeftModel makes Trainer search for unused parameters every backward; LoRA has none.
            ddp_find_unused_parameters=None if seeds else False,
            **shared_training_args(args, accumulation, cuda),
        )
        trainer = Trainer(
            model=model, args=training_args, train_dataset=train, data_collator=collator, callbacks=[timer]
        )
        trainer.train()
        facts = {"stack": "hf_trainer", "mode": args.mode, "launched_wall_time": launched, "train_rows": len(train)}
        finish(trainer, timer, collator, evaluation, args.out, facts)


if __name__ == "__main__":
    main()
