"""The routers' load in the train events of a 2-rank FSDP2 run: every rank's tokens, each counted top-k times."""

from __future__ import annotations

import math
from pathlib import Path

from tests.conftest import events
from trainyard.runs.report import write_report


def test_train_events_count_every_ranks_tokens_top_k_times_per_moe_layer(moe_reference: Path, tmp_path: Path) -> None:
    train = events(moe_reference, "train")
    tokens = [0] + [e["tokens"] for e in train]  # real tokens of all ranks so far; padding-free rows have no pad
    for event, before, after in zip(train, tokens, tokens[1:], strict=False):
        load = event["expert_load"]
        assert load["layers"] == [1, 2], load  # layer 0 is dense (first_k_dense_replace: 1)
        assert [sum(row) for row in load["tokens_per_expert"]] == [2 * (after - before)] * 2, event["step"]
        assert math.isfinite(event["router_aux_loss"]) and event["router_aux_loss"] > 0
    written = write_report([moe_reference], tmp_path / "report")
    assert "router_aux_loss.png" in [path.name for path in written]
    report = written[-1].read_text()
    assert "## Experts" in report and "| 1 |" in report, report
