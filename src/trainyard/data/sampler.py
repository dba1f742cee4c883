"""Which rows each rank reads, in an order that is deterministic and resumable on any world size."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from trainyard.errors import DataError


def epoch_seed(seed: int, epoch: int) -> int:
    """A generator seed per (seed, epoch) that does not depend on Python's hash()."""
    digest = hashlib.sha256(f"{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class ResumableSampler:
    """Indices of this rank's share of one global stream of rows, forever.

    The stream is epoch 0's permutation (seeded by (seed, epoch)), then epoch 1's, and so on;
    nothing is dropped. Its position is global: how many rows all ranks together have taken,
    counted as if they move in lockstep, which they do between optimizer steps. From position g,
    rank r of world w takes stream[g + r], stream[g + r + w], ...: once every rank has taken k
    rows, exactly stream[g : g + k*w] is consumed, whatever w is. Every rank takes the same
    number of rows per step (a rank that ran out early would hang the others), and a job of
    another world size that loads the position continues with no row skipped or repeated.

    `first` rows lead epoch 0, in that order, and the rest of its permutation follows without them (the worst
    batch first: loader.largest_rows). They are part of the state, so a resume keeps the order the run began with.

    `state_dict()` is {"epoch", "position"} and "first" where rows lead epoch 0: the epoch, how many of its rows
    are consumed, and those rows. It is the same on every rank at a step boundary, which a checkpoint relies on.
    """

    def __init__(
        self,
        num_samples: int,
        *,
        seed: int,
        rank: int,
        world_size: int,
        shuffle: bool = True,
        first: Sequence[int] = (),
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        if num_samples < world_size:
            raise DataError(
                f"the dataset is too small for the world size: {num_samples} rows "
                f"for {world_size} ranks leaves a rank with none in an epoch",
                fix="add rows, or train with fewer processes",
            )
        self.num_samples = num_samples
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.first = [int(index) for index in first]
        self.consumed = 0
        """Global position in the stream: rows taken by all ranks together since epoch 0 began."""
        self._cached: tuple[int, torch.Tensor] | None = None

    def _order(self, epoch: int) -> torch.Tensor:
        if self._cached is None or self._cached[0] != epoch:  # a tensor: 8 bytes a row, not a Python int
            if self.shuffle:
                generator = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
                order = torch.randperm(self.num_samples, generator=generator)
            else:
                order = torch.arange(self.num_samples)
            if epoch == 0 and self.first:
                leading = torch.tensor(self.first, dtype=order.dtype)
                order = torch.cat([leading, order[~torch.isin(order, leading)]])
            self._cached = (epoch, order)
        return self._cached[1]

    def epoch_order(self, epoch: int) -> list[int]:
        """Every row of one epoch, in the order the ranks together consume them."""
        return self._order(epoch).tolist()

    def at(self, stream_position: int) -> int:
        """The dataset index at a global stream position."""
        epoch, offset = divmod(stream_position, self.num_samples)
        return int(self._order(epoch)[offset])

    def next_positions(self, count: int) -> list[int]:
        """The stream positions of the next `count` rows this rank takes (nothing is consumed)."""
        start = self.consumed + self.rank
        return [start + k * self.world_size for k in range(count)]

    def upcoming(self, count: int) -> torch.Tensor:
        """The dataset indices at the next `count` global positions, every rank's (rank r's are [r::world_size]),
        nothing consumed: what lets each rank cut every rank's rows of a step alike without a collective."""
        pieces, position, end = [], self.consumed, self.consumed + count
        while position < end:
            epoch, offset = divmod(position, self.num_samples)
            take = min(end - position, self.num_samples - offset)
            pieces.append(self._order(epoch)[offset : offset + take])
            position += take
        return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.long)

    def __iter__(self) -> Iterator[int]:
        while True:
            position = self.consumed + self.rank
            self.consumed += self.world_size
            yield self.at(position)

    @property
    def epoch(self) -> int:
        return self.consumed // self.num_samples

    def state_dict(self) -> dict[str, Any]:
        epoch, position = divmod(self.consumed, self.num_samples)
        return {"epoch": epoch, "position": position, **({"first": list(self.first)} if self.first else {})}

    def load_state_dict(self, state: dict[str, Any], saved_world_size: int | None = None) -> None:
        """Continue at a saved global position, whatever world size saved it.

        Checkpoints from before positions were global hold {"epoch", "index"}: rank r had taken
        rows r, r+w, ... of the epoch's order, so `index` rows per rank are `index * w` in all,
        with w the world size that saved them (`saved_world_size`, default this one).
        """
        epoch = int(state["epoch"])
        if "position" in state:
            position = int(state["position"])
        else:
            position = int(state["index"]) * (saved_world_size or self.world_size)
        if epoch < 0 or not 0 <= position <= self.num_samples:
            raise DataError(
                f"the saved sampler position (epoch {epoch}, row {position}) does not fit an epoch "
                f"of {self.num_samples} rows; the data changed",
                fix="resume with the data the checkpoint was trained on, or start a fresh run",
            )
        if any(not 0 <= index < self.num_samples for index in state.get("first", [])):
            raise DataError(
                f"the saved sampler's leading rows do not fit a dataset of {self.num_samples} rows; the data changed",
                fix="resume with the data the checkpoint was trained on, or start a fresh run",
            )
        self.consumed = epoch * self.num_samples + position
        first = [int(index) for index in state.get("first", [])]  # a checkpoint from before had none
        if first != self.first:
            self.first, self._cached = first, None
