"""LoRA and full fine-tuning under FSDP2 on 2 ranks compute, for every model family users fine-tune, the loss and
gradients of the unsharded model: sliding windows, soft-capping, attention sinks, fused and shared experts, MLA.
One torchrun launch runs every family (tests/dist/scripts/families_fsdp.py)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_script
from tests.unit.model.families import FAMILIES, settings
from tests.world import World
from trainyard.loss import CHUNKED_FAMILIES

pytestmark = pytest.mark.dist

TOKENIZER_KEYS = ("vocab_size", "pad_token_id", "bos_token_id", "eos_token_id")
"""Set from builtin:bytes by trainyard, as for any job's model.config."""
LOSS_REL, GRAD_REL = 1e-5, 1e-4
"""fp32: the 2 ranks' gradient reduction may reorder sums, nothing more."""


@pytest.fixture(scope="module")
def results(world: World, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool], dict]:
    out = tmp_path_factory.mktemp("families") / "results.jsonl"
    jobs = {family: {k: v for k, v in settings(family).items() if k not in TOKENIZER_KEYS} for family in FAMILIES}
    run_script(world, "families_fsdp", str(out), json.dumps(jobs))
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    return {(line["family"], line["lora"]): line for line in lines}


def test_every_family_and_mode_ran_once(results: dict[tuple[str, bool], dict]) -> None:
    assert sorted(results) == sorted((family, lora) for family in FAMILIES for lora in (True, False))


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_fsdp2_loss_and_gradients_match_the_unsharded_model(
    results: dict[tuple[str, bool], dict], family: str, lora: bool
) -> None:
    line = results.get((family, lora))
    assert line is not None, f"the script wrote no line for {family} (lora={lora})"
    assert line["ok_error"] is None, line["ok_error"]
    assert line["attention"] == "trainyard_varlen", line
    assert line["trainable"] > 0, line
    assert line["loss_rel"] < LOSS_REL, line
    assert line["grad_rel"] < GRAD_REL, line
    # an untied embedding and head are FSDP2 units of their own (build.untied_ends), and the chunked loss still
    # finds the head under FSDP2's wrapper class; a tied pair stays in the root
    assert line["ends_apart"] == [not line["tied"]] * 2, line
    assert line["chunked"] == (family in CHUNKED_FAMILIES), line
