"""The estimate under dist.context_parallel N: each rank holds tokens / N of a micro-batch through the block (its
activations and logits those of a micro-batch N times shorter, attention's scores still spanning whole documents),
one layer's q/k/v exchange buffers, and per step the all-to-all bytes around every layer's attention; the global
batch counts data ranks (world / N). The dry run names the CP size; --trace traces one CP rank's step.
dist.context_parallel auto takes the cheapest fix's split where the job does not fit as it is, the same size in the
dry run, `trainyard estimate` and `train`, else 1 and why. A ~1B Llama (32 heads, 8 KV heads) with one 32,768-token
document on 8 H100s."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from tests.conftest import REPO, TINY, run_cli
from tests.unit.model import registry
from trainyard import estimate, plan
from trainyard.config_file import load_config
from trainyard.dist import DistInfo
from trainyard.estimate import context
from trainyard.hardware import gpu
from trainyard.parallel.context_parallel import kv_repeats
from trainyard.train import build, trace

LLAMA_1B = str(REPO / "configs" / "llama-1b.yaml")
H100_8 = estimate.Hardware("h100-80gb", 8, 1)
TOKENS, LAYERS, HEADS, KV_HEADS, HEAD_DIM, BF16 = 32768, 16, 32, 8, 64, 2
LONG = ["data.max_length=32768", "data.packing=false", "train.micro_batch_size=1", "train.global_batch_size=8"]
TOO_LONG = ["data.max_length=524288", "model.gradient_checkpointing=true"]
"""One document whose activations no H100 holds, even checkpointed under fsdp (the seed config's strategy)."""


def job(size: int, *more: str):
    return load_config(LLAMA_1B, [*LONG, f"dist.context_parallel={size}", *more])


@pytest.fixture(scope="module")
def model() -> estimate.mem.Model:
    return estimate.mem.model_of(job(1))


@pytest.fixture(scope="module")
def planned(model) -> dict[int, estimate.Estimate]:
    return {size: estimate.estimate(job(size), H100_8, model=model, suggest=False) for size in (1, 4, 8)}


def test_each_rank_holds_tokens_over_n_and_one_layers_exchange(planned: dict, model) -> None:
    plain, eight = planned[1], planned[8]
    assert eight.layout.context_parallel == 8 and plain.layout.context_parallel == 1
    assert eight.memory.weights == plain.memory.weights  # the shard dimension is the same 8 ranks
    # the same formula for a micro-batch of 32768 / 8 tokens whose longest document is still the whole one
    precision = estimate.mem.resolve_precision(job(1), gpu(H100_8.gpu))
    alone = estimate.mem.memory(job(1), model, plain.layout, precision, estimate.mem.MicroBatch(TOKENS // 8, TOKENS))
    assert eight.memory.activations == alone.activations and eight.memory.logits == alone.logits
    assert eight.memory.activations == pytest.approx(plain.memory.activations / 8, rel=1e-6)
    # q (32 heads), k and v (8 KV heads each: 8 divides them, no repeat), sent and received, of 4096 tokens
    assert eight.memory.context_exchange == 2 * (TOKENS // 8) * HEAD_DIM * (HEADS + 2 * KV_HEADS) * BF16
    assert plain.memory.context_exchange == 0
    assert any("context parallel 8: each rank holds 4,096 tokens" in note for note in eight.memory.notes)
    assert eight.memory.peak < plain.memory.peak - 20 * 2**30


def test_the_all_to_all_bytes_per_step_and_the_data_ranks(planned: dict) -> None:
    plain, four, eight = planned[1].timing, planned[4].timing, planned[8].timing
    assert plain.context_exchanged_bytes == 0
    # accumulation: 8 rows over 8 / N data ranks of one row each; every layer sends 7/8 of its 4096 tokens' q, k, v
    # and output (2 x 32 + 2 x 8 heads of 64) forward and backward (the seed config does not checkpoint)
    assert planned[8].accumulation == 8 and planned[4].accumulation == 4 and planned[1].accumulation == 1
    per_layer = 7 / 8 * (TOKENS // 8) * (2 * HEADS + 2 * KV_HEADS) * HEAD_DIM * BF16
    assert eight.context_exchanged_bytes == pytest.approx(8 * 2 * LAYERS * per_layer)
    assert four.context_exchanged_bytes == pytest.approx(4 * 2 * LAYERS * 3 / 4 * (TOKENS // 4) * 80 * 64 * BF16)
    assert eight.within_node_bytes - plain.within_node_bytes > eight.context_exchanged_bytes  # gathers per micro-batch
    assert plain.tokens_per_step == four.tokens_per_step == eight.tokens_per_step == 8 * TOKENS
    assert "context: all-to-all" in estimate.render(planned[8])
    assert estimate.to_json(planned[8])["context_parallel"] == 8


@pytest.mark.parametrize(("heads", "kv", "size"), [(32, 8, 8), (32, 8, 16), (8, 1, 8), (8, 2, 4), (4, 2, 2)])
def test_kv_heads_repeat_as_the_exchange_repeats_them(model, heads: int, kv: int, size: int) -> None:
    shape = replace(model.shape, heads=heads, kv_heads=kv)
    assert context.kv_heads_exchanged(shape, size) == kv * kv_repeats(heads, kv, size)


def test_the_dry_run_names_the_cp_size_and_the_data_ranks() -> None:
    text = plan.describe_plan(job(8, "train.max_steps=4"), 8, plan.Target("h100-80gb", 8, 1))
    assert "1 samples x 8 accumulation x 1 data ranks (context-parallel groups of 8 ranks)" in text
    assert "context parallel 8: each rank holds 1/8 of every row's tokens" in text


def test_the_trace_of_one_cp_rank_is_within_10_percent_of_the_formula() -> None:
    """The whole 16 layers (at 2 the formula's FSDP buffers outweigh a 4,096-token slice: 0.81, as without CP)."""
    result = trace.trace(job(8, "train.global_batch_size=1"), H100_8)
    assert result.mesh == "shard 8 (cp 8)" and result.accumulation == 1
    assert abs(result.peak_bytes / result.formula.peak_tensor_bytes - 1) <= 0.10


def test_a_document_too_long_for_one_device_is_split_by_the_cheapest_fix(model) -> None:
    """Checkpointed FSDP2 on 8 H100s cannot hold one 524,288-token document's activations on a device: the cheapest
    fix splits it over the fewest of the node's GPUs that fit it, before proposing more nodes."""
    long = ["data.max_length=524288", "model.gradient_checkpointing=true", "dist.strategy=fsdp"]
    result = estimate.estimate(job(1, *long), H100_8, model=model)
    assert not result.fits
    size = int(result.fix.split("dist.context_parallel=")[1].split()[0])
    assert estimate.estimate(job(size, *long), H100_8, model=model, suggest=False).fits
    assert not estimate.estimate(job(size // 2, *long), H100_8, model=model, suggest=False).fits, result.fix
    assert "--nodes" not in result.fix


def test_no_split_is_proposed_where_the_job_cannot_run_context_parallelism(model) -> None:
    long = ["data.max_length=524288", "model.gradient_checkpointing=true", "dist.strategy=fsdp"]
    unpadded = estimate.estimate(job(1, *long, "data.padding_free=false"), H100_8, model=model)
    assert not unpadded.fits and "dist.context_parallel" not in unpadded.fix


def test_auto_takes_the_fewest_of_a_nodes_gpus_that_fit_a_document_too_long_for_one(model) -> None:
    result = estimate.estimate(job("auto", *TOO_LONG), H100_8, model=model)
    size = result.layout.context_parallel
    assert size > 1 and result.fits and result.fix is None, result.context_parallel_why
    assert not estimate.estimate(job(size // 2, *TOO_LONG), H100_8, model=model, suggest=False).fits
    assert f"{size} of a node's 8 GPUs are the fewest whose split fits it" in result.context_parallel_why
    assert f"dist.context_parallel={size} " in estimate.estimate(job(1, *TOO_LONG), H100_8, model=model).fix
    assert f"dist.context_parallel auto -> {size}: the job does not fit" in estimate.render(result)


def test_the_dry_run_estimate_and_train_take_the_same_size_and_the_dry_run_says_why(tmp_path, monkeypatch) -> None:
    """One document of 600,000 bytes (the byte tokenizer's tokens), cut at 524,288: the dry run and `trainyard
    estimate` read it, `train` plans from its prepared rows (here unread: every row fills data.max_length, the same
    micro-batch)."""
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"text": "long document " * 42_858}) + "\n")
    args = [*LONG, *TOO_LONG, f"data.path={data}", f"output_dir={tmp_path}", "dist.context_parallel=auto",
            "train.max_steps=4", "--gpu", "h100-80gb", "--gpus-per-node", "8"]
    planned = run_cli("train", LLAMA_1B, *args, "--dry-run")
    assert planned.returncode == 0, planned.stdout[-3000:] + planned.stderr[-2000:]
    context = next(line for line in planned.stdout.splitlines() if line.startswith("context "))
    size = int(context.split("context parallel ")[1].split(":")[0])
    assert size > 1 and "(requested auto: the job does not fit (peak" in context, context
    assert f"{size} of a node's 8 GPUs are the fewest whose split fits it" in context
    assert f"x {8 // size} data ranks (context-parallel groups of {size} ranks)" in planned.stdout
    assert "the data's 1 documents" in planned.stdout  # planned from the data's own lengths
    estimated = run_cli("estimate", LLAMA_1B, *args, "--json")
    assert estimated.returncode == 0, estimated.stderr[-2000:]
    assert json.loads(estimated.stdout)["context_parallel"] == size
    monkeypatch.setattr(plan, "this_hardware", lambda info: H100_8)  # `train` on a node of 8 H100s
    trained = build.planned_context(job("auto", *TOO_LONG), DistInfo(0, 8, 0, 8, torch.device("cpu"), None), None)
    assert trained.dist.context_parallel == size and trained.dist.strategy in ("fsdp", "hsdp")


def test_the_trace_runs_the_size_auto_takes() -> None:
    result = run_cli("estimate", LLAMA_1B, *LONG, *TOO_LONG, "dist.context_parallel=auto", "--gpu", "h100-80gb",
                     "--gpus-per-node", "8", "--trace", "model.config.num_hidden_layers=2")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "fsdp over shard 8 (cp 2)" in result.stdout and "all_to_all      cp" in result.stdout


@pytest.mark.parametrize(("more", "hardware", "why"), [
    ([], H100_8, "the job fits without it (peak"),
    ([*TOO_LONG, "data.padding_free=false"], H100_8, "dist.context_parallel 2 slices padding-free rows"),
    ([*TOO_LONG, "dist.strategy=ddp"], H100_8, "CP is carved out of fsdp/hsdp, not ddp"),
    (TOO_LONG, estimate.Hardware("h100-80gb", 1, 1), "one process"),
])
def test_auto_stays_1_where_the_job_fits_or_cannot_be_split(model, more: list[str], hardware, why: str) -> None:
    resolved, said = plan.context_parallel(job("auto", *more), hardware)
    assert resolved.dist.context_parallel == 1 and why in said, said
    result = estimate.estimate(job("auto", *more), hardware, model=model, suggest=False)
    assert result.layout.context_parallel == 1 and result.context_parallel_why == said


def test_a_family_whose_layers_carry_a_state_is_never_split() -> None:
    """qwen3_next's Gated DeltaNet runs each row on one rank: neither auto nor the cheapest fix splits it, though a
    Llama of the same size is split (a tiny model with a 16M-token document on 8 L4s: 3 times what one holds)."""
    tokenizer = ("vocab_size", "pad_token_id", "bos_token_id", "eos_token_id")
    hybrid = {k: v for k, v in registry.settings("qwen3_next").items() if k not in tokenizer}
    long = ["dist.strategy=fsdp", "data.max_length=16777216", "data.packing=false", "train.micro_batch_size=1",
            "model.gradient_checkpointing=true"]
    l4 = estimate.Hardware("l4", 8, 1)
    llama = estimate.estimate(load_config(TINY, [*long, "dist.context_parallel=auto"]), l4)
    assert llama.layout.context_parallel > 1 and llama.fits
    auto = estimate.estimate(load_config(TINY, [*long, f"model.config={json.dumps(hybrid)}",
                                                "dist.context_parallel=auto"]), l4)
    assert not auto.fits and auto.layout.context_parallel == 1
    assert "context parallelism is not proven exact for qwen3_next" in auto.context_parallel_why
    assert "dist.context_parallel" not in (auto.fix or "")
