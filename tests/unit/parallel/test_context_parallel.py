"""dist.context_parallel is refused, exit 2 naming the field, where it cannot run exactly this round: without
fsdp/hsdp, with expert parallelism, DPO or padded rows; on a family not proven, attention that builds
its mask from the rank's slice, or a size that does not divide the heads or the shard dimension. KV heads are
repeated just enough for the group to split them."""

from __future__ import annotations

import pytest

from tests.conftest import TINY, run_cli
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
    (["dist.strategy=ddp", "dist.context_parallel=2"], "needs dist.strategy fsdp or hsdp"),
    ([*SHARDED, "dist.expert_parallel=2"], "dist.expert_parallel 2: the two do not compose yet"),
    ([*SHARDED, "train.objective=dpo"], "runs train.objective sft only"),
    ([*SHARDED, "data.padding_free=false"], "slices padding-free rows"),
])
def test_what_context_parallelism_cannot_run_yet_is_refused_naming_it(overrides: list[str], named: str) -> None:
    with pytest.raises(ConfigError, match=f"dist.context_parallel 2.*{named}|{named}.*dist.context_parallel"):
        load_config(TINY, overrides)


def test_a_refusal_exits_2_without_a_traceback() -> None:
    assert load_config(TINY, SHARDED).dist.context_parallel == 2
    assert load_config(TINY, [*SHARDED, "train.epochs=1", "~train.max_steps"]).train.epochs == 1  # sized by data ranks
    result = run_cli("train", TINY, "dist.strategy=ddp", "dist.context_parallel=2", "--dry-run")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "dist.context_parallel" in result.stderr


def test_the_model_check_refuses_what_is_not_proven_exact() -> None:
    llama = build("llama", VARLEN)
    context_parallel.check(llama, 2, 4, DataConfig(path="x.jsonl"), WHERE)  # 4 heads, 4 ranks: runs
    assert "not proven exact for olmo2" in refusal(build("olmo2", VARLEN))
    assert "must divide the attention heads (4)" in refusal(llama, size=3, shard=3)
    assert "must divide the shard dimension (3 ranks)" in refusal(llama, size=2, shard=3)
    assert "runs trainyard's varlen attention inside its exchange; llama runs sdpa" in refusal(build("llama", "sdpa"))
    padded = DataConfig(path="x.jsonl", padding_free=False)
    assert "collates padded rows (data.padding_free is off)" in refusal(llama, data=padded)


@pytest.mark.parametrize(("heads", "kv", "size", "repeats"), [(4, 2, 2, 1), (4, 1, 2, 2), (8, 2, 4, 2), (8, 1, 8, 8),
                                                               (8, 4, 2, 1)])
def test_kv_heads_repeat_just_enough_for_the_group_to_split_them(heads: int, kv: int, size: int, repeats: int) -> None:
    assert context_parallel.kv_repeats(heads, kv, size) == repeats
