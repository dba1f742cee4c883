"""Preference pairs: TRL's three shapes become one row of two documents, the completions the only targets (chat
replies with SFT's own masks), and a bad pair is named by its file:line or skipped."""

from __future__ import annotations

import pytest

from tests.unit.data.conftest import prepare, target_runs, write_jsonl
from trainyard.data import collate
from trainyard.data.chat import BadRow, ChatTemplate, encode_chat
from trainyard.data.preference import encode_pair
from trainyard.errors import DataError

USER = {"role": "user", "content": "Name a colour"}
EARLIER = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
STANDARD = {"prompt": "2+2=", "chosen": "4", "rejected": "five"}
CONVERSATIONAL = {
    "prompt": [*EARLIER, USER],
    "chosen": [{"role": "assistant", "content": "Blue"}],
    "rejected": [{"role": "assistant", "content": "Seven"}],
}
IMPLICIT = {
    "chosen": [*EARLIER, USER, {"role": "assistant", "content": "Blue"}],
    "rejected": [*EARLIER, USER, {"role": "assistant", "content": "Seven"}],
}


def documents(tok, row: dict, max_length: int = 512) -> list[tuple[str, list[str]]]:
    """(text, trained runs) of the chosen then the rejected document."""
    pair = encode_pair(row, tok, ChatTemplate(), max_length)
    cut = pair["seq_lens"][0]
    assert len(pair["seq_lens"]) == 2 and sum(pair["seq_lens"]) == len(pair["input_ids"]) == len(pair["labels"])
    return [(tok.decode(pair["input_ids"][start:end]), target_runs(tok, pair["labels"][start:end]))
            for start, end in ((0, cut), (cut, len(pair["input_ids"])))]


def test_a_standard_pair_trains_each_completion_and_its_eos(tok):
    assert documents(tok, STANDARD) == [("2+2=4<|eos|>", ["4<|eos|>"]), ("2+2=five<|eos|>", ["five<|eos|>"])]


@pytest.mark.parametrize("row", [CONVERSATIONAL, IMPLICIT], ids=["explicit", "implicit"])
def test_a_conversation_trains_the_last_reply_only_with_sfts_mask(tok, row):
    """The earlier reply sits in the prompt: not trained. The last reply's mask is chat.py's, token for token."""
    (chosen, chosen_runs), (rejected, rejected_runs) = documents(tok, row)
    sft = encode_chat({"messages": IMPLICIT["chosen"]}, tok, ChatTemplate(), train_on_prompt=False)
    assert chosen == tok.decode(sft["input_ids"]) and "Hello!" in chosen and "Seven" in rejected
    assert target_runs(tok, sft["labels"]) == ["Hello!<|eos|>", "Blue<|eos|>"]
    assert (chosen_runs, rejected_runs) == (["Blue<|eos|>"], ["Seven<|eos|>"])


def test_a_pair_collates_as_two_documents_with_restarting_positions(tok):
    rows = [encode_pair(row, tok, ChatTemplate(), 512) for row in (STANDARD, CONVERSATIONAL)]
    batch = collate(rows, tok.pad_token_id, padding_free=True)
    starts = (batch["position_ids"][0] == 0).nonzero().squeeze(1).tolist()
    lengths = [length for row in rows for length in row["seq_lens"]]
    assert starts == [sum(lengths[:i]) for i in range(4)] and batch["input_ids"].shape == (1, sum(lengths))


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ({"prompt": "x", "chosen": "a"}, "missing field: 'rejected' is missing"),
        ({"chosen": "a", "rejected": "b"}, "missing field: 'prompt' is missing"),
        ({"prompt": "x", "chosen": "same", "rejected": "same"}, "chosen equals rejected"),
        ({"prompt": "x", "chosen": " ", "rejected": "b"}, "empty completion: 'chosen' has no reply"),
        ({"chosen": IMPLICIT["chosen"], "rejected": IMPLICIT["chosen"][:3]}, "empty completion: 'rejected'"),
        ({"prompt": "x", "chosen": ["a"], "rejected": "b"}, "missing field: 'chosen' and 'rejected' must both"),
    ],
)
def test_a_bad_pair_names_its_line_or_is_skipped(tmp_path, tok, row, reason):
    path = write_jsonl(tmp_path / "pairs.jsonl", [STANDARD, row])
    with pytest.raises(DataError) as err:
        prepare(tmp_path, tok, path=str(path))
    assert str(err.value).startswith(f"{path}:2: {reason}")
    prepared = prepare(tmp_path, tok, path=str(path), on_bad_row="skip")
    assert prepared.stats["skipped"] == {reason.split(":")[0]: 1} and len(prepared.train) == 1
    assert prepared.train[0]["seq_lens"] == encode_pair(STANDARD, tok, ChatTemplate(), 512)["seq_lens"]


def test_a_completion_cut_away_by_max_length_is_a_bad_row(tok):
    long_prompt = {"prompt": "a long question " * 4, "chosen": "yes", "rejected": "no"}
    with pytest.raises(BadRow, match="empty completion: 'chosen' keeps no token of its reply within"):
        encode_pair(long_prompt, tok, ChatTemplate(), 16)
