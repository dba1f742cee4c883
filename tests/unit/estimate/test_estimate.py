"""`trainyard estimate`: the memory breakdown adds up to the meta model's parameters, sharding divides the
state, checkpointing lowers activations, the bandwidth and Young/Daly formulas, the JSON, the seed jobs'
verdicts, and bad options through the real CLI. Nothing here downloads: hub models come from the known table."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.conftest import REPO, TINY, run_cli
from tests.unit.model.families import settings
from trainyard import estimate, hardware
from trainyard.config_file import load_config
from trainyard.errors import OptionError
from trainyard.estimate import timing as estimate_time

MISTRAL = str(REPO / "configs" / "mistral7b-lora-ddp.yaml")
TINY_PARAMS = 90_816  # tiny.yaml's Llama with the byte tokenizer (as `train --dry-run` prints it)


def run(overrides: list[str], gpu: str = "h100-80gb", per_node: int = 1, nodes: int = 1) -> estimate.Estimate:
    return estimate.estimate(load_config(TINY, overrides), estimate.Hardware(gpu, per_node, nodes))


def test_full_fine_tune_weights_are_every_parameter_in_the_master_dtype() -> None:
    result = run(["train.precision=fp32"])
    memory = result.memory
    assert result.total_params == result.trainable_params == TINY_PARAMS
    assert memory.weights == TINY_PARAMS * 4 and memory.lora_adapters == 0
    assert memory.gradients == TINY_PARAMS * 4
    assert memory.optimizer == TINY_PARAMS * 8  # AdamW: two fp32 moments
    assert memory.mixed_precision_copies == 0  # fp32 computes in fp32: no autocast copies


def test_lora_splits_frozen_bf16_base_from_fp32_adapters() -> None:
    result = run(["lora.enabled=true", "train.precision=bf16-mixed", "model.dtype=bfloat16"])
    memory = result.memory
    frozen = result.total_params - result.trainable_params
    assert 0 < result.trainable_params < result.total_params
    assert result.total_params > TINY_PARAMS  # the adapters are counted too
    assert memory.weights == frozen * 2 and memory.lora_adapters == result.trainable_params * 4
    assert memory.gradients == result.trainable_params * 4 and memory.optimizer == result.trainable_params * 8
    assert memory.mixed_precision_copies == result.trainable_params * 2  # autocast's bf16 copies of adapters


def test_fsdp_divides_the_state_by_the_world_and_hsdp_by_its_shard_group() -> None:
    ddp = run(["dist.strategy=ddp"], per_node=4).memory
    fsdp = run(["dist.strategy=fsdp"], per_node=4).memory
    hsdp = run(["dist.strategy=hsdp"], per_node=4, nodes=2)
    assert ddp.ddp_buckets == ddp.gradients and fsdp.ddp_buckets == 0
    for part in ("weights", "gradients", "optimizer"):
        assert getattr(fsdp, part) == pytest.approx(getattr(ddp, part) / 4)
    assert hsdp.layout.shard == 4 and hsdp.memory.weights == pytest.approx(fsdp.weights)
    assert fsdp.fsdp_buffers > 0 and ddp.fsdp_buffers == 0
    assert fsdp.activations == hsdp.memory.activations  # sharding leaves each rank's micro-batch alone


def test_diloco_adds_fp32_outer_state_sharded_over_a_site_under_inner_fsdp() -> None:
    """Round-start weights and outer momentum, fp32, per trainable parameter; inner fsdp shards them (and the
    rest of the state) over the site's ranks, inner ddp keeps DDP's buckets."""
    ddp = run(["dist.strategy=diloco", "train.precision=fp32"], per_node=4, nodes=2)
    fsdp = run(["dist.strategy=diloco", "diloco.inner=fsdp", "train.precision=fp32"], per_node=4, nodes=2)
    assert ddp.layout.shard == 1 and fsdp.layout.shard == 4  # groups: node
    assert ddp.memory.diloco_outer == 2 * TINY_PARAMS * 4 and ddp.memory.ddp_buckets == TINY_PARAMS * 4
    assert fsdp.memory.diloco_outer == pytest.approx(2 * TINY_PARAMS * 4 / 4) and fsdp.memory.ddp_buckets == 0
    assert fsdp.memory.optimizer == pytest.approx(ddp.memory.optimizer / 4) and fsdp.memory.fsdp_buffers > 0
    assert run(["dist.strategy=ddp"], per_node=4, nodes=2).memory.diloco_outer == 0


def test_diloco_with_inner_hsdp_shards_over_a_node_of_a_site_of_several_nodes() -> None:
    """2 sites of 2 nodes of 4: fsdp shards over the site's 8 ranks, hsdp over a node's 4 (or dist.shard_size)."""
    two_sites = ["dist.strategy=diloco", "diloco.groups=2", "train.precision=fp32"]
    fsdp = run([*two_sites, "diloco.inner=fsdp"], per_node=4, nodes=4)
    hsdp = run([*two_sites, "diloco.inner=hsdp"], per_node=4, nodes=4)
    pairs = run([*two_sites, "diloco.inner=hsdp", "dist.shard_size=2"], per_node=4, nodes=4)
    assert (fsdp.layout.shard, hsdp.layout.shard, pairs.layout.shard) == (8, 4, 2)
    assert hsdp.memory.diloco_outer == pytest.approx(2 * TINY_PARAMS * 4 / 4)
    assert hsdp.memory.optimizer == pytest.approx(2 * fsdp.memory.optimizer) and hsdp.memory.ddp_buckets == 0


def test_diloco_counts_the_outer_syncs_chunks_not_copies_of_the_model() -> None:
    """2 sites of 4 ranks. The sync holds its largest fp32 chunk (the shard it syncs, when smaller) and, where a
    site's ranks split each chunk, the gather of their slices; bf16 adds a bf16 slice; int8 the slice's codes,
    every site's codes twice (the gather's own copy) and their fp32 worth."""
    diloco = ["dist.strategy=diloco", "train.precision=fp32"]
    small = [*diloco, f"diloco.sync_chunk_mib={4096 * 4 / 2**20}"]  # 4096 values, slices of 1024 under ddp
    whole = run(diloco, per_node=4, nodes=2)
    ddp = run(small, per_node=4, nodes=2)
    assert whole.memory.diloco_sync == 2 * TINY_PARAMS * 4  # the model fits a chunk
    assert ddp.memory.diloco_sync == 2 * 4096 * 4
    bf16 = run([*small, "diloco.pseudo_grad_dtype=bf16"], per_node=4, nodes=2).memory.diloco_sync
    int8 = run([*small, "diloco.pseudo_grad_dtype=int8"], per_node=4, nodes=2).memory.diloco_sync
    assert bf16 == 2 * 4096 * 4 + 1024 * 2 and int8 == 2 * 4096 * 4 + 1024 * (1 + 2 * 2 + 4)
    assert run([*small, "diloco.inner=fsdp"], per_node=4, nodes=2).memory.diloco_sync == 4096 * 4  # no slicers
    growth = whole.memory.peak_tensor_bytes - ddp.memory.peak_tensor_bytes
    assert growth == pytest.approx(whole.memory.diloco_sync - ddp.memory.diloco_sync)
    assert "diloco sync chunks" in estimate.render(ddp)
    assert run(["dist.strategy=ddp"], per_node=4, nodes=2).memory.diloco_sync == 0


def test_activation_checkpointing_keeps_only_block_inputs_and_one_block() -> None:
    plain = run(["model.gradient_checkpointing=false"]).memory
    ckpt = run(["model.gradient_checkpointing=true"]).memory
    assert ckpt.activations < plain.activations
    assert ckpt.recomputed_layer > 0 and plain.recomputed_layer == 0
    cfg = load_config(TINY)
    tokens, layers, hidden = cfg.train.micro_batch_size * cfg.data.max_length, 2, 64
    residual = 4  # bf16-mixed over fp32 weights: the residual stream stays fp32
    # Without checkpointing every layer saves what the recomputed one does; with it, only each layer's input.
    assert plain.activations - ckpt.activations == pytest.approx(
        (layers - 1) * ckpt.recomputed_layer - layers * tokens * hidden * residual
    )


def _family_job(tmp_path, family: str) -> str:
    job = tmp_path / f"{family}.yaml"
    config = "\n".join(f"    {key}: {value}" for key, value in settings(family).items() if key != "vocab_size")
    job.write_text(f"model:\n  config:\n{config}\n  tokenizer: builtin:bytes\ndata:\n  max_length: 512\n"
                   "train:\n  precision: fp32\n")
    return str(job)


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_on_a_gpu_only_eager_documents_keep_their_scores(tmp_path, family: str) -> None:
    """Soft-capping (Gemma 2) and sinks (gpt-oss) on a GPU: auto runs flash-attention or flex_attention, which keep
    the output and its log-sum-exp; varlen runs the family's eager attention on each document, whose softmax (heads x
    document length per token: H·L² per document per layer) and k/v repeated to every head stay for backward."""
    job, h100 = _family_job(tmp_path, family), estimate.Hardware("h100-80gb", 1, 1)
    auto = estimate.estimate(load_config(job), h100).memory
    flex = estimate.estimate(load_config(job, ["model.attn_implementation=flex_attention"]), h100).memory
    eager = estimate.estimate(load_config(job, ["model.attn_implementation=varlen"]), h100).memory
    cfg = load_config(job)
    tokens, length, layers, heads, q = cfg.train.micro_batch_size * 512, 512, 2, 4, 4 * 16
    fused = q * 4 + heads * 4  # fp32: the kernel's output and log-sum-exp
    assert auto.activations == flex.activations
    assert eager.activations - auto.activations == layers * tokens * (heads * length * 4 + 2 * q * 4 - fused)


@pytest.mark.parametrize(("family", "per_score"), [("gemma2", 8), ("gpt_oss", 4)])
def test_on_a_cpu_every_document_keeps_its_scores(tmp_path, family: str, per_score: int) -> None:
    """On a CPU flex cannot train: auto runs varlen, whose documents keep their fp32 scores (H·L² per document per
    layer; Gemma 2's eager attention its tanh beside its softmax) where the same job on a GPU keeps none."""
    job = _family_job(tmp_path, family)
    cpu = estimate.estimate(load_config(job), estimate.Hardware("cpu", 1, 1)).memory
    gpu = estimate.estimate(load_config(job), estimate.Hardware("h100-80gb", 1, 1)).memory
    cfg = load_config(job)
    tokens, length, layers, heads, q = cfg.train.micro_batch_size * 512, 512, 2, 4, 4 * 16
    assert cpu.activations - gpu.activations == layers * tokens * (heads * length * per_score + 2 * q * 4 - q * 4
                                                                   - heads * 4)


def test_ring_collectives_and_young_daly() -> None:
    assert estimate_time.ring_all_reduce_s(8e9, 8, 1e9) == pytest.approx(2 * 7 / 8 * 8)
    assert estimate_time.all_gather_s(8e9, 8, 1e9) == pytest.approx(7 / 8 * 8)
    assert estimate_time.ring_all_reduce_s(8e9, 1, 1e9) == 0
    assert estimate_time.young_daly_interval_s(60, 86400) == pytest.approx(math.sqrt(2 * 60 * 86400))
    one, four = run(["checkpoint.mtbf_hours=12"], nodes=1).timing, run(["checkpoint.mtbf_hours=12"], nodes=4).timing
    assert one.mtbf_s == 12 * 3600 and four.mtbf_s == 3 * 3600  # a job of N nodes fails N times as often
    assert four.interval_s == pytest.approx(math.sqrt(2 * four.save_s * four.mtbf_s))
    # each expected failure loses half an interval of work (the whole job is shorter than one here)
    assert four.lost_work_s == pytest.approx(four.train_s / four.mtbf_s * min(four.interval_s, four.train_s) / 2)


def test_mistral_full_fine_tune_does_not_fit_8_h100_with_ddp_but_its_lora_does() -> None:
    hardware = estimate.Hardware("h100-80gb", 8, 1)
    full = estimate.estimate(load_config(MISTRAL, ["lora.enabled=false"]), hardware)
    lora = estimate.estimate(load_config(MISTRAL), hardware)
    assert full.layout.strategy == lora.layout.strategy == "ddp"
    assert 7.2e9 < full.total_params < 7.3e9
    assert not full.fits and full.memory.optimizer > 50 * 2**30
    assert full.fix is not None and "dist.strategy=fsdp" in full.fix
    assert lora.fits and lora.margin_bytes > 40 * 2**30
    assert estimate.fits(load_config(MISTRAL), "ddp", 8, 80 * 2**30)
    assert not estimate.fits(load_config(MISTRAL, ["lora.enabled=false"]), "ddp", 8, 80 * 2**30)


def test_json_has_the_verdict_and_the_breakdown() -> None:
    result = run_cli("estimate", TINY, "--gpu", "l4", "--gpus-per-node", "2", "--price-per-gpu-hour", "1.5",
                       "--spot-discount", "0.5", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["fits"] is True and data["strategy"] == "ddp" and data["gpu"] == "l4"
    parts = data["memory_bytes"]
    assert data["peak_bytes_per_device"] == pytest.approx(
        parts["peak_tensor_bytes"] + parts["allocator_slack"] + parts["cuda_context"] + parts["runtime"])
    assert parts["runtime"] == 0 and "reserved" in data["peak_is"]  # a GPU's: the interpreter is host memory
    assert parts["weights"] == TINY_PARAMS * 4
    assert data["cost"]["spot"] == pytest.approx(data["cost"]["on_demand"] * 0.5)
    assert data["cost"]["on_demand"] == pytest.approx(data["cost"]["gpu_hours"] * 1.5)


@pytest.mark.parametrize(
    ("options", "needles"),
    [
        (["--gpu", "v100"], ["--gpu v100", "h100-80gb", "a100-40gb", "cpu"]),
        (["--price-per-gpu-hour", "-2"], ["--price-per-gpu-hour -2"]),
        (["--spot-discount", "0.5"], ["--spot-discount needs --price-per-gpu-hour"]),
    ],
)
def test_bad_options_exit_2_naming_them(options: list[str], needles: list[str]) -> None:
    result = run_cli("estimate", TINY, *options, env={"COLUMNS": "1000"})
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("hardware", "assumptions", "needle"),
    [
        (estimate.Hardware("h200", 8, 0), estimate.Assumptions(), "--nodes 0"),
        (estimate.Hardware("h200", -1), estimate.Assumptions(), "--gpus-per-node -1"),
        (estimate.Hardware("h200", network_gbps=0), estimate.Assumptions(), "--network-gbps 0"),
        (estimate.Hardware("h200"), estimate.Assumptions(mfu=1.5), "--mfu 1.5"),
        (estimate.Hardware("h200"), estimate.Assumptions(price_per_gpu_hour=2.0, spot_discount=1.0), "--spot-discount"),
    ],
)
def test_numbers_an_estimate_cannot_use_are_option_errors(
    hardware: estimate.Hardware, assumptions: estimate.Assumptions, needle: str
) -> None:
    with pytest.raises(OptionError, match=needle):
        estimate.check_options(hardware, assumptions)


def test_dry_run_prints_the_estimate() -> None:
    from typer.testing import CliRunner

    from trainyard.cli import app

    result = CliRunner().invoke(app, ["train", TINY, "--dry-run", "--world-size", "2"])
    assert result.exit_code == 0, result.output
    assert "estimate         process peak" in result.output


def test_unknown_hub_model_is_a_model_error_naming_the_known_ones() -> None:
    cfg = load_config(TINY, ["model.config=null", "model.path=nobody/unknown-model-xyz"])
    line, result = estimate.describe(cfg, estimate.Hardware("cpu"))
    assert result is None
    assert line.startswith("estimate         unknown") and "mistralai/Mistral-7B-v0.1" in line
    assert hardware.GPUS["h200"].memory_bytes > hardware.GPUS["h100-80gb"].memory_bytes


def test_dpo_counts_a_pair_per_row_and_what_its_reference_costs() -> None:
    """Unread data: each of a pair's documents fills max_length. LoRA's reference is one more forward per step and
    no weights; full fine-tuning's is one forward over the data before the first step, and its file."""
    sft = run(["lora.enabled=true"])
    simpo, lora, full = (run(["train.objective=dpo", *more]) for more in (
        ["lora.enabled=true", "dpo.loss=simpo"], ["lora.enabled=true"], ["lora.enabled=false"]))
    cfg = load_config(TINY, ["train.objective=dpo", "lora.enabled=false"])
    batch = cfg.train.micro_batch_size  # one rank, no accumulation
    length, rows = cfg.data.max_length, cfg.train.max_steps * batch
    assert lora.timing.tokens_per_step == 2 * sft.timing.tokens_per_step == 2 * length * batch
    full_sft, full_orpo = run(["lora.enabled=false"]), run(["train.objective=dpo", "lora.enabled=false",
                                                             "dpo.loss=orpo"])
    assert full_orpo.memory.activations == pytest.approx(2 * full_sft.memory.activations)
    adapted = estimate.mem.model_of(load_config(TINY, ["train.objective=dpo", "lora.enabled=true"]))
    lora_forward = hardware.forward_flops(adapted.counts.flops, (length, length)) / (2 * length)
    assert lora.timing.flops_per_token == pytest.approx(simpo.timing.flops_per_token + lora_forward)
    forward = hardware.forward_flops(estimate.mem.model_of(cfg).counts.flops, (length, length)) / (2 * length)
    assert (lora.memory.weights, lora.memory.lora_adapters, lora.memory.peak) == (
        simpo.memory.weights, simpo.memory.lora_adapters, simpo.memory.peak)
    assert lora.timing.reference_s == simpo.timing.reference_s == 0.0 and simpo.timing.reference is None
    peak = hardware.kind_peak_flops(full.layout.gpu, torch.bfloat16) * full.efficiency.mfu
    assert full.timing.reference == "precomputed"
    assert full.timing.reference_s == pytest.approx(forward * rows * 2 * length / peak)
    assert full.timing.reference_bytes == rows * estimate_time.REFERENCE_BYTES_PER_PAIR
    assert full.timing.compile_s == full.efficiency.compile_s > 0  # train.compile auto: the GPU compiles its blocks
    assert full.timing.total_s == pytest.approx(full.timing.train_s + full.timing.lost_work_s
                                                + full.timing.checkpoint_overhead_s + full.timing.reference_s
                                                + full.timing.compile_s)
    assert "initial model's log-probabilities, one forward over the data" in estimate.render(full)
    assert any("adapters off" in note for note in lora.memory.notes)


def test_dpo_lengths_read_from_the_data_are_each_pairs_documents(tmp_path) -> None:
    from trainyard import plan

    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}*{i}=", "chosen": str(i * i), "rejected": "no" * (i + 1)})
                            + "\n" for i in range(20)))
    cfg = load_config(TINY, ["train.objective=dpo", "lora.enabled=false", f"data.path={path}"])
    lengths = plan.reading.data_lengths(cfg, 1)
    assert len(lengths.documents) == 2 * 20 and lengths.rows == 20 and "20 pairs" in lengths.source
    result = estimate.estimate(cfg, estimate.Hardware("cpu"), lengths=lengths)
    pair = sum(lengths.documents) / 20
    assert result.timing.tokens_per_step == round(cfg.train.micro_batch_size * pair)
    assert result.timing.reference_bytes == 20 * estimate_time.REFERENCE_BYTES_PER_PAIR
