"""A rank's random streams in and out of its checkpoint: on CPU every stream round-trips and no CUDA entry is
written or read; with CUDA, only the current device's generator is saved; lists of every visible device's
generator, from older checkpoints, still resume."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from trainyard.train.state import own_cuda_state, rng_state, set_rng_state


def draws() -> tuple[float, float, list[float]]:
    """One draw from each stream a checkpoint carries on every machine."""
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_every_stream_resumes_where_it_was_saved() -> None:
    saved = json.loads(json.dumps(rng_state()))  # as rank-<r>.json holds it
    expected = draws()
    draws()
    set_rng_state(saved)
    assert draws() == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the path of a machine without CUDA")
def test_without_cuda_no_cuda_state_is_saved_and_a_saved_one_is_skipped() -> None:
    state = rng_state()
    assert "cuda" not in state
    expected = draws()
    set_rng_state({**state, "cuda": ["c0", "c1"]})  # a checkpoint from a GPU job, resumed on CPU
    assert draws() == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_with_cuda_only_the_current_devices_generator_is_saved_and_restored() -> None:
    device = torch.cuda.current_device()
    state = rng_state()
    assert isinstance(state["cuda"], str)
    expected = torch.rand(3, device=device).tolist()
    torch.rand(3, device=device)
    set_rng_state(state)
    assert torch.rand(3, device=device).tolist() == expected


def test_a_single_saved_state_is_the_current_devices() -> None:
    assert own_cuda_state("only", device_index=3) == "only"


def test_an_older_list_gives_the_current_devices_entry() -> None:
    assert own_cuda_state(["d0", "d1", "d2"], device_index=1) == "d1"


def test_an_older_list_without_the_current_devices_entry_gives_its_first() -> None:
    """Saved where each process saw 2 GPUs, resumed on the sixth of 8 a process sees now."""
    assert own_cuda_state(["d0", "d1"], device_index=5) == "d0"
