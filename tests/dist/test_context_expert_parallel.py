"""Context parallelism composes with expert parallelism on 4 ranks: each EP group is made of whole CP groups
(dist.build_mesh: the shard dimension flattened from "shard_mod_ep" x "ep_mod_cp" x "cp", "ep" from the last two).
Both ranks of a CP group take the same padding-free row of three documents, each its half (the second document
crosses the halves' boundary); each rank's half is routed to the experts of its EP group through the all-to-all;
attention, routers and shared experts stay sharded over all four ranks, the expert stacks over what EP leaves. The
fp32 loss and every gradient (the EP ranks' experts put back together), with LoRA on the routed experts
(lora.target_parameters auto) and with full fine-tuning, match one process on the whole row: qwen3_moe and
glm4_moe at fsdp CP 2 x EP 2 (2 experts per rank, sharded again over 2), glm4_moe at CP 2 x EP 4 (two CP groups
in one EP group: 1 expert per rank) and under HSDP (replicate 2 x shard 2, CP 2 = EP 2). One script runs every
job (tests/dist/scripts/context_parallel.py, the CP tests' own).

Tolerance: the CP and EP tests' own; measured on every job: losses within 9.5e-8 of their value (bitwise under full
fine-tuning), the worst gradient within 3.8e-7 of its largest."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from tests.conftest import run_script
from tests.unit.model.families import settings
from tests.world import World

pytestmark = [pytest.mark.dist, pytest.mark.worlds]

TOKENIZER_KEYS = ("vocab_size", "pad_token_id", "bos_token_id", "eos_token_id")
LOSS_REL, GRAD_REL = 1e-6, 1e-5
JOBS = {
    "qwen3_moe-fsdp-cp2-ep2": ("qwen3_moe", ["dist.expert_parallel=2"], [2, 2]),
    "glm4_moe-fsdp-cp2-ep2": ("glm4_moe", ["dist.expert_parallel=2"], [2, 2]),
    "glm4_moe-fsdp-cp2-ep4": ("glm4_moe", ["dist.expert_parallel=4"], [1, 1]),
    "glm4_moe-hsdp-2x2-cp2-ep2": ("glm4_moe", ["dist.strategy=hsdp", "dist.shard_size=2",
                                               "dist.expert_parallel=2"], [2, 2]),
}
"""name: (family, the sharded build's overrides beside dist.context_parallel 2, each expert stack's [experts a
rank holds, ranks FSDP2 shards them over (replicas included)])."""


def job(family: str, sharded: list[str]) -> dict:
    found = {k: v for k, v in settings(family).items() if k not in TOKENIZER_KEYS}
    return {"settings": found, "sharded": sharded}


@pytest.fixture(scope="module")
def results(worlds: Callable[[int], World], tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool], dict]:
    out = tmp_path_factory.mktemp("context-expert-parallel") / "four.jsonl"
    jobs = {name: job(family, sharded) for name, (family, sharded, _) in JOBS.items()}
    run_script(worlds(4), "context_parallel", str(out), json.dumps(jobs))
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    return {(line["job"], line["lora"]): line for line in lines}


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("name", list(JOBS))
def test_cp_with_ep_matches_one_process_loss_and_every_gradient(
    results: dict[tuple[str, bool], dict], name: str, lora: bool
) -> None:
    line = results.get((name, lora))
    assert line is not None, f"the script wrote no line for {name} (lora={lora})"
    assert line["ok_error"] is None, line["ok_error"]
    # each CP group slices the row alike: rank 1 of each starts inside the second document (position 11)
    assert line["slices"] == [[31, 30, 31, 0], [31, 28, 30, 11]] * 2, line["slices"]
    assert line["expert_grads"] > 0, "the routed experts (and their adapters) must train"
    assert line["expert_rows"] and all(rows == JOBS[name][2] for rows in line["expert_rows"]), line
    assert line["loss_rel"] < LOSS_REL, line
    assert line["grad_rel"] < GRAD_REL, line
