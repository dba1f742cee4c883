"""The one FLOP counter (MFU's and the estimate's) against what torch counts, FlopCounterMode, over a real forward
and backward of tiny models of the families users fine-tune: padding-free and padded batches, full fine-tuning and
LoRA, dense and MoE (shared experts, a dense first layer, expert biases), MLA head sizes, sliding windows.

FlopCounterMode counts the matmuls (mm, addmm) and, under eager or trainyard's varlen attention on a CPU, the
scores and weighted values as bmm over each document's full length x length square (sdpa on a CPU it does not
count at all). The counter counts the causal pairs a query sees, so torch's attention is restated per attended
pair before the two are compared. Routed experts run transformers' eager experts, one matmul per expert over the
tokens the router sent it: FlopCounterMode has no formula for the grouped_mm they run by default.

Measured: full fine-tuning matches to the FLOP (ratio 1.0 for matmuls and attention alike, every family); with
LoRA (4 layers) the counter has 3-4% more matmul FLOPs than torch (1.031 dense, 1.040 MoE): exactly the input
gradients of the first block's q/k/v projections and their adapters, which frozen embeddings spare."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from tests.unit.model.families import build, documents
from trainyard import hardware
from trainyard.config import LoraConfig
from trainyard.data.collate import padded_batch, padding_free_batch
from trainyard.estimate.arch import KNOWN_ARCHITECTURES
from trainyard.model import attention, lora
from trainyard.model import documents as documents_room

COUNTED = {
    "llama": "dense, tied embeddings: the lm_head counts once",
    "qwen3": "head_dim apart from hidden / heads, a sliding window on one layer",
    "mixtral": "top-2 of 4 routed experts (num_local_experts), windows on every layer",
    "qwen3_moe": "top-2 of 4 routed experts (num_experts)",
    "glm4_moe": "a shared expert, a dense first layer, sigmoid routing",
    "deepseek_v3": "MLA: 24-wide query/key heads, 16-wide value heads",
    "gpt_oss": "expert biases, attention sinks, alternating windows",
}
ATTENTION_ONLY = ["q_proj", "k_proj", "v_proj", "o_proj"]
"""Adapters a MoE's fused experts do not take over (PEFT moves gate/up/down_proj targets onto them)."""
LORA_SPARES = 0.05
"""LoRA's counter / torch for matmuls: above 1 by the first block's q/k/v input gradients (see the docstring)."""


def tiny(family: str, implementation: str = attention.VARLEN, **changes: object) -> PreTrainedModel:
    model = build(family, implementation, **changes)
    model.config._experts_implementation = "eager"
    return model


def rows() -> list[dict[str, list[int]]]:
    return [{"input_ids": ids.tolist(), "labels": ids.tolist()} for ids in documents()]


def lengths() -> list[int]:
    return [len(ids) for ids in documents()]


