"""Expert parallelism (dist.expert_parallel 2 on 2 ranks, fsdp) computes, for every MoE family, with LoRA and with
full fine-tuning, the single process's loss and gradients: each rank holds half of every expert stack and its
adapters (not sharded further), tokens travel to their experts and back, and each rank trains on its own
micro-batch, so the experts receive both ranks' tokens. One script runs every job (tests/dist/scripts/
expert_parallel.py). The hybrids (HYBRIDS) carry a state along each row in their Gated DeltaNet, Mamba or
short-convolution layers beside attention, on the rows trainyard collates for them: EP moves only the experts'
tokens, so those layers see each rank's rows whole, as one process does.

Tolerance: fp32; the losses come out bitwise equal and the worst gradient differs by < 4e-7 of its largest value
(measured on every job): the grouped products run on fewer rows per call and the ranks' gradients are summed in
another order. A wrong gradient factor (the EP group's sum not divided by the data-parallel size) would be off
by 2x, a lost or misrouted token by far more than GRAD_REL."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_script
from tests.unit.model import registry
from tests.unit.model.families import settings
from tests.world import World

pytestmark = [pytest.mark.dist, pytest.mark.worlds]

FAMILIES = ["qwen3_moe", "mixtral", "glm4_moe", "deepseek_v3", "gpt_oss"]
HYBRIDS = ["qwen3_next", "granitemoehybrid", "lfm2_moe"]
"""One of each kind of layer that carries a state: linear attention, state-space (with a shared expert), a short
causal convolution; their tiny configs are the family matrix's (tests/unit/model/registry.py)."""
TOKENIZER_KEYS = ("vocab_size", "pad_token_id", "bos_token_id", "eos_token_id")
IDLE = "glm4_moe_idle_expert"
"""glm4_moe with its last expert's score correction bias at -1e4: no token on any rank chooses it."""
CHECKPOINTED = "glm4_moe_activation_checkpointing"
"""glm4_moe with full activation checkpointing: the backward recomputes each block, all-to-alls included."""
FOLDED = "gpt_oss_peft_fold"
"""gpt_oss with lora.moe_adapter: peft: PEFT folds W + B·A over this rank's experts, then the exchange runs them
(against the grouped products of the 1-process reference: equal to < 4e-6, tests/unit/model/test_moe_lora.py)."""
LOSS_REL, GRAD_REL = 1e-6, 1e-5


LAYOUTS = {
    "fsdp-ep2-shard2": (["dist.strategy=fsdp", "dist.expert_parallel=2"], [2, 2]),
    "fsdp-ep4": (["dist.strategy=fsdp", "dist.expert_parallel=4"], [1, 1]),
    "hsdp-2x2-ep2": (["dist.strategy=hsdp", "dist.shard_size=2", "dist.expert_parallel=2"], [2, 2]),
}
"""On 4 ranks (qwen3_moe): EP=2 with the experts' rows sharded again over the 2 ranks left of the shard dimension;
EP=4 (one expert per rank); HSDP, EP=2 within each shard group of 2, replicated across the 2 groups. With the
experts' rows: [experts of an EP rank, ranks FSDP2 shards them over (replicas included)]."""


def job(family: str, idle: int | None = None, parallel: list[str] | None = None) -> dict:
    found = registry.settings(family) if family in HYBRIDS else settings(family)
    settings_ = {k: v for k, v in found.items() if k not in TOKENIZER_KEYS}
    return {"settings": settings_, "idle": idle, **({"parallel": parallel} if parallel else {})}


@pytest.fixture(scope="module")
def results(world: World, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool], dict]:
    out = tmp_path_factory.mktemp("expert-parallel") / "results.jsonl"
    checkpointed = ["dist.strategy=fsdp", "dist.expert_parallel=2", "model.gradient_checkpointing=true"]
    jobs = {family: job(family) for family in FAMILIES + HYBRIDS} | {
        IDLE: job("glm4_moe", idle=3), CHECKPOINTED: job("glm4_moe", parallel=checkpointed),
        FOLDED: job("gpt_oss", parallel=["dist.strategy=fsdp", "dist.expert_parallel=2", "lora.moe_adapter=peft"]),
    }
    run_script(world, "expert_parallel", str(out), json.dumps(jobs))
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    return {(line["job"], line["lora"]): line for line in lines}


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("family", FAMILIES + HYBRIDS)
def test_expert_parallel_loss_and_gradients_match_one_process(
    results: dict[tuple[str, bool], dict], family: str, lora: bool
) -> None:
    line = results.get((family, lora))
    assert line is not None, f"the script wrote no line for {family} (lora={lora})"
    assert line["ok_error"] is None, line["ok_error"]
    assert line["expert_grads"] > 0 and line["expert_rows"], line
    assert all(rows == [2, 1] for rows in line["expert_rows"]), "2 of 4 experts, not sharded further"
    assert line["loss_rel"] < LOSS_REL, line
    assert line["grad_rel"] < GRAD_REL, line


@pytest.fixture(scope="module")
def four_ranks(worlds, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool], dict]:
    out = tmp_path_factory.mktemp("expert-parallel-4") / "results.jsonl"
    jobs = {name: job("qwen3_moe", parallel=parallel) for name, (parallel, _) in LAYOUTS.items()}
    run_script(worlds(4), "expert_parallel", str(out), json.dumps(jobs))
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    return {(line["job"], line["lora"]): line for line in lines}


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_on_4_ranks_ep_within_a_larger_shard_dimension_and_under_hsdp_is_exact(
    four_ranks: dict[tuple[str, bool], dict], layout: str, lora: bool
) -> None:
    line = four_ranks[(layout, lora)]
    assert line["ok_error"] is None, line["ok_error"]
    assert line["expert_rows"] and all(rows == LAYOUTS[layout][1] for rows in line["expert_rows"]), line
    assert line["loss_rel"] < LOSS_REL, line
    assert line["grad_rel"] < GRAD_REL, line


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_activation_checkpointing_recomputes_the_exchange_exactly(
    results: dict[tuple[str, bool], dict], lora: bool
) -> None:
    line = results[(CHECKPOINTED, lora)]
    assert line["ok_error"] is None, line["ok_error"]
    assert line["loss_rel"] < LOSS_REL and line["grad_rel"] < GRAD_REL, line


def test_pefts_folded_expert_adapters_run_through_the_exchange_too(results: dict[tuple[str, bool], dict]) -> None:
    line = results[(FOLDED, True)]
    assert line["ok_error"] is None, line["ok_error"]
    assert line["expert_grads"] > 0 and line["loss_rel"] < LOSS_REL and line["grad_rel"] < GRAD_REL, line


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_an_expert_no_token_reaches_gets_a_zero_gradient(results: dict[tuple[str, bool], dict], lora: bool) -> None:
    line = results[(IDLE, lora)]
    assert line["ok_error"] is None, line["ok_error"]
    assert line["idle_zero"] is True, line
    assert line["grad_rel"] < GRAD_REL, line
