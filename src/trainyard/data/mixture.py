"""A deterministic, resumable stream of fixed-length rows drawn from a weighted mixture of prepared token shards.

The rows form one global sequence that does not depend on the world size:

* global row g comes from source s(g) = the source whose share of [0, 1) holds frac(g * phi + phase(seed)), with
  phi the golden ratio. This Weyl sequence is the most evenly spread of its kind: in any prefix of n rows each
  source's count stays within a few rows of weight * n (the realised token shares match the weights long before
  10M tokens), while the seed moves the phase, so two seeds interleave the sources differently. It needs no state:
  s(g) is a pure function of (seed, g), computed in 64-bit integer arithmetic so it stays exact at any g.
* the k-th row that source s gives is tokens [k*L, (k+1)*L) of that source's token stream (documents back to back,
  each ended by EOS), repeated end to end: under `repeat` a source that runs out starts its next epoch with no
  token dropped; under `stop` the whole stream ends at the first global row whose source has no full row left.
* rank r of W takes the global rows g with g % W == r, so ranks read disjoint rows of every source.

The state is the global row up to which all ranks consumed the sequence and each source's cursor (tokens, rows,
epoch). It is the same on every rank when each drew the same number of rows (as a training loop does), and a
stream at any world size started from it continues the same global sequence: no row skipped or repeated.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import numpy as np

from trainyard.config import JobConfig
from trainyard.data.formats import IGNORE_INDEX
from trainyard.data.shards import PreparedShards, SourceTokens
from trainyard.errors import DataError

STATE_VERSION = 1
CHUNK_ROWS = 4096
"""Global rows planned at once: numpy per chunk, so a rank of a large world skips others' rows cheaply."""
GOLDEN = 0x9E3779B97F4A7C15
"""2**64 / golden ratio, odd: g * GOLDEN mod 2**64 is frac(g * phi) in 64-bit fixed point."""
Row = dict[str, list[int]]


def _phase(seed: int) -> np.uint64:
    return np.uint64(int.from_bytes(hashlib.sha256(f"trainyard-mixture-{seed}".encode()).digest()[:8], "little"))


def _thresholds(weights: Sequence[float]) -> np.ndarray:
    """Upper ends of each source's share of [0, 2**64), all but the last (searchsorted finds the share)."""
    total = float(sum(weights))
    edges, running = [], 0.0
    for weight in weights[:-1]:
        running += weight
        edges.append(min(int(running / total * 2**64), 2**64 - 1))
    return np.array(edges, dtype=np.uint64)


def choose_sources(seed: int, weights: Sequence[float], first: int, count: int) -> np.ndarray:
    """s(g) for global rows first .. first + count - 1."""
    rows = np.arange(first, first + count, dtype=np.uint64)
    with np.errstate(over="ignore"):
        points = rows * np.uint64(GOLDEN) + _phase(seed)  # wraps mod 2**64 by design
    return np.searchsorted(_thresholds(weights), points, side="right")


def to_row(tokens: np.ndarray, eos_id: int) -> Row:
    """input_ids, labels and seq_lens of one row, in the form collate takes.

    seq_lens splits the row after every EOS, so collate restarts position_ids per document; the first token of
    every document after the first gets IGNORE_INDEX as label, as packing does, so nothing learns across a border.
    """
    ids = tokens.astype(np.int64)
    starts = np.flatnonzero(ids[:-1] == eos_id) + 1
    labels = ids.copy()
    labels[starts] = IGNORE_INDEX
    seq_lens = np.diff(np.concatenate(([0], starts, [len(ids)])))
    return {"input_ids": ids.tolist(), "labels": labels.tolist(), "seq_lens": seq_lens.tolist()}


