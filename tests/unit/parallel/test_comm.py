"""The comm timer counts time with at least one collective in flight: overlapping spans once, never their sum."""

from __future__ import annotations

import pytest
import torch

from trainyard.metrics import LogWindow
from trainyard.parallel.comm import CommTimer, covered_seconds, merge_intervals


def test_overlapping_spans_merge() -> None:
    assert merge_intervals([(5.0, 6.0), (1.0, 3.0), (0.0, 2.0), (3.0, 4.0)]) == [(0.0, 4.0), (5.0, 6.0)]
    assert covered_seconds([]) == 0.0


def test_the_timer_counts_the_union_not_the_sum() -> None:
    timer = CommTimer(cuda=False)
    for start, end in [(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]:
        timer.add_interval(start, end)
    timer.end_step(keep=True)
    assert timer.take() == pytest.approx(4.0)  # the durations add up to 5
    assert timer.take() == 0.0


def test_a_skipped_step_spans_are_dropped() -> None:
    timer = CommTimer(cuda=False)
    timer.add_interval(0.0, 1.0)
    timer.end_step(keep=False)
    timer.add_interval(2.0, 2.5)
    timer.end_step(keep=True)
    assert timer.take() == pytest.approx(0.5)


def test_many_collectives_in_flight_together_share_at_most_the_step() -> None:
    timer = CommTimer(cuda=False)
    window = LogWindow(torch.device("cpu"), timer, peak=None)
    for i in range(2000):  # more than the timer holds before merging
        timer.add_interval(i * 0.001, i * 0.001 + 1.0)  # queued on one stream: 2000 s of durations in 3 s
    one = torch.tensor(1.0, dtype=torch.float64)
    window.add(one, one, one, flops=0.0, seconds=3.0, data_wait=0.0)
    share = window.figures()["comm_share"]
    assert share == pytest.approx(2.999 / 3.0)
    assert share <= 1.0
