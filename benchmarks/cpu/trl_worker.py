"""TRL's SFTTrainer + PEFT LoRA under torchrun, on an alpaca JSONL file (bench.py's trl row).

    torchrun --standalone --nproc-per-node 2 benchmarks/cpu/trl_worker.py --data train.jsonl \\
        --eval-data eval.jsonl --steps 12 --bf16 --padding-free check --out trl.json

The rows become TRL prompt/completion pairs: prompt = trainyard's alpaca prompt, completion = the
output + eos, with completion-only loss (the same prompt/response split as trainyard; TRL tokenizes
prompt + completion as one string, so a boundary token can differ). Same model, LoRA (r=8, alpha=16,
dropout 0, q/k/v/o/gate/up/down), batch 4 per device, one accumulation step on 2 ranks.

`--padding-free on` flattens each batch into one row with position_ids and no attention mask (no
padding computed at all). It is only right if the attention keeps the documents apart: `check` first
compares one batch's loss padding-free against the same batch padded (fp32, eval mode) and uses
padding-free only when they agree within 1e-3, else dynamic padding; the result JSON says which and why.
With transformers 5.x sdpa the flattened rows are kept apart (from position_ids) only when the forward
builds no KV cache: TRL's compute_loss passes use_cache=False, and so does the check; with a cache the
rows attend across each other (a batch measured 7.107 against 7.437 padded).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from trainyard.config import ModelConfig
from trainyard.data.formats import alpaca_prompt
from trainyard.model.source import resolve_model_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # the shared helpers

from hf_common import LORA_TARGETS, CountingCollator, StepTimer, finish, read_rows, shared_training_args  # noqa: E402

TOLERANCE = 1e-3


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True)
    parser.add_argument("--eval-data", required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=4, help="per device")
    parser.add_argument("--samples-per-step", type=int, default=8, help="over all ranks; sets accumulation")
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--padding-free", choices=["on", "off", "check"], default="check")
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--warmup-steps", type=int, default=0)
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--out", default=None)
    return parser.parse_args()


def prompt_completion(path: str, eos: str) -> Dataset:
    rows = read_rows(path)
    prompts = [alpaca_prompt(r["instruction"], r.get("input") or "") for r in rows]
    return Dataset.from_list([{"prompt": p, "completion": r["output"] + eos} for p, r in zip(prompts, rows)])


def padding_free_check(model: Any, dataset: Dataset, pad_id: int, batch: int) -> dict[str, Any]:
    """One batch's loss padding-free vs padded, in fp32: does attention keep the flattened rows apart?"""
    features = [{k: dataset[i][k] for k in ("input_ids", "labels")} for i in range(batch)]
    losses = {}
    model.eval()
    with torch.no_grad():
        for name, flat in (("padded", False), ("padding_free", True)):
            inputs = DataCollatorForLanguageModeling(pad_token_id=pad_id, padding_free=flat)(features)
            keep = {k: v for k, v in inputs.items() if k in ("input_ids", "labels", "attention_mask", "position_ids")}
            losses[name] = float(model(**keep, use_cache=False).loss)  # as TRL's compute_loss calls it
    model.train()
    diff = abs(losses["padded"] - losses["padding_free"])
    return {**losses, "abs_diff": diff, "ok": diff <= TOLERANCE}


def main() -> None:
    args = parse_args()
    launched = time.time()
    transformers.utils.logging.set_verbosity_error()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    accumulation = max(1, args.samples_per_step // (args.batch * world))
    model_path = resolve_model_path(ModelConfig(path=args.model))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    train = prompt_completion(args.data, tokenizer.eos_token)
    evaluation = prompt_completion(args.eval_data, tokenizer.eos_token)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model = get_peft_model(
        model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    )
    cuda = torch.cuda.is_available()
    timer = StepTimer()
    check: dict[str, Any] | None = None

    def build(padding_free: bool, output_dir: str) -> SFTTrainer:
        config = SFTConfig(
            output_dir=output_dir,
            per_device_train_batch_size=args.batch,
            padding_free=padding_free,
            # padding-free without packing refuses max_length; every generated row is shorter than it
            max_length=None if padding_free else args.max_length,
            completion_only_loss=True,
            ddp_find_unused_parameters=False,  # else searched every backward for a PeftModel; LoRA has none
            **shared_training_args(args, accumulation, cuda),
        )
        return SFTTrainer(
            model=model,
            args=config,
            train_dataset=train,
            eval_dataset=evaluation,
            processing_class=tokenizer,
            callbacks=[timer],
        )

    with tempfile.TemporaryDirectory(prefix="trl-") as output_dir:
        padding_free = args.padding_free != "off"
        trainer = build(padding_free, output_dir)
        if args.padding_free == "check":
            check = padding_free_check(trainer.model, trainer.train_dataset, tokenizer.pad_token_id, args.batch)
            if not check["ok"]:
                padding_free = False
                trainer = build(False, output_dir)
        collator = CountingCollator(trainer.data_collator)  # TRL refuses a custom collator with padding-free
        trainer.data_collator = collator
        trainer.train()
        facts = {
            "stack": "trl",
            "trl": __import__("trl").__version__,
            "padding_free": padding_free,
            "padding_free_check": check,
            "launched_wall_time": launched,
            "train_rows": len(train),
        }
        finish(trainer, timer, collator, trainer.eval_dataset, args.out, facts)


if __name__ == "__main__":
    main()
