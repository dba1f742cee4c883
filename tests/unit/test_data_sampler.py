"""The sampler: disjoint rank shards, deterministic epochs, exact resume."""

from __future__ import annotations

from itertools import islice

import pytest

from trainyard.data import ResumableSampler
from trainyard.errors import DataError


def take(sampler: ResumableSampler, count: int) -> list[int]:
    return list(islice(iter(sampler), count))


def test_ranks_get_disjoint_equal_shards_of_one_epoch():
    shards = [take(ResumableSampler(10, seed=3, rank=r, world_size=3), 3) for r in range(3)]
    flat = [i for shard in shards for i in shard]
    assert len(flat) == len(set(flat)) == 9
    assert set(flat) <= set(range(10))


def test_order_is_deterministic_and_differs_by_seed_and_epoch():
    first = take(ResumableSampler(50, seed=1, rank=0, world_size=1), 100)
    assert take(ResumableSampler(50, seed=1, rank=0, world_size=1), 100) == first
    assert take(ResumableSampler(50, seed=2, rank=0, world_size=1), 50) != first[:50]
    epoch0, epoch1 = first[:50], first[50:]
    assert sorted(epoch0) == sorted(epoch1) == list(range(50))
    assert epoch0 != epoch1


def test_without_shuffle_rank_r_takes_every_world_th_index():
    assert take(ResumableSampler(7, seed=0, rank=1, world_size=2, shuffle=False), 4) == [1, 3, 5, 1]


def test_state_tracks_epoch_and_position():
    sampler = ResumableSampler(10, seed=0, rank=0, world_size=2)
    take(sampler, 7)
    assert sampler.state_dict() == {"epoch": 1, "index": 2}


@pytest.mark.parametrize("stop", [0, 3, 5, 12])
def test_resumed_sampler_continues_the_uninterrupted_sequence(stop):
    uninterrupted = take(ResumableSampler(11, seed=7, rank=1, world_size=2), 20)
    saved = ResumableSampler(11, seed=7, rank=1, world_size=2)
    head = take(saved, stop)
    resumed = ResumableSampler(11, seed=7, rank=1, world_size=2)
    resumed.load_state_dict(saved.state_dict())
    assert head + take(resumed, 20 - stop) == uninterrupted


def test_dataset_smaller_than_world_is_an_error():
    with pytest.raises(DataError, match="too small for the world size"):
        ResumableSampler(3, seed=0, rank=0, world_size=4)


def test_state_from_another_setup_is_rejected():
    sampler = ResumableSampler(10, seed=0, rank=0, world_size=2)
    with pytest.raises(DataError, match="does not fit"):
        sampler.load_state_dict({"epoch": 0, "index": 6})
