"""A hybrid family's training step on padding-free rows (each state layer runs each document on its own:
model/state_layers.py) against the padded rows it had before, on one CPU process: seconds a step (forward and
backward), the tokens each computes, and whether both give the same loss.

    python benchmarks/cpu/state_layers.py [--family qwen3_next] [--documents 12] [--repeats 3] [--seed 0]

The model is built from a tiny config of the family with wider layers (random weights); the documents' lengths are
drawn from a long-tailed spread (many short answers, a few long ones), as chat data has them."""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the families' tiny configs, as the tests build them

from tests.unit.model import registry  # noqa: E402
from trainyard.data.collate import collate  # noqa: E402
from trainyard.model import attention, state_layers  # noqa: E402
from trainyard.model.documents import model_inputs  # noqa: E402

WIDE = dict(hidden_size=256, intermediate_size=512, vocab_size=2048)
CPU = torch.device("cpu")


def build(family: str) -> torch.nn.Module:
    settings = {**registry.settings(family), **WIDE}
    config = AutoConfig.for_model(**settings)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()


def documents(count: int, seed: int) -> list[dict[str, list[int]]]:
    generator = random.Random(seed)
    lengths = [min(1024, max(16, int(generator.lognormvariate(4.8, 0.8)))) for _ in range(count)]
    return [{"input_ids": (ids := [generator.randrange(3, 2048) for _ in range(n)]), "labels": [-100, *ids[1:]]}
            for n in lengths]


def step_seconds(model: torch.nn.Module, batch: dict[str, torch.Tensor], repeats: int) -> tuple[float, float]:
    """The median step time over `repeats` after one warm-up step, and the step's mean loss."""
    inputs = {**model_inputs(batch, CPU, model.config), "labels": batch["labels"]}
    times, loss = [], 0.0
    for i in range(repeats + 1):
        start = time.perf_counter()
        out = model(**inputs, use_cache=False)
        out.loss.backward()
        model.zero_grad(set_to_none=True)
        loss = out.loss.item()
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times), loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen3_next")
    parser.add_argument("--documents", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = documents(args.documents, args.seed)
    padded_model = build(args.family)
    padded_model.config._attn_implementation = "sdpa"
    split_model = build(args.family)
    split_model.config._attn_implementation = attention.choose("auto", split_model, CPU)
    layers = state_layers.install(split_model)
    padded = collate(rows, pad_id=0, padding_free=False)
    one_row = collate(rows, pad_id=0, padding_free=True)
    real = sum(len(row["input_ids"]) for row in rows)
    lengths = sorted(len(row["input_ids"]) for row in rows)
    print(f"{args.family}: {layers} state layers split; {len(rows)} documents, {real} tokens "
          f"(lengths {lengths[0]}-{lengths[-1]}, median {lengths[len(lengths) // 2]}), one thread")
    padded_s, padded_loss = step_seconds(padded_model, padded, args.repeats)
    split_s, split_loss = step_seconds(split_model, one_row, args.repeats)
    print(f"padded rows      {padded_s:.3f} s/step  {padded['input_ids'].numel()} tokens computed  "
          f"loss {padded_loss:.6f}")
    print(f"padding-free     {split_s:.3f} s/step  {one_row['input_ids'].numel()} tokens computed  "
          f"loss {split_loss:.6f}")
    print(f"speed-up         {padded_s / split_s:.2f}x")


if __name__ == "__main__":
    main()
