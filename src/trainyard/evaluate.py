"""Evaluation on a fixed subset with exactly one all-reduce per evaluation.

Seed 000 lost 85 minutes per eval to one collective per batch, and could not read its
curves because the subset changed every time. Here the subset is a fixed-seed shuffle's
first N examples, each rank sums locally, and one all-reduce combines loss, token count
and exact-match counts at the end.

Generation under FSDP is the one exception: every forward pass all-gathers weights, so all
ranks must run the same number of them. They agree once per new token whether any rank is
still generating (HF's `synced_gpus`), so each sequence still ends at its own end of turn.

The generations themselves (prompt, answer, reference, correct) are kept when asked: each rank's
byte count rides on that all-reduce, then one gather brings them to rank 0, which writes them to
the run dir's samples/ in one file.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainyard.atomic import write_atomically
from trainyard.config import DpoConfig
from trainyard.data import collate
from trainyard.dist import DistInfo, all_reduce_sum, is_fsdp
from trainyard.loss import token_loss_sum
from trainyard.preference.loss import STATS, count_pairs, pair_loss_sum
from trainyard.parallel.parallelize import unwrap
from trainyard.redaction import redact
from trainyard.runs import layout as run_layout

if TYPE_CHECKING:
    import datasets


def evaluation_subset(num_rows: int, subset_size: int, seed: int) -> list[int]:
    """The same examples at every evaluation: a fixed-seed shuffle, then the first N."""
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_rows, generator=generator).tolist()
    return order[: min(subset_size, num_rows)]


def _rank_batches(indices: list[int], info: DistInfo, batch_size: int) -> list[list[int]]:
    """This rank's share, cut into as many batches as every other rank gets (FSDP needs lockstep)."""
    mine = indices[info.rank :: info.world_size]
    per_rank = math.ceil(len(indices) / info.world_size)
    n_batches = math.ceil(per_rank / batch_size)
    return [mine[i * batch_size : (i + 1) * batch_size] for i in range(n_batches)]


@torch.no_grad()
def generate_answers(
    model: torch.nn.Module,
    prompts: list[list[int]],
    tokenizer: Any,
    max_new_tokens: int,
    lockstep: bool,
    device: torch.device,
) -> list[str]:
    """Greedy answers to a batch of prompts (left-padded), each cut at its first end of turn.

    `lockstep` (FSDP): ranks keep running forward passes until every rank's batch is done,
    one scalar all-reduce per token; a sequence that ended is never extended. Forcing a
    minimum length instead would forbid the end-of-turn token and run every answer on.
    """
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts], device=device)
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    with head_reads_contiguous(model):
        output = model.generate(
            input_ids=input_ids,
            attention_mask=attention,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=tokenizer.eos_token_id,
            synced_gpus=lockstep,
        )
    eos = tokenizer.eos_token_id
    return [tokenizer.decode(_until_eos(ids.tolist(), eos), skip_special_tokens=True) for ids in output[:, width:]]


@contextlib.contextmanager
def head_reads_contiguous(model: torch.nn.Module) -> Iterator[None]:
    """The output head's input made contiguous while generating. The first forward keeps one position per prompt
    (`logits_to_keep=1`): a strided slice of the hidden states, which torch's CPU linear multiplies as a batch
    against the head's weight copied once per prompt. For SmolLM2's head in bf16 (49k x 576) that took 4.5 s per
    batch of 20 prompts against 15 ms for the same rows made contiguous (pytorch/pytorch#151934, open)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        yield
        return
    handle = head.register_forward_pre_hook(lambda _module, args: (args[0].contiguous(), *args[1:]))
    try:
        yield
    finally:
        handle.remove()


def _generations(
    model: torch.nn.Module,
    rows: list[dict[str, Any]],
    tokenizer: Any,
    max_new_tokens: int,
    lockstep: bool,
    device: torch.device,
) -> list[dict[str, Any]]:
    """Greedy answers, each with its prompt, the expected answer, and whether they match as stripped strings."""
    answers = generate_answers(model, [row["prompt_ids"] for row in rows], tokenizer, max_new_tokens, lockstep, device)
    return [
        {
            "prompt": tokenizer.decode(row["prompt_ids"], skip_special_tokens=True),
            "answer": got,
            "reference": row["answer"],
            "correct": got.strip() == row["answer"].strip(),
        }
        for got, row in zip(answers, rows)
    ]


def samples_file(run_dir: Path, step: int) -> Path:
    """Where the generations of the evaluation at `step` are kept."""
    return run_dir / run_layout.SAMPLES / f"step-{step:08d}.jsonl"


def _gather_to_first(payload: bytes, sizes: list[int], info: DistInfo) -> list[dict[str, Any]]:
    """Every rank's generations (JSON bytes, `sizes` from the all-reduce) on rank 0, others get []: one gather
    of equal-sized byte tensors, where gather_object would add an all-gather of the sizes."""
    if not info.distributed:
        return json.loads(payload)
    mine = torch.zeros(max(sizes), dtype=torch.uint8, device=info.device)
    mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    every = [torch.empty_like(mine) for _ in sizes] if info.is_main else None
    torch.distributed.gather(mine, every, dst=0)
    return [record for part, size in zip(every or [], sizes) for record in json.loads(bytes(part[:size].tolist()))]


def write_samples(path: Path, records: list[dict[str, Any]]) -> None:
    """One JSON line per generation, in the subset's order, redacted, written atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    ordered = sorted(records, key=lambda record: record["index"])
    write_atomically(path, "".join(json.dumps(redact(record), ensure_ascii=False) + "\n" for record in ordered))


