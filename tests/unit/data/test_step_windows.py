"""What the loop's windows say of the steps they gave (data.token_batches.StepWindows): each train event the
micro-batches of its own steps, summary.json those of the run; under a token budget no row-path accumulation."""

from __future__ import annotations

from tests.conftest import TINY
from tests.unit.data.test_token_batches import ACCUM, MICRO, PAD, dataset, sampler
from trainyard.config_file import load_config
from trainyard.data import micro_batches
from trainyard.data.token_batches import StepWindows, accumulation_windows, token_windows
from trainyard.plan import batching


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


def test_the_run_s_last_word_says_the_counts_its_steps_ran() -> None:
    tokens = load_config(TINY, ["train.micro_batch_size=4", "train.micro_batch_tokens=300"])
    ran = batching.ran_words(tokens, ACCUM, {"mean": 5.333, "min": 5, "max": 6})
    assert ran == ("ran each step's 8 rows per rank in 5 to 6 (mean 5.333) micro-batch(es) of up to 300 tokens, "
                   "as many on every rank")
    assert batching.ran_words(load_config(TINY), ACCUM, {"mean": 2, "min": 2, "max": 2}) == ""  # logged at the start
