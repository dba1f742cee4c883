"""Exports load in plain transformers/PEFT and compute what the trained model computes;
`trainyard eval` scores a checkpoint as the training run's own final eval did."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import TINY, assert_ok, events, train_in, trainyard
from tests.dist.checkpoint_helpers import COMMON, FULL_FSDP, LORA_DDP, STEPS, model_tensors
from trainyard.model import build as model_room
from trainyard.model import lora as lora_room
from trainyard.model import source as source_room
from trainyard.checkpoint.save import step_dir
from trainyard.config_file import load_config
from trainyard.checkpoint.export import export
from trainyard.data.chat import chat_template_for, renderer

pytestmark = pytest.mark.dist

PROMPTS = ["<|user|>2024-02-29<|assistant|>", "<|user|>1999-12-31<|assistant|>"]


def trained_model(run_dir: Path) -> tuple[torch.nn.Module, object]:
    """The model as training holds it at the end: the job's base, LoRA as the trainer adds
    it, and every trained tensor of the final full (DCP) checkpoint loaded on top."""
    cfg = load_config(str(run_dir / "config.yaml"))
    tokenizer = source_room.load_tokenizer(cfg.model, None)
    model = model_room.load_model(cfg.model, None, tokenizer, torch.float32, cfg.train.seed)
    if cfg.lora.enabled:
        model = lora_room.apply_lora(model, cfg.lora, cfg.train.seed)
    trained = model_tensors(step_dir(run_dir / "checkpoints", STEPS))
    result = model.load_state_dict(trained, strict=False)
    assert not result.unexpected_keys
    return model.eval(), tokenizer


def logits(model: torch.nn.Module, tokenizer: object) -> torch.Tensor:
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        return model(**batch).logits


def greedy(model: torch.nn.Module, tokenizer: object) -> torch.Tensor:
    batch = tokenizer(PROMPTS[:1], return_tensors="pt")
    return model.generate(**batch, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)


def test_lora_exports_merged_and_unmerged_compute_what_training_computed(tmp_path: Path, lora_reference: Path) -> None:
    want_model, tokenizer = trained_model(lora_reference)
    want = logits(want_model, tokenizer)

    unmerged = export(step_dir(lora_reference / "checkpoints", STEPS), tmp_path / "unmerged")
    base = AutoModelForCausalLM.from_pretrained(unmerged)
    adapted = PeftModel.from_pretrained(base, str(unmerged / "adapter")).eval()
    exported_tokenizer = AutoTokenizer.from_pretrained(unmerged)
    assert torch.equal(logits(adapted, exported_tokenizer), want)
    assert torch.equal(greedy(adapted, exported_tokenizer), greedy(want_model, tokenizer))

    merged = export(lora_reference, tmp_path / "merged", merge_lora=True)
    assert not (merged / "adapter").exists() and not (merged / "adapter_config.json").exists()
    plain = AutoModelForCausalLM.from_pretrained(merged).eval()
    assert not any("lora" in name for name in plain.state_dict())
    torch.testing.assert_close(logits(plain, AutoTokenizer.from_pretrained(merged)), want, rtol=1e-5, atol=1e-5)


def test_full_finetune_export_holds_the_trained_weights(tmp_path: Path, full_reference: Path) -> None:
    out = export(full_reference, tmp_path / "full")
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    trained = model_tensors(step_dir(full_reference / "checkpoints", STEPS))
    state = exported.state_dict()
    assert all(torch.equal(state[name], tensor) for name, tensor in trained.items())
    want_model, tokenizer = trained_model(full_reference)
    assert torch.equal(logits(exported, AutoTokenizer.from_pretrained(out)), logits(want_model, tokenizer))


def figures(stdout: str) -> dict[str, str]:
    return dict(line.split(" ", 1) for line in stdout.strip().splitlines())


@pytest.mark.parametrize(
    ("reference", "mode", "nproc"), [("lora_reference", LORA_DDP, 1), ("full_reference", FULL_FSDP, 2)]
)
def test_eval_of_a_checkpoint_matches_the_runs_final_eval(
    reference: str, mode: list[str], nproc: int, request: pytest.FixtureRequest
) -> None:
    run_dir: Path = request.getfixturevalue(reference)
    result = trainyard(
        "eval",
        TINY,
        f"output_dir={run_dir.parent}",
        *COMMON,
        *mode,
        "--checkpoint",
        str(run_dir),
        "--nproc",
        str(nproc),
    )
    assert_ok(result)
    got = figures(result.stdout)
    want = events(run_dir, "eval")[-1]
    assert got["checkpoint"] == str(step_dir(run_dir / "checkpoints", STEPS))
    assert int(got["eval_tokens"]) == want["eval_tokens"]
    assert float(got["eval_loss"]) == pytest.approx(want["eval_loss"], rel=1e-6)
    assert float(got["eval_ppl"]) == pytest.approx(want["eval_ppl"], rel=1e-6)


REASONING = [
    {"role": "system", "content": "Add."},
    {"role": "user", "content": "4+1?"},
    {"role": "assistant", "content": "<think>4+1</think>5"},
    {"role": "user", "content": "5+1?"},
    {"role": "assistant", "content": "<think>\n5+1\n</think>\n\n6"},
]


def test_exports_and_adapter_folders_render_chat_as_the_job_trained(tmp_path: Path, solo) -> None:
    """A LoRA job on chat rows with qwen3 and enable_thinking: false: the export's tokenizer and each adapter
    folder's render a conversation, with and without the generation prompt, as the job's renderer did."""
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": REASONING[:i]}) + "\n" for i in (3, 5)) * 4)
    train_in(
        solo, TINY, f"output_dir={tmp_path}", f"data.path={data}", "data.chat_template=qwen3",
        "data.chat_template_kwargs.enable_thinking=false", "data.max_length=192", "lora.enabled=true",
        "train.max_steps=2", "train.micro_batch_size=2", "checkpoint.lite_every_steps=1", "checkpoint.every_steps=0",
        "eval.every_steps=0", "eval.at_end=false", "log.progress=false", "log.tensorboard=false",
    )
    run_dir = tmp_path / "tiny"
    cfg = load_config(str(run_dir / "config.yaml"))
    render = renderer(source_room.load_tokenizer(cfg.model, None), chat_template_for(cfg.data))
    lite, full = (step_dir(run_dir / "checkpoints", step) / "adapter" for step in (1, 2))
    for folder in (export(run_dir, tmp_path / "export"), lite, full):
        saved = AutoTokenizer.from_pretrained(folder)
        for prompt in (False, True):
            assert saved.apply_chat_template(REASONING, tokenize=False, add_generation_prompt=prompt) == render(
                REASONING, prompt
            )
    assert render(REASONING, True).endswith("<think>\n\n</think>\n\n")  # the kwarg is in what they render
