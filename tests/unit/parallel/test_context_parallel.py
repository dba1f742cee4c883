"""dist.context_parallel is refused, exit 2 naming the field, where it cannot run exactly this round: without
fsdp/hsdp, with an expert-parallel size not made of whole CP groups, DPO or padded rows; on a family not proven (one
whose layers carry a state along the row named with their kind), attention that builds its mask from the rank's
slice, or a size that does not divide the heads or the shard dimension. KV heads are repeated just enough for the
group to split them."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.conftest import TINY, run_cli
from tests.unit.model import registry
from tests.unit.model.families import build
from trainyard.config.data import DataConfig
from trainyard.config_file import load_config
from trainyard.errors import ConfigError
from trainyard.model.attention import VARLEN
from trainyard.parallel import context_parallel

WHERE = "dist.context_parallel (job.yaml:9)"
SHARDED = ["dist.strategy=fsdp", "dist.context_parallel=2"]


def refusal(model, size: int = 2, shard: int = 2, data: DataConfig | None = None) -> str:
    with pytest.raises(ConfigError) as err:
        context_parallel.check(model, size, shard, data or DataConfig(path="x.jsonl"), WHERE)
    assert err.value.where == WHERE
    return err.value.what + " " + (err.value.fix or "")


@pytest.mark.parametrize(("overrides", "named"), [
    (["dist.strategy=ddp", "dist.context_parallel=2"], "needs dist.strategy fsdp, hsdp or diloco"),
    ([*SHARDED, "dist.expert_parallel=3"], "dist.expert_parallel 3: each EP group is made of whole CP groups"),
    ([*SHARDED, "train.objective=dpo", "dpo.loss=orpo"], "runs dpo.loss orpo not yet"),
    ([*SHARDED, "data.padding_free=false"], "slices padding-free rows"),
])
def test_what_context_parallelism_cannot_run_yet_is_refused_naming_it(overrides: list[str], named: str) -> None:
    with pytest.raises(ConfigError, match=f"dist.context_parallel 2.*{named}|{named}.*dist.context_parallel"):
        load_config(TINY, overrides)


def test_a_refusal_exits_2_without_a_traceback() -> None:
    assert load_config(TINY, SHARDED).dist.context_parallel == 2
    assert load_config(TINY, [*SHARDED, "train.objective=dpo"]).dist.context_parallel == 2  # orpo alone is refused
    assert load_config(TINY, [*SHARDED, "train.epochs=1", "~train.max_steps"]).train.epochs == 1  # sized by data ranks
    result = run_cli("train", TINY, "dist.strategy=ddp", "dist.context_parallel=2", "--dry-run")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "dist.context_parallel" in result.stderr


def test_ep_made_of_whole_cp_groups_loads_and_any_other_size_exits_2_naming_both_fields_and_the_sizes() -> None:
    for ep in (2, 4, "auto"):  # auto: the plan takes a multiple of the CP size (estimate.experts.candidates)
        assert load_config(TINY, [*SHARDED, f"dist.expert_parallel={ep}"]).dist.expert_parallel == ep
    result = run_cli("train", TINY, "dist.strategy=fsdp", "dist.context_parallel=4", "dist.expert_parallel=2",
                     "--dry-run")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    err = " ".join(result.stderr.split())
    assert "dist.context_parallel 4 with dist.expert_parallel 2" in err, err
    assert "set dist.expert_parallel to 4, 8, ..." in err and "or dist.context_parallel to one of 1, 2" in err, err


def test_the_model_check_refuses_what_is_not_proven_exact() -> None:
    llama = build("llama", VARLEN)
    context_parallel.check(llama, 2, 4, DataConfig(path="x.jsonl"), WHERE)  # 4 heads, 4 ranks: runs
    assert "not proven exact for olmo2" in refusal(build("olmo2", VARLEN))
    assert "must divide the attention heads (4)" in refusal(llama, size=3, shard=3)
    assert "must divide the shard dimension (3 ranks)" in refusal(llama, size=2, shard=3)
    assert "runs trainyard's varlen attention inside its exchange; llama runs sdpa" in refusal(build("llama", "sdpa"))
    padded = DataConfig(path="x.jsonl", padding_free=False)
    assert "collates padded rows (data.padding_free is off)" in refusal(llama, data=padded)


@pytest.mark.parametrize(("family", "named"), [
    ("qwen3_next", "qwen3_next's Qwen3NextGatedDeltaNet layers (linear attention)"),
    ("falcon_h1", "falcon_h1's FalconH1Mixer layers (state-space)"),
    ("lfm2_moe", "lfm2_moe's Lfm2MoeShortConv layers (short causal convolution)"),
])
def test_layers_that_carry_a_state_along_the_row_are_refused_by_name_and_kind(family: str, named: str) -> None:
    """A CP rank holds 1/N of each row: such a layer would run on its slice alone (the exchange is attention's)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**registry.settings(family)))
    said = refusal(model)
    assert f"dist.context_parallel 2: {named} need the whole document on one rank" in said, said
    assert "exchanges only attention's tokens" in said and "set dist.context_parallel: 1" in said


def test_the_dry_run_refuses_them_with_exit_2_naming_the_field() -> None:
    tokenizer = ("vocab_size", "pad_token_id", "bos_token_id", "eos_token_id")
    settings = {k: v for k, v in registry.settings("qwen3_next").items() if k not in tokenizer}
    result = run_cli("train", TINY, f"model.config={json.dumps(settings)}", "dist.strategy=fsdp",
                     "dist.context_parallel=2", "--world-size", "2", "--dry-run", "--skip-data-check")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "dist.context_parallel" in result.stderr and "Qwen3NextGatedDeltaNet layers (linear attention)" in (
        result.stderr), result.stderr[-2000:]


@pytest.mark.parametrize(("heads", "kv", "size", "repeats"), [(4, 2, 2, 1), (4, 1, 2, 2), (8, 2, 4, 2), (8, 1, 8, 8),
                                                               (8, 4, 2, 1)])
def test_kv_heads_repeat_just_enough_for_the_group_to_split_them(heads: int, kv: int, size: int, repeats: int) -> None:
    assert context_parallel.kv_repeats(heads, kv, size) == repeats
