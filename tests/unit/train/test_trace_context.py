"""`trainyard estimate --trace` under dist.context_parallel N: one CP rank's step (its 1/N of the row through the
block, whole documents for heads / N inside attention, the all-to-alls around every layer's attention on the mesh's
"cp" dimension), set beside the formula's figures per rank. Tiny families at 4,096-token rows: a few seconds each."""

from __future__ import annotations

import pytest

from tests.unit.train.test_trace import _family_at_4k
from trainyard import estimate
from trainyard.config_file import load_config
from trainyard.errors import ConfigError
from trainyard.estimate import arch as estimate_arch
from trainyard.estimate import context
from trainyard.train import trace

TOKENS, HEADS, KV_HEADS, HEAD_DIM, BF16 = 4096, 4, 2, 16, 2
"""tests/unit/model/families.py's widths (head_dim 64 / 4 = 16), bf16-mixed on a GPU."""


def _exchanged(result: trace.Trace) -> list[trace.Collective]:
    return [one for one in result.collectives if one.kind == "all_to_all"]


def _traced(tmp_path, family: str, size: int, gpus: int, device: str = "h100-80gb", *more: str) -> trace.Trace:
    job = load_config(_family_at_4k(tmp_path, family), ["dist.strategy=fsdp", f"dist.context_parallel={size}", *more])
    return trace.trace(job, estimate.Hardware(device, gpus, 1))


@pytest.mark.parametrize("device", ["h100-80gb", "cpu"])
def test_one_cp_rank_s_step_is_within_10_percent_of_the_formula(tmp_path, device: str) -> None:
    """Llama, CP 2 of FSDP over 4 ranks: rank 0 holds 2,048 of the row's tokens; forward and backward send q, k, v
    and the output of each layer through the "cp" group (whole, its own 1/N included), which the formula's bytes
    sent to the others are (N - 1) / N of; the held state is FSDP's over 4, the peak per rank within 10% (0.95 on a
    GPU, inside the exchange torch's varlen kernel traced as the fused one; 0.91 on this CPU, trainyard's varlen)
    and below the same job's without CP."""
    result = _traced(tmp_path, "llama", 2, 4, device)
    alone = _traced(tmp_path, "llama", 1, 4, device)
    assert result.mesh == "shard 4 (cp 2)" and result.layout.context_parallel == 2
    exchanged, rank_tokens = _exchanged(result), TOKENS // 2
    width = BF16 if device != "cpu" else min(one.bytes_in for one in exchanged) // (rank_tokens * KV_HEADS * HEAD_DIM)
    assert {(one.group, one.ranks) for one in exchanged} == {("cp", 2)}
    assert len(exchanged) == 2 * 4 * result.layers * result.accumulation  # forward, backward: q, k, v, output
    assert sorted({one.bytes_in for one in exchanged}) == [rank_tokens * h * HEAD_DIM * width
                                                            for h in (KV_HEADS, HEADS)]
    planned = estimate.estimate(load_config(_family_at_4k(tmp_path, "llama"), ["dist.strategy=fsdp",
                                "dist.context_parallel=2"]), estimate.Hardware(device, 4, 1), suggest=False)
    assert planned.timing.context_exchanged_bytes == pytest.approx(sum(one.bytes_in for one in exchanged) / 2)
    assert result.static_bytes == pytest.approx(trace.held_between_steps(result.formula), rel=0.02)
    assert abs(result.peak_bytes / result.formula.peak_tensor_bytes - 1) <= 0.10
    assert result.peak_bytes < alone.peak_bytes
    assert any("context parallel 2: rank 0 holds 2,048 of the row's 4,096 tokens" in note for note in result.notes)
    assert "traced as trainyard_context" not in result.notes[0]


def test_kv_heads_fewer_than_the_group_are_repeated_and_a_window_s_rank_is_within_10_percent(tmp_path) -> None:
    """Mistral (2 KV heads, a sliding window of 8), CP 4 on 8 GPUs: each rank's 2 KV heads are repeated to 4 so the
    group splits them, so k and v go out as wide as q (the formula's kv_heads_exchanged); within 10% (0.95)."""
    result = _traced(tmp_path, "mistral", 4, 8)
    shape = estimate_arch.shape_of(trace.architecture(load_config(_family_at_4k(tmp_path, "mistral")), None))
    assert context.kv_heads_exchanged(shape, 4) == HEADS
    assert {one.bytes_in for one in _exchanged(result)} == {TOKENS // 4 * HEADS * HEAD_DIM * BF16}
    assert {one.ranks for one in _exchanged(result)} == {4} and result.mesh == "shard 8 (cp 4)"
    assert abs(result.peak_bytes / result.formula.peak_tensor_bytes - 1) <= 0.10


def test_the_trace_refuses_what_train_refuses_under_cp(tmp_path) -> None:
    """A family CP is not proven exact for is refused as `train` refuses it, naming the field, before any step."""
    with pytest.raises(ConfigError, match="not proven exact for qwen2") as err:
        _traced(tmp_path, "qwen2", 2, 4)
    assert err.value.where is not None


@pytest.mark.parametrize(("family", "size", "gpus"), [("mistral", 4, 8), ("gemma2", 2, 2)])
def test_on_cpu_a_window_s_mask_and_soft_capping_s_scores_are_counted_per_rank(tmp_path, family: str, size: int,
                                                                               gpus: int) -> None:
    """On a CPU a rank attends whole documents for heads / N: mistral's sliding window makes one [L, L] mask for
    all heads and layers, the whole document's on every rank (the formula once divided it by N with the tokens: 3.42x;
    each layer once made its own, and the booleans it was made from doubled it at a rank's peak: 1.17 in bf16), and
    gemma2's eager soft-capping keeps [heads / N, L, L] scores (once counted for all heads: 0.75x); both within
    10% (0.99 in fp32 and bf16-mixed, and 0.99)."""
    result = _traced(tmp_path, family, size, gpus, "cpu")
    assert result.layout.context_parallel == size
    assert abs(result.peak_bytes / result.formula.peak_tensor_bytes - 1) <= 0.10
