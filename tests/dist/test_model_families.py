"""LoRA and full fine-tuning under FSDP2 on 2 ranks compute, for every model family users fine-tune, the loss and
gradients of the unsharded model: sliding windows, soft-capping, attention sinks, fused and shared experts, MLA.
One torchrun launch runs every family (tests/dist/scripts/families_fsdp.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.dist

SCRIPT = REPO / "tests" / "dist" / "scripts" / "families_fsdp.py"
BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256)
ROUTED = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
              n_shared_experts=1, n_group=1, topk_group=1)
WINDOWED = ["sliding_attention", "full_attention"]
FAMILIES: dict[str, dict] = {
    "llama": {},
    "mistral": dict(sliding_window=8),
    "mixtral": dict(sliding_window=8, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16),
    "gemma2": dict(sliding_window=8, attn_logit_softcapping=0.5, final_logit_softcapping=5.0, head_dim=16,
                   query_pre_attn_scalar=16),
    "gemma3_text": dict(sliding_window=8, head_dim=16, query_pre_attn_scalar=16, layer_types=WINDOWED),
    "phi3": dict(sliding_window=8),
    "glm4_moe": dict(ROUTED, head_dim=16),
    "deepseek_v3": dict(ROUTED, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=16),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8, head_dim=16, layer_types=WINDOWED),
}
"""Tiny configs with each family's features on (windows shorter than the documents); vocab from builtin:bytes."""
LOSS_REL, GRAD_REL = 1e-5, 1e-4
"""fp32: the 2 ranks' gradient reduction may reorder sums, nothing more."""


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool], dict]:
    out = tmp_path_factory.mktemp("families") / "results.jsonl"
    settings = {family: {"model_type": family, **BASE, **extra} for family, extra in FAMILIES.items()}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(SCRIPT), str(out),
         json.dumps(settings)],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )
    assert result.returncode == 0, f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-5000:]}"
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
