"""Run under torchrun with 2 ranks: call the real `evaluate` and report what it returned.

Every rank also keeps an unwrapped copy of the same model (built from the same seed) and
computes, without trainyard's eval code, what a single process gets: the loss over the
subset example by example, unpadded, and greedy answers cut at their first end of turn.
Each rank writes `<prefix>-rank<r>.json`; the test compares the two sides.
"""

from __future__ import annotations

import copy
import json
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainyard import evaluate as eval_room
from trainyard.parallel import parallelize as parallel
from trainyard.config_file import load_config
from trainyard.data import prepare_datasets
from trainyard.dist import exit_process, init, teardown
from trainyard.model.build import load_model
from trainyard.model.source import load_tokenizer
from wrapping import wrap_in_memory  # beside this script

COLLECTIVES = ["all_reduce", "all_gather", "all_gather_object", "broadcast", "reduce", "barrier",
               "reduce_scatter", "all_to_all", "gather", "scatter", "broadcast_object_list", "monitored_barrier"]
EXAMPLES, BATCH, NEW_TOKENS = 37, 4, 16


def count_collectives() -> Counter[str]:
    """Wrap torch.distributed's collectives (looked up at call time) to count the calls."""
    counts: Counter[str] = Counter()
    for name in COLLECTIVES:
        original = getattr(dist, name)

        def counting(*args, _name=name, _original=original, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counting)
    return counts


@torch.no_grad()
def single_process_loss(model: torch.nn.Module, rows: list[dict]) -> tuple[float, int]:
    """Summed next-token cross-entropy over target tokens, one unpadded example at a time."""
    total, targets = 0.0, 0
    for row in rows:
        ids, labels = torch.tensor([row["input_ids"]]), torch.tensor(row["labels"])
        logits = model(input_ids=ids).logits[0, :-1].double()
        mask = labels[1:] != -100
        total += F.cross_entropy(logits[mask], labels[1:][mask], reduction="sum").item()
        targets += int(mask.sum())
    return total, targets


@torch.no_grad()
def plain_generate(model: torch.nn.Module, prompts: list[list[int]], tokenizer) -> list[list[int]]:
    """HF greedy generation in one process, with nothing of trainyard's around it."""
    width, pad = max(len(p) for p in prompts), tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                         pad_token_id=pad, eos_token_id=tokenizer.eos_token_id)
    return [row.tolist() for row in out[:, width:]]


def end_on_a_token_it_emits(model: torch.nn.Module, prompts: list[list[int]], tokenizer) -> int:
    """Untie the head and swap the end-of-turn row with a token the model emits at varied
    positions, so greedy answers end at different lengths (a random model never ends)."""
    first_seen: dict[int, list[int]] = {}
    for ids in plain_generate(model, prompts, tokenizer):
        for position, token in enumerate(ids):
            if ids.index(token) == position:
                first_seen.setdefault(token, []).append(position)
    token = max(sorted(first_seen), key=lambda t: len(set(first_seen[t])))
    head = torch.nn.Parameter(model.get_output_embeddings().weight.detach().clone())
    eos = tokenizer.eos_token_id
    head.data[[eos, token]] = head.data[[token, eos]]
    model.get_output_embeddings().weight = head
    model.config.tie_word_embeddings = False
    return token


def cut(ids: list[int], eos: int) -> list[int]:
    return ids[: ids.index(eos)] if eos in ids else ids


def main() -> None:
    out_dir, strategy, prefix = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    cfg = load_config("tiny", [f"output_dir={out_dir}", f"data.synthetic_eval_size={EXAMPLES}",
                               f"dist.strategy={strategy}", "model.config.initializer_range=0.5"])
    info = init(cfg.dist)
    tokenizer = load_tokenizer(cfg.model, None)
    eos = tokenizer.eos_token_id
    data = prepare_datasets(cfg.data, tokenizer, out_dir / "cache")
    model = load_model(cfg.model, None, tokenizer, torch.float32, 0).eval()
    rows = [data.eval[i] for i in eval_room.evaluation_subset(len(data.eval), 100, 1)]
    swapped = end_on_a_token_it_emits(model, [r["prompt_ids"] for r in rows], tokenizer)
    single = copy.deepcopy(model)
    loss_sum, targets = single_process_loss(single, rows)
    wrapped = wrap_in_memory(model, strategy, info)

    counts = count_collectives()
    result = eval_room.evaluate(wrapped, data.eval, subset_size=100, seed=1, batch_size=BATCH, info=info,
                                tokenizer=tokenizer)
    counted = dict(counts)
    with_answers = eval_room.evaluate(wrapped, data.eval, subset_size=100, seed=1, batch_size=BATCH, info=info,
                                      tokenizer=tokenizer, generate=True, max_new_tokens=NEW_TOKENS)
    samples = eval_room.samples_file(out_dir / "run", 7)
    counts.clear()
    kept = eval_room.evaluate(wrapped, data.eval, subset_size=100, seed=1, batch_size=BATCH, info=info,
                              tokenizer=tokenizer, generate=True, max_new_tokens=NEW_TOKENS, samples_path=samples)
    kept_collectives = dict(counts)

    # This rank's batches as evaluate cuts them, answered under the strategy and by one process.
    lockstep = strategy == "fsdp"
    target = wrapped if lockstep else parallel.unwrap(wrapped)
    batches = eval_room._rank_batches(list(range(len(rows))), info, BATCH)
    answers, expected, raw, asked = [], [], [], []
    for batch in batches:
        prompts = [rows[i]["prompt_ids"] for i in batch] or [rows[0]["prompt_ids"]]  # padding batch
        got = eval_room.generate_answers(target, prompts, tokenizer, NEW_TOKENS, lockstep, info.device)
        if batch:
            ids = plain_generate(single, prompts, tokenizer)
            answers += got
            raw += ids
            expected += [tokenizer.decode(cut(i, eos), skip_special_tokens=True) for i in ids]
            asked += batch
    Path(f"{prefix}-rank{info.rank}.json").write_text(json.dumps({
        "collectives": counted, "batches": len(batches), "result": result, "with_answers": with_answers,
        "single_loss_sum": loss_sum, "single_targets": targets, "subset": len(rows),
        "answers": answers, "expected": expected, "raw": raw, "eos": eos, "swapped": swapped,
        "correct": sum(int(a.strip() == rows[i]["answer"].strip()) for a, i in zip(expected, asked)),
        "kept": kept, "kept_collectives": kept_collectives, "samples": str(samples),
    }))
    teardown()
    exit_process(0)


if __name__ == "__main__":
    main()
