"""The sampler: disjoint rank shares, deterministic epochs, exact resume on any world size."""

from __future__ import annotations

import random
from itertools import islice

import numpy
import pytest

from trainyard.data import ResumableSampler
from trainyard.data.sampler import deal
from trainyard.errors import DataError


def take(sampler: ResumableSampler, count: int) -> list[int]:
    return list(islice(iter(sampler), count))


def test_ranks_get_disjoint_equal_shares_of_one_epoch():
    shares = [take(ResumableSampler(10, seed=3, rank=r, world_size=3), 3) for r in range(3)]
    flat = [i for share in shares for i in share]
    assert len(flat) == len(set(flat)) == 9
    assert set(flat) <= set(range(10))


def test_order_is_deterministic_and_differs_by_seed_and_epoch():
    first = take(ResumableSampler(50, seed=1, rank=0, world_size=1), 100)
    assert take(ResumableSampler(50, seed=1, rank=0, world_size=1), 100) == first
    assert take(ResumableSampler(50, seed=2, rank=0, world_size=1), 50) != first[:50]
    epoch0, epoch1 = first[:50], first[50:]
    assert sorted(epoch0) == sorted(epoch1) == list(range(50))
    assert epoch0 != epoch1


def test_without_shuffle_rank_r_takes_every_world_th_row_of_the_stream():
    # 7 rows, 2 ranks: the stream is 0..6, 0..6, ...; nothing at an epoch's end is dropped.
    assert take(ResumableSampler(7, seed=0, rank=1, world_size=2, shuffle=False), 5) == [1, 3, 5, 0, 2]
    assert take(ResumableSampler(7, seed=0, rank=0, world_size=2, shuffle=False), 5) == [0, 2, 4, 6, 1]


def test_state_is_the_global_position_in_an_epoch():
    sampler = ResumableSampler(10, seed=0, rank=0, world_size=2)
    take(sampler, 7)  # 7 rows on each of 2 ranks: 14 in all, 4 into epoch 1
    assert sampler.state_dict() == {"epoch": 1, "position": 4}
    other_rank = ResumableSampler(10, seed=0, rank=1, world_size=2)
    take(other_rank, 7)
    assert other_rank.state_dict() == sampler.state_dict()


@pytest.mark.parametrize("stop", [0, 3, 5, 12])
def test_resumed_sampler_continues_the_uninterrupted_sequence(stop):
    uninterrupted = take(ResumableSampler(11, seed=7, rank=1, world_size=2), 20)
    saved = ResumableSampler(11, seed=7, rank=1, world_size=2)
    head = take(saved, stop)
    resumed = ResumableSampler(11, seed=7, rank=1, world_size=2)
    resumed.load_state_dict(saved.state_dict())
    assert head + take(resumed, 20 - stop) == uninterrupted


