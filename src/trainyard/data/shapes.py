"""What a row must look like under each train.objective, and the advice every data error gives with it.

SFT learns from rows with one response; DPO from preference pairs (preference.py). An error about a row, a file or
a data.format tells the user the shapes of the job's own objective, never the other one's. `objective` None is a
caller that does not know the job (a library call): it hears both.
"""

from __future__ import annotations

from typing import Literal

from trainyard.config.data import PAIR_SHAPES, SFT_SHAPES
from trainyard.errors import DataError

Objective = Literal["sft", "dpo"] | None



def shapes(objective: Objective) -> str:
    """The rows the objective trains on, as a fix names them."""
    sft = f"train.objective sft: each row {SFT_SHAPES}"
    dpo = f"train.objective dpo: each row a preference pair, {PAIR_SHAPES}"
    return {"sft": sft, "dpo": dpo}.get(objective or "", f"{sft}; {dpo}")


def row_fix(objective: Objective) -> str:
    """The fix of a bad row under data.on_bad_row: error."""
    return (f"fix or remove the row ({shapes(objective)}), or set data.on_bad_row: skip to skip bad rows "
            "(they are counted)")


def unknown_shape_fix(objective: Objective) -> str:
    """The fix of a row whose keys name no format the objective knows."""
    fix = f"give each row {SFT_SHAPES}, or set data.format to chat, alpaca or text"
    return fix if objective == "sft" else f"{fix}; for train.objective dpo, each row {PAIR_SHAPES}"


def no_rows_fix(objective: Objective) -> str:
    """The fix of a source with no usable row."""
    need = "a chosen and a rejected completion" if objective == "dpo" else "a response to learn from"
    return f"check the file and data.format ({shapes(objective)}); every row needs {need}"


def source_fix(field: str, objective: Objective) -> str:
    """The fix of a data source that does not exist: the built-in tasks are SFT rows, so dpo is not sent there."""
    kinds = "a JSONL, JSON or Parquet file or a save_to_disk folder"
    if objective == "dpo":
        return f"set {field} to {kinds} of preference pairs ({PAIR_SHAPES})"
    return f"set {field} to {kinds} with one response a row ({SFT_SHAPES}), or a built-in task such as builtin:dates"


def format_for(data_format: str, objective: Objective) -> str | None:
    """The format rows are read as (None: what the first row's keys announce); a data.format that does not fit the
    objective is an error before any row is read."""
    if objective == "dpo" and data_format not in ("auto", "preference"):
        raise DataError(
            f"data.format is {data_format}, but train.objective dpo trains on preference pairs",
            fix=f"set data.format: preference (or auto), each row {PAIR_SHAPES}",
        )
    if objective == "sft" and data_format == "preference":
        raise DataError(
            "data.format is preference, but train.objective is sft",
            fix=f"set train.objective: dpo to train on the pairs, or data.format: auto with each row {SFT_SHAPES}",
        )
    if objective == "dpo":
        return "preference"
    return None if data_format == "auto" else data_format


def pair_under_sft(keys: list[str], where: str) -> DataError:
    """A preference pair in an SFT job: located, since the first row decides the format."""
    return DataError(
        f"this row is a preference pair (keys {keys}) but train.objective is sft",
        where=where,
        fix=f"set train.objective: dpo to train on pairs, or give each row {SFT_SHAPES}",
    )
