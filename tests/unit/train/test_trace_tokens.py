"""`trainyard estimate --trace` under train.micro_batch_tokens: the step traced is the token budget's, one
padding-free row of N tokens a micro-batch, as many per step as the estimate plans, not micro_batch_size rows."""

from __future__ import annotations

import pytest

from tests.conftest import TINY
from trainyard import estimate
from trainyard.config_file import load_config
from trainyard.train import trace, trace_batch

FSDP = estimate.Hardware("h100-80gb", 2, 1)
STEP = ["dist.strategy=fsdp", "train.micro_batch_size=2", "train.global_batch_size=16"]
"""8 rows of 104 tokens per rank per step: 4 micro-batches of 2 rows on the row path."""


def _gathers(result: trace.Trace) -> int:
    return sum(one.kind == "all_gather" for one in result.collectives)


@pytest.fixture(scope="module")
def traced() -> dict[str, trace.Trace]:
    jobs = {"rows": [], "tokens": ["train.micro_batch_tokens=416"], "rows of 416": ["train.micro_batch_size=4",
                                                                                   "train.global_batch_size=16"]}
    return {name: trace.trace(load_config(TINY, [*STEP, *changes]), FSDP) for name, changes in jobs.items()}


def test_the_token_budget_s_micro_batches_are_traced(traced) -> None:
    """416 tokens hold 4 of the step's 8 rows: 2 micro-batches, each gathering every unit again; a row of 416
    tokens peaks as 4 rows of 104 do (the same tokens), above the row path's 2 rows."""
    rows, tokens, as_rows = traced["rows"], traced["tokens"], traced["rows of 416"]
    assert (rows.accumulation, tokens.accumulation, as_rows.accumulation) == (4, 2, 2)
    assert _gathers(tokens) == _gathers(as_rows) == _gathers(rows) // 2
    assert tokens.peak_bytes > rows.peak_bytes
    assert tokens.peak_bytes == pytest.approx(as_rows.peak_bytes, rel=0.05)
    assert 0.75 < tokens.peak_bytes / tokens.formula.peak_tensor_bytes < 1.25
    assert any("each micro-batch one padding-free row of 416 tokens" in note for note in tokens.notes)


def test_a_budget_is_cut_into_documents_of_max_length_and_never_below_one_row() -> None:
    assert trace_batch.documents(load_config(TINY, ["train.micro_batch_tokens=300"])) == [104, 104, 92]
    assert trace_batch.documents(load_config(TINY, ["train.micro_batch_tokens=50"])) == [104]
    assert trace_batch.documents(load_config(TINY)) == [104] * 8