def run_segments(num_samples: int, global_batch: int, segments: list[tuple[int, int]], seed: int = 5) -> list[int]:
    """Steps of a job whose world size changes: (world size, steps) per segment, each resuming
    from the state every rank of the previous one saved. Returns the rows of each step in
    order (rank by rank within a step: the set per step is what matters)."""
    state = None
    trained: list[int] = []
    for world, steps in segments:
        samplers = [ResumableSampler(num_samples, seed=seed, rank=r, world_size=world) for r in range(world)]
        for sampler in samplers:
            if state is not None:
                sampler.load_state_dict(state)
        streams = [iter(sampler) for sampler in samplers]
        for _ in range(steps):
            for stream in streams:
                trained += list(islice(stream, global_batch // world))
        states = [sampler.state_dict() for sampler in samplers]
        assert all(s == states[0] for s in states), states  # a checkpoint's ranks agree
        state = states[0]
    return trained


def epochs(num_samples: int, count: int, seed: int = 5) -> list[list[int]]:
    reference = ResumableSampler(num_samples, seed=seed, rank=0, world_size=1)
    return [reference.epoch_order(e) for e in range(count)]


@pytest.mark.parametrize(
    "segments",
    [
        [(2, 5), (1, 4), (3, 6), (2, 5)],
        [(1, 7), (4, 3), (6, 9)],
        [(12, 2), (1, 1), (3, 11)],
    ],
)
def test_changing_world_size_neither_skips_nor_repeats_a_row(segments):
    """World 2 -> 1 -> 3 -> 2 with a global batch of 12 over a 50-row epoch (steps span epochs):
    every step trains the next 12 rows of the epochs' orders laid back to back."""
    trained = run_segments(50, 12, segments)
    steps = sum(count for _, count in segments)
    assert len(trained) == steps * 12
    order = [i for epoch in epochs(50, len(trained) // 50 + 1) for i in epoch]
    for step in range(steps):  # each step trains exactly the next 12 rows of the stream
        assert sorted(trained[step * 12 : (step + 1) * 12]) == sorted(order[step * 12 : (step + 1) * 12]), step


def test_random_world_size_changes_match_one_uninterrupted_world():
    rng = random.Random(0)
    global_batch = 24
    segments = [(rng.choice([1, 2, 3, 4, 6, 8, 12, 24]), rng.randint(0, 5)) for _ in range(12)]
    steps = sum(count for _, count in segments)
    changed = run_segments(37, global_batch, segments)
    straight = run_segments(37, global_batch, [(1, steps)])
    for step in range(steps):
        window = slice(step * global_batch, (step + 1) * global_batch)
        assert sorted(changed[window]) == sorted(straight[window]), (segments, step)


def test_a_legacy_per_rank_index_becomes_a_global_position():
    """Checkpoints from before positions were global stored rows per rank; rank r had taken
    rows r, r+w, ... of the epoch's order, so index 3 on 2 ranks is 6 rows in all."""
    sampler = ResumableSampler(10, seed=0, rank=0, world_size=1)
    sampler.load_state_dict({"epoch": 2, "index": 3}, saved_world_size=2)
    assert sampler.state_dict() == {"epoch": 2, "position": 6}
    assert take(sampler, 4) == sampler.epoch_order(2)[6:10]


def test_dataset_smaller_than_world_is_an_error():
    with pytest.raises(DataError, match="too small for the world size"):
        ResumableSampler(3, seed=0, rank=0, world_size=4)


def test_state_from_other_data_is_rejected():
    sampler = ResumableSampler(10, seed=0, rank=0, world_size=2)
    with pytest.raises(DataError, match="does not fit"):
        sampler.load_state_dict({"epoch": 0, "position": 11})


def test_the_first_rows_lead_epoch_0_only_and_every_row_is_still_taken_once():
    first = [7, 2, 9, 4]
    stream = take(ResumableSampler(10, seed=3, rank=0, world_size=1, first=first), 20)
    plain = take(ResumableSampler(10, seed=3, rank=0, world_size=1), 20)
    assert stream[:4] == first
    assert sorted(stream[:10]) == list(range(10))
    assert stream[4:10] == [i for i in plain[:10] if i not in first]  # the rest keeps the seed's order
    assert stream[10:] == plain[10:]  # epoch 1 as without them


def test_a_resume_keeps_the_order_the_run_began_with_on_any_world_size():
    first = [5, 0, 8, 3]
    ranks = [ResumableSampler(10, seed=1, rank=r, world_size=2, first=first) for r in range(2)]
    taken = [take(s, 3) for s in ranks]
    state = ranks[0].state_dict()
    assert state["first"] == first
    resumed = ResumableSampler(10, seed=1, rank=0, world_size=1)  # another world, and no leading rows of its own
    resumed.load_state_dict(state)
    whole = take(ResumableSampler(10, seed=1, rank=0, world_size=1, first=first), 10)
    assert sorted(taken[0] + taken[1] + take(resumed, 4)) == list(range(10))
    assert taken[0] + taken[1] == [whole[i] for i in (0, 2, 4, 1, 3, 5)]


def test_leading_rows_that_do_not_fit_the_data_are_refused():
    sampler = ResumableSampler(10, seed=1, rank=0, world_size=1)
    with pytest.raises(DataError, match="leading rows"):
        sampler.load_state_dict({"epoch": 0, "position": 4, "first": [3, 12]})


def test_the_largest_rows_come_first_so_the_first_micro_batch_is_the_largest():
    from datasets import Dataset

    from trainyard.data.loader import largest_rows, micro_batches

    lengths = [3, 9, 1, 9, 4, 7, 2, 5]
    rows = Dataset.from_dict({"input_ids": [[1] * n for n in lengths], "labels": [[1] * n for n in lengths]})
    first = largest_rows(rows, 4)
    assert first == [1, 3, 5, 7]
    for padding_free in (True, False):
        sampler = ResumableSampler(len(lengths), seed=0, rank=0, world_size=1, first=first)
        batches = list(islice(micro_batches(rows, sampler, 2, 0, padding_free=padding_free), 4))
        sizes = [int(b["input_ids"].numel()) for b in batches]
        assert sizes[0] == max(sizes), sizes


def test_deal_gives_the_long_row_a_rank_of_few_others():
    # round robin would hold 481 + 70 + 90 + 110 = 751 tokens on rank 0 and 360 on rank 1
    shares = deal([481, 60, 70, 80, 90, 100, 110, 120], 2)
    assert shares == [[0, 2], [1, 3, 4, 5, 6, 7]]


def test_deal_keeps_the_round_robin_where_it_is_as_even():
    assert deal([100] * 6, 3) == [[0, 3], [1, 4], [2, 5]]


def test_deal_places_every_row_once_never_above_the_round_robin():
    draw = random.Random(7)
    for _ in range(200):
        world = draw.randint(1, 5)
        lengths = [draw.randint(1, 500) for _ in range(world * draw.randint(1, 6))]
        shares = deal(lengths, world)
        assert sorted(i for share in shares for i in share) == list(range(len(lengths)))
        assert all(share and share == sorted(share) for share in shares)
        robin = max(sum(lengths[rank::world]) for rank in range(world))
        assert max(sum(lengths[i] for i in share) for share in shares) <= robin


def test_take_by_tokens_consumes_what_the_round_robin_does():
    lengths = numpy.array([5 * (i % 7) + 1 + (40 if i % 11 == 0 else 0) for i in range(30)])
    dealt = [ResumableSampler(30, seed=4, rank=r, world_size=3) for r in range(3)]
    plain = [ResumableSampler(30, seed=4, rank=r, world_size=3) for r in range(3)]
    moved = 0
    for _ in range(5):  # 5 micro-batches of 4 rows a rank: 60 rows, two epochs
        took = [sampler.take(4, lengths) for sampler in dealt]
        robin = [take(sampler, 4) for sampler in plain]
        assert sorted(i for _, rows in took for i in rows) == sorted(i for rows in robin for i in rows)
        assert sorted(p for positions, _ in took for p in positions) == list(range(dealt[0].consumed - 12,
                                                                                     dealt[0].consumed))
        assert max(lengths[rows].sum() for _, rows in took) <= max(lengths[rows].sum() for rows in robin)
        assert [s.state_dict() for s in dealt] == [s.state_dict() for s in plain]
        moved += any(sorted(rows) != sorted(mine) for (_, rows), mine in zip(took, robin, strict=True))
    assert moved, "no micro-batch was dealt otherwise than the round robin"


def test_take_leaves_the_leading_rows_in_the_streams_order():
    lengths = numpy.array([1] * 10 + [90, 80, 70, 60])
    first = [10, 11, 12, 13]
    samplers = [ResumableSampler(14, seed=0, rank=r, world_size=2, first=first) for r in range(2)]
    assert [s.take(2, lengths)[1] for s in samplers] == [[10, 12], [11, 13]]
