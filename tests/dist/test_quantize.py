"""model.quantize nf4 on 2 ranks: LoRA trains on a 4-bit base under DDP and FSDP2, checkpoints hold no base weight,
and the merged export computes what the NF4 model with its adapter computes; the tiny MoE's fused experts, each
expert in NF4, alone, under DDP, FSDP2 and expert parallelism (4 ranks)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader
from transformers import AutoModelForCausalLM

from tests.conftest import TINY, TINY_MOE, events, train_in
from tests.world import World
from trainyard import dist, precision
from trainyard.checkpoint.export import adapter_dir, export, frozen_dtype, job_of
from trainyard.checkpoint.layout import read_trainer_state
from trainyard.checkpoint.save import model_signature
from trainyard.model import quantize, weights
from trainyard.model import source as source_room
from trainyard.train.build import build_and_wrap

pytestmark = [pytest.mark.dist, pytest.mark.worlds]

WIDE = ["model.config.hidden_size=256", "model.config.intermediate_size=512", "model.config.num_key_value_heads=4"]
"""The tiny model wide enough that every linear weight holds whole NF4 blocks on each of 2 ranks."""
NF4 = ["model.quantize=nf4", "lora.enabled=true", *WIDE, "train.max_steps=12", "log.every_steps=1",
       "log.progress=false", "log.tensorboard=false", "eval.every_steps=0", "eval.at_end=false",
       "checkpoint.at_end=true", "dist.desync_check_steps=0"]
MOE = [*(item for item in NF4 if not item.startswith("model.config.")), "train.precision=fp32", "train.max_steps=16"]
"""The tiny MoE as it is: every expert of its stacks (gate_up 96 x 64, down 64 x 48) holds whole NF4 blocks."""


def _losses(run_dir: Path) -> list[float]:
    return [event["loss"] for event in events(run_dir, "train")]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_lora_on_an_nf4_base_trains_and_checkpoints_no_base_weight(world: World, tmp_path: Path,
                                                                  strategy: str) -> None:
    train_in(world, TINY, f"output_dir={tmp_path}", f"dist.strategy={strategy}", *NF4)
    run_dir = tmp_path / "tiny"
    _assert_trained_on_nf4(run_dir, "14 linear weights in NF4", 0.9)


def _assert_trained_on_nf4(run_dir: Path, words: str, fall: float) -> None:
    """The log names what NF4 holds, the loss fell below `fall` of its start, the checkpoint holds no base weight
    (adapters, and buffers such as a router's score correction)."""
    losses = _losses(run_dir)
    assert sum(losses[-3:]) < fall * sum(losses[:3]), losses
    assert words in (run_dir / "logs" / "rank-0.log").read_text()
    step = run_dir / "checkpoints" / (run_dir / "checkpoints" / "LATEST").read_text().strip()
    saved = FileSystemReader(str(step)).read_metadata().state_dict_metadata
    model_keys = [key for key in saved if key.startswith("model.")]
    base = [key for key in model_keys if "lora_" not in key and (key.endswith(".weight") or ".experts." in key)]
    assert any("lora_" in key for key in model_keys) and not base, model_keys


EXPERTS_IN_NF4 = "21 linear weights and 4 expert stacks (per expert) in NF4"


@pytest.mark.parametrize(("ranks", "layout"), [(1, ["dist.strategy=none"]), (2, ["dist.strategy=ddp"]),
                                               (4, ["dist.strategy=fsdp", "dist.expert_parallel=2"])],
                         ids=["none", "ddp", "expert-parallel"])
def test_lora_on_nf4_experts_trains_and_checkpoints_no_base_weight(worlds: Callable[[int], World], tmp_path: Path,
                                                                   ranks: int, layout: list[str]) -> None:
    """Expert parallelism over 4 ranks: each EP rank's 2 experts, each expert's rows sharded over 2 ranks. The
    checkpoint's model signature is the one-process model's, so it resumes at another EP size or none."""
    train_in(worlds(ranks), TINY_MOE, f"output_dir={tmp_path}", *layout, *MOE)
    run_dir = tmp_path / "tiny-moe"
    _assert_trained_on_nf4(run_dir, EXPERTS_IN_NF4, 0.97)
    step = run_dir / "checkpoints" / (run_dir / "checkpoints" / "LATEST").read_text().strip()
    cfg = job_of(step)
    cfg.dist.expert_parallel = 1
    cfg.dist.strategy = "none"
    one, _, _ = build_and_wrap(cfg, dist.init(cfg.dist), precision.resolve(cfg, torch.device("cpu")), None,
                               source_room.load_tokenizer(cfg.model, None))
    assert read_trainer_state(step)["model_signature"] == model_signature(one)


def test_the_merged_export_computes_what_the_nf4_model_with_its_adapter_computes(world: World,
                                                                                 tmp_path: Path) -> None:
    # fp32 on every CPU: where auto picks bf16-mixed, both sides compute in bf16; the check is of the merge
    train_in(world, TINY, f"output_dir={tmp_path}", "dist.strategy=fsdp", *NF4, "train.precision=fp32")
    run_dir = tmp_path / "tiny"
    assert frozen_dtype(run_dir) == torch.float32  # env.json's: what the export quantizes the base in again
    _assert_the_merged_export_computes_the_nf4_model(run_dir, tmp_path)

    unmerged = export(run_dir, tmp_path / "unmerged")
    assert not list(unmerged.glob("*.safetensors"))  # the adapter alone: no full-precision copy of the base
    adapter = load_file(unmerged / "adapter" / "adapter_model.safetensors")
    assert adapter and all("lora_" in key for key in adapter)
    assert json.loads((unmerged / "adapter" / "adapter_config.json").read_text())["r"] == 16


def test_the_merged_export_of_nf4_experts_under_fsdp2_computes_what_the_nf4_model_computes(world: World,
                                                                                           tmp_path: Path) -> None:
    train_in(world, TINY_MOE, f"output_dir={tmp_path}", "dist.strategy=fsdp", *MOE)
    run_dir = tmp_path / "tiny-moe"
    _assert_trained_on_nf4(run_dir, EXPERTS_IN_NF4, 0.97)
    _assert_the_merged_export_computes_the_nf4_model(run_dir, tmp_path)


def _assert_the_merged_export_computes_the_nf4_model(run_dir: Path, tmp_path: Path) -> None:
    """`export --merge-lora` loads with from_pretrained and computes what the NF4 model with its adapter does."""
    merged_dir = export(run_dir, tmp_path / "merged", merge_lora=True)
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    step = run_dir / "checkpoints" / (run_dir / "checkpoints" / "LATEST").read_text().strip()
    cfg = job_of(step)
    cfg.dist.strategy = "none"
    info = dist.init(cfg.dist)
    tokenizer = source_room.load_tokenizer(cfg.model, None)
    trained, _, _ = build_and_wrap(cfg, info, precision.resolve(cfg, info.device), None, tokenizer, forward_only=True)
    assert any(quantize.is_nf4(param) for param in trained.parameters())
    weights.load_adapter(trained, adapter_dir(step) / "adapter_model.safetensors")
    ids = torch.randint(3, 200, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = trained(input_ids=ids).logits, merged(input_ids=ids).logits
    assert (want - got).abs().max() < 1e-4 * want.abs().max()


def test_fsdp2_gathers_the_nf4_weights_one_process_holds_whole(world: World, solo: World, tmp_path: Path) -> None:
    """The first step's loss depends on the weights alone: gathered NF4 shards give the NF4 model's own loss."""
    first = [*NF4, "train.max_steps=1", "train.global_batch_size=16", "train.micro_batch_size=8",
             "checkpoint.at_end=false"]
    train_in(solo, TINY, f"output_dir={tmp_path / 'one'}", "dist.strategy=none", *first)
    train_in(world, TINY, f"output_dir={tmp_path / 'two'}", "dist.strategy=fsdp", *first)
    one, two = _losses(tmp_path / "one" / "tiny"), _losses(tmp_path / "two" / "tiny")
    assert one[0] == pytest.approx(two[0], rel=1e-5), (one, two)
