"""The dry run's survey counts as truncated only the rows data.max_length cuts: a document longer than it, or a
preference pair one of whose documents reaches it, never a document that fits exactly nor a pair whose two documents
only add up to more."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import TINY
from tests.unit.data.conftest import write_jsonl
from trainyard.config_file import load_config
from trainyard.data.chat import ChatTemplate
from trainyard.data.formats import encode_row
from trainyard.data.preference import encode_pair
from trainyard.data.survey import Survey, survey

MAX = 64


def text_of_tokens(tok, tokens: int) -> dict[str, str]:
    """A text row whose encoding (as the survey encodes it, before any cut) has exactly `tokens` tokens."""
    for size in range(1, 4 * tokens):
        row = {"text": "x" * size}
        if len(encode_row(row, "text", tok, max_length=10**6, train_on_prompt=False)["input_ids"]) == tokens:
            return row
    raise AssertionError(f"no text row of {tokens} tokens")


def surveyed(tmp_path: Path, tok, rows: list[dict], fmt: str, objective: str = "sft") -> Survey:
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    cfg = load_config(TINY, [f"data.path={data}", f"data.format={fmt}", f"data.max_length={MAX}",
                             f"train.objective={objective}"])
    return survey(cfg, tok)


def test_a_document_that_fits_exactly_is_whole_and_a_longer_one_is_truncated(tok, tmp_path: Path) -> None:
    rows = [text_of_tokens(tok, MAX - 1), text_of_tokens(tok, MAX), text_of_tokens(tok, MAX + 1),
            text_of_tokens(tok, 3 * MAX)]
    found = surveyed(tmp_path, tok, rows, "text")
    assert found.lengths == [MAX - 1, MAX, MAX, MAX]  # after the cut
    assert found.truncated == 2  # the two longer than data.max_length, not the one that fits exactly


def test_a_pair_is_truncated_by_its_documents_not_their_sum(tok, tmp_path: Path) -> None:
    short = {"prompt": "a" * 20, "chosen": "b" * 20, "rejected": "c" * 20}  # each document ~40 tokens, ~80 together
    long = {"prompt": "a" * 20, "chosen": "b" * 90, "rejected": "c" * 5}  # its chosen document passes MAX
    lengths = [encode_pair(row, tok, ChatTemplate(), 10**6)["seq_lens"] for row in (short, long)]
    assert max(lengths[0]) < MAX < sum(lengths[0]) and max(lengths[1]) > MAX  # the rows are what the test says
    found = surveyed(tmp_path, tok, [short, long], "preference", objective="dpo")
    assert found.truncated == 1