class MixtureStream:
    """Rows of exactly `max_length` tokens for rank `rank` of `world_size`; iterate it, save state_dict()."""

    def __init__(
        self,
        shards: PreparedShards,
        weights: Sequence[float],
        *,
        max_length: int,
        seed: int,
        exhausted: Literal["repeat", "stop"] = "repeat",
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if len(weights) != len(shards.sources) or min(weights, default=0) <= 0:
            raise ValueError(f"need one positive weight per source ({len(shards.sources)}), got {list(weights)}")
        if not 0 <= rank < world_size or max_length < 1:
            raise ValueError(f"bad rank {rank} of world {world_size} or max_length {max_length}")
        self.shards, self.weights, self.max_length, self.seed = shards, list(weights), max_length, seed
        self.exhausted, self.rank, self.world_size = exhausted, rank, world_size
        self._totals = np.array([source.tokens for source in shards.sources], dtype=np.int64)
        self._start = _Cursor.fresh(len(weights))
        self._drawn = 0
        self._cache = self._start.copy()

    # ------------------------------------------------------------ planning

    def _plan(self, cursor: _Cursor, count: int) -> tuple[np.ndarray, np.ndarray, int]:
        """(source, start token in its repeated stream) of global rows cursor.row .. + count, and how many of them
        exist (fewer under `stop` once a source has no full row left)."""
        sources = choose_sources(self.seed, self.weights, cursor.row, count)
        one_hot = sources[:, None] == np.arange(len(self.weights))
        earlier = (np.cumsum(one_hot, axis=0) - one_hot)[np.arange(count), sources]
        starts = cursor.tokens[sources] + earlier * self.max_length
        usable = count
        if self.exhausted == "stop":
            missing = np.flatnonzero(starts + self.max_length > self._totals[sources])
            usable = int(missing[0]) if len(missing) else count
        return sources, starts, usable

    def _advance(self, cursor: _Cursor, sources: np.ndarray, usable: int, count: int) -> None:
        taken = np.bincount(sources[:usable], minlength=len(self.weights))
        cursor.rows += taken
        cursor.tokens += taken * self.max_length
        cursor.row += usable
        cursor.ended = usable < count

    def _position(self) -> _Cursor:
        """The global cursor after the rows this rank drew: through row start + drawn * world_size."""
        target = self._start.row + self._drawn * self.world_size
        if self._cache.row > target:
            self._cache = self._start.copy()
        while self._cache.row < target and not self._cache.ended:
            count = min(CHUNK_ROWS, target - self._cache.row)
            sources, _, usable = self._plan(self._cache, count)
            self._advance(self._cache, sources, usable, count)
        if self.exhausted == "stop" and not self._cache.ended:
            self._cache.ended = self._plan(self._cache, 1)[2] == 0  # the next row's source has run out
        return self._cache.copy()

    # ------------------------------------------------------------ reading

    def _read(self, source: SourceTokens, start: int) -> np.ndarray:
        """max_length tokens from `start` in the source's stream repeated end to end (an epoch may end mid-row)."""
        pieces, length, position = [], self.max_length, start % source.tokens
        while length > 0:
            take = min(length, source.tokens - position)
            pieces.append(source.read(position, take))
            length, position = length - take, 0
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """This rank's rows from the current state on, each with its global `row` and `source` index (for the
        record of what was trained); ends only under `stop`."""
        cursor = self._position()
        first_own = (self.rank - cursor.row) % self.world_size
        while not cursor.ended:
            sources, starts, usable = self._plan(cursor, CHUNK_ROWS)
            for i in range(first_own, usable, self.world_size):
                tokens = self._read(self.shards.sources[sources[i]], int(starts[i]))
                self._drawn += 1
                yield {**to_row(tokens, self.shards.eos_id), "row": cursor.row + i, "source": int(sources[i])}
            first_own = (first_own - CHUNK_ROWS) % self.world_size
            self._advance(cursor, sources, usable, CHUNK_ROWS)

    # ------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """A small dict: the global row reached and each source's rows, tokens and epoch (JSON-friendly)."""
        cursor = self._position()
        return {
            "version": STATE_VERSION,
            "fingerprint": self.shards.fingerprint,
            "row": cursor.row,
            "ended": cursor.ended,
            "sources": [
                {"path": source.path, "rows": int(rows), "tokens": int(tokens), "epoch": int(tokens // source.tokens)}
                for source, rows, tokens in zip(self.shards.sources, cursor.rows, cursor.tokens, strict=True)
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a state saved at any world size. The weights, seed and max_length may differ from the
        saved run's: the rows from there on follow the new ones (the exact-continuation promise needs them equal)."""
        if state.get("version") != STATE_VERSION or state.get("fingerprint") != self.shards.fingerprint:
            raise DataError(
                f"the saved data state belongs to other prepared shards ({state.get('fingerprint')}, these are "
                f"{self.shards.fingerprint})",
                fix="resume with the data.mixture and tokenizer the run started with, or start a fresh run",
            )
        sources = state["sources"]
        self._start = _Cursor(
            row=int(state["row"]),
            rows=np.array([s["rows"] for s in sources], dtype=np.int64),
            tokens=np.array([s["tokens"] for s in sources], dtype=np.int64),
            ended=bool(state["ended"]),
        )
        self._drawn = 0
        self._cache = self._start.copy()

    def tokens_per_source(self) -> dict[str, int]:
        """Tokens consumed from each source by all ranks together up to the current state, keyed by path."""
        tokens = self._position().tokens
        keys = [source.path for source in self.shards.sources]
        return {
            key if keys.count(key) == 1 else f"{key} [{i}]": int(count)
            for i, (key, count) in enumerate(zip(keys, tokens, strict=True))
        }


class _Cursor:
    """Where the global sequence stands: rows < row consumed; per source rows taken and tokens (over epochs)."""

    def __init__(self, row: int, rows: np.ndarray, tokens: np.ndarray, ended: bool) -> None:
        self.row, self.rows, self.tokens, self.ended = row, rows, tokens, ended

    @classmethod
    def fresh(cls, sources: int) -> _Cursor:
        return cls(0, np.zeros(sources, dtype=np.int64), np.zeros(sources, dtype=np.int64), False)

    def copy(self) -> _Cursor:
        return _Cursor(self.row, self.rows.copy(), self.tokens.copy(), self.ended)


def mixture_stream(cfg: JobConfig, shards: PreparedShards, rank: int = 0, world_size: int = 1) -> MixtureStream:
    """The job's stream for one rank: data.mixture weights, data.max_length, data.mixture_exhausted, train.seed."""
    mixture = cfg.data.mixture or []
    paths = [source.path for source in shards.sources]
    if paths != [source.path for source in mixture]:
        raise DataError(
            f"the prepared shards {shards.folder} hold the sources {paths}, not this job's data.mixture",
            fix="run `trainyard prepare CONFIG` for this job and use the folder it prints",
        )
    return MixtureStream(
        shards,
        [source.weight for source in mixture],
        max_length=cfg.data.max_length,
        seed=cfg.train.seed,
        exhausted=cfg.data.mixture_exhausted,
        rank=rank,
        world_size=world_size,
    )


def unigram_entropy(shards: PreparedShards, weights: Sequence[float]) -> float:
    """Entropy in nats of the mixture's token frequencies: the loss of a model that knows only how often each token
    occurs, the bar a trained model's loss must fall well below."""
    shares = np.asarray(weights, dtype=np.float64) / float(sum(weights))
    mixed: np.ndarray | None = None
    for share, source in zip(shares, shards.sources, strict=True):
        counts = sum(np.bincount(shard, minlength=1).astype(np.float64) for shard in source.shards)
        width = max(len(counts), 0 if mixed is None else len(mixed))
        part = share * np.pad(counts, (0, width - len(counts))) / counts.sum()
        mixed = part if mixed is None else np.pad(mixed, (0, width - len(mixed))) + part
    probabilities = mixed[mixed > 0]
    return float(-(probabilities * np.log(probabilities)).sum())
