"""What the loop's windows say of the steps they gave (data.token_batches.StepWindows): each train event the
micro-batches of its own steps, summary.json those of the run; under a token budget no row-path accumulation."""

from __future__ import annotations

from tests.unit.data.test_token_batches import ACCUM, MICRO, PAD, dataset, sampler
from trainyard.data import micro_batches
from trainyard.data.token_batches import StepWindows, accumulation_windows, token_windows


def test_a_token_budget_s_events_and_summary_count_the_micro_batches_each_step_ran() -> None:
    windows = StepWindows(token_windows(dataset(), sampler(), MICRO * ACCUM, 60, PAD), 60, ACCUM)
    ran = [len(next(windows)) for _ in range(3)]
    assert len(set(ran)) > 1, ran  # the rows' lengths set each step's count
    assert windows.since_log() == {"micro_batch_tokens": 60, "micro_batches_per_step": round(sum(ran) / 3, 3)}
    ran.append(len(next(windows)))
    assert windows.since_log() == {"micro_batch_tokens": 60, "micro_batches_per_step": ran[-1]}  # its steps only
    assert windows.summary() == {"accumulation": None, "micro_batch_tokens": 60, "micro_batches_per_step": {
        "mean": round(sum(ran) / 4, 3), "min": min(ran), "max": max(ran)}}


def test_the_row_path_says_its_accumulation_and_before_any_step_no_count() -> None:
    windows = StepWindows(accumulation_windows(micro_batches(dataset(), sampler(), MICRO, PAD), ACCUM), None, ACCUM)
    assert windows.summary() == {"accumulation": ACCUM, "micro_batch_tokens": None, "micro_batches_per_step": None}
    next(windows)
    assert windows.since_log() == {"micro_batches_per_step": ACCUM}
    assert windows.summary()["micro_batches_per_step"] == {"mean": ACCUM, "min": ACCUM, "max": ACCUM}
