"""Built-in tasks: deterministic, held-out eval disjoint from train, answers correct."""

from __future__ import annotations

import datetime
import re

import pytest

from trainyard.data import builtin_rows, spoken_date
from trainyard.errors import DataError

ISO = re.compile(r"\b(\d{4}-\d{2}-\d{2})\b")


def iso_of(row: dict) -> str:
    return ISO.search(row["messages"][0]["content"]).group(1)


def test_spoken_date_example():
    assert spoken_date(datetime.date(2021, 3, 7)) == "March 7, 2021"


def test_dates_are_deterministic_per_seed():
    first = builtin_rows("builtin:dates", 50, 10, seed=1)
    assert builtin_rows("builtin:dates", 50, 10, seed=1) == first
    assert builtin_rows("builtin:dates", 50, 10, seed=2) != first


def test_dates_eval_is_disjoint_from_train_and_sized():
    train, held_out = builtin_rows("builtin:dates", 500, 100, seed=0)
    assert (len(train), len(held_out)) == (500, 100)
    train_dates = {iso_of(row) for row in train}
    eval_dates = {iso_of(row) for row in held_out}
    assert len(train_dates) == 500 and len(eval_dates) == 100
    assert not train_dates & eval_dates


def test_dates_answers_are_correct_chat_rows():
    train, held_out = builtin_rows("builtin:dates", 200, 20, seed=0)
    months = [datetime.date(2000, m, 1).strftime("%B") for m in range(1, 13)]
    for row in train + held_out:
        user, assistant = row["messages"]
        assert (user["role"], assistant["role"]) == ("user", "assistant")
        assert "'Month D, YYYY'" in user["content"]
        day = datetime.date.fromisoformat(iso_of(row))
        expected = f"{months[day.month - 1]} {day.day}, {day.year}"
        assert assistant["content"] == row["answer"] == expected


def test_text_task_gives_distinct_plain_documents():
    train, held_out = builtin_rows("builtin:text", 40, 10, seed=0)
    texts = [row["text"] for row in train + held_out]
    assert len(set(texts)) == 50
    assert all(set(row) == {"text"} and row["text"].endswith(".") for row in train + held_out)


def test_unknown_task_and_oversized_request_are_errors():
    with pytest.raises(DataError, match="builtin:dates"):
        builtin_rows("builtin:nope", 1, 1)
    with pytest.raises(DataError, match="synthetic_train_size"):
        builtin_rows("builtin:dates", 100_000, 1)
