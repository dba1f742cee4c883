"""Which rows each rank reads, in an order that is deterministic and resumable on any world size."""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Iterator, Sequence
from typing import Any

import numpy
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
    rows, exactly stream[g : g + k*w] is consumed, whatever w is (`take` may deal those k*w rows
    otherwise, by their tokens). Every rank takes its share of every micro-batch's rows (a rank
    that ran out early would hang the others), and a job of another world size that loads the
    position continues with no row skipped or repeated.

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

    def shares(self, rows: int, lengths: numpy.ndarray | None = None) -> tuple[numpy.ndarray, list[list[int]]]:
        """The next `rows` x world rows (dataset indices; nothing consumed) and every rank's offsets among them.
        Without `lengths`, rank r's are the stream's r, r + w, ..., as `__iter__` takes them. With every row's token
        count they are dealt so each rank holds about as many tokens (deal): a step waits for its slowest rank, and
        the loss is normalised over every rank's tokens together, so the step's loss and gradient stay the same. The
        rows that lead epoch 0 (the worst batch first) keep the stream's order, so the first step still holds the
        largest micro-batch any rank sees."""
        count = rows * self.world_size
        slot = self.upcoming(count).numpy()  # host indices, read as numpy: no tensor is read back
        if lengths is None or (self.epoch == 0 and self.consumed < len(self.first)):
            return slot, [list(range(rank, count, self.world_size)) for rank in range(self.world_size)]
        return slot, deal(lengths[slot].tolist(), self.world_size)

    def take(self, rows: int, lengths: numpy.ndarray | None = None) -> tuple[list[int], list[int]]:
        """This rank's share of the next `rows` x world rows (`shares`), consumed: their stream positions and
        dataset indices."""
        start = self.consumed
        slot, shares = self.shares(rows, lengths)
        self.consumed += len(slot)
        mine = shares[self.rank]
        return [start + offset for offset in mine], slot[mine].tolist()

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


def deal(lengths: Sequence[int], world: int) -> list[list[int]]:
    """Offsets 0..n-1 of rows of `lengths` tokens dealt to `world` ranks, each rank's in stream order: the longest
    row first to the rank holding the fewest tokens (ties: the lower rank), or the stream's round robin (rank r:
    r, r + w, ...) where that leaves no rank with more. Every rank gets a row while n >= world; every rank computes
    the same from the same lengths, so no collective is needed. A heap of the ranks' loads: n log w, not n w, so a
    world of hundreds of ranks deals a micro-batch in milliseconds."""
    robin = [list(range(rank, len(lengths), world)) for rank in range(world)]
    loads, greedy = [(0, rank) for rank in range(world)], [[] for _ in range(world)]
    for offset in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        held, rank = heapq.heappop(loads)
        greedy[rank].append(offset)
        heapq.heappush(loads, (held + lengths[offset], rank))
    most = max(sum(lengths[i] for i in share) for share in robin)
    return robin if most <= max(loads)[0] else [sorted(share) for share in greedy]
