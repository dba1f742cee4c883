"""Built-in generated tasks, addressed as `data.path: builtin:NAME`.

They need no download and are deterministic from a seed, so a quickstart or a test always sees
the same rows. `dates` is a task small instruct models fail before fine-tuning and learn fast,
which makes it a quick check that training really changes the model.
"""

from __future__ import annotations

import datetime
import random
from typing import Any

from trainyard.errors import DataError

BUILTIN_PREFIX = "builtin:"
MONTHS = (
    "January", "February", "March", "April", "May", "June",
    "July", "August", "September", "October", "November", "December",
)  # fmt: skip
FIRST_DAY = datetime.date(1900, 1, 1)
LAST_DAY = datetime.date(2099, 12, 31)

Rows = list[dict[str, Any]]


def spoken_date(day: datetime.date) -> str:
    """'March 7, 2021': English month names, whatever the locale."""
    return f"{MONTHS[day.month - 1]} {day.day}, {day.year}"


def date_prompt(iso: str) -> str:
    return f"Rewrite the date {iso} in the form 'Month D, YYYY'. Reply with the date only."


def _date_row(day: datetime.date) -> dict[str, Any]:
    answer = spoken_date(day)
    return {
        "messages": [
            {"role": "user", "content": date_prompt(day.isoformat())},
            {"role": "assistant", "content": answer},
        ],
        "answer": answer,
    }


def _distinct_draws(population: int, count: int, seed: int, name: str) -> list[int]:
    if count > population:
        raise DataError(
            f"builtin:{name} has {population} distinct rows, {count} were asked for",
            fix="lower data.synthetic_train_size + data.synthetic_eval_size",
        )
    return random.Random(seed).sample(range(population), count)


def dates_task(train_size: int, eval_size: int, seed: int) -> tuple[Rows, Rows]:
    """ISO date -> 'Month D, YYYY'; eval dates never appear in train."""
    span = (LAST_DAY - FIRST_DAY).days + 1
    offsets = _distinct_draws(span, train_size + eval_size, seed, "dates")
    days = [FIRST_DAY + datetime.timedelta(days=offset) for offset in offsets]
    return [_date_row(d) for d in days[eval_size:]], [_date_row(d) for d in days[:eval_size]]


_NAMES = ("Ada", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun")
_VERBS = ("sees", "buys", "paints", "counts", "finds", "drops", "keeps", "sells")
_COLORS = ("red", "blue", "green", "yellow", "white", "black")
_THINGS = ("apples", "boxes", "cups", "stones", "kites", "books", "shells", "coins")
_COUNTS = tuple(range(2, 13))


def _sentence(index: int) -> str:
    """The index-th sentence of a fixed small grammar (mixed radix over the word lists)."""
    words = []
    for options in (_NAMES, _VERBS, _COUNTS, _COLORS, _THINGS):
        index, pick = divmod(index, len(options))
        words.append(str(options[pick]))
    name, verb, count, color, thing = words
    return f"{name} {verb} {count} {color} {thing}."


def text_task(train_size: int, eval_size: int, seed: int) -> tuple[Rows, Rows]:
    """Short plain-text documents of a few simple sentences, for pretraining-style runs."""
    grammar = len(_NAMES) * len(_VERBS) * len(_COUNTS) * len(_COLORS) * len(_THINGS)
    draws = _distinct_draws(grammar, 3 * (train_size + eval_size), seed, "text")
    docs = [" ".join(_sentence(i) for i in draws[k : k + 3]) for k in range(0, len(draws), 3)]
    rows = [{"text": doc} for doc in docs]
    return rows[eval_size:], rows[:eval_size]


TASKS = {"dates": dates_task, "text": text_task}


def is_builtin(path: str) -> bool:
    return path.startswith(BUILTIN_PREFIX)


def builtin_rows(path: str, train_size: int, eval_size: int, seed: int = 0) -> tuple[Rows, Rows]:
    """(train rows, eval rows) of the task `builtin:NAME`."""
    name = path.removeprefix(BUILTIN_PREFIX)
    if name not in TASKS:
        raise DataError(
            f"unknown built-in data '{path}'",
            fix=f"use one of: {', '.join(BUILTIN_PREFIX + task for task in TASKS)}",
        )
    return TASKS[name](train_size, eval_size, seed)
