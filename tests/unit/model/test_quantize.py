"""model.quantize nf4: the frozen base in 4-bit NF4 under LoRA; where it cannot apply, the job is refused."""

from __future__ import annotations

import copy

import pytest
import torch
from accelerate import init_empty_weights
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from tests.conftest import TINY, TINY_MOE, run_cli
from trainyard import dist, precision
from trainyard.config_file import load_config
from trainyard.errors import ConfigError, ModelError
from trainyard.model import build as model_room
from trainyard.model import moe_lora, nf4_experts, nf4_fast, quantize, weights
from trainyard.model import source as source_room
from trainyard.train.build import build_and_wrap

CPU = torch.device("cpu")


def test_nf4_without_lora_is_refused_naming_the_field_and_the_fix() -> None:
    done = run_cli("train", TINY, "model.quantize=nf4", "lora.enabled=false")
    assert done.returncode == 2, done.stderr
    assert "model.quantize" in done.stderr and "set lora.enabled: true" in done.stderr
    assert "Traceback" not in done.stderr


def test_nf4_with_peft_s_expert_fold_is_refused() -> None:
    done = run_cli("train", TINY, "model.quantize=nf4", "lora.enabled=true", "lora.moe_adapter=peft")
    assert done.returncode == 2, done.stderr
    assert "lora.moe_adapter" in done.stderr and "set lora.moe_adapter: grouped" in done.stderr


def test_nf4_with_frozen_weights_in_checkpoints_is_refused() -> None:
    done = run_cli("train", TINY, "model.quantize=nf4", "lora.enabled=true", "checkpoint.save_frozen=true")
    assert done.returncode == 2, done.stderr
    assert "checkpoint.save_frozen" in done.stderr and "set checkpoint.save_frozen: false" in done.stderr


def _meta_llama(hidden: int) -> torch.nn.Module:
    config = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=300)
    with init_empty_weights():
        return AutoModelForCausalLM.from_config(config)


def test_nf4_takes_every_linear_weight_of_whole_blocks_and_never_the_head_or_embeddings() -> None:
    quantized, left, _, _ = quantize.nf4_targets(_meta_llama(128), torch.float32)
    assert sorted(name.split(".")[-2] for name in quantized) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])  # k/v: 128 blocks
    assert not left
    assert not any("embed" in name or "lm_head" in name or "norm" in name for name in quantized + left)


