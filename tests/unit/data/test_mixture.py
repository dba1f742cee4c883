"""The mixture stream on tiny shards of synthetic tokens (no tokenizer, no model): proportions, determinism,
disjoint ranks, exact resume across world sizes, repeat vs stop, and rows in the form collate takes."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from trainyard.data.collate import padding_free_batch
from trainyard.data.formats import IGNORE_INDEX
from trainyard.data.mixture import MixtureStream
from trainyard.data.shards import PreparedShards, open_shards
from trainyard.errors import DataError

EOS = 0
BASE = 1_000_000
"""Source s holds the tokens s * BASE + position + 1 (and EOS every DOC tokens): a token says where it came from."""
DOC = 37


def write_shards(root: Path, lengths: list[int], shard_tokens: int = 1000) -> PreparedShards:
    """A prepared folder in the on-disk format (uint32: the position-coded tokens exceed uint16)."""
    sources = []
    for s, length in enumerate(lengths):
        tokens = np.arange(length, dtype=np.uint32) + s * BASE + 1
        tokens[DOC - 1 :: DOC] = EOS
        folder = root / f"source-{s:03d}"
        folder.mkdir(parents=True)
        shards = []
        for k, start in enumerate(range(0, length, shard_tokens)):
            piece = tokens[start : start + shard_tokens]
            piece.tofile(folder / f"shard-{k:05d}.bin")
            shards.append({"file": f"shard-{k:05d}.bin", "tokens": len(piece), "documents": int((piece == EOS).sum())})
        index = {"dtype": "uint32", "shards": shards, "documents": length // DOC, "tokens": length}
        (folder / "index.json").write_text(json.dumps(index))
        sources.append({"path": f"src{s}", "folder": folder.name, "documents": length // DOC, "tokens": length,
                        "bytes": 4 * length})
    manifest = {"fingerprint": "synthetic", "eos_id": EOS, "dtype": "uint32", "sources": sources}
    (root / "manifest.json").write_text(json.dumps(manifest))
    return open_shards(root)


def take(stream: MixtureStream, count: int) -> list[dict]:
    return list(itertools.islice(iter(stream), count))


def origin(row: dict) -> tuple[int, int]:
    """(source, position of the row's first non-EOS token) of a row."""
    token = next(t for t in row["input_ids"] if t != EOS)
    return (token - 1) // BASE, (token - 1) % BASE


@pytest.fixture
def shards(tmp_path: Path) -> PreparedShards:
    return write_shards(tmp_path / "shards", [50_000, 70_000, 20_000])


def stream(shards: PreparedShards, **kwargs) -> MixtureStream:
    settings = {"max_length": 64, "seed": 7, "weights": [5, 3, 2], **kwargs}
    return MixtureStream(shards, settings.pop("weights"), **settings)


def test_token_shares_match_the_weights_within_1_percent_over_10m_tokens(shards: PreparedShards) -> None:
    mix = stream(shards, max_length=1024)
    rows = take(mix, 10_000_000 // 1024 + 1)
    tokens = np.concatenate([row["input_ids"] for row in rows])
    real = tokens[tokens != EOS]
    for s, weight in enumerate([0.5, 0.3, 0.2]):
        share = ((real - 1) // BASE == s).mean()
        assert abs(share - weight) < 0.01 * weight, (s, share)
    counted = mix.tokens_per_source()
    assert sum(counted.values()) == len(tokens)
    assert abs(counted["src0"] / len(tokens) - 0.5) < 0.005
    assert mix.state_dict()["sources"][0]["epoch"] > 1  # the 50k-token source repeated many times


def test_same_seed_same_rows_other_seed_other_order(shards: PreparedShards) -> None:
    first, again, other = (take(stream(shards, seed=seed), 300) for seed in (7, 7, 8))
    assert first == again
    assert [origin(r)[0] for r in first] != [origin(r)[0] for r in other]


def test_ranks_take_disjoint_rows_of_the_global_sequence(shards: PreparedShards) -> None:
    whole = take(stream(shards), 600)
    ranks = [take(stream(shards, rank=r, world_size=3), 200) for r in range(3)]
    for r in range(3):
        assert ranks[r] == whole[r::3]
    seen = [set(t for row in rows for t in row["input_ids"] if t != EOS) for rows in ranks]
    assert not (seen[0] & seen[1]) and not (seen[0] & seen[2]) and not (seen[1] & seen[2])


def interleave(per_rank: list[list[dict]]) -> list[dict]:
    """Rows of all ranks in global order: rank r's i-th row is global row i * world + r."""
    return [row for group in zip(*per_rank, strict=True) for row in group]


@pytest.mark.parametrize("world_after", [1, 2, 3])
def test_resume_at_another_world_size_continues_the_same_sequence(shards: PreparedShards, world_after: int) -> None:
    uninterrupted = take(stream(shards), 120 + 60 * world_after)
    before = [stream(shards, rank=r, world_size=2) for r in range(2)]
    drawn = interleave([take(s, 60) for s in before])
    states = [s.state_dict() for s in before]
    assert states[0] == states[1] and states[0]["row"] == 120
    after = []
    for r in range(world_after):
        resumed = stream(shards, rank=r, world_size=world_after)
        resumed.load_state_dict(json.loads(json.dumps(states[0])))
        after.append(take(resumed, 60))
    assert drawn + interleave(after) == uninterrupted


def test_state_counts_rows_tokens_and_epochs_per_source(shards: PreparedShards) -> None:
    mix = stream(shards, max_length=1000)
    rows = take(mix, 100)
    state = mix.state_dict()
    per_source = [sum(origin(r)[0] == s for r in rows) for s in range(3)]
    assert [s["rows"] for s in state["sources"]] == per_source
    assert [s["tokens"] for s in state["sources"]] == [1000 * n for n in per_source]
    sizes = [50_000, 70_000, 20_000]
    assert [s["epoch"] for s in state["sources"]] == [1000 * n // size for n, size in zip(per_source, sizes)]


def test_repeat_wraps_a_source_without_dropping_tokens(tmp_path: Path) -> None:
    small = write_shards(tmp_path / "s", [1000, 100_000])
    rows = take(stream(small, weights=[1, 1], max_length=300), 40)
    from_small = np.concatenate([r["input_ids"] for r in rows if origin(r)[0] == 0])
    cycle = np.arange(1000) + 1
    cycle[DOC - 1 :: DOC] = EOS
    assert np.array_equal(from_small[:3000], np.tile(cycle, 3))  # epochs 0, 1, 2 back to back


def test_stop_ends_when_the_first_source_runs_out(tmp_path: Path) -> None:
    small = write_shards(tmp_path / "s", [1000, 100_000])
    single = stream(small, weights=[1, 1], max_length=300, exhausted="stop")
    rows = list(single)
    assert sum(origin(r)[0] == 0 for r in rows) == 1000 // 300  # only full rows, then the stream ends
    assert single.state_dict()["ended"]
    ranks = [list(stream(small, weights=[1, 1], max_length=300, exhausted="stop", rank=r, world_size=2))
             for r in range(2)]
    assert sorted(map(origin, ranks[0] + ranks[1])) == sorted(map(origin, rows))
    assert len(take(stream(small, weights=[1, 1], max_length=300), len(rows) + 10)) == len(rows) + 10


def test_rows_split_at_documents_with_no_label_across_a_border(shards: PreparedShards) -> None:
    for row in take(stream(shards, max_length=100), 20):
        ids, labels, lens = row["input_ids"], row["labels"], row["seq_lens"]
        assert len(ids) == len(labels) == sum(lens) == 100
        starts = np.cumsum([0, *lens[:-1]])
        for i in range(1, len(lens)):
            assert ids[starts[i] - 1] == EOS and labels[starts[i]] == IGNORE_INDEX
        assert all(label == token for i, (label, token) in enumerate(zip(labels, ids)) if i not in starts[1:])
        positions = padding_free_batch([row])["position_ids"][0].tolist()
        assert [positions[s] for s in starts] == [0] * len(lens)


def test_a_state_of_other_shards_is_refused(shards: PreparedShards, tmp_path: Path) -> None:
    state = stream(shards).state_dict()
    other = write_shards(tmp_path / "other", [500, 500, 500])
    other.fingerprint = "different"
    with pytest.raises(DataError, match="other prepared shards"):
        stream(other).load_state_dict(state)
