"""tiny-moe trained with dist.expert_parallel 2 (each EP rank holds 2 of the 4 routed experts of each MoE layer; on 4
ranks FSDP2 shards them again over 2) against the same job without EP, LoRA and full fine-tuning, fp32: the same
losses, gradient norms and expert load at every step, the same weights at the end, in checkpoints laid out as
without EP (export and `trainyard eval` read them so); and a run stopped at a full checkpoint then resumed ends
bitwise equal to the uninterrupted one.

Tolerance: the expert counts come out equal, the per-step losses equal under LoRA and within 3e-8 relative under
full fine-tuning; gradient norms differ by < 2e-7 relative and final weights by < 1e-6 (measured: 1.8e-7 on the
adapter), from the grouped products' rows per call and the order of the gradient sums. A misplaced expert or a
wrong gradient factor moves them by orders of magnitude more."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

from tests.conftest import TINY_MOE, events, run_script, train_in
from tests.dist.checkpoint_helpers import adapter_tensors, assert_same_tensors, dcp_adapter_tensors, model_tensors
from tests.world import World
from trainyard.checkpoint.export import export
from trainyard.checkpoint.save import step_dir

pytestmark = [pytest.mark.dist, pytest.mark.worlds]

STEPS, EVERY = 4, 2
JOB = [
    f"train.max_steps={STEPS}", f"checkpoint.every_steps={EVERY}", "checkpoint.keep_last=4", "eval.every_steps=0",
    "eval.at_end=true", "log.every_steps=1", "log.progress=false", "log.tensorboard=false", "train.precision=fp32",
]
EP = "dist.expert_parallel=2"
LOSS_REL, GRAD_NORM_REL = 1e-6, 1e-6
WEIGHT_ABS = 1e-5
"""AdamW at lr 3e-3 moves an element whose gradient is at fp32 rounding (summed in another order under EP) by a
share of lr: after 4 steps a few 1e-6 apart where the rows of step 1 make such elements, far below a step's 3e-3."""


def train(world: World, out: Path, *overrides: str) -> Path:
    train_in(world, TINY_MOE, f"output_dir={out}", *JOB, *overrides)
    return out / "tiny-moe"


@pytest.fixture(scope="module", params=[("lora", 2), ("full", 2), ("lora", 4), ("full", 4)],
                ids=["lora", "full", "lora-4-ranks", "full-4-ranks"])