def test_a_linear_weight_of_no_whole_blocks_stays_in_the_model_s_dtype_and_the_log_names_it() -> None:
    targets = quantize.nf4_targets(_meta_llama(40), torch.float32)  # k/v 20 x 40: 12.5 blocks
    assert sorted(name.split(".")[-2] for name in targets.left) == ["k_proj", "v_proj"]
    assert sorted(name.split(".")[-2] for name in targets.quantized) == sorted(
        ["q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])  # 25 blocks (scaler blocks of 1), 50 (of 2)
    assert "size not a multiple of 64" in quantize.describe(*targets)


def test_smollm2_s_attention_is_quantized_and_the_log_counts_its_scales_exactly() -> None:
    """SmolLM2-135M's shapes (576 x 576, 192 x 576: scaler blocks of 8) are torchao's to_nf4 with that scaler
    block, bit for bit, and the log's bytes are what the NF4Tensors hold."""
    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=1, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=300)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    targets = quantize.nf4_targets(model, torch.bfloat16)
    assert len(targets.quantized) == 7 and not targets.left
    held = 0
    for name in targets.quantized:
        shape = model.get_parameter(name).shape
        whole = torch.randn(shape, generator=torch.Generator().manual_seed(len(name))).to(torch.bfloat16)
        size = nf4_fast.scaler_block(whole.numel() // quantize.BLOCK)
        got = nf4_fast.to_nf4(whole)
        _assert_bit_identical(got, quantize.nf4_module().to_nf4(whole, quantize.BLOCK, size))
        # attention 5184 or 1728 blocks, MLP 13824: the largest scaler blocks that split over 8 shards
        assert got.scaler_block_size == size == (8 if "self_attn" in name else 64)
        assert (whole.numel() // quantize.BLOCK // size) % 8 == 0
        held += sum(getattr(got, inner).nbytes for inner in _INNER)
    assert held == targets.nbytes
    assert f"{targets.nbytes / 2**20:.3g} MiB with their scales" in quantize.describe(*targets)
    quantize.quantize_meta(model, set(targets.quantized), 3, torch.device("cpu"), weights.checkpoint_key)
    attention = model.model.layers[0].self_attn
    assert attention.q_proj.weight.scaler_block_size == attention.k_proj.weight.scaler_block_size == 8


_INNER = ["quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4"]


def _assert_bit_identical(got: torch.Tensor, want: torch.Tensor) -> None:
    assert (got.shape, got.dtype, got.n_blocks) == (want.shape, want.dtype, want.n_blocks)
    for name in _INNER:
        mine, theirs = getattr(got, name), getattr(want, name)
        assert (mine.dtype, mine.shape) == (theirs.dtype, theirs.shape), name
        assert torch.equal(mine.reshape(-1).view(torch.uint8), theirs.reshape(-1).view(torch.uint8)), name


def _adversarial(dtype: torch.dtype) -> torch.Tensor:
    """Random rows, then a zero block, blocks of NF4's levels and of the midpoints between them (ties), a block of
    one repeated value, tiny and huge magnitudes."""
    levels = nf4_fast.levels(torch.float64)
    whole = torch.randn(128, 512, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    whole[0, :64] = 0
    whole[1, :16], whole[1, 16:32] = levels * 3, -levels * 3
    middles = (levels[1:] + levels[:-1]) / 2
    whole[2, :15], whole[2, 15:30], whole[2, 63] = middles * 5, -middles * 5, 5
    whole[3, :64] = -0.25
    whole[4] *= 1e-30
    whole[5] *= 1e30 if dtype != torch.float16 else 1e4
    return whole.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_fast_nf4_is_torchao_s_bit_for_bit_on_random_and_adversarial_weights(dtype: torch.dtype) -> None:
    nf4 = quantize.nf4_module()
    # the second: a parallel mean; then scaler blocks of 1 (25 blocks), 2 and 64 (SmolLM2's attention)
    for whole in (_adversarial(dtype), torch.randn(512, 4096), torch.randn(40, 40), torch.randn(80, 40),
                  torch.randn(192, 576)):
        whole = whole.to(dtype)
        size = nf4_fast.scaler_block(whole.numel() // quantize.BLOCK)
        _assert_bit_identical(nf4_fast.to_nf4(whole), nf4.to_nf4(whole, quantize.BLOCK, size))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_codes_of_every_16_bit_pattern_are_torchao_s(dtype: torch.dtype) -> None:
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(dtype)
    want = quantize.nf4_module().NF4Tensor.quantize_tensor_nearest(every, nf4_fast.levels(dtype))
    assert torch.equal(nf4_fast.codes(every), want.to(torch.uint8))


def test_the_fp32_codes_are_torchao_s_around_every_step_midpoint_and_level() -> None:
    """Every fp32 value within 2048 steps of each code's change, of each exact midpoint and of each level; values
    in [-1, 1] and their ends; NaN (a zero block's 0 / 0)."""
    levels = nf4_fast.levels(torch.float32)
    first, _, steps = nf4_fast._table32()
    changes = ((steps != 1 << 16).nonzero().flatten() << 16 | steps[steps != 1 << 16]).view(torch.float32)
    middles = ((levels[1:].double() + levels[:-1].double()) / 2).float()
    centres = torch.cat([changes, middles, levels, -torch.cat([changes, middles, levels])])
    around = (centres.view(torch.int32)[:, None] + torch.arange(-2048, 2049, dtype=torch.int32)).view(torch.float32)
    ends = torch.tensor([-1.0, -0.0, 0.0, 1.0, float("nan")])
    values = torch.cat([around.flatten(), torch.rand(1 << 20) * 2 - 1, ends])
    values = values[values.isnan() | (values.abs() <= 1)]
    want = quantize.nf4_module().NF4Tensor.quantize_tensor_nearest(values, levels)
    assert len(changes) >= 15 and torch.equal(nf4_fast.codes(values), want.to(torch.uint8))


@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16])
def test_each_rank_s_rows_streamed_in_chunks_are_the_whole_tensor_quantized_then_split(
        monkeypatch: pytest.MonkeyPatch, source: torch.dtype) -> None:
    """NF4's scales share one mean over the tensor: rows quantized alone would dequantize to other values. Chunks
    of 64 rows: the stream, not one read, is what is checked; each rank reads no row twice."""
    monkeypatch.setattr(nf4_fast, "CHUNK_VALUES", 64 * 256)
    nf4 = quantize.nf4_module()
    whole = torch.randn(512, 256, generator=torch.Generator().manual_seed(0)).to(source)
    expected = nf4.to_nf4(whole.to(torch.bfloat16), quantize.BLOCK, nf4_fast.SCALER_BLOCK)
    meta = nf4_fast.meta_nf4(nf4, whole.shape, torch.bfloat16, torch.device("cpu"), nf4_fast.SCALER_BLOCK)
    for start, stop in ((0, 512), (0, 256), (256, 512), (128, 192)):
        local = torch.empty_like(meta.split(stop - start)[0], device="cpu")
        reads: list[tuple[int, int]] = []
        quantize.fill_own_rows(local, lambda a, b: reads.append((a, b)) or whole[a:b], whole.shape, start, stop)
        assert isinstance(local, nf4.NF4Tensor)
        _assert_bit_identical(local, expected.split(stop - start)[start // (stop - start)])
        assert sorted(reads) == sorted(set(reads)) and max(b - a for a, b in reads) <= 64
        assert sum(b - a for a, b in reads) == 512


@pytest.mark.parametrize("size", [64, 8])
def test_rows_of_a_small_scaler_block_streamed_per_rank_are_the_whole_tensor_quantized_then_split(size: int) -> None:
    """576 x 576 at scaler blocks of 64: each of 3 ranks' rows (and of 2 at scaler blocks of 8) quantized from
    the stream is torchao's to_nf4 of the whole tensor with that scaler block, then split."""
    nf4 = quantize.nf4_module()
    whole = torch.randn(576, 576, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    expected = nf4.to_nf4(whole, quantize.BLOCK, size)
    meta = nf4_fast.meta_nf4(nf4, whole.shape, torch.bfloat16, torch.device("cpu"), size)
    assert meta.scaler_block_size == size
    ranks = 3 if size == 64 else 2
    rows = 576 // ranks
    for rank in range(ranks):
        local = torch.empty_like(meta.split(rows)[0], device="cpu")
        quantize.fill_own_rows(local, lambda a, b: whole[a:b], whole.shape, rank * rows, (rank + 1) * rows)
        _assert_bit_identical(local, expected.split(rows)[rank])


def test_a_weight_that_shards_do_not_split_into_whole_blocks_is_refused_naming_it() -> None:
    model = _meta_llama(256)
    quantized = quantize.nf4_targets(model, torch.float32).quantized
    with pytest.raises(ModelError, match=r"q_proj.weight \(256, 256\) cannot be split into 16 shards"):
        quantize.quantize_meta(model, set(quantized), 16, torch.device("cpu"), weights.checkpoint_key)
    done = quantize.quantize_meta(model, set(quantized), 2, torch.device("cpu"), weights.checkpoint_key)
    assert done == len(quantized)
    assert quantize.is_nf4(model.model.layers[0].mlp.down_proj.weight)


def _meta_glm_moe(moe_intermediate: int, hidden: int = 128) -> torch.nn.Module:
    config = AutoConfig.for_model("glm4_moe", hidden_size=hidden, intermediate_size=256,
                                  moe_intermediate_size=moe_intermediate, num_hidden_layers=2, first_k_dense_replace=1,
                                  n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
    with init_empty_weights():
        return AutoModelForCausalLM.from_config(config)


def test_fused_expert_stacks_are_quantized_per_expert_and_the_log_counts_their_bytes() -> None:
    """gate_up [4, 256, 128] and down [4, 128, 128]: each expert is torchao's to_nf4 of it alone (its own scales'
    mean), and the log's bytes are what the per-expert NF4Tensors hold."""
    model = _meta_glm_moe(128)
    quantized, left, nbytes, values = quantize.nf4_targets(model, torch.float32)
    stacks = ["model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"]
    assert set(stacks) <= set(quantized) and not left
    assert "model.layers.1.mlp.shared_experts.down_proj.weight" in quantized
    assert not any(".gate." in name or name.endswith("gate.weight") for name in quantized)  # the router
    assert "linear weights and 2 expert stacks (per expert) in NF4" in quantize.describe(quantized, left, nbytes,
                                                                                          values)
    dense = [name for name in quantized if name not in stacks]
    held = sum(_held(nf4_fast.to_nf4(torch.randn(model.get_parameter(name).shape))) for name in dense)
    held += 4 * (_held(nf4_fast.to_nf4(torch.randn(256, 128))) + _held(nf4_fast.to_nf4(torch.randn(128, 128))))
    assert nbytes == held and values == sum(model.get_parameter(name).numel() for name in quantized)


def test_a_stack_whose_experts_hold_no_whole_blocks_stays_in_the_model_s_dtype_and_the_log_names_it() -> None:
    targets = quantize.nf4_targets(_meta_glm_moe(12, hidden=40), torch.float32)  # down 40 x 12: 7.5 blocks
    assert "model.layers.1.mlp.experts.down_proj" in targets.left
    assert "model.layers.1.mlp.experts.gate_up_proj" in targets.quantized  # 24 x 40: 15 blocks an expert
    assert "a stack's, each expert's" in quantize.describe(*targets)


def _held(tensor: torch.Tensor) -> int:
    return sum(getattr(tensor, inner).nbytes for inner in _INNER)


def test_nf4_experts_under_expert_parallelism_with_one_rank_per_expert_shard_are_refused() -> None:
    """torch's FSDP2 copies a lone rank's shard as one tensor, which an NF4Tensor is not: EP 2 over a shard
    dimension of 2 would fail at the first gather; over 4 each expert's rows split over 2 ranks."""
    model = _meta_glm_moe(128)
    targets = set(quantize.nf4_targets(model, torch.float32).quantized)
    with pytest.raises(ModelError, match="model.quantize nf4: under dist.expert_parallel 2") as refused:
        quantize.quantize_meta(model, targets, 2, torch.device("cpu"), weights.checkpoint_key, expert_parallel=2)
    assert "dist.expert_parallel: 1, or model.quantize: none" in refused.value.fix
    quantize.quantize_meta(model, targets, 4, torch.device("cpu"), weights.checkpoint_key, expert_parallel=2)
    experts = model.model.layers[1].mlp.experts
    assert sorted(nf4_experts.stacks_of(experts)) == ["down_proj", "gate_up_proj"]
    assert all(quantize.is_nf4(weight) and weight.shape == (256, 128) for weight in experts.gate_up_proj_nf4)


def _tiny_moe(quantized: bool, training: str = "fp32") -> tuple[torch.nn.Module, torch.nn.Module,
                                                                dict[str, torch.Tensor]]:
    """The tiny MoE in fp32 (experts: gate_up 96 x 64, down 64 x 48, whole blocks), with LoRA as training builds
    it at train.precision `training`; the plain model of the same random init; the init by checkpoint name."""
    cfg = load_config(TINY_MOE, [f"model.quantize={'nf4' if quantized else 'none'}", f"train.precision={training}",
                                 "dist.strategy=none"])
    tokenizer = source_room.load_tokenizer(cfg.model, None)
    built, _, _ = build_and_wrap(cfg, dist.DistInfo(0, 1, 0, 1, CPU, None), precision.resolve(cfg, CPU), None,
                                 tokenizer)
    config = source_room.architecture(cfg.model, tokenizer, None)
    init = model_room.random_init(cfg.model, config, cfg.train.seed)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(init)
    return built.eval(), plain.eval(), init


def test_each_expert_is_its_own_to_nf4_and_the_moe_computes_what_each_expert_s_round_trip_computes() -> None:
    """The grouped expert path on per-expert NF4 weights gives the logits of the plain model with each expert's
    weight replaced by its NF4 round trip (LoRA's B starts at zero), not those of the unquantized model."""
    model, plain, init = _tiny_moe(quantized=True)
    experts = model.base_model.model.model.layers[1].mlp.experts.get_base_layer()
    nf4 = quantize.nf4_module()
    for name in ("gate_up_proj", "down_proj"):
        stack = init[f"model.layers.1.mlp.experts.{name}"]
        held = nf4_experts.quantized_stack(experts, name)
        assert held is not None and len(held) == stack.shape[0] == 4
        for expert, weight in zip(stack, held, strict=True):
            size = nf4_fast.scaler_block(expert.numel() // quantize.BLOCK)
            _assert_bit_identical(weight, nf4.to_nf4(expert, quantize.BLOCK, size))
    ids = torch.randint(3, 200, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        unquantized = plain(input_ids=ids).logits
        targets = quantize.nf4_targets(plain, torch.float32).quantized
        assert "model.layers.1.mlp.experts.gate_up_proj" in targets
        quantize.round_trip(plain, targets)
        assert torch.equal(experts.gate_up_proj, plain.model.layers[1].mlp.experts.gate_up_proj)
        want, got = plain(input_ids=ids).logits, model(input_ids=ids).logits
    assert (got - want).abs().max() < 1e-5 * want.abs().max()
    assert (unquantized - want).abs().max() > 100 * (got - want).abs().max()


def test_an_export_quantizes_the_base_again_in_the_dtype_training_held_it_in() -> None:
    """Under bf16-mixed LoRA training quantizes the frozen base from its bf16 values (the scales computed in bf16),
    while an export loads the base in fp32 on a CPU: its round trip in that frozen dtype (env.json's) gives the
    base training saw, bit for bit, a linear layer's and each expert's; in fp32 it gives another."""
    model, plain, _ = _tiny_moe(quantized=True, training="bf16-mixed")
    layer = model.base_model.model.model.layers[1]
    trained = {"experts": layer.mlp.experts.get_base_layer().gate_up_proj.float(),
               "q_proj": layer.self_attn.q_proj.base_layer.weight.get_original_weight().float()}
    other = copy.deepcopy(plain)
    targets = quantize.nf4_targets(plain, torch.float32).quantized
    quantize.round_trip(plain, targets, torch.bfloat16)
    quantize.round_trip(other, targets)
    for base, same in ((plain, True), (other, False)):
        found = {"experts": base.model.layers[1].mlp.experts.gate_up_proj,
                 "q_proj": base.model.layers[1].self_attn.q_proj.weight}
        assert all(torch.equal(found[name], trained[name]) == same for name in trained)


def test_the_grouped_path_takes_peft_s_adapter_factors_without_dequantizing_a_stack() -> None:
    """PEFT's get_delta_factors reads the wrapped stack for its dtype alone: moe_lora takes the same factors from
    the NF4 weights' dtype, and reads no stack."""
    model, _, _ = _tiny_moe(quantized=True)
    outer = model.base_model.model.model.layers[1].mlp.experts
    chain = moe_lora.wrapper_chain(outer)
    assert sorted(wrapper.parameter_name for wrapper in chain) == ["down_proj", "gate_up_proj"]
    experts = chain[-1].get_base_layer()
    reads: list[str] = []
    stacks = nf4_experts.stacks_of(experts).values()
    for stack in stacks:
        stack.dequantized = lambda stack=stack: reads.append("read") or nf4_experts.NF4ExpertStack.dequantized(stack)
    for wrapper in chain:
        torch.nn.init.normal_(wrapper.lora_B["default"].weight, generator=torch.Generator().manual_seed(3))
        got = moe_lora.delta_factors(wrapper, "default")
        assert not reads
        want = wrapper.get_delta_factors("default")
        assert reads and all(torch.equal(a, b) for a, b in zip(got[:2], want[:2], strict=True)) and got[2] == want[2]
        reads.clear()


def test_shard_groups_of_one_rank_among_several_are_refused_for_nf4() -> None:
    with pytest.raises(ConfigError) as refused:  # hsdp with dist.shard_size 1 on 2 ranks: FSDP2's gather fails
        quantize.refuse_lone_shards(1, 2, "override 'dist.shard_size=1'")
    assert "dist.strategy: ddp" in refused.value.fix and refused.value.where == "override 'dist.shard_size=1'"
    quantize.refuse_lone_shards(1, 1, None)  # fsdp on one process trains
    quantize.refuse_lone_shards(2, 4, None)  # hsdp 2 x 2 trains (tests/dist/test_quantize.py)


def test_the_dry_run_refuses_hsdp_of_one_rank_shard_groups_under_nf4(tmp_path) -> None:
    job = ["--nproc", "2", "--dry-run", f"output_dir={tmp_path}", "dist.strategy=hsdp", "model.quantize=nf4",
           "lora.enabled=true", "model.config.hidden_size=256", "model.config.intermediate_size=512",
           "model.config.num_key_value_heads=4"]
    done = run_cli("train", TINY, *job, "dist.shard_size=1")
    assert done.returncode == 2, done.stderr[-2000:]
    assert "override 'dist.shard_size=1'" in done.stderr and "dist.strategy: ddp" in done.stderr
    assert "Traceback" not in done.stderr
    assert run_cli("train", TINY, *job).returncode == 0  # shard groups of 2 plan


def test_the_dry_run_refuses_nf4_experts_sharded_over_one_rank_as_the_build_does(tmp_path) -> None:
    job = ["--dry-run", f"output_dir={tmp_path}", "dist.strategy=fsdp", "model.quantize=nf4", "lora.enabled=true",
           "dist.expert_parallel=2"]
    done = run_cli("train", TINY_MOE, "--nproc", "2", *job)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "override 'dist.expert_parallel=2'" in done.stderr and "each expert stack is sharded over one rank" in \
        done.stderr
    assert "Traceback" not in done.stderr
    planned = run_cli("train", TINY_MOE, "--nproc", "4", *job)  # each expert's rows over 2 ranks
    assert planned.returncode == 0, planned.stderr[-2000:]
    assert "expert parallel 2" in planned.stdout
