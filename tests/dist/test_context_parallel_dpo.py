"""DPO under context parallelism (dist.context_parallel 2 on 2 ranks, fsdp, fp32) computes the single process's loss,
DPO's figures (rewards, margins, accuracies, log-probabilities) and every gradient, with LoRA (the reference is the
adapters-off forward, summed over the CP group like the policy) and with full fine-tuning (the stored reference,
computed by reference.py's pass on the CP build and compared with one process's): both ranks take the same
padding-free row of two pairs from the training collator, each its half; the second pair's chosen reply starts on
rank 0 and ends on rank 1 (tests/dist/scripts/context_parallel_dpo.py).

Tolerance: fp32, as tests/dist/test_context_parallel.py's, but a reward is beta x a difference of log-probabilities
near -50, so its relative error is larger (< 7e-6 measured, the bound 5e-5). Without the sums over the CP group each
rank's pairs would be its slices' fragments: the loss and figures are off by far more than these bounds (the old
code refused the job)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import run_script
from tests.world import World

pytestmark = [pytest.mark.dist, pytest.mark.worlds]

JOBS = {
    "lora_sigmoid": ["lora.enabled=true", "dpo.loss=sigmoid"],
    "lora_ipo": ["lora.enabled=true", "dpo.loss=ipo"],  # per-token log-ratios: the token counts are summed too
    "full_sigmoid": ["lora.enabled=false", "dpo.loss=sigmoid"],
}
LOSS_REL, GRAD_REL, FIGURES_REL, REFERENCE_REL = 1e-6, 1e-5, 5e-5, 1e-6


@pytest.fixture(scope="module")
def results(worlds: Callable[[int], World], tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("context-parallel-dpo") / "two.jsonl"
    run_script(worlds(2), "context_parallel_dpo", str(out), json.dumps(JOBS))
    return {line["job"]: line for line in map(json.loads, out.read_text().splitlines())}


@pytest.mark.parametrize("name", list(JOBS))
def test_dpo_under_context_parallelism_matches_one_process(results: dict[str, dict], name: str) -> None:
    line = results.get(name)
    assert line is not None, f"the script wrote no line for {name}"
    assert line["ok_error"] is None, line["ok_error"]
    # 49 tokens padded to 50: rank 0 holds the first pair's 11 reply tokens and 1 of the second chosen reply's 11,
    # rank 1 the other 10 and the 9 of the second rejected reply; each pair counts on the rank holding its end.
    assert line["targets"] == [12, 19], line["targets"]
    assert line["pairs"] == [1, 1] and line["want_pairs"] == 2, line
    assert line["loss_rel"] < LOSS_REL, line
    assert line["grad_rel"] < GRAD_REL, line
    assert line["figures_rel"] < FIGURES_REL, line
    assert line["reference_rel"] < REFERENCE_REL, line
