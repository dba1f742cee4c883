"""Context parallelism (dist.context_parallel 2 on 2 ranks, fsdp; and 2 CP groups x FSDP 2 on 4 ranks) computes the
single process's loss and every gradient, for llama, qwen3, mistral (sliding windows of 8), gemma2 (soft-capping,
alternating windows) and gpt_oss (sinks, each rank its heads' share), with LoRA and with full fine-tuning: both
ranks take the same padding-free row of three documents from the training collator, each its half (the second
document crosses the halves' boundary; the row's odd length is padded), and attention trades the halves for heads
around the whole row's documents. Also with one KV head (repeated for the 2 ranks) and under activation
checkpointing (the backward recomputes the exchange). One script runs every job
(tests/dist/scripts/context_parallel.py).

Tolerance: fp32; the worst loss differs by < 1e-7 of its value and the worst gradient by < 5e-7 of its largest
(measured on every job): the ranks' gradients are summed in another order. Each rank attending only its own half (no
exchange) is off by 3e-4 in the loss and 0.4-0.6 in the gradients."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import run_script
from tests.unit.model.families import settings
from tests.world import GROUP_LIMIT, World

pytestmark = [pytest.mark.dist, pytest.mark.worlds]

TOKENIZER_KEYS = ("vocab_size", "pad_token_id", "bos_token_id", "eos_token_id")
FAMILIES = ["llama", "qwen3", "mistral", "gemma2", "gpt_oss"]
ONE_KV_HEAD, CHECKPOINTED = "llama_one_kv_head", "llama_checkpointed"
ON_FOUR, ON_FOUR_MISTRAL = "llama_cp2_x_fsdp2", "mistral_cp2_x_fsdp2"
"""On 4 ranks: two CP groups of 2, the weights sharded over all four."""
LOSS_REL, GRAD_REL = 1e-6, 1e-5


def job(family: str, parallel: list[str] | None = None, **changes: object) -> dict:
    found = {k: v for k, v in {**settings(family), **changes}.items() if k not in TOKENIZER_KEYS}
    return {"settings": found, "parallel": parallel or []}


def run_jobs(world: World, out: Path, jobs: dict[str, dict]) -> dict[tuple[str, bool], dict]:
    run_script(world, "context_parallel", str(out), json.dumps(jobs))
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    return {(line["job"], line["lora"]): line for line in lines}


@pytest.fixture(scope="module")
def results(worlds: Callable[[int], World], tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool], dict]:
    out = tmp_path_factory.mktemp("context-parallel")
    jobs = {family: job(family) for family in FAMILIES} | {
        ONE_KV_HEAD: job("llama", num_key_value_heads=1),
        CHECKPOINTED: job("llama", ["model.gradient_checkpointing=true"]),
    }
    found = run_jobs(worlds(2), out / "two.jsonl", jobs)
    four = run_jobs(worlds(4), out / "four.jsonl", {ON_FOUR: job("llama"), ON_FOUR_MISTRAL: job("mistral")})
    return found | four


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("name", [*FAMILIES, ONE_KV_HEAD, CHECKPOINTED, ON_FOUR, ON_FOUR_MISTRAL])
def test_context_parallel_loss_and_gradients_match_one_process(
    results: dict[tuple[str, bool], dict], name: str, lora: bool
) -> None:
    line = results.get((name, lora))
    assert line is not None, f"the script wrote no line for {name} (lora={lora})"
    assert line["ok_error"] is None, line["ok_error"]
    # 61 tokens padded to 62: each rank 31 tokens; rank 1 starts inside the second document (position 11), and
    # holds the one padding token; each target is counted on one rank only (30 + 28 of the row's 58).
    groups = 2 if name in (ON_FOUR, ON_FOUR_MISTRAL) else 1  # each CP group slices the row alike
    assert line["slices"] == [[31, 30, 31, 0], [31, 28, 30, 11]] * groups, line["slices"]
    assert line["loss_rel"] < LOSS_REL, line
    assert line["grad_rel"] < GRAD_REL, line


def test_a_world_holds_few_process_groups_between_tasks(
    results: dict[tuple[str, bool], dict], worlds: Callable[[int], World]
) -> None:
    """The 4-rank jobs above left their ranks 13 process groups (CP and shard groups, each with a gloo thread that
    wakes every 10 ms); the world is started again after such a task, so the suite's later tests do not pay for
    them (tests/world.py GROUP_LIMIT)."""
    held = worlds(4).run("tests.world_rank:process_groups")
    assert max(held) <= GROUP_LIMIT, held
