"""Run under torchrun (2 or 4 ranks): DPO under context parallelism (dist.context_parallel 2, fsdp, fp32) against one
process. For each job, build the model as training does, collate one padding-free row of two pairs through the
training collator (each rank its slice; the second pair's chosen reply crosses the halves' boundary, the row's odd
length is padded), run the DPO loss with the loop's scale (world / global pairs), and compare the ranks' summed loss,
DPO's figures (summed over the ranks, divided by their pairs, as the log window does) and every trainable
parameter's gradient with a 1-process build on rank 0 that takes the whole row. On 4 ranks there are two CP groups
(CP 2 x FSDP 2: the weights sharded over all four); both take the same row, so the ranks' sums are twice the row's,
and so are their pairs. Full fine-tuning's reference is computed by reference.py's pass on each build (the CP build:
each rank its rows, whole), compared, and stored on the rows; LoRA's is the adapters-off forward, summed over the CP
group.

With "eval", each job's evaluation too: evaluate.py on the CP build (each rank its share of the three eval pairs,
whole, one at a time: rank 1's second batch is padding only) against evaluate.py on the 1-process build. Its one
all-reduce is the world's, so every rank runs that 1-process evaluation alone and the world sums as many copies of
the same sums: the figures (sums / pairs) are one process's, its pairs the world's copies.

argv: result file, a JSON object {job: [overrides]}, optionally "eval". Rank 0 writes one JSON line per job: job,
loss_rel, grad_rel, worst, figures_rel, reference_rel, targets (each rank's target tokens), pairs (each rank's
count: the pairs it owns), want_pairs, eval_rel, eval_pairs ([CP's, one process's]), ok_error."""

from __future__ import annotations

import contextlib
import json
import sys
import traceback
from pathlib import Path

import datasets
import torch
import torch.distributed as torch_dist

from context_parallel import TINY, build_model  # beside this script
from expert_parallel import full_grads  # beside this script
from trainyard import dist
from trainyard.config import JobConfig
from trainyard.config_file import load_config
from trainyard.data.collate import collate
from trainyard.data.formats import IGNORE_INDEX
from trainyard.evaluate import evaluate
from trainyard.model import source as source_room
from trainyard.parallel import context_parallel
from trainyard.preference import reference as reference_pass
from trainyard.preference.loss import count_pairs, pair_logps, pair_loss_sum, target_logps

SHIFT = (-0.3, 0.2)
"""Added to the stored reference's [chosen, rejected] in both builds, so that full fine-tuning's rewards at its initial
weights are not zero."""
PAIRS = ((12, 5, 9, 5), (15, 4, 13, 4), (10, 3, 14, 6))
"""(chosen, its prompt, rejected, its prompt) per pair. Training takes the first two: 49 tokens, padded to 50, each
rank 25; the second chosen document holds tokens 21-35, its reply 25-35 across the boundary. Evaluation takes all
three."""
TRAINED = 2


def rows() -> list[dict[str, list[int]]]:
    generator = torch.Generator().manual_seed(11)
    found = []
    for chosen, chosen_prompt, rejected, rejected_prompt in PAIRS:
        ids = torch.randint(3, 90, (chosen + rejected,), generator=generator).tolist()
        labels = ([IGNORE_INDEX] * chosen_prompt + ids[chosen_prompt:chosen]
                  + [IGNORE_INDEX] * rejected_prompt + ids[chosen + rejected_prompt:])
        found.append({"input_ids": ids, "labels": labels, "seq_lens": [chosen, rejected]})
    return found


def stored_reference(model: torch.nn.Module, cfg_overrides: list[str], info: dist.DistInfo) -> list[list[float]]:
    """reference.py's pass over the rows on the CP build: [chosen, rejected] per row."""
    split = datasets.Dataset.from_list(rows())
    return reference_pass._pass(model, split, info, load_config(TINY, cfg_overrides), contextlib.nullcontext)


@torch.no_grad()
def one_process_reference(model: torch.nn.Module, pad_id: int, device: torch.device) -> list[list[float]]:
    """What that pass computes on one process (its all-reduce would wait for rank 1): each row whole, in eval."""
    model.eval()
    found = []
    for row in rows():
        batch = collate([row], pad_id, True)
        logps = pair_logps(target_logps(model, batch, device), batch)
        found.append([float(logps.chosen[0]), float(logps.rejected[0])])
    model.train()
    return found


def with_reference(stored: list[list[float]] | None) -> list[dict]:
    """The rows, each with its stored reference shifted (full fine-tuning), or as they are (LoRA's is computed)."""
    if stored is None:
        return rows()
    return [{**row, "ref_logps": [value + shift for value, shift in zip(values, SHIFT)]}
            for row, values in zip(rows(), stored)]


def evaluated(model: torch.nn.Module, examples: list[dict], cfg: JobConfig, info: dist.DistInfo) -> dict[str, float]:
    """evaluate.py's DPO figures over every row, one pair a batch, as a job's eval runs them on `info`'s ranks."""
    tokenizer = source_room.load_tokenizer(cfg.model, None)
    return evaluate(model, datasets.Dataset.from_list(examples), subset_size=len(examples), seed=0, batch_size=1,
                    info=info, tokenizer=tokenizer, dpo=cfg.dpo)