def runs(request: pytest.FixtureRequest, worlds, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Without EP, with EP, and with EP stopped after the first full checkpoint then run again (a resume). On 4
    ranks EP=2 leaves 2 ranks of the shard dimension, over which FSDP2 shards each EP rank's experts again."""
    kind, nproc = request.param
    world = worlds(nproc)
    mode = [f"lora.enabled={str(kind == 'lora').lower()}"]
    out = tmp_path_factory.mktemp(f"ep-{kind}-{nproc}")
    stopped = out / "resumed"
    train(world, stopped, *mode, EP, f"train.max_steps={EVERY}")
    return {
        "mode": kind,
        "world": world,
        "overrides": mode,
        "plain": train(world, out / "plain", *mode),
        "ep": train(world, out / "ep", *mode, EP),
        "resumed": train(world, stopped, *mode, EP),
    }


def final_weights(run_dir: Path, lora: bool) -> dict[str, torch.Tensor]:
    final = step_dir(run_dir / "checkpoints", STEPS)
    return adapter_tensors(final) if lora else model_tensors(final)


def test_each_step_has_the_loss_gradient_norm_and_expert_load_of_the_run_without_ep(runs: dict) -> None:
    plain, ep = events(runs["plain"], "train"), events(runs["ep"], "train")
    assert [e["step"] for e in ep] == [e["step"] for e in plain] == list(range(1, STEPS + 1))
    for want, got in zip(plain, ep, strict=True):
        assert abs(got["loss"] - want["loss"]) <= LOSS_REL * want["loss"], (want["step"], got["loss"], want["loss"])
        assert abs(got["grad_norm"] - want["grad_norm"]) <= GRAD_NORM_REL * want["grad_norm"], want["step"]
        assert got["expert_load"] == want["expert_load"], want["step"]
        assert len(got["expert_load"]["tokens_per_expert"][0]) == 4, "the load counts every expert, not a rank's"


def test_the_final_weights_are_those_of_the_run_without_ep_in_the_same_layout(runs: dict) -> None:
    lora = runs["mode"] == "lora"
    want, got = final_weights(runs["plain"], lora), final_weights(runs["ep"], lora)
    assert got.keys() == want.keys() and any(".experts." in name for name in want)
    for name, tensor in want.items():
        assert got[name].shape == tensor.shape, name
        assert (got[name] - tensor).abs().max().item() <= WEIGHT_ABS, name
    assert all(want[name].abs().sum() > 0 for name in want if ".experts." in name), "an expert did not train"


def test_a_resumed_run_ends_bitwise_equal_to_the_uninterrupted_one(runs: dict) -> None:
    resumed = [e for e in events(runs["resumed"], "system") if e.get("event") == "resumed"]
    assert [e["step"] for e in resumed] == [EVERY], resumed
    lora = runs["mode"] == "lora"
    assert_same_tensors(final_weights(runs["resumed"], lora), final_weights(runs["ep"], lora))


def test_evaluation_during_training_and_trainyard_eval_of_the_checkpoint_give_the_run_without_eps_loss(
    runs: dict, tmp_path: Path
) -> None:
    """The final eval of the EP run (forward passes through the token exchange) and `trainyard eval` of its last
    checkpoint with the job's config (built without EP: the checkpoint holds whole expert stacks and a PEFT adapter
    file) both give the eval loss of the run without EP."""
    want = events(runs["plain"], "eval")[-1]["eval_loss"]
    assert abs(events(runs["ep"], "eval")[-1]["eval_loss"] - want) <= LOSS_REL * want
    out = tmp_path / "figures.json"
    final = step_dir(runs["ep"] / "checkpoints", STEPS)
    run_script(runs["world"], "evaluate_checkpoint", str(out), TINY_MOE, str(final), *JOB, *runs["overrides"], EP,
               f"output_dir={tmp_path}")
    assert abs(json.loads(out.read_text())["eval_loss"] - want) <= LOSS_REL * want


def test_export_of_the_ep_checkpoint_is_the_model_of_the_run_without_ep(runs: dict, tmp_path: Path) -> None:
    """`trainyard export` (LoRA merged) reads an EP checkpoint as one without EP: the same whole model."""
    lora = runs["mode"] == "lora"
    want = load_file(export(runs["plain"], tmp_path / "plain", merge_lora=lora) / "model.safetensors")
    got = load_file(export(runs["ep"], tmp_path / "ep", merge_lora=lora) / "model.safetensors")
    assert got.keys() == want.keys() and any(".experts." in name for name in want)
    for name, tensor in want.items():
        assert (got[name].float() - tensor.float()).abs().max().item() <= WEIGHT_ABS, name


def test_every_ep_rank_writes_its_experts_into_the_full_checkpoint(runs: dict) -> None:
    """Each expert tensor in DCP is in one chunk per rank (EP rank, and FSDP2 shard on 4 ranks); under LoRA the
    adapter file (gathered from every EP rank's experts) is what DCP holds, lora_B seen as [out, r, experts] there."""
    final = step_dir(runs["ep"] / "checkpoints", STEPS)
    metadata = FileSystemReader(str(final)).read_metadata().state_dict_metadata
    experts = [key for key in metadata if key.startswith("model.") and ".experts." in key]
    ranks = runs["world"].nproc
    assert experts and all(len(metadata[key].chunks) == ranks for key in experts), experts
    if runs["mode"] == "lora":
        in_dcp = {name: t.reshape(t.shape[0], -1) for name, t in dcp_adapter_tensors(final).items()}
        assert_same_tensors(adapter_tensors(final), in_dcp)
