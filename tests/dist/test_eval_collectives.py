"""`evaluate` on 2 ranks: one collective, and the figures one process computes by itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_script

pytestmark = [pytest.mark.dist, pytest.mark.worlds]


@pytest.fixture(scope="module", params=["ddp", "fsdp"])
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict]]:
    """What each of 2 ranks reported after evaluating the same tiny model (37 examples)."""
    strategy = request.param
    tmp = tmp_path_factory.mktemp(f"eval-{strategy}")
    run_script(request.getfixturevalue("world"), "evaluate_two_ranks", str(tmp), strategy, str(tmp / "report"))
    return strategy, [json.loads((tmp / f"report-rank{r}.json").read_text()) for r in (0, 1)]


def test_one_collective_per_evaluation(ranks: tuple[str, list[dict]]) -> None:
    _, reports = ranks
    # 37 examples over 2 ranks in batches of 4: 5 batches per rank, uneven shards.
    assert [r["batches"] for r in reports] == [5, 5]
    assert [r["collectives"] for r in reports] == [{"all_reduce": 1}] * 2


def test_loss_and_counts_equal_one_process_over_the_whole_subset(ranks: tuple[str, list[dict]]) -> None:
    """Every example counted once (none twice from the padding batch, none lost to the uneven
    shard), and every rank gets the same reduced figures."""
    _, reports = ranks
    single = reports[0]
    assert single["subset"] == 37
    for report in reports:
        result = report["result"]
        assert result["eval_tokens"] == single["single_targets"]
        assert result["eval_loss"] == pytest.approx(single["single_loss_sum"] / single["single_targets"], rel=1e-5)
        assert report["with_answers"]["eval_examples"] == 37
        correct = sum(r["correct"] for r in reports)
        assert report["with_answers"]["eval_accuracy"] == pytest.approx(correct / 37)


def test_generation_stops_at_each_sequences_end_and_equals_one_process(ranks: tuple[str, list[dict]]) -> None:
    """Under FSDP every rank runs the same forward passes, yet each answer still ends at its
    own end-of-turn token, exactly as a single process's greedy generation ends it."""
    strategy, reports = ranks
    raw = [ids for r in reports for ids in r["raw"]]
    eos = reports[0]["eos"]
    ends = {ids.index(eos) for ids in raw if eos in ids}
    # The test means something only if answers end at different lengths, and some run on.
    assert len(ends) >= 3 and any(eos not in ids for ids in raw), (reports[0]["swapped"], raw)
    for rank, report in enumerate(reports):
        assert len(report["answers"]) == len(report["expected"]) == [19, 18][rank]
        assert report["answers"] == report["expected"], (strategy, rank)


def test_kept_generations_cost_one_gather_and_rank_0_writes_them_all(ranks: tuple[str, list[dict]]) -> None:
    """Each evaluation's generations land in samples/step-XXXXXXXX.jsonl: one all-reduce (carrying each rank's
    byte count) and one gather, however many batches (FSDP's generation adds its per-token all-reduces, as
    without samples); the file holds every example once, in the subset's order."""
    strategy, reports = ranks
    assert [r["kept_collectives"]["gather"] for r in reports] == [1, 1]
    if strategy == "ddp":
        assert [r["kept_collectives"] for r in reports] == [{"all_reduce": 1, "gather": 1}] * 2
    assert reports[0]["kept"] == reports[0]["with_answers"]
    lines = [json.loads(line) for line in Path(reports[0]["samples"]).read_text().splitlines()]
    assert Path(reports[0]["samples"]).name == "step-00000007.jsonl"
    assert [line["index"] for line in lines] == list(range(37))
    assert {"prompt", "answer", "reference", "correct"} <= lines[0].keys()
    assert sum(line["correct"] for line in lines) == sum(r["correct"] for r in reports)
