"""The quickstart on the real pretrained SmolLM2-135M-Instruct: LoRA, 2 DDP processes on CPU."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests.conftest import assert_ok, events, trainyard

pytestmark = pytest.mark.e2e


SHORTER = ["train.max_steps=6", "eval.subset_size=20", "data.synthetic_train_size=400"]
"""The built-in job's mechanics on a shorter run: the task is learnt by step 4 (train loss ~0.003 there in the
15-step run), so 6 steps still cross the bar below; 20 held-out dates (10 a rank) against 40, 400 rows tokenized
against 2000. The full run's held-out exact match (0% -> 97.5%) is what `make demo` and the benchmarks measure."""


def test_quickstart_learns_the_task_and_saves_a_peft_adapter(tmp_path: Path) -> None:
    result = trainyard("train", f"output_dir={tmp_path}", *SHORTER, timeout=1200, fresh=True)  # as `make demo` runs it
    assert_ok(result)
    run_dir = tmp_path / "quickstart"
    summary = json.loads((run_dir / "summary.json").read_text())
    before, after = summary["baseline_eval_accuracy"], summary["final_eval_accuracy"]
    assert before <= 0.2, f"untuned model already scores {before}"
    assert after >= before + 0.4, f"accuracy {before} -> {after}"
    assert "held-out exact match before training" in result.stderr
    assert summary["world_size"] == 2 and summary["strategy"] == "ddp"
    assert summary["final_train_loss"] < summary["first_train_loss"]
    train = events(run_dir, "train")
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s"} <= set(train[0])
    # its memory settles in over the first steps (bf16 kernels for each row length): no leak alarm for that
    assert [e for e in events(run_dir, "system") if e.get("event") == "memory_growth"] == []
    # what it planned a rank's peak at (the estimate `train` and its dry run decide a fit by) is what it held: the
    # processes' high-water marks, the end's evaluation and generation included (0.99-1.00 in fp32 and bf16-mixed)
    planned = re.search(r"planned peak ([\d,]+) MiB a rank", (run_dir / "logs" / "rank-0.log").read_text())
    assert planned is not None
    held = summary["peak_memory_bytes"] / (float(planned[1].replace(",", "")) * 2**20)
    assert abs(held - 1) <= 0.15, held

    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainyard.model.source import default_model_cache

    adapter = run_dir / "checkpoints" / f"step-{summary['steps']:08d}" / "adapter"
    assert (adapter / "adapter_model.safetensors").is_file()
    base_dir = next(default_model_cache().glob("SmolLM2-135M-Instruct*"))
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), str(adapter))
    prompt = tokenizer.apply_chat_template(
        [
            {
                "role": "user",
                "content": "Rewrite the date 1987-11-04 in the form 'Month D, YYYY'. Reply with the date only.",
            }
        ],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True).strip()
    assert answer == "November 4, 1987"
