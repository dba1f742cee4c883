"""train.micro_batch_tokens in the plan: auto is the largest N whose estimated peak fits 90% of the device (a 1B
Llama on an H100: it fits at N, not at a clearly larger N, and holds several of micro_batch_size's micro-batches);
the dry run, `trainyard estimate` and `train` take the same N, the dry run saying why; on a CPU auto is the data's
largest micro-batch of rows (no gain); fewer micro-batches a step mean fewer FSDP gathers; bad values exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REPO, TINY, run_cli
from tests.unit.model.test_hybrid_families import settings
from trainyard import estimate
from trainyard.config_file import load_config
from trainyard.errors import ConfigError
from trainyard.plan import batching
from trainyard.plan.reading import data_lengths

LLAMA_1B = str(REPO / "configs" / "llama-1b.yaml")
H100 = estimate.Hardware("h100-80gb", 1, 1)
STEP = ["train.global_batch_size=256"]  # 256 rows of 2048 tokens a step: far more than one H100 holds at once


def peak_share(cfg, tokens: int, hardware: estimate.Hardware = H100) -> float:
    changed = cfg.model_copy(deep=True)
    changed.train.micro_batch_tokens = tokens
    result = estimate.estimate(changed, hardware, suggest=False)
    return result.memory.peak / result.device_bytes


def test_auto_is_the_largest_micro_batch_the_estimate_fits_in_90_percent_of_an_h100() -> None:
    cfg = load_config(LLAMA_1B, [*STEP, "train.micro_batch_tokens=auto"])
    resolved, why = batching.micro_batch_tokens(cfg, H100)
    tokens = resolved.train.micro_batch_tokens
    assert isinstance(tokens, int) and tokens % batching.GRAIN == 0
    assert peak_share(cfg, tokens) <= 0.9 < peak_share(cfg, tokens + 2 * batching.GRAIN)
    assert peak_share(cfg, round(tokens * 1.25)) > 0.9
    assert tokens >= 4 * 2 * 2048  # several of micro_batch_size 2's micro-batches of 2048-token rows
    assert "fits 90% of 79.6 GiB on h100-80gb" in why


def test_auto_stops_at_the_step_s_rows_and_at_the_longest_row() -> None:
    small = load_config(LLAMA_1B, ["train.micro_batch_tokens=auto"])  # 2 rows a step: one micro-batch holds them
    resolved, why = batching.micro_batch_tokens(small, H100)
    assert resolved.train.micro_batch_tokens == 2 * 2048 and "all 2 rows a rank takes per step fit" in why
    l4 = estimate.Hardware("l4", 1, 1)
    long_rows = load_config(LLAMA_1B, [*STEP, "train.micro_batch_tokens=auto", "data.max_length=65536",
                                       "model.config.max_position_embeddings=65536"])
    resolved, why = batching.micro_batch_tokens(long_rows, l4)
    assert resolved.train.micro_batch_tokens == 65536 and "not even the longest row" in why


def test_on_a_cpu_auto_is_the_data_s_largest_micro_batch_of_rows() -> None:
    cfg = load_config(TINY, ["train.micro_batch_tokens=auto"])
    resolved, why = batching.micro_batch_tokens(cfg, estimate.Hardware("cpu", 1, 1))
    assert resolved.train.micro_batch_tokens == 8 * 104  # micro_batch_size 8 x data.max_length: the data unread
    assert "a CPU gains nothing from larger micro-batches" in why


def test_the_dry_run_and_the_estimate_print_the_one_choice() -> None:
    job = [*STEP, "train.micro_batch_tokens=auto", "data.synthetic_train_size=600"]  # 600 rows: about 300 packed
    cfg = load_config(LLAMA_1B, job)
    tokens = batching.micro_batch_tokens(cfg, H100, data_lengths(cfg, 1))[0].train.micro_batch_tokens
    target = ["--gpu", "h100-80gb", "--gpus-per-node", "1"]
    planned = run_cli("train", LLAMA_1B, *job, "--dry-run", *target)
    assert planned.returncode == 0, planned.stderr[-2000:]
    assert f"micro batch      up to {tokens:,} tokens, padding-free (train.micro_batch_tokens auto -> {tokens:,}: " \
           "the largest micro-batch whose estimated peak fits 90%" in planned.stdout
    assert f"planned for a micro-batch of {tokens:,} tokens" in planned.stdout
    assert "each step's 256 rows per rank (about " in planned.stdout and " micro-batch(es) of up to " in planned.stdout
    estimated = run_cli("estimate", LLAMA_1B, *job, *target)
    assert estimated.returncode == 0, estimated.stderr[-2000:]
    assert f"note: train.micro_batch_tokens auto -> {tokens:,}: " in estimated.stdout


def test_larger_micro_batches_gather_fsdp_s_weights_fewer_times_a_step() -> None:
    eight = estimate.Hardware("h100-80gb", 8, 1)
    rows = estimate.estimate(load_config(LLAMA_1B, STEP), eight)
    tokens = estimate.estimate(load_config(LLAMA_1B, [*STEP, "train.micro_batch_tokens=16384"]), eight)
    assert rows.accumulation == tokens.accumulation == 16  # the global batch holds: 256 rows = 2 x 16 x 8
    assert tokens.timing.tokens_per_step == rows.timing.tokens_per_step
    assert tokens.timing.within_node_bytes < rows.timing.within_node_bytes / 3  # 4 micro-batches a step, not 16
    assert tokens.micro_batch.tokens == 16384


def _hybrid(tmp_path: Path) -> str:
    job = tmp_path / "qwen3_next.yaml"
    config = "\n".join(f"    {key}: {value}" for key, value in settings("qwen3_next").items() if key != "vocab_size")
    job.write_text(f"model:\n  config:\n{config}\n  tokenizer: builtin:bytes\n")
    return str(job)


@pytest.mark.parametrize(("overrides", "words"), [
    (["train.micro_batch_tokens=0"], "train.micro_batch_tokens: Input should be greater than or equal to 1 or 'auto'"),
    (["train.micro_batch_tokens=lots"], "train.micro_batch_tokens: Input should be a valid integer or 'auto'"),
    (["train.micro_batch_tokens=512", "data.padding_free=false"], "set data.padding_free: true"),
])
def test_bad_values_exit_2_naming_the_field(overrides: list[str], words: str) -> None:
    result = run_cli("train", TINY, *overrides, "--dry-run")
    assert result.returncode == 2, result.stderr[-2000:]
    assert words in result.stderr and "Traceback" not in result.stderr


def test_a_mixture_is_refused_with_micro_batch_size_as_the_fix() -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(TINY, ["train.micro_batch_tokens=100", "data.mixture=[{path: a, weight: 1}]", "~data.path"])
    assert "set train.micro_batch_size (N / data.max_length rows) instead" in caught.value.what


def test_a_model_that_keeps_rows_padded_is_refused_before_any_weight(tmp_path: Path) -> None:
    padded = run_cli("train", _hybrid(tmp_path), "train.micro_batch_tokens=512", "model.attn_implementation=sdpa",
                     "--dry-run")
    assert padded.returncode == 2, padded.stderr[-2000:]
    assert "train.micro_batch_tokens packs padding-free micro-batches, but the rows stay padded" in padded.stderr
    assert "remove train.micro_batch_tokens" in padded.stderr
