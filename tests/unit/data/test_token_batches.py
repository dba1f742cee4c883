"""train.micro_batch_tokens' collation: each step takes the row path's rows, in order, cut into padding-free
micro-batches of up to N tokens (a longer row alone); every rank runs as many as the rank needing the most, so the
ranks' forwards pair up; the sampler's position after a step is the row path's, so a resume continues exactly."""

from __future__ import annotations

import random
from itertools import islice

import datasets
import pytest
import torch

from trainyard.data import IGNORE_INDEX, ResumableSampler, micro_batches
from trainyard.data.token_batches import accumulation_windows, token_groups, token_windows

PAD = 0
ROWS, MICRO, ACCUM = 40, 4, 2


def dataset(seed: int = 5) -> datasets.Dataset:
    """Rows of 3 to 60 tokens; a row's ids start with its index, so a micro-batch says which rows it holds. A row's
    first label is ignored, as encoding makes it: no target spans two rows of a micro-batch."""
    rng = random.Random(seed)
    ids = [[index + 1] + [rng.randint(1, 90) for _ in range(rng.randint(2, 59))] for index in range(ROWS)]
    return datasets.Dataset.from_dict({"input_ids": ids, "labels": [[IGNORE_INDEX, *row[1:]] for row in ids]})


def rows_of(batch: dict[str, torch.Tensor]) -> list[int]:
    """The dataset indices of a padding-free micro-batch's rows, from each row's first token."""
    starts = batch["cu_seq_lens"][:-1].tolist()
    return [int(batch["input_ids"][0, start]) - 1 for start in starts]


def sampler(rank: int = 0, world: int = 1) -> ResumableSampler:
    return ResumableSampler(ROWS, seed=3, rank=rank, world_size=world)


def test_rows_are_grouped_in_order_up_to_the_budget_a_longer_row_alone() -> None:
    assert token_groups([30, 50, 40, 90, 10, 10], 100) == [[0, 1], [2], [3, 4], [5]]
    assert token_groups([150, 20], 100) == [[0], [1]]  # a row over the budget is a micro-batch of its own


def test_more_groups_are_made_by_halving_the_fullest_within_the_budget() -> None:
    lengths = [10, 20, 30, 5, 5, 25]
    groups = token_groups(lengths, 100, count=4)
    assert len(groups) == 4 and [i for g in groups for i in g] == list(range(6))
    assert all(sum(lengths[i] for i in g) <= 100 for g in groups)


def test_a_step_takes_the_row_path_s_rows_in_micro_batches_within_the_budget() -> None:
    data, budget = dataset(), 120
    tokens = token_windows(data, sampler(), MICRO * ACCUM, budget, PAD)
    rows = accumulation_windows(micro_batches(data, sampler(), MICRO, PAD), ACCUM)
    lengths = [len(ids) for ids in data["input_ids"]]
    for _ in range(ROWS // (MICRO * ACCUM) + 2):  # past an epoch's end
        window, expected = next(tokens), next(rows)
        assert [r for b in window for r in rows_of(b)] == [r for b in expected for r in rows_of(b)]
        for batch in window:
            assert batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch  # one padding-free row
            assert batch["input_ids"].numel() <= budget or len(rows_of(batch)) == 1
        held = [lengths[r] for b in window for r in rows_of(b)]
        assert len(window) == len(token_groups(held, budget))  # one rank: no more micro-batches than it needs


def test_every_rank_runs_as_many_micro_batches_as_the_rank_needing_the_most() -> None:
    data, budget, world = dataset(), 90, 3
    ranks = [token_windows(data, sampler(rank, world), MICRO * ACCUM, budget, PAD) for rank in range(world)]
    lengths = [len(ids) for ids in data["input_ids"]]
    unequal = 0
    for _ in range(6):
        windows = [next(windows_of) for windows_of in ranks]
        needed = [len(token_groups([lengths[r] for b in w for r in rows_of(b)], budget)) for w in windows]
        assert {len(w) for w in windows} == {max(needed)}
        unequal += len(set(needed)) > 1
        assert all(b["input_ids"].numel() <= budget or len(rows_of(b)) == 1 for w in windows for b in w)
    assert unequal  # the ranks' rows did need different counts


def test_a_resumed_sampler_continues_with_the_same_windows() -> None:
    data, budget = dataset(), 150
    first = sampler()
    straight = token_windows(data, first, MICRO * ACCUM, budget, PAD)
    [next(straight) for _ in range(3)]
    saved = first.state_dict()
    assert saved == {"epoch": 0, "position": 3 * MICRO * ACCUM}  # the row path's position after 3 steps
    resumed = sampler()
    resumed.load_state_dict(saved)
    again = token_windows(data, resumed, MICRO * ACCUM, budget, PAD)
    for _ in range(4):
        assert [rows_of(b) for b in next(straight)] == [rows_of(b) for b in next(again)]


def test_upcoming_names_every_rank_s_next_rows_across_an_epoch_s_end() -> None:
    stream = sampler(1, 2)
    list(islice(iter(stream), 18))  # 36 of 40 rows taken
    ahead = stream.upcoming(10)
    assert ahead.tolist() == [stream.at(stream.consumed + k) for k in range(10)]
    assert stream.consumed == 36


@pytest.mark.parametrize("budget", [1, 10_000])
def test_any_budget_keeps_every_row_once(budget: int) -> None:
    window = next(token_windows(dataset(), sampler(), ROWS, budget, PAD))
    assert sorted(r for b in window for r in rows_of(b)) == list(range(ROWS))
    assert len(window) == (ROWS if budget == 1 else 1)
