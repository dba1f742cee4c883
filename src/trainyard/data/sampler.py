"""Which rows each rank reads, in an order that is deterministic and resumable mid-epoch."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import torch

from trainyard.errors import DataError


def epoch_seed(seed: int, epoch: int) -> int:
    """A generator seed per (seed, epoch) that does not depend on Python's hash()."""
    digest = hashlib.sha256(f"{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class ResumableSampler:
    """Indices of this rank's share of the data, epoch after epoch, forever.

    Each epoch is a fresh permutation seeded by (seed, epoch). The tail that does not divide
    world_size is dropped so every rank takes the same number of steps (a rank that ran out
    early would hang the others in their next collective). Rank r takes positions r, r+world, ...

    `state_dict()` is the position after the last index handed out, so a sampler restored from
    it continues exactly where the saved one stopped.
    """

    def __init__(
        self,
        num_samples: int,
        *,
        seed: int,
        rank: int,
        world_size: int,
        shuffle: bool = True,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.per_rank = num_samples // world_size
        if self.per_rank == 0:
            raise DataError(
                f"the dataset is too small for the world size: {num_samples} rows "
                f"for {world_size} ranks leaves a rank with none",
                fix="add rows, or train with fewer processes",
            )
        self.num_samples = num_samples
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.epoch = 0
        self.index = 0
        self._cached: tuple[int, list[int]] | None = None

    def __len__(self) -> int:
        """Samples per epoch on this rank."""
        return self.per_rank

    def epoch_indices(self, epoch: int) -> list[int]:
        """This rank's indices for one epoch, in order."""
        if self._cached is None or self._cached[0] != epoch:
            if self.shuffle:
                generator = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
                order = torch.randperm(self.num_samples, generator=generator)
            else:
                order = torch.arange(self.num_samples)
            kept = order[: self.per_rank * self.world_size]
            self._cached = (epoch, kept[self.rank :: self.world_size].tolist())
        return self._cached[1]

    def __iter__(self) -> Iterator[int]:
        while True:
            if self.index >= self.per_rank:
                self.epoch += 1
                self.index = 0
            position = self.index
            self.index += 1
            yield self.epoch_indices(self.epoch)[position]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or not 0 <= index <= self.per_rank:
            raise DataError(
                f"the saved sampler position (epoch {epoch}, index {index}) does not fit "
                f"{self.per_rank} samples per rank; the data or the world size changed",
                fix="resume with the same data and number of processes, or start a fresh run",
            )
        self.epoch, self.index = epoch, index
