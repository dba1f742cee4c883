"""The families with layers other than attention that mix tokens (linear attention, state-space, short causal
convolutions) and Llama 4's chunked attention: trainyard's default job computes what the family's own eager model
computes on padded rows (one document a row), on padding-free rows whose state layers run each document on its own
(state_layers.py), or refuses with exit 2 saying why; LoRA at its defaults adapts only plain linear maps and trains; a
target naming anything else is refused.

Tolerance: 1e-5 relative, fp32, as in test_families.py (the differences seen are below 1e-6)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from tests.conftest import run_cli
from tests.unit.model.families import BASE, documents
from tests.unit.model.matrix import sgd_step
from tests.unit.model.test_families import CPU, TOLERANCE, packed_loss
from trainyard.config import DataConfig, LoraConfig
from trainyard.data.collate import collate
from trainyard.errors import ModelError
from trainyard.model import collation
from trainyard.model import attention, layers, lora, state_layers
from trainyard.model.documents import model_inputs

HYBRID: dict[str, dict] = {
    "qwen3_next": dict(head_dim=16, num_hidden_layers=4, linear_num_value_heads=4, linear_num_key_heads=2,
                       linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32, shared_expert_intermediate_size=32),
    "llama4_text": dict(head_dim=16, intermediate_size_mlp=96, num_local_experts=4, num_experts_per_tok=1,
                        attention_chunk_size=8),
    "falcon_h1": dict(head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
                      mamba_n_groups=1, mamba_chunk_size=8),
    "lfm2": dict(layer_types=["conv", "full_attention"]),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                  num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_expand=2),
    "nemotron_h": dict(head_dim=16, num_hidden_layers=3, hybrid_override_pattern="M*-", mamba_num_heads=4,
                       mamba_head_dim=16, ssm_state_size=8, n_groups=1, chunk_size=8),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"], num_local_experts=4, num_experts_per_tok=2,
                             shared_intermediate_size=64, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=8,
                             mamba_n_groups=1, mamba_chunk_size=8, mamba_expand=2),
}
"""Tiny configs with each family's layer kinds on; Llama 4's chunks (8) shorter than the documents (13-27)."""
CARRIERS = {"qwen3_next": "Qwen3NextGatedDeltaNet", "falcon_h1": "FalconH1Mixer", "lfm2": "Lfm2ShortConv",
            "jamba": "JambaMambaMixer", "nemotron_h": "NemotronHMamba2Mixer",
            "granitemoehybrid": "GraniteMoeHybridMambaLayer"}
NOT_PLAIN = {"llama4_text": "feed_forward.router", "falcon_h1": "mamba.out_proj", "jamba": "mamba.dt_proj",
             "nemotron_h": "mixer.out_proj", "granitemoehybrid": "mamba.out_proj"}
"""Linear layers LoRA must leave alone: a router whose forward returns a tuple, weights handed to fused kernels."""
STEPS, LR = 2, 0.5


def settings(family: str) -> dict:
    return {"model_type": family, **BASE, **HYBRID[family]}


def build(family: str, implementation: str = "eager", seed: int = 0) -> PreTrainedModel:
    config = AutoConfig.for_model(**settings(family))
    config._attn_implementation = implementation
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def rows() -> list[dict[str, list[int]]]:
    return [{"input_ids": doc.tolist(), "labels": [-100, *doc[1:].tolist()]} for doc in documents()]


def losses(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> list[float]:
    """STEPS plain SGD steps on the batch (the family's own loss: mean over every target): the loss before each."""
    inputs = {**model_inputs(batch, CPU, model.config), "labels": batch["labels"]}  # as the loop feeds it
    seen = []
    for _ in range(STEPS):
        loss = model(**inputs, use_cache=False).loss
        loss.backward()
        sgd_step(model, LR)
        seen.append(loss.item())
    return seen


@pytest.mark.parametrize("family", HYBRID)
def test_the_default_job_computes_the_family_s_eager_model_on_padding_free_rows(family: str) -> None:
    want = losses(build(family), collate(rows(), pad_id=0, padding_free=False))
    model = build(family)
    model.config._attn_implementation = attention.choose("auto", model, CPU)
    assert state_layers.install(model) == (family in CARRIERS) * sum(
        type(m).__name__ == CARRIERS.get(family) for m in model.modules())
    assert collation.padded_rows(model, DataConfig()) is None
    assert collation.model_one_row(model, DataConfig())  # trainyard's defaults: padding-free rows
    got = losses(model, collate(rows(), pad_id=0, padding_free=True))
    assert max(abs(a - b) / b for a, b in zip(got, want)) < TOLERANCE, (got, want)


def test_rows_are_padded_where_the_state_layers_get_no_bounds_saying_why() -> None:
    """sdpa reads the documents from position_ids: the collator's bounds never reach the blocks."""
    model = build("qwen3_next", "sdpa")
    assert state_layers.install(model) == 0
    assert collation.padded_rows(model, DataConfig()) == (
        "qwen3_next has Qwen3NextGatedDeltaNet layers that carry state across documents (under sdpa, whose rows "
        "come without the documents' bounds)")
    assert not collation.model_one_row(model, DataConfig())
    want = losses(build("qwen3_next"), collate(rows(), pad_id=0, padding_free=False))
    got = losses(model, collate(rows(), pad_id=0, padding_free=False))
    assert max(abs(a - b) / b for a, b in zip(got, want)) < TOLERANCE, (got, want)


@pytest.mark.parametrize(("family", "implementation"), [("qwen3_next", "eager"), ("llama4_text", attention.VARLEN)])
def test_the_check_can_fail_one_padding_free_row_joins_the_documents(family: str, implementation: str) -> None:
    """What trainyard's defaults trained before: linear attention carried its state into the next document;
    Llama 4's layers do not give their attention position_ids, so varlen saw the row as one document."""
    want = losses(build(family), collate(rows(), pad_id=0, padding_free=False))[0]
    with torch.no_grad():
        joined = packed_loss(build(family, implementation)).item()
    assert abs(joined - want) / want > 20 * TOLERANCE


def test_llama4_keeps_its_chunks_per_document_only_through_transformers_mask() -> None:
    model = build("llama4_text")
    assert attention.features(model) == [attention.CHUNKED, attention.POSITIONS_NOT_PASSED]
    assert attention.choose("auto", model, CPU) == "sdpa"
    assert attention.choose("auto", model, torch.device("cuda")) == "sdpa"
    for dropping in ("varlen", "flex_attention"):
        with pytest.raises(ModelError, match=rf"{dropping} drops the chunked attention and document isolation .*"
                                             "keep them: sdpa, eager"):
            attention.refuse_dropped(dropping, model)
    with pytest.raises(ModelError, match="varlen drops the chunked attention of llama4_text on padded rows"):
        attention.choose("varlen", model, CPU, packed=False)  # a padded batch's mask may be left out (all ones)


class TokenShift(torch.nn.Module):
    """A layer that mixes tokens in a way trainyard knows nothing of."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.roll(hidden, 1, dims=1)


def test_a_layer_of_no_known_kind_is_refused_on_padding_free_rows() -> None:
    from tests.unit.model.families import build as build_known

    model = build_known("llama", "eager")
    model.model.layers[1].mlp.act_fn = TokenShift()
    assert layers.unknown_layers(model) == ["TokenShift"]
    with pytest.raises(ModelError, match=r"llama has TokenShift layers, which trainyard does not know(.|\n)*"
                                         r"data.padding_free: false"):
        attention.choose("auto", model, CPU)
    assert attention.choose("auto", model, CPU, packed=False) == attention.VARLEN


def _job(tmp_path: Path, family: str) -> str:
    job = tmp_path / f"{family}.yaml"
    config = "\n".join(f"    {key}: {value}" for key, value in settings(family).items() if key != "vocab_size")
    job.write_text(f"model:\n  config:\n{config}\n  tokenizer: builtin:bytes\n")
    return str(job)


def test_the_dry_run_says_which_rows_and_refuses_packed_rows_without_bounds(tmp_path: Path) -> None:
    job = _job(tmp_path, "qwen3_next")
    planned = run_cli("train", job, "--dry-run", "lora.enabled=true")
    assert planned.returncode == 0, planned.stderr[-2000:]
    assert ("state layers     Qwen3NextGatedDeltaNet run each document of the padding-free row on its own"
            in planned.stdout)
    assert "padded rows" not in planned.stdout
    assert "conv1d" not in planned.stdout  # the convolution's kernel is no expert stack
    padded = run_cli("train", job, "--dry-run", "model.attn_implementation=sdpa")
    assert padded.returncode == 0, padded.stderr[-2000:]
    assert ("attention        padded rows: qwen3_next has Qwen3NextGatedDeltaNet layers that carry state across "
            "documents (under sdpa") in padded.stdout
    packed = run_cli("train", job, "--dry-run", "data.packing=true", "data.padding_free=false")
    assert packed.returncode == 2, packed.stderr[-2000:]
    assert "data.packing: rows of several documents, but qwen3_next has Qwen3NextGatedDeltaNet" in packed.stderr


@pytest.mark.parametrize("family", HYBRID)
def test_lora_at_its_defaults_adapts_plain_linear_maps_and_trains(family: str) -> None:
    model = lora.apply_lora(build(family), LoraConfig(), seed=0)
    adapted = {lora._block_relative(name) for name, module in model.named_modules()
               if isinstance(module, lora.LoraLayer)}
    assert NOT_PLAIN.get(family) not in adapted
    assert not [name for name in adapted if name.rsplit(".", 1)[-1] in ("conv1d", "conv")]  # no convolution kernel
    assert adapted & {"self_attn.q_proj", "mixer.q_proj"}
    assert adapted & {"linear_attn.in_proj_qkvz", "mamba.in_proj", "mixer.in_proj", "conv.in_proj"} or (
        family == "llama4_text")
    if family in NOT_PLAIN:
        assert lora.describe_lora_reach(model).endswith(f"; not plain linear maps, left frozen: {NOT_PLAIN[family]}")
    trained = [param.detach().clone() for param in model.parameters() if param.requires_grad]
    first, _ = losses(model, collate(rows(), pad_id=0, padding_free=False))
    assert torch.isfinite(torch.tensor(first))
    moved = [param for param in model.parameters() if param.requires_grad]
    assert any(not torch.equal(a, b) for a, b in zip(trained, moved))


@pytest.mark.parametrize(("family", "target", "why"), [
    ("llama4_text", "router", "Llama4Router's forward is not a plain linear map"),
    ("falcon_h1", "out_proj", "FalconH1Mixer hands its weight to a fused kernel"),
])
def test_an_explicit_target_that_is_not_a_plain_linear_map_is_refused(family: str, target: str, why: str) -> None:
    with pytest.raises(ModelError, match=rf"lora.target_modules: \S*{target} \({why}"):
        lora.apply_lora(build(family), LoraConfig(target_modules=["q_proj", target]), seed=0)



def test_dpo_is_refused_where_a_pair_s_two_responses_would_share_their_state(tmp_path: Path) -> None:
    """A pair is one row of two documents however it is collated: the rejected response would read the chosen."""
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"prompt": "2+2?", "chosen": "4", "rejected": "5"}\n' * 4)
    for padding_free in ("true", "false"):
        refused = run_cli("train", _job(tmp_path, "qwen3_next"), "--dry-run", "train.objective=dpo",
                          f"data.path={pairs}", "lora.enabled=true", f"data.padding_free={padding_free}")
        assert refused.returncode == 2, refused.stderr[-2000:]
        assert "train.objective: dpo puts each pair's chosen and rejected responses in one row, but qwen3_next has " \
               "Qwen3NextGatedDeltaNet layers" in refused.stderr, refused.stderr[-2000:]
        assert "Traceback" not in refused.stderr


def test_llama4_s_nope_temperature_gets_padded_rows() -> None:
    """Llama 4's NoPE layers scale each query by its index in the row from floor_scale tokens on: in one row of
    documents a later document's queries would be scaled as if it began where the row does."""
    def nope(implementation: str = "eager") -> PreTrainedModel:
        config = AutoConfig.for_model(**settings("llama4_text"), no_rope_layers=[1, 0], floor_scale=16,
                                    attn_scale=4.0, initializer_range=0.3)
        config._attn_implementation = implementation
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)

    want = losses(nope(), collate(rows(), pad_id=0, padding_free=False))
    model = nope(attention.choose("auto", nope(), CPU))
    assert collation.padded_rows(model, DataConfig()) == ("llama4_text has Llama4TextAttention (NoPE: queries scaled "
                                                          "by their index in the row) layers that carry state across "
                                                          "documents")
    got = losses(model, collate(rows(), pad_id=0, padding_free=collation.model_one_row(model, DataConfig())))
    assert max(abs(a - b) / b for a, b in zip(got, want)) < TOLERANCE, (got, want)
    joined = losses(nope(), collate(rows(), pad_id=0, padding_free=True))[0]
    assert abs(joined - want[0]) / want[0] > 20 * TOLERANCE  # what one row of documents computed
