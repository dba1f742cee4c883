"""The options a mesh group is given: which backend's, carrying dist.timeout_s, a fresh object for each group."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from trainyard.dist import DistInfo, group_backend, options_kind


@pytest.mark.parametrize(
    ("backend", "kind"),
    [("cpu:gloo,cuda:nccl", "nccl"), ("cuda:nccl,cpu:gloo", "nccl"), ("nccl", "nccl"), ("gloo", "gloo"),
     ("cpu:gloo", "gloo"), ("cpu:gloo,cuda:gloo", "gloo"), ("mpi", None), (None, None)],
)
def test_a_group_takes_nccl_s_options_wherever_its_cuda_half_is_nccl(backend: str | None, kind: str | None) -> None:
    """CUDA's default, "cpu:gloo,cuda:nccl", took no options at all: its groups waited torch's 30 minutes."""
    assert options_kind(backend) == kind


def test_each_group_gets_its_own_options_with_the_job_timeout() -> None:
    info = DistInfo(0, 4, 0, 4, torch.device("cpu"), "cpu:gloo", timeout_s=123)
    (backend, first), (_, second) = group_backend(info), group_backend(info)
    assert backend == "cpu:gloo"
    assert first is not second  # torch writes each group's name and ranks into its options
    assert first._timeout == second._timeout == timedelta(seconds=123)
    assert group_backend(DistInfo(0, 4, 0, 4, torch.device("cpu"), "mpi", timeout_s=123)) is None
