"""Seed 000 in miniature: tiny-moe (glm4_moe: routed experts fused into 3-D parameters, a shared
expert, a dense first layer) trains with LoRA under FSDP2 on 2 ranks, and its adapters, the
routed experts' included, survive lite and full checkpoints, a SIGKILL and an export."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from torch.distributed.checkpoint import FileSystemReader
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import SEED, TINY_MOE, assert_ok, events, trainyard
from tests.dist.checkpoint_helpers import (
    EVERY,
    LORA_FSDP,
    STEPS,
    adapter_tensors,
    assert_same_tensors,
    dcp_adapter_tensors,
    events_of_last_run,
    kill_tree,
    last_step,
    resumed_events,
    start,
    train_args,
    wait_for_step,
)
from tests.dist.test_checkpoint_export import greedy, logits, trained_model
from tests.dist.test_checkpoint_resume import assert_same_final_weights
from trainyard.checkpoint.export import export
from trainyard.checkpoint.save import committed, latest_full, step_dir
from trainyard.model.lora import describe_lora_reach

pytestmark = pytest.mark.dist

EXPERT_ADAPTER = ".mlp.experts."
# The killed run saves full checkpoints on another rhythm than the reference (every 4 steps), so its
# lite saves (every 4) land on steps where the reference holds DCP shards to compare them with.
KILLED_FULL_EVERY = 6
KILLED_LITE_EVERY = 4


def expert_keys(tensors: dict[str, torch.Tensor]) -> list[str]:
    return [name for name in tensors if EXPERT_ADAPTER in name]


def assert_written_by_both_ranks(step: Path, names: list[str]) -> None:
    """Each expert adapter is stored as two shards, one per rank: a comparison covers both ranks' values."""
    metadata = FileSystemReader(str(step)).read_metadata().state_dict_metadata
    for name in names:
        key = "model." + name.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default.")
        assert len(metadata[key].chunks) == 2, (key, metadata[key].chunks)


def test_tiny_moe_trains_with_lora_on_the_routed_experts(moe_reference: Path) -> None:
    log = (moe_reference / "logs" / "rank-0.log").read_text()
    assert "4 expert parameters (2 layers × mlp.experts." in log, log[-2000:]
    losses = [e["loss"] for e in events(moe_reference, "train")]
    assert len(losses) == STEPS and max(losses[-4:]) < min(losses[:4]), losses
    final = adapter_tensors(step_dir(moe_reference / "checkpoints", STEPS))
    trained_b = [name for name in expert_keys(final) if ".lora_B." in name]
    assert len(trained_b) == 4 and all(final[name].abs().sum() > 0 for name in trained_b), trained_b


def test_full_checkpoints_hold_every_ranks_adapter_experts_included(moe_reference: Path) -> None:
    """Each adapter file (gathered from the FSDP2 shards) equals what every rank wrote into DCP."""
    saved = committed(moe_reference / "checkpoints")
    assert [p.name for p in saved] == [f"step-{s:08d}" for s in range(EVERY, STEPS + 1, EVERY)]
    for path in saved:
        adapter = adapter_tensors(path)
        assert len(expert_keys(adapter)) == 8, sorted(adapter)
        assert_written_by_both_ranks(path, expert_keys(adapter))
        assert_same_tensors(adapter, dcp_adapter_tensors(path))


def test_sigkill_then_rerun_ends_bitwise_identical_and_lite_saves_match(
    tmp_path: Path, moe_reference: Path, draw_step
) -> None:
    args = train_args(
        tmp_path, *LORA_FSDP, f"checkpoint.every_steps={KILLED_FULL_EVERY}",
        f"checkpoint.lite_every_steps={KILLED_LITE_EVERY}", "checkpoint.keep_last=6", config=TINY_MOE,
    )
    run_dir, checkpoints = tmp_path / "tiny-moe", tmp_path / "tiny-moe" / "checkpoints"
    kill_at = draw_step(KILLED_FULL_EVERY + 1, STEPS - KILLED_FULL_EVERY)
    proc = start(args)
    seen = wait_for_step(proc, run_dir, kill_at)
    kill_tree(proc)
    assert proc.returncode == -signal.SIGKILL and last_step(run_dir) < STEPS
    saved = latest_full(checkpoints)

    assert_ok(trainyard(*args))

    context = f"killed at step >= {kill_at} (saw {seen}, TRAINYARD_TEST_SEED={SEED}), last committed {saved}"
    assert [e["path"] for e in resumed_events(run_dir)] == ([str(saved)] if saved else []), context
    first_step = int(saved.name[5:]) + 1 if saved else 1
    assert [e["step"] for e in events_of_last_run(run_dir, "train")] == list(range(first_step, STEPS + 1))
    assert_same_final_weights(run_dir, moe_reference, lora=True)
    lite = [int(p.name[5:]) for p in committed(checkpoints, "lite")]
    assert lite == [s for s in range(KILLED_LITE_EVERY, STEPS, KILLED_LITE_EVERY) if s % KILLED_FULL_EVERY], context
    for step in lite:  # the adapter alone, gathered at that step: what the reference's ranks wrote to DCP then
        adapter = adapter_tensors(step_dir(checkpoints, step))
        assert expert_keys(adapter), sorted(adapter)
        assert_same_tensors(adapter, dcp_adapter_tensors(step_dir(moe_reference / "checkpoints", step)))
    for path in committed(checkpoints):
        assert_same_tensors(adapter_tensors(path), dcp_adapter_tensors(path))


def test_export_loads_in_transformers_and_peft_and_computes_the_trained_logits(
    tmp_path: Path, moe_reference: Path
) -> None:
    want_model, tokenizer = trained_model(moe_reference)
    want = logits(want_model, tokenizer)

    unmerged = export(moe_reference, tmp_path / "unmerged")
    base = AutoModelForCausalLM.from_pretrained(unmerged).eval()
    assert not torch.equal(logits(base, tokenizer), want), "the adapter changes nothing: the test would prove nothing"
    adapted = PeftModel.from_pretrained(base, str(unmerged / "adapter")).eval()
    assert "4 expert parameters" in describe_lora_reach(adapted)
    exported_tokenizer = AutoTokenizer.from_pretrained(unmerged)
    # training ran the experts' adapters as grouped low-rank products, PEFT's own forward folds W + B·A: equal up to
    # rounding (tests/unit/model/test_moe_lora.py), so within fp32 tolerance rather than bitwise
    torch.testing.assert_close(logits(adapted, exported_tokenizer), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(greedy(adapted, exported_tokenizer), greedy(want_model, tokenizer))

    merged = export(moe_reference, tmp_path / "merged", merge_lora=True)
    plain = AutoModelForCausalLM.from_pretrained(merged).eval()
    assert not any("lora" in name for name in plain.state_dict())
    torch.testing.assert_close(logits(plain, AutoTokenizer.from_pretrained(merged)), want, rtol=1e-5, atol=1e-5)

