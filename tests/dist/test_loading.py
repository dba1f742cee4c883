"""Meta-device build, wrap, then each rank's own weights: every value equals what transformers
loads (or initialises) in one process, and an FSDP2 rank holds only its half."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.conftest import run_script
from tests.world import World
from trainyard.model import weights
from trainyard.errors import ModelError

pytestmark = [pytest.mark.dist, pytest.mark.worlds]

SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
             max_position_embeddings=256)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tied Llama stored in bf16, and a GLM-4.5-shaped MoE whose experts are stored one by one."""
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    llama = AutoConfig.for_model("llama", intermediate_size=128, tie_word_embeddings=True, **SMALL)
    AutoModelForCausalLM.from_config(llama, dtype=torch.bfloat16).save_pretrained(root / "llama")
    moe = AutoConfig.for_model("glm4_moe", intermediate_size=128, moe_intermediate_size=32, n_routed_experts=4,
                               n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, head_dim=16, **SMALL)
    AutoModelForCausalLM.from_config(moe).save_pretrained(root / "moe")
    return {"llama": root / "llama", "moe": root / "moe"}


def _folder_job(folder: Path, *extra: str) -> list[str]:
    return ["model.config=null", f"model.path={folder}", "model.tokenizer=builtin:bytes", *extra]


def _run(world: World, strategy: str, jobs: list[list], out: Path) -> dict[str, list[dict]]:
    run_script(world, "load_shards", strategy, json.dumps(jobs), str(out))
    return {label: [json.loads((out / f"{label}-rank{r}.json").read_text()) for r in (0, 1)] for label, _, _ in jobs}


def test_fsdp2_ranks_read_only_their_half_and_match_transformers(
    world: World, folders: dict[str, Path], tmp_path: Path
) -> None:
    jobs = [
        ["random", [], ""],
        ["random-lora", ["lora.enabled=true"], ""],
        ["llama-bf16-file-lora", _folder_job(folders["llama"], "lora.enabled=true"), str(folders["llama"])],
        ["moe-lora", _folder_job(folders["moe"], "lora.enabled=true"), str(folders["moe"])],
    ]
    results = _run(world, "fsdp", jobs, tmp_path)
    for label, ranks in results.items():
        for rank in ranks:
            assert rank["mismatched"] == [], label
            assert rank["meta_left"] == [], label
            assert abs(rank["held_share"] - 0.5) < 1e-3, (label, rank["held_share"])
    assert all(rank["tied"] for label in ("random", "llama-bf16-file-lora") for rank in results[label])


def test_expert_parallel_ranks_read_only_their_experts_rows_and_match_transformers(
    world: World, folders: dict[str, Path], tmp_path: Path
) -> None:
    """dist.expert_parallel 2: each rank reads its 2 of the 4 experts from the folder's one-by-one expert tensors
    (and half of the rest), adapters included; together they make transformers' model."""
    ep = "dist.expert_parallel=2"
    jobs = [
        ["moe-ep", _folder_job(folders["moe"], ep), str(folders["moe"])],
        ["moe-ep-lora", _folder_job(folders["moe"], "lora.enabled=true", ep), str(folders["moe"])],
    ]
    for label, ranks in _run(world, "fsdp", jobs, tmp_path).items():
        for rank in ranks:
            assert rank["mismatched"] == [] and rank["meta_left"] == [], label
            assert abs(rank["held_share"] - 0.5) < 1e-3, (label, rank["held_share"])


def test_ddp_ranks_hold_one_whole_copy_equal_to_transformers(world: World, folders: dict[str, Path], tmp_path: Path) -> None:
    jobs = [["random", [], ""], ["moe", _folder_job(folders["moe"]), str(folders["moe"])]]
    results = _run(world, "ddp", jobs, tmp_path)
    for label, ranks in results.items():
        for rank in ranks:
            assert rank["mismatched"] == [] and rank["meta_left"] == [], label
            assert rank["held_share"] == 1.0
    assert all(rank["tied"] for rank in results["random"])


def test_a_folder_missing_a_weight_is_named_before_any_is_read(folders: dict[str, Path], tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(folders["llama"] / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    broken = tmp_path / "broken"
    broken.mkdir()
    save_file(tensors, broken / "model.safetensors")
    source = weights.SafetensorsFolder.open(broken)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folders["llama"]))
    model.to_empty(device="cpu")
    with pytest.raises(ModelError, match="model.layers.1.mlp.down_proj.weight"):
        weights.load(model, source, skip=lambda name: False)


def test_a_folder_without_safetensors_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="no \\*.safetensors"):
        weights.SafetensorsFolder.open(tmp_path)