def _until_eos(ids: list[int], eos_id: int | None) -> list[int]:
    """The answer proper: what comes before the end of turn (and the padding after it)."""
    return ids[: ids.index(eos_id)] if eos_id in ids else ids


def evaluate(
    model: torch.nn.Module,
    eval_data: datasets.Dataset,
    *,
    subset_size: int,
    seed: int,
    batch_size: int,
    info: DistInfo,
    tokenizer: Any,
    generate: bool = False,
    max_new_tokens: int = 32,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    padding_free: bool = True,
    samples_path: Path | None = None,
    dpo: DpoConfig | None = None,
) -> dict[str, float]:
    """Loss, perplexity and (optionally) exact-match accuracy, reduced once over ranks.
    `autocast` computes in the training's precision (bf16 products over fp32 weights).
    `padding_free`: each batch collated as one padding-free row, as training collates its own (collation.one_row).
    `samples_path` (with `generate`): rank 0 writes every generation there (see `samples_file`).
    `dpo` (train.objective dpo): the eval rows are pairs; the loss is per pair, with TRL's eval_rewards/ and
    eval_logps/ figures riding the same all-reduce."""
    sharded = is_fsdp(model)
    net = model if sharded else unwrap(model)
    was_training = net.training
    net.eval()
    indices = evaluation_subset(len(eval_data), subset_size, seed)
    can_generate = generate and "answer" in eval_data.column_names and "prompt_ids" in eval_data.column_names
    keep = can_generate and samples_path is not None
    # loss, tokens, correct, asked, then (keeping generations) each rank's bytes of them
    pair_sums = torch.zeros(len(STATS) if dpo is not None else 0, dtype=torch.float64, device=info.device)
    totals = torch.zeros(4 + len(pair_sums) + (info.world_size if keep else 0), dtype=torch.float64,
                         device=info.device)
    own = 4 + len(pair_sums)  # where each rank's generation bytes start
    position = {index: order for order, index in enumerate(indices)}
    kept: list[dict[str, Any]] = []
    with torch.no_grad(), autocast():
        for batch_indices in _rank_batches(indices, info, batch_size):
            padding_only = not batch_indices
            rows = [eval_data[i] for i in (batch_indices or indices[:1])]
            # seq_lens: a packed row's documents each attend to themselves, as in training
            columns = [name for name in ("input_ids", "labels", "seq_lens", "ref_logps")
                       if name in eval_data.column_names and (dpo is not None or name != "ref_logps")]
            batch = collate([{k: r[k] for k in columns} for r in rows], tokenizer.pad_token_id, padding_free)
            if dpo is not None:
                loss, stats = pair_loss_sum(net, batch, info.device, dpo)
                count = count_pairs(batch)
            else:
                loss, count = token_loss_sum(net, batch, info.device)
            if not padding_only:
                totals[0] += loss.double()
                totals[1] += count
                if dpo is not None:
                    totals[4:own] += stats.double()
            if can_generate:
                generations = _generations(net, rows, tokenizer, max_new_tokens, sharded, info.device)
                if not padding_only:
                    totals[2] += sum(record["correct"] for record in generations)
                    totals[3] += len(rows)
                    kept += [{"index": position[i], **g} for i, g in zip(batch_indices, generations)]
    payload = json.dumps(kept).encode() if keep else b""
    if keep:
        totals[own + info.rank] = len(payload)
    all_reduce_sum(totals)
    if keep:
        gathered = _gather_to_first(payload, [int(size) for size in totals[own:].tolist()], info)
        if info.is_main:
            assert samples_path is not None
            write_samples(samples_path, gathered)
    net.train(was_training)
    loss = (totals[0] / totals[1].clamp(min=1)).item()
    if dpo is not None:
        pairs = max(totals[1].item(), 1.0)
        result = {"eval_loss": loss, "eval_pairs": int(totals[1].item()),
                  **{f"eval_{name}": value / pairs for name, value in zip(STATS, totals[4:own].tolist())}}
    else:
        result = {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0)), "eval_tokens": int(totals[1].item())}
    if can_generate:
        result["eval_accuracy"] = (totals[2] / totals[3].clamp(min=1)).item()
        result["eval_examples"] = int(totals[3].item())
    return result