def counted(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(matmul FLOPs, attention FLOPs) torch counts over one forward and backward of the batch, given to the model
    as training gives it (model_inputs: the documents' bounds made on the host)."""
    inputs = {**documents_room.model_inputs(batch, torch.device("cpu"), model.config), "labels": batch["labels"]}
    with FlopCounterMode(display=False) as counter:
        model(**inputs).loss.backward()
    flops = counter.get_flop_counts()["Global"]  # scores: baddbmm (varlen's short documents) or bmm; values: bmm
    scores_and_values = flops.get(torch.ops.aten.bmm, 0) + flops.get(torch.ops.aten.baddbmm, 0)
    return counter.get_total_flops() - scores_and_values, scores_and_values


def causal_share(shape: hardware.FlopShape, computed: list[int]) -> float:
    """The attended pairs of every layer over the full squares torch counts."""
    pairs = sum(hardware.attended_pairs(n, window) for n in computed for window in shape.windows)
    return pairs / (len(shape.windows) * sum(n * n for n in computed))


def ratios(model: torch.nn.Module, batch: dict[str, torch.Tensor], computed: list[int]) -> tuple[float, float]:
    """(counter / torch) for the matmuls and for attention, the counter given the documents the batch computes."""
    shape = hardware.flop_shape(model)
    matmuls, scores_and_values = counted(model, batch)
    attention_flops = 3 * hardware.attention_flops(shape, computed)  # forward, and twice that in backward
    matmul_flops = hardware.training_flops(shape, computed) - attention_flops
    return matmul_flops / matmuls, attention_flops / (scores_and_values * causal_share(shape, computed))


@pytest.mark.parametrize("family", COUNTED)
def test_full_fine_tuning_of_a_padding_free_row_counts_what_torch_counts(family: str) -> None:
    assert ratios(tiny(family), padding_free_batch(rows()), lengths()) == pytest.approx((1.0, 1.0), rel=1e-9)


def test_a_padded_batch_computes_every_row_at_the_longest() -> None:
    """What a padded batch computes; the training loop passes the real lengths, so padding lowers MFU."""
    batch = padded_batch(rows(), pad_id=0)
    computed = [batch["input_ids"].shape[1]] * len(rows())
    assert ratios(tiny("llama", "eager"), batch, computed) == pytest.approx((1.0, 1.0), rel=1e-9)


@pytest.mark.parametrize(("family", "targets"), [("llama", "all-linear"), ("qwen3_moe", ATTENTION_ONLY)])
def test_lora_takes_no_weight_gradient_of_a_frozen_weight(family: str, targets: str | list[str]) -> None:
    """Adapters on linear layers only: PEFT folds an adapter on fused experts into W + BA every forward, whose
    weight gradient it then computes (hardware work, not model FLOPs)."""
    adapters = LoraConfig(r=4, target_modules=targets, target_parameters=[])
    model = lora.apply_lora(tiny(family, num_hidden_layers=4), adapters, seed=0)
    matmuls, scores_and_values = ratios(model, padding_free_batch(rows()), lengths())
    assert scores_and_values == pytest.approx(1.0, rel=1e-9)
    assert 1.0 <= matmuls < 1 + LORA_SPARES


@pytest.mark.parametrize(("length", "window"), [(20, None), (20, 8), (8, 8), (5, 8), (1, 1)])
def test_attended_pairs_are_the_keys_a_causal_windowed_query_sees(length: int, window: int | None) -> None:
    seen = sum(1 for query in range(length) for key in range(query + 1) if window is None or key > query - window)
    assert hardware.attended_pairs(length, window) == seen


def test_glm_air_counts_the_experts_a_token_runs_through_and_its_attention_width() -> None:
    """GLM-4.5-Air: 106B parameters, about 12B of them (the lm_head too) a token runs through; its attention is
    96 heads x 128 wide, three times its hidden size (4096). All parameters would have put MFU above 1."""
    settings = dict(KNOWN_ARCHITECTURES["zai-org/GLM-4.5-Air"])
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shape = hardware.flop_shape(model)
    assert sum(p.numel() for p in model.parameters()) > 100e9
    assert 12e9 < shape.active < 13e9 and shape.trainable == shape.active
    assert shape.heads * shape.qk_head_dim == 12288 and shape.windows == (None,) * 46
    per_token = hardware.flops_per_token(shape, [1000, 3000])
    assert per_token == pytest.approx(6 * shape.active + 6 * 2 * 12288 * (1000 * 1001 + 3000 * 3001) / 2 / 4000 * 46)


@pytest.mark.parametrize(
    ("gres_type", "kind"),
    [("h100", "h100-80gb"), ("H100-80GB", "h100-80gb"), ("nvidia_h100_80gb_hbm3", "h100-80gb"),
     ("nvidia_h100_pcie", "h100-pcie"), ("h200", "h200"), ("nvidia_a100-sxm4-80gb", "a100-80gb"),
     ("nvidia_a100_80gb_pcie", "a100-80gb"), ("a100", "a100-40gb"), ("nvidia_a100-pcie-40gb", "a100-40gb"),
     ("l4", "l4"), ("nvidia_l4", "l4"), ("l40s", None), ("nvidia_h100_nvl", None), ("gh200", None), ("v100", None)],
)
def test_slurm_gres_types_name_a_device_kind_only_where_one_fits(gres_type: str, kind: str | None) -> None:
    assert hardware.kind_of_gres_type(gres_type) == kind
    assert kind is None or kind in hardware.GPUS