def eval_difference(got: dict[str, float], want: dict[str, float], copies: int) -> dict:
    """The worst relative difference of the CP job's eval figures from one process's, and both pair counts."""
    assert sorted(got) == sorted(want), f"eval figures differ: {sorted(set(got) ^ set(want))}"
    figures = [name for name in got if name != "eval_pairs"]
    worst = max(abs(got[name] - want[name]) / max(abs(want[name]), 1e-6) for name in figures)
    return {"eval_rel": worst, "eval_pairs": [got["eval_pairs"], want["eval_pairs"] / copies],
            "eval": got}


def compare(overrides: list[str], info: dist.DistInfo, with_eval: bool) -> dict:
    common = ["model.tokenizer=builtin:bytes", "train.precision=fp32", "model.attn_implementation=auto",
              "data.padding_free=true", "train.objective=dpo", "train.micro_batch_size=2", *overrides]
    sharded_overrides = [*common, "dist.strategy=fsdp", "dist.context_parallel=2"]
    cfg = load_config(TINY, sharded_overrides)
    sharded, pad_id = build_model(sharded_overrides, info, 1)
    stored = None if cfg.lora.enabled else stored_reference(sharded, sharded_overrides, info)
    got_eval = evaluated(sharded, with_reference(stored), cfg, info) if with_eval else {}
    batch = collate(with_reference(stored)[:TRAINED], pad_id, True, context_parallel.slice_of(sharded))
    pairs = torch.tensor([float(count_pairs(batch))])
    dist.all_reduce_sum(pairs)
    loss_sum, stats = pair_loss_sum(sharded, batch, info.device, cfg.dpo)
    (loss_sum * info.world_size / pairs.item()).backward()  # the loop's scale: FSDP averages over the world
    summed = dist.all_reduce_sum(torch.cat([loss_sum.detach().reshape(1), stats.detach()]).double())
    facts: list[list[int] | None] = [None] * info.world_size
    torch_dist.all_gather_object(facts, [int((batch["labels"][:, 1:] != IGNORE_INDEX).sum()), count_pairs(batch)])
    grads = full_grads(sharded, 1)
    del sharded
    if not (info.is_main or with_eval):
        return {}
    alone = dist.DistInfo(0, 1, 0, 1, info.device, None)
    reference, _ = build_model([*common, "dist.strategy=none"], alone, 1)
    want_stored = None if stored is None else one_process_reference(reference, pad_id, info.device)
    found = {}
    if with_eval:  # on every rank: the world's all-reduce
        found = eval_difference(got_eval, evaluated(reference, with_reference(want_stored), cfg, alone),
                                info.world_size)
    if not info.is_main:
        return {}
    reference_rel = 0.0
    if stored is not None:
        reference_rel = max(abs(g - w) / abs(w) for got, want in zip(stored, want_stored) for g, w in zip(got, want))
    whole = collate(with_reference(want_stored)[:TRAINED], pad_id, True)
    want_pairs = count_pairs(whole)
    want_loss, want_stats = pair_loss_sum(reference, whole, info.device, cfg.dpo)
    (want_loss / want_pairs).backward()
    want = full_grads(reference, 1)
    assert sorted(want) == sorted(grads), f"trainable parameters differ: {sorted(set(want) ^ set(grads))}"
    worst, grad_rel = "", 0.0
    for name, expected in want.items():
        got = grads[name]
        assert expected is not None and got is not None and got.shape == expected.shape, name
        rel = (got - expected).abs().max().item() / max(expected.abs().max().item(), 1e-30)
        if rel > grad_rel:
            worst, grad_rel = name, rel
    got_loss = summed[0].item() / pairs.item()
    got_figures, want_figures = summed[1:] / pairs.item(), want_stats.double() / want_pairs
    figures_rel = ((got_figures - want_figures).abs() / want_figures.abs().clamp_min(1e-6)).max().item()
    return {"loss_rel": abs(got_loss - want_loss.item() / want_pairs) / abs(want_loss.item() / want_pairs),
            "grad_rel": grad_rel, "worst": worst, "figures_rel": figures_rel, "reference_rel": reference_rel,
            "targets": [f[0] for f in facts if f], "pairs": [f[1] for f in facts if f], "want_pairs": want_pairs,
            "figures": got_figures.tolist(), **found}


def main() -> None:
    result_file, jobs = Path(sys.argv[1]), json.loads(sys.argv[2])
    with_eval = sys.argv[3:] == ["eval"]
    info = dist.init(load_config(TINY, ["dist.timeout_s=120"]).dist)
    if info.is_main:
        result_file.write_text("")
    for job, overrides in jobs.items():
        try:
            figures, error = compare(overrides, info, with_eval), None
        except Exception:  # whatever it is, reported for this job alone
            figures, error = {}, traceback.format_exc()
        errors: list[str | None] = [None] * info.world_size
        torch_dist.all_gather_object(errors, error)
        error = next((f"rank {r}: {e}" for r, e in enumerate(errors) if e), None)
        line = json.dumps({"job": job, "loss_rel": None, "grad_rel": None, **figures, "ok_error": error})
        if info.is_main:
            with result_file.open("a") as out:
                out.write(line + "\n")
            print(line, flush=True)
    dist.exit_process(0)


if __name__ == "__main__":
    main()
