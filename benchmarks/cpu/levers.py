"""The performance levers one by one: one LoRA training step of SmolLM2-135M-Instruct in one process.

Each case switches one thing in trainyard's own step (collate -> attention -> token_loss_sum -> backward ->
AdamW) and is timed interleaved with the others, round after round, so load from other jobs falls on all
of them alike. The micro-batch is 4 alpaca-shaped documents (60, 120, 180 and 420 tokens, the prompt
half of each masked), as `make bench` draws them.

    python benchmarks/cpu/levers.py                       # every case, 5 rounds (~3 min on one core)
    python benchmarks/cpu/levers.py --only today padded-sdpa --rounds 3

Cases (each differs from `today`, trainyard's default step on this CPU, in one thing):
  today            padding-free row, varlen attention, logits at target positions, bf16-mixed, fused AdamW
  padded-sdpa      rows padded to the longest, sdpa with a padding mask (the layout before issue 10)
  dense-mask       padding-free row, transformers' sdpa isolating documents with a dense mask
  flash-kernel     varlen attention with torch's CPU flash kernel for every document (no short-document path)
  all-logits       logits and fp32 softmax at every position
  fp32             no bf16 autocast, frozen weights in fp32
  foreach-adamw    torch's default AdamW implementation instead of the fused kernel
  compiled-mlp     every block's MLP under torch.compile (first step's compile time printed apart)
  peft-forward     PEFT's own lora.Linear forward (scale and add over the whole output) instead of lora_linear.py's
  fp32-peft-forward  the same at fp32 (compare with `fp32`)
It prints one JSON line per case: median step seconds, the ratio to `today`, and per-round times.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from typing import Any

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from trainyard import loss as loss_room
from trainyard.config import ModelConfig
from trainyard.data import collate
from trainyard.model import attention
from trainyard.model.lora_linear import use_fused_linear_adapters
from trainyard.model.source import resolve_model_path

CASES = ["today", "padded-sdpa", "dense-mask", "flash-kernel", "all-logits", "fp32", "foreach-adamw",
         "compiled-mlp", "peft-forward", "fp32-peft-forward"]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LENGTHS = (60, 120, 180, 420)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=CASES, default=CASES)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 = one rank of a 2-process run)")
    return parser.parse_args()


def documents() -> list[dict[str, list[int]]]:
    generator = torch.Generator().manual_seed(0)
    rows = []
    for length in LENGTHS:
        ids = torch.randint(100, 49000, (length,), generator=generator).tolist()
        rows.append({"input_ids": ids, "labels": [-100] * (length // 2) + ids[length // 2 :]})
    return rows


def lora_model(dtype: torch.dtype, fused: bool = True) -> torch.nn.Module:
    """Frozen base in `dtype`, fp32 adapters: what trainyard builds for LoRA under bf16-mixed / fp32."""
    torch.manual_seed(0)
    path = resolve_model_path(ModelConfig(path="builtin:smollm2-135m-instruct"))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attention.VARLEN)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS))
    if fused:
        use_fused_linear_adapters(model)
    for param in model.parameters():
        if param.requires_grad:
            param.data = param.data.float()
    return model


class Case:
    """One lever's model, optimizer, batch and switches."""

    def __init__(self, name: str) -> None:
        self.name = name
        fp32 = name.startswith("fp32")
        self.model = lora_model(torch.float32 if fp32 else torch.bfloat16, fused=not name.endswith("peft-forward"))
        implementation = {"padded-sdpa": "sdpa", "dense-mask": "sdpa"}.get(name, attention.VARLEN)
        self.model.base_model.model.set_attn_implementation(implementation)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=1e-4, fused=name != "foreach-adamw")
        self.batch = collate(documents(), pad_id=0, padding_free=name != "padded-sdpa")
        self.compile_s = 0.0
        if name == "compiled-mlp":
            for layer in self.model.base_model.model.model.layers:
                layer.mlp.compile(dynamic=True)
            started = time.perf_counter()
            self.step()
            self.compile_s = time.perf_counter() - started

    def step(self) -> float:
        started = time.perf_counter()
        short = attention.SHORT_DOCUMENT
        keeps = loss_room._MASK_KEEP
        attention.SHORT_DOCUMENT = 0 if self.name == "flash-kernel" else short
        loss_room._MASK_KEEP = self.name != "all-logits" and keeps
        fp32 = self.name.startswith("fp32")
        autocast = contextlib.nullcontext() if fp32 else torch.autocast("cpu", dtype=torch.bfloat16)
        try:
            with autocast:
                loss, _ = loss_room.token_loss_sum(self.model, self.batch, torch.device("cpu"))
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        finally:
            attention.SHORT_DOCUMENT, loss_room._MASK_KEEP = short, keeps
        return time.perf_counter() - started


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    cases = [Case(name) for name in args.only]
    for case in cases:
        case.step()  # warm-up
    times: dict[str, list[float]] = {case.name: [] for case in cases}
    for _ in range(args.rounds):
        for case in cases:
            times[case.name].append(case.step())
    today = statistics.median(times["today"]) if "today" in times else None
    for case in cases:
        median = statistics.median(times[case.name])
        line: dict[str, Any] = {"case": case.name, "median_step_s": round(median, 3),
                                "vs_today": round(median / today, 2) if today else None,
                                "rounds_s": [round(t, 3) for t in times[case.name]]}
        if case.compile_s:
            line["first_step_with_compile_s"] = round(case.compile_s, 1)
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
