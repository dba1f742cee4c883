"""model.quantize nf4: the frozen base in 4-bit NF4 under LoRA; where it cannot apply, the job is refused."""

from __future__ import annotations

from tests.conftest import TINY, run_cli


def test_nf4_without_lora_is_refused_naming_the_field_and_the_fix() -> None:
    done = run_cli("train", TINY, "model.quantize=nf4", "lora.enabled=false")
    assert done.returncode == 2, done.stderr
    assert "model.quantize" in done.stderr and "set lora.enabled: true" in done.stderr
    assert "Traceback" not in done.stderr


def test_nf4_with_peft_s_expert_fold_is_refused() -> None:
    done = run_cli("train", TINY, "model.quantize=nf4", "lora.enabled=true", "lora.moe_adapter=peft")
    assert done.returncode == 2, done.stderr
    assert "lora.moe_adapter" in done.stderr and "set lora.moe_adapter: grouped" in done.stderr
