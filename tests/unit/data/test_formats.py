"""Readers, format detection and label masking: the targets are exactly the responses."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest

from tests.unit.data.conftest import prepare, target_runs, write_jsonl
from trainyard.data import IGNORE_INDEX, build_byte_tokenizer, encode_row
from trainyard.data.formats import detect_format, read_rows
from trainyard.errors import DataError

ALPACA = {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"}
CHAT = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Name a colour"},
        {"role": "assistant", "content": "Blue"},
    ]
}
TEXT = {"text": "The cat sat."}





def encode(row, fmt, tokenizer, max_length=512, train_on_prompt=False):
    return encode_row(row, fmt, tokenizer, max_length=max_length, train_on_prompt=train_on_prompt)



# ---------------------------------------------------------------- readers and detection


def write_source(kind: str, tmp_path: Path, rows: list[dict]) -> Path:
    if kind == "jsonl":
        return write_jsonl(tmp_path / "d.jsonl", rows)
    if kind == "json":
        path = tmp_path / "d.json"
        path.write_text(json.dumps(rows))
        return path
    if kind == "parquet":
        path = tmp_path / "d.parquet"
        datasets.Dataset.from_list(rows).to_parquet(str(path))
        return path
    path = tmp_path / "saved"
    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "saved"])
@pytest.mark.parametrize("row", [ALPACA, CHAT, TEXT], ids=["alpaca", "chat", "text"])
def test_every_reader_gives_the_rows_with_their_location(tmp_path, kind, row):
    second = dict(row, **({"text": "Another."} if "text" in row else {}))
    path = write_source(kind, tmp_path, [row, second])
    read = list(read_rows(path))
    assert [r for _, r in read] == [row, second]
    where = [w for w, _ in read]
    expected = ["1", "2"] if kind == "jsonl" else ["row 0", "row 1"]
    assert where == [f"{path}:{place}" for place in expected]


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "saved"])
def test_prepare_detects_the_format_from_the_keys(tmp_path, tok, kind):
    path = write_source(kind, tmp_path, [ALPACA, ALPACA])
    train = prepare(tmp_path, tok, path=str(path)).train
    assert target_runs(tok, train[0]["labels"]) == ["5<|eos|>"]


def test_detect_format_by_keys():
    assert detect_format(CHAT, "f:1") == "chat"
    assert detect_format(ALPACA, "f:1") == "alpaca"
    assert detect_format({"instruction": "x", "output": "y"}, "f:1") == "alpaca"
    assert detect_format(TEXT, "f:1") == "text"


def test_unknown_shape_names_file_line_and_keys(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "reply": "r"}])
    with pytest.raises(DataError) as err:
        prepare(tmp_path, tok, path=str(path))
    message = str(err.value)
    assert f"{path}:1" in message and "'question'" in message and "'reply'" in message
    assert "data.format" in message


def test_explicit_format_overrides_detection(tmp_path, tok):
    row = {"text": "plain words", "instruction": "i", "output": "o"}
    path = write_jsonl(tmp_path / "d.jsonl", [row])
    train = prepare(tmp_path, tok, path=str(path), format="text").train
    assert tok.decode(train[0]["input_ids"]) == "plain words<|eos|>"


# ---------------------------------------------------------------- masking


def test_alpaca_targets_are_the_output_and_eos(tok):
    example = encode(ALPACA, "alpaca", tok)
    decoded = tok.decode(example["input_ids"])
    expected_prompt = "### Instruction:\nAdd the numbers.\n\n### Input:\n2 and 3\n\n### Response:\n"
    assert decoded == expected_prompt + "5<|eos|>"
    assert target_runs(tok, example["labels"]) == ["5<|eos|>"]


def test_alpaca_without_input_has_no_input_block(tok):
    example = encode({"instruction": "Say hi.", "input": "", "output": "hi"}, "alpaca", tok)
    expected = "### Instruction:\nSay hi.\n\n### Response:\nhi<|eos|>"
    assert tok.decode(example["input_ids"]) == expected


def test_chat_targets_are_every_assistant_turn_with_its_end_token(tok):
    example = encode(CHAT, "chat", tok)
    assert target_runs(tok, example["labels"]) == ["Hello!<|eos|>", "Blue<|eos|>"]
    assert len(example["labels"]) == len(example["input_ids"])


def test_chat_masking_keeps_multibyte_characters_whole(tok):
    row = {"messages": [{"role": "user", "content": "é?"}, {"role": "assistant", "content": "ü ñ"}]}
    assert target_runs(tok, encode(row, "chat", tok)["labels"]) == ["ü ñ<|eos|>"]


SHAREGPT = {
    "conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "Hi"},
        {"from": "gpt", "value": "Hello!"},
        {"from": "human", "value": "Name a colour"},
        {"from": "gpt", "value": "Blue"},
    ]
}


def test_sharegpt_conversations_are_chat_rows(tmp_path, tok):
    assert detect_format(SHAREGPT, "f:1") == "chat"
    assert encode(SHAREGPT, "chat", tok) == encode(CHAT, "chat", tok)
    path = write_jsonl(tmp_path / "d.jsonl", [SHAREGPT])
    labels = prepare(tmp_path, tok, path=str(path)).train[0]["labels"]
    assert target_runs(tok, labels) == ["Hello!<|eos|>", "Blue<|eos|>"]


def test_openai_text_parts_are_joined_into_the_message(tok):
    row = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Name"}, {"type": "text", "text": "a colour"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Blue"}]},
        ]
    }
    example = encode(row, "chat", tok)
    assert tok.decode(example["input_ids"]) == "<|user|>Name\na colour<|assistant|>Blue<|eos|>"
    assert target_runs(tok, example["labels"]) == ["Blue<|eos|>"]


@pytest.mark.parametrize(
    "row,reason",
    [
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "url": "x.png"}]}, CHAT["messages"][2]]},
            "unsupported content part: message 0 has a content part of type 'image'",
        ),
        ({"conversations": [{"from": "bot", "value": "hi"}]}, "unknown role: conversation turn 0 is from 'bot'"),
    ],
)
def test_a_chat_row_that_cannot_be_text_names_its_line_or_is_skipped(tmp_path, tok, row, reason):
    path = write_jsonl(tmp_path / "d.jsonl", [CHAT, row])
    with pytest.raises(DataError) as err:
        prepare(tmp_path, tok, path=str(path))
    assert str(err.value).startswith(f"{path}:2: {reason}")
    prepared = prepare(tmp_path, tok, path=str(path), on_bad_row="skip")
    assert prepared.stats["skipped"] == {reason.split(":")[0]: 1} and len(prepared.train) == 1


def test_text_targets_everything_but_the_first_token(tok):
    example = encode(TEXT, "text", tok)
    assert tok.decode(example["input_ids"]) == "The cat sat.<|eos|>"
    assert example["labels"][0] == IGNORE_INDEX
    assert example["labels"][1:] == example["input_ids"][1:]


@pytest.mark.parametrize("row,fmt", [(ALPACA, "alpaca"), (CHAT, "chat")])
def test_train_on_prompt_targets_every_token_but_the_first(tok, row, fmt):
    example = encode(row, fmt, tok, train_on_prompt=True)
    assert example["labels"][0] == IGNORE_INDEX
    assert example["labels"][1:] == example["input_ids"][1:]


def test_truncation_keeps_max_length_tokens(tok):
    example = encode({"text": "x" * 100}, "text", tok, max_length=16)
    assert len(example["input_ids"]) == len(example["labels"]) == 16


def test_chat_without_template_is_an_error_with_a_fix(tmp_path):
    tokenizer = build_byte_tokenizer()
    tokenizer.chat_template = None
    path = write_jsonl(tmp_path / "d.jsonl", [CHAT])
    with pytest.raises(DataError, match="no chat template") as err:
        prepare(tmp_path, tokenizer, path=str(path))
    assert err.value.fix


def test_template_that_rewrites_earlier_turns_is_rejected(tmp_path):
    tokenizer = build_byte_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{% if loop.last %}[last]{% endif %}"
        "{{ '<|' + m['role'] + '|>' + m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    path = write_jsonl(tmp_path / "d.jsonl", [CHAT])
    with pytest.raises(DataError, match="prefix-stable"):
        prepare(tmp_path, tokenizer, path=str(path))
    assert prepare(tmp_path, tokenizer, path=str(path), train_on_prompt=True).stats["rows"] == 1


# ---------------------------------------------------------------- eval rows for generation


def test_chat_eval_rows_carry_the_generation_prompt_and_answer(tok):
    example = encode(CHAT, "chat", tok)
    prompt = tok.decode(example["prompt_ids"])
    history = "<|system|>Be brief.<|user|>Hi<|assistant|>Hello!<|eos|>"
    assert prompt == history + "<|user|>Name a colour<|assistant|>"
    assert example["answer"] == "Blue"
    assert example["input_ids"][: len(example["prompt_ids"])] == example["prompt_ids"]


def test_answer_field_wins_and_alpaca_needs_one(tok):
    assert encode(dict(CHAT, answer="blue"), "chat", tok)["answer"] == "blue"
    assert "answer" not in encode(ALPACA, "alpaca", tok)
    graded = encode(dict(ALPACA, answer="5"), "alpaca", tok)
    assert graded["answer"] == "5"
    assert tok.decode(graded["prompt_ids"]).endswith("### Response:\n")


def test_prompt_only_chat_with_an_answer_learns_and_grades_the_answer(tok):
    row = {"messages": [{"role": "user", "content": "2+2?"}], "answer": "4"}
    example = encode(row, "chat", tok)
    assert target_runs(tok, example["labels"]) == ["4<|eos|>"]
    assert tok.decode(example["prompt_ids"]) == "<|user|>2+2?<|assistant|>"
    assert example["answer"] == "4"


def test_eval_split_keeps_grading_columns_only_when_every_row_has_an_answer(tmp_path, tok):
    train = write_jsonl(tmp_path / "t.jsonl", [ALPACA])
    graded = write_jsonl(tmp_path / "g.jsonl", [dict(ALPACA, answer="5")] * 2)
    mixed = write_jsonl(tmp_path / "m.jsonl", [dict(ALPACA, answer="5"), ALPACA])
    prepared = prepare(tmp_path, tok, path=str(train), eval_path=str(graded))
    assert prepared.eval.column_names == ["input_ids", "labels", "prompt_ids", "answer"]
    assert prepared.train.column_names == ["input_ids", "labels"]
    prepared = prepare(tmp_path, tok, path=str(train), eval_path=str(mixed))
    assert prepared.eval.column_names == ["input_ids", "labels"]


# ---------------------------------------------------------------- bad rows


def bad_rows_file(tmp_path: Path) -> Path:
    return write_jsonl(
        tmp_path / "d.jsonl",
        [
            ALPACA,
            dict(ALPACA, output=""),
            '{"instruction": "broken", \n',
            {"instruction": "x" * 300, "output": "y"},
            ALPACA,
        ],
    )


def test_malformed_json_names_its_line(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [ALPACA, ALPACA, '{"instruction": \n', ALPACA])
    with pytest.raises(DataError) as err:
        prepare(tmp_path, tok, path=str(path))
    assert f"{path}:3" in str(err.value)
    assert "malformed JSON" in str(err.value)
    assert "data.on_bad_row: skip" in err.value.fix


@pytest.mark.parametrize(
    "row,reason",
    [
        (dict(ALPACA, output=""), "empty response"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "empty response"),
        ({"instruction": "x" * 300, "output": "y"}, "no target token after truncation"),
        ({"messages": "hello"}, "missing field"),
    ],
)
def test_bad_row_is_an_error_naming_file_line_and_reason(tmp_path, tok, row, reason):
    path = write_jsonl(tmp_path / "d.jsonl", [CHAT if "messages" in row else ALPACA, row])
    with pytest.raises(DataError) as err:
        prepare(tmp_path, tok, path=str(path), max_length=128)
    assert str(err.value).startswith(f"{path}:2: {reason}")


def test_bad_rows_are_skipped_and_counted_when_asked(tmp_path, tok):
    path = bad_rows_file(tmp_path)
    prepared = prepare(tmp_path, tok, path=str(path), max_length=128, on_bad_row="skip")
    assert prepared.stats["rows"] == 5
    assert prepared.stats["train_rows"] == 2
    assert prepared.stats["skipped"] == {
        "empty response": 1,
        "malformed JSON": 1,
        "no target token after truncation": 1,
    }


def test_failed_preparation_leaves_no_lock_or_partial_cache(tmp_path, tok):
    path = bad_rows_file(tmp_path)
    with pytest.raises(DataError):
        prepare(tmp_path, tok, path=str(path), max_length=128)
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.startswith(".")] == []


def test_only_bad_rows_is_an_error_even_when_skipping(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [dict(ALPACA, output="")])
    with pytest.raises(DataError, match="no usable rows"):
        prepare(tmp_path, tok, path=str(path), on_bad_row="skip")


# ---------------------------------------------------------------- unreadable bytes


def test_a_line_that_is_not_utf8_names_its_line_or_is_skipped(tmp_path, tok):
    """A latin-1 row used to raise UnicodeDecodeError from deep in the reader."""
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n{"text": "also fine"}\n')
    with pytest.raises(DataError, match="not UTF-8 text") as err:
        prepare(tmp_path, tok, path=str(path))
    assert err.value.where == f"{path}:2"
    prepared = prepare(tmp_path, tok, path=str(path), on_bad_row="skip")
    assert prepared.stats["skipped"] == {"not UTF-8 text": 1} and len(prepared.train) == 2


@pytest.mark.parametrize("name", ["binary.jsonl", "binary.json"])
def test_a_binary_file_is_a_data_error_naming_the_field(tmp_path, tok, name):
    path = tmp_path / name
    path.write_bytes(b"PK\x03\x04\x14\x00\x08\x00" * 50)  # a zip file named .jsonl
    with pytest.raises(DataError, match=r"data.path: .* is a binary file") as err:
        prepare(tmp_path, tok, path=str(path))
    assert err.value.where == f"{path}:1"


def test_a_truncated_parquet_file_is_a_data_error(tmp_path, tok):
    whole = write_source("parquet", tmp_path, [TEXT] * 20).read_bytes()
    path = tmp_path / "cut.parquet"
    path.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(DataError, match="data.path: .* is not a readable Parquet file"):
        prepare(tmp_path, tok, path=str(path))


def test_a_corrupt_save_to_disk_folder_is_a_data_error(tmp_path, tok):
    path = write_source("saved", tmp_path, [TEXT, TEXT])
    (path / "state.json").write_text("{")
    with pytest.raises(DataError, match="save_to_disk folder .* cannot be read"):
        prepare(tmp_path, tok, path=str(path))
