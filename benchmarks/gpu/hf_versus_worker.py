"""HF Trainer at its best on one job of benchmarks/gpu/versus.py: one variant a process, its figures as JSON.

    python benchmarks/gpu/hf_versus_worker.py --job JOB.json --save-weights DIR      # the job's model, once
    python benchmarks/gpu/hf_versus_worker.py --job JOB.json --weights DIR --variant flatten --out hf-flatten.json
    python benchmarks/gpu/hf_versus_worker.py --job JOB.json --weights DIR --variant padded --gradient-checkpointing \
        --out x.json

JOB.json is what versus.py writes: the model's config, LoRA (r, alpha; null: full fine-tuning), the documents'
JSONL file, rows per micro-batch, accumulation, steps, lr. Rows are encoded by trainyard's own text encoder and byte
tokenizer (the same ids and labels trainyard trains on), and the HF config comes from trainyard's resolver (the same
vocabulary and special ids). What HF does at its best:

  the model  --save-weights: built from the config on the device (random init there: seconds, not the minute a
             CPU takes for 8B) and saved as a model folder, which trainyard and each variant then load;
             sdpa attention, no KV cache (with a cache, transformers 5 attends across a flattened row's documents);
             full fine-tuning keeps fp32 weights under bf16 autocast (Trainer's bf16=True, as trainyard's bf16-mixed),
             LoRA a bf16 base with fp32 adapters (PEFT's autocast_adapter_dtype)
  LoRA       r and alpha as trainyard's, dropout 0, q/k/v/o/gate/up/down of every block and, on an MoE, its fused
             3-D expert stacks through PEFT's target_parameters (PEFT folds W + B·A over each whole stack)
  variants   flatten: DataCollatorWithFlattening (one row of the micro-batch's documents, position_ids, no padding)
             padded:  rows padded to the micro-batch's longest (DataCollatorForSeq2Seq), group_by_length sampling
  optimizer  adamw_torch_fused, cosine schedule with the job's warmup, grad clipping at 1.0, no weight decay

Figures, over the optimizer steps after the first (step ends timed after a device sync): real tokens/s, MFU
(trainyard.hardware.training_flops of flop_shape(this model) over each step's documents, over device_peak_flops),
torch.cuda.max_memory_allocated (CPU: peak RSS), step 1's seconds from the epoch's start (its batches included),
the median step. flatten also checks, before training, that a flattened row keeps its documents apart: the largest
difference of per-token losses against each document alone (`isolation_loss_diff`). Exit 3 when the variant runs
out of memory (versus.py then runs it again with --gradient-checkpointing). No assertions: a measurement.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import (
    AutoModelForCausalLM,
    DataCollatorForSeq2Seq,
    DataCollatorWithFlattening,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from trainyard.config import ModelConfig
from trainyard.data.formats import encode_row
from trainyard.hardware import device_peak_flops, flop_shape, training_flops
from trainyard.model.source import architecture, load_tokenizer

IGNORE_INDEX = -100
OOM_EXIT = 3
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", required=True, help="the job.json versus.py wrote")
    parser.add_argument("--save-weights", default=None, help="build the job's model on the device, save it here, exit")
    parser.add_argument("--weights", default=None, help="the model folder --save-weights wrote")
    parser.add_argument("--variant", choices=("flatten", "padded"))
    parser.add_argument("--gradient-checkpointing", action="store_true", help="non-reentrant, every layer")
    parser.add_argument("--out", help="the result JSON")
    args = parser.parse_args()
    if not args.save_weights and not (args.weights and args.variant and args.out):
        parser.error("give --save-weights DIR, or --weights DIR --variant V --out FILE")
    return args


class Recorder:
    """Wraps the collator: each micro-batch's real and computed tokens and its documents' lengths, in order (batches
    are collated in this process, no loader workers: micro-batches [A*k, A*(k+1)) make optimizer step k+1)."""

    def __init__(self, collate: Any) -> None:
        self.collate = collate
        self.documents: list[list[int]] = []
        self.computed: list[int] = []

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        self.documents.append([len(f["input_ids"]) for f in features])
        batch = self.collate(features)
        self.computed.append(int(batch["input_ids"].numel()))
        return batch


class StepClock(TrainerCallback):
    """When the epoch starts and each optimizer step ends, after the device finished it (Trainer's loop does not
    wait for the GPU: without a sync a step's end would be when its kernels were queued)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.start: float | None = None
        self.ends: list[float] = []
        self.first_step_wall: float | None = None

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.monotonic()

    def on_epoch_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if self.start is None:
            self.start = self._now()

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self.ends.append(self._now())
        if self.first_step_wall is None:
            self.first_step_wall = time.time()


def expert_stacks(model: torch.nn.Module) -> list[str]:
    """The fused 3-D expert parameters, named from their block (mlp.experts.gate_up_proj): PEFT's target_parameters."""
    names = {name.split(".layers.", 1)[-1].split(".", 1)[-1] for name, p in model.named_parameters() if p.ndim == 3}
    return sorted(names)


@torch.no_grad()
def isolation_loss_diff(model: torch.nn.Module, rows: list[dict[str, list[int]]], device: torch.device) -> float:
    """The largest per-token loss difference between two documents flattened into one row and each alone: ~0 (bf16
    rounding) when the flattened row's attention keeps them apart, ~0.1-1 where the second attends to the first."""
    pair = [r["input_ids"][:128] for r in rows[:2]]
    collate = DataCollatorWithFlattening(return_position_ids=True, separator_id=IGNORE_INDEX)
    flat = collate([{"input_ids": ids, "labels": ids} for ids in pair])
    model.eval()
    with torch.autocast(device.type, dtype=torch.bfloat16):
        together = model(input_ids=flat["input_ids"].to(device), position_ids=flat["position_ids"].to(device),
                         use_cache=False).logits.float()[0]
        alone = [model(input_ids=torch.tensor([ids], device=device), use_cache=False).logits.float()[0] for ids in pair]
    model.train()
    first = len(pair[0])
    pieces = [(together[: first - 1], alone[0][:-1], pair[0][1:]), (together[first:-1], alone[1][:-1], pair[1][1:])]
    loss = torch.nn.functional.cross_entropy
    return max(float((loss(a, torch.tensor(t, device=device), reduction="none")
                      - loss(b, torch.tensor(t, device=device), reduction="none")).abs().max()) for a, b, t in pieces)


def save_weights(model_cfg: ModelConfig, tokenizer: Any, seed: int, dtype: torch.dtype, device: torch.device,
                 folder: Path) -> None:
    """The job's model from trainyard's resolution of its config (its vocabulary and special ids), drawn on the
    device and saved as a model folder both stacks load."""
    config = architecture(model_cfg, tokenizer)
    config.use_cache = False
    torch.manual_seed(seed)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(folder)


def main() -> None:
    args = parse_args()
    launched = time.time()
    transformers.utils.logging.set_verbosity_error()
    spec = json.loads(Path(args.job).read_text())
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    model_cfg = ModelConfig(config=spec["model_config"], tokenizer="builtin:bytes")
    tokenizer = load_tokenizer(model_cfg, None)
    lora = spec["lora"]
    dtype = torch.bfloat16 if lora else torch.float32
    if args.save_weights:
        save_weights(model_cfg, tokenizer, spec["seed"], dtype, device, Path(args.save_weights))
        return
    texts = [json.loads(line) for line in Path(spec["data"]).read_text().splitlines() if line.strip()]
    rows = [encode_row(row, "text", tokenizer, max_length=spec["max_tokens"], train_on_prompt=False)
            for row in texts]
    rows = [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows]
    model = AutoModelForCausalLM.from_pretrained(args.weights, dtype=dtype, attn_implementation="sdpa", use_kernels=False,
                                                 device_map=device)
    model.config.use_cache = False
    experts = expert_stacks(model)
    if lora:
        model = get_peft_model(model, LoraConfig(
            r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=0.0, target_modules=LORA_TARGETS,
            target_parameters=experts or None, task_type="CAUSAL_LM"))
    shape = flop_shape(model)
    isolation = isolation_loss_diff(model, rows, device) if args.variant == "flatten" else None

    if args.variant == "flatten":
        collator = Recorder(DataCollatorWithFlattening(return_position_ids=True, separator_id=IGNORE_INDEX))
    else:
        collator = Recorder(DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=IGNORE_INDEX,
                                                   return_tensors="pt"))
    clock = StepClock(cuda)
    accumulation = spec["accumulation"]
    with tempfile.TemporaryDirectory(prefix="hf-versus-") as scratch:
        training_args = TrainingArguments(
            output_dir=scratch,
            per_device_train_batch_size=spec["micro_batch_size"],
            gradient_accumulation_steps=accumulation,
            max_steps=spec["steps"],
            learning_rate=spec["lr"],
            lr_scheduler_type="cosine",
            warmup_steps=spec["warmup_steps"],
            weight_decay=0.0,
            max_grad_norm=1.0,
            bf16=True,
            optim="adamw_torch_fused",
            train_sampling_strategy="group_by_length" if args.variant == "padded" else "random",
            activation_checkpointing=args.gradient_checkpointing,  # transformers 5's name for gradient_checkpointing
            activation_checkpointing_kwargs={"use_reentrant": False} if args.gradient_checkpointing else None,
            eval_strategy="no",
            save_strategy="no",
            report_to="none",
            logging_steps=spec["steps"],
            disable_tqdm=True,
            use_cpu=not cuda,
            dataloader_num_workers=0,
            seed=spec["seed"],
        )
        trainer = Trainer(model=model, args=training_args, train_dataset=Dataset.from_list(rows),
                          data_collator=collator, callbacks=[clock])
        facts: dict[str, Any] = {
            "variant": args.variant, "gradient_checkpointing": args.gradient_checkpointing,
            "attention": model.config._attn_implementation,
            "experts_implementation": getattr(model.config, "_experts_implementation", None) if experts else None,
            "lora_expert_targets": (experts or None) if lora else None,
            "params": sum(p.numel() for p in model.parameters()),
            "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "isolation_loss_diff": isolation,
        }
        try:
            output = trainer.train()
        except torch.OutOfMemoryError as err:
            peak = torch.cuda.max_memory_allocated() if cuda else None
            write(args.out, {**facts, "error": f"out of memory: {str(err)[:300]}", "peak_memory_bytes": peak})
            sys.exit(OOM_EXIT)

    steps = len(clock.ends)
    per_step = [sum(collator.documents[k * accumulation:(k + 1) * accumulation], []) for k in range(steps)]
    computed = [sum(collator.computed[k * accumulation:(k + 1) * accumulation]) for k in range(steps)]
    start = clock.start if clock.start is not None else (clock.ends or [0.0])[0]
    seconds = [end - begin for begin, end in zip([start, *clock.ends], clock.ends)]
    tokens = [sum(docs) for docs in per_step]
    flops = [training_flops(shape, docs) for docs in per_step]
    peak_flops = device_peak_flops(device, torch.bfloat16)
    steady_s = sum(seconds[1:])
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    write(args.out, {
        **facts,
        "tokens_per_s": sum(tokens[1:]) / steady_s if steady_s else None,
        "mfu": sum(flops[1:]) / steady_s / peak_flops if steady_s and peak_flops else None,
        "peak_memory_bytes": peak,
        "first_step_s": seconds[0] if seconds else None,
        "median_step_s": statistics.median(seconds[1:]) if steps > 1 else None,
        "first_step_wall_time": clock.first_step_wall,
        "steps": steps,
        "tokens": sum(tokens),
        "padding_share": 1 - sum(tokens) / max(sum(computed), 1),
        "flops_per_token": sum(flops[1:]) / max(sum(tokens[1:]), 1),
        "step_seconds": [round(s, 4) for s in seconds],
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "train_loss": output.training_loss,
        "launched_wall_time": launched,
    })


def write(path: str, result: dict[str, Any]) -> None:
    text = json.dumps(result)
    Path(path).write_text(text + "\n")
    print(text, flush=True)


if __name__ == "__main__":
    main()
