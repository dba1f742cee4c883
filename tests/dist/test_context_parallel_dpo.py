"""DPO under context parallelism (dist.context_parallel 2, fsdp, fp32: on 2 ranks, and as 2 CP groups x FSDP 2 on 4)
computes the single process's loss, DPO's figures (rewards, margins, accuracies, log-probabilities) and every
gradient, with LoRA (the reference is the adapters-off forward, summed over the CP group like the policy) and with
full fine-tuning (the stored reference, computed by reference.py's pass on the CP build and compared with one
process's): the ranks of a CP group take the same padding-free row of two pairs from the training collator, each its
half; the second pair's chosen reply starts on rank 0 and ends on rank 1 (tests/dist/scripts/context_parallel_dpo.py).
On 2 ranks the job's evaluation (evaluate.py: each rank its own eval pairs, whole) gives one process's eval loss and
eval figures too.

Tolerance: fp32, as tests/dist/test_context_parallel.py's, but a reward is beta x a difference of log-probabilities
near -50, so its relative error is larger (< 7e-6 measured, the bound 5e-5). Without the sums over the CP group each
rank's pairs would be its slices' fragments: the loss and figures are off by far more than these bounds (the old
code refused the job); summed over the world instead of the CP group, the 4 ranks' are off by 9% in the loss
and 100% in the figures. The evaluation runs the same one-pair batches as one process: 0 difference measured,
the figures' bound kept."""

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
RANKS = [2, 4]
"""2: one CP group; 4: two CP groups of 2, the weights sharded over all four."""
LOSS_REL, GRAD_REL, FIGURES_REL, REFERENCE_REL, EVAL_REL = 1e-6, 1e-5, 5e-5, 1e-6, 5e-5
EVAL_FIGURES = {"eval_loss", "eval_pairs", "eval_rewards/chosen", "eval_rewards/rejected", "eval_rewards/margins",
                "eval_rewards/accuracies", "eval_logps/chosen", "eval_logps/rejected"}


@pytest.fixture(scope="module")
def results(worlds: Callable[[int], World], tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], dict]:
    out = tmp_path_factory.mktemp("context-parallel-dpo")
    found = {}
    for ranks in RANKS:
        run_script(worlds(ranks), "context_parallel_dpo", str(out / f"{ranks}.jsonl"), json.dumps(JOBS),
                   *(["eval"] if ranks == 2 else []))
        lines = map(json.loads, (out / f"{ranks}.jsonl").read_text().splitlines())
        found |= {(line["job"], ranks): line for line in lines}
    return found


def line_of(results: dict[tuple[str, int], dict], name: str, ranks: int) -> dict:
    line = results.get((name, ranks))
    assert line is not None, f"the script wrote no line for {name} on {ranks} ranks"
    assert line["ok_error"] is None, line["ok_error"]
    return line


@pytest.mark.parametrize("ranks", RANKS, ids=["cp2", "cp2_x_fsdp2"])
@pytest.mark.parametrize("name", list(JOBS))
def test_dpo_under_context_parallelism_matches_one_process(
    results: dict[tuple[str, int], dict], name: str, ranks: int
) -> None:
    line = line_of(results, name, ranks)
    groups = ranks // 2  # each CP group slices the row alike and owns its pairs: the sums count the row per group
    # 49 tokens padded to 50: rank 0 holds the first pair's 11 reply tokens and 1 of the second chosen reply's 11,
    # rank 1 the other 10 and the 9 of the second rejected reply; each pair counts on the rank holding its end.
    assert line["targets"] == [12, 19] * groups, line["targets"]
    assert line["pairs"] == [1, 1] * groups and line["want_pairs"] == 2, line
    assert line["loss_rel"] < LOSS_REL, line
    assert line["grad_rel"] < GRAD_REL, line
    assert line["figures_rel"] < FIGURES_REL, line
    assert line["reference_rel"] < REFERENCE_REL, line


@pytest.mark.parametrize("name", list(JOBS))
def test_dpo_evaluation_under_context_parallelism_matches_one_process(
    results: dict[tuple[str, int], dict], name: str
) -> None:
    """Each of the 3 eval pairs counted once over the ranks (rank 1's second batch is padding only); eval_loss and
    TRL's eval_rewards/ and eval_logps/ figures those of one process."""
    line = line_of(results, name, 2)
    assert set(line["eval"]) == EVAL_FIGURES, line["eval"]
    assert line["eval_pairs"] == [3, 3], line
    assert line["eval"]["eval_rewards/margins"] != 0.0, line  # the policy is not its reference: a figure to compare
    assert line["eval_rel"] < EVAL_REL, line
