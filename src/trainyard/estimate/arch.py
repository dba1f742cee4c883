"""What `trainyard estimate` knows of a job's model without loading it: the HF config (from the job, a
local folder or cache, or a small table of known hub models) and parameter counts of a meta-built model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoConfig
from transformers.utils import logging as hf_logging

from trainyard.config import JobConfig
from trainyard.errors import ModelError
from trainyard.estimate import quantized
from trainyard.estimate.quantized import LowBit
from trainyard.estimate.state_memory import Mixer, mixer_of
from trainyard.hardware import FlopShape, flop_shape
from trainyard.model import attention
from trainyard.model import build as model_room
from trainyard.model import layers as layer_kinds
from trainyard.model import source as source_room

# Known architectures, keyed by hub id: their config.json's shape fields, so an estimate needs no download.
# Values copied from the models' published config.json files (only fields that change parameter counts).
KNOWN_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "mistralai/Mistral-7B-v0.1": {
        "model_type": "mistral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "max_position_embeddings": 32768, "tie_word_embeddings": False,
    },
    "zai-org/GLM-4.5-Air": {
        "model_type": "glm4_moe", "vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 10944,
        "moe_intermediate_size": 1408, "num_hidden_layers": 46, "num_attention_heads": 96,
        "num_key_value_heads": 8, "head_dim": 128, "n_routed_experts": 128, "n_shared_experts": 1,
        "num_experts_per_tok": 8, "first_k_dense_replace": 1, "partial_rotary_factor": 0.5,
        "attention_bias": True, "tie_word_embeddings": False, "max_position_embeddings": 131072,
        "norm_topk_prob": True, "use_qk_norm": False,
    },
}


@dataclass(frozen=True)
class Shape:
    """The sizes the activation and FLOP formulas use (MoE fields 0 for a dense model)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    experts: int = 0
    experts_per_token: int = 0
    moe_intermediate: int = 0
    shared_experts: int = 0
    dense_layers: int = 0
    """Leading layers with a dense MLP on an MoE model (GLM's first_k_dense_replace)."""
    family: str = ""
    """The HF model_type: expert parallelism runs only the families proven exact."""
    logit_softcap: bool = False
    """final_logit_softcapping (Gemma 2): the loss holds a chunk's capped logits and their tanh beside them."""
    value_head_dim: int = 0
    """Values narrower than queries and keys (MLA's v_head_dim); 0: as wide. sdpa's fused CPU kernel refuses them."""


@dataclass(frozen=True)
class ExpertCounts:
    """Elements of the routed experts' 3-D stacks with their adapters (PEFT's ParamWrappers around them)."""

    total: int = 0
    trainable: int = 0
    block_total: int = 0
    """In the largest decoder block: what FSDP2 gathers of it for the experts."""
    block_trainable: int = 0


@dataclass(frozen=True)
class Block:
    """One decoder block of a family whose blocks differ (state layers beside or instead of attention): what it
    computes, with its own norms and adapters."""

    attention: bool
    mixers: tuple[Mixer, ...] = ()
    """Its state layers (linear attention, Mamba, short convolutions); Falcon-H1 runs one beside attention."""
    gated_attention: bool = False
    """q_proj also makes a gate that multiplies attention's output (Qwen3-Next's sigmoid gate)."""
    window: int | None = None
    mlp: int = 0
    """A dense MLP's width (LFM2 sizes its own), or an MoE block's shared expert's; 0: none."""
    mlp_linears: int = 3
    """A dense MLP's linear layers: gate, up, down (Nemotron-H's has no gate)."""
    moe: bool = False
    norms: int = 0
    """Hidden-wide norms whose outputs the block's linear layers read."""
    norm_inputs: int = 0
    """Per token, what its norms outside the state layers normalise (`_norm_inputs`)."""
    lora_ranks: int = 0
    lora_inputs: int = 0


@dataclass(frozen=True)
class Counts:
    """Parameters of the meta-built model (LoRA included), as sharding and FLOPs need them."""

    total: int
    trainable: int
    block_total: int
    """The largest decoder block: what FSDP2 all-gathers at once."""
    block_trainable: int
    root_total: int
    """Outside the blocks (embeddings, final norm, head)."""
    root_trainable: int
    embedding: int
    tied: bool
    lora_inputs_per_block: int
    """Sum of in_features over the LoRA-adapted linear layers of one block (dropout copies those inputs)."""
    lora_ranks_per_block: int
    """Sum of ranks over those layers (each saves its A output for B)."""
    flops: FlopShape
    """What a token costs in FLOPs (hardware's one counter, shared with the training loop's MFU)."""
    lora_parameters_per_block: int = 0
    """Elements of the 3-D parameters (fused MoE experts) LoRA adapts in one block: PEFT folds W + BA into a new
    tensor of that size on every forward, which the experts' matmuls save."""
    lora_largest_parameter: int = 0
    """Elements of the largest of those: a whole-stack gradient of one folded weight appears in backward while the
    block's folded weights are still saved (the largest, not knowing which comes first)."""
    lora_expert_ranks_per_block: int = 0
    """lora.moe_adapter grouped: sum of ranks over the expert projections run as grouped low-rank products; each
    routed (token, expert) pair saves its x·Aᵀ of that width for the B product."""
    lora_expert_copies_per_block: int = 0
    """Elements of those projections' B factors, copied once per forward into grouped_mm's layout and saved."""
    attention_features: tuple[str, ...] = ()
    """What the family's attention adds to causal attention (attention.features, on packed rows): with soft-capping
    or sinks trainyard's varlen runs the family's eager attention on each document, whose softmax backward keeps;
    auto on a GPU runs flash-attention or flex_attention instead (attention.auto_choice)."""
    attention_dropout: float = 0.0
    """The family's attention dropout, which flex_attention does not apply (auto then keeps to varlen)."""
    ends_apart: bool = False
    """An embedding and a head that share no weight: FSDP2 shards each as a unit of its own (build.untied_ends),
    and an embedding is gathered for its lookup alone."""
    head_trainable: int = 0
    """Trainable elements of the output head (full fine-tuning): its gradient is made while every activation lives."""
    experts: ExpertCounts = ExpertCounts()
    """The routed experts' stacks and their adapters: what expert parallelism holds apart."""
    norm_inputs_per_block: int = 0
    """Per token, the elements the largest block's norms normalise: two hidden-wide RMSNorms in most families; four
    in Gemma and OLMo 2's post-norms, plus q/k norms over every head (Qwen 3, Gemma 3, OLMo 2) and MLA's
    low-rank norms. Each saves its input in fp32."""
    attention_windows: tuple[int | None, ...] = ()
    """Each decoder layer's sliding window (None: full causal): on a CPU a window shorter than a document makes sdpa
    take a [L, L] mask, which it keeps for backward."""
    low_bit: LowBit = LowBit()
    """The weights model.quantize nf4 stores in 4 bits and train.precision fp8 computes with (quantized.py)."""
    blocks: tuple[Block, ...] = ()
    """Each decoder block, where any carries a state layer (empty: every block is attention and an MLP alike)."""


def hf_config(cfg: JobConfig):  # -> PretrainedConfig
    """The job's architecture: the one resolver (model.source.architecture), then the known table."""
    tokenizer = source_room.offline_tokenizer(cfg.model)[0] if cfg.model.config is not None else None  # its vocab
    config = source_room.architecture(cfg.model, tokenizer, where=cfg.where("model.config"))
    if config is not None:
        return config
    known = KNOWN_ARCHITECTURES.get(cfg.model.path or "")
    if known is None:
        raise ModelError(
            f"model.path {cfg.model.path}: its config is not available offline and not in the known architectures "
            f"({', '.join(KNOWN_ARCHITECTURES)})",
            fix="download the model once (its config.json is enough), or describe it with model.config",
        )
    settings = dict(known)
    return AutoConfig.for_model(settings.pop("model_type"), **settings)


def shape_of(config) -> Shape:  # type: ignore[no-untyped-def]
    """Sizes from an HF config, with the usual defaults where a model omits a field."""
    heads = getattr(config, "num_attention_heads", None) or 0  # 0: no attention layer (Mamba, Mamba2)
    experts = next((getattr(config, f) for f in ("n_routed_experts", "num_local_experts", "num_experts")
                    if getattr(config, f, None)), 0)
    return Shape(
        hidden=config.hidden_size,
        intermediate=getattr(config, "intermediate_size", None) or 0,  # Mamba2: none (no MLP)
        layers=config.num_hidden_layers,
        heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        # MLA (DeepSeek V3): queries and keys are qk_head_dim wide (its head_dim is the rotary part alone)
        head_dim=next((getattr(config, f) for f in ("qk_head_dim", "head_dim") if getattr(config, f, None)),
                      config.hidden_size // heads if heads else 0),
        vocab=config.vocab_size,
        experts=experts,
        experts_per_token=getattr(config, "num_experts_per_tok", 0) if experts else 0,
        moe_intermediate=getattr(config, "moe_intermediate_size", None) or getattr(config, "intermediate_size", 0),
        shared_experts=getattr(config, "n_shared_experts", None) or 0 if experts else 0,
        dense_layers=getattr(config, "first_k_dense_replace", 0) if experts else 0,
        family=getattr(config, "model_type", ""),
        logit_softcap=bool(getattr(config, "final_logit_softcapping", None)),
        value_head_dim=getattr(config, "v_head_dim", None) or 0,
    )


def meta_model(cfg: JobConfig, config) -> torch.nn.Module:  # type: ignore[no-untyped-def]
    """The model with LoRA on the meta device: counts and shapes, no memory (adapters on meta too, so a
    108B MoE's 1.8B adapter parameters are not drawn)."""
    hf_logging.set_verbosity_error()
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = model_room.causal_lm(config, cfg.model.trust_remote_code)
        if cfg.lora.enabled:
            from trainyard.model import lora as lora_room  # PEFT: only for a LoRA job

            model = lora_room.apply_lora(model, cfg.lora, cfg.train.seed)
    return model


def count(model: torch.nn.Module, shape: Shape) -> Counts:
    """Totals, the largest block, the root, and what LoRA adds to one block's activations."""
    total, trainable = model_room.parameter_counts(model)
    blocks = model_room.decoder_blocks(model)
    sizes = [_sizes(block) for block in blocks] or [(0, 0)]
    block_total, block_trainable = max(sizes)
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    root = [p for p in model.parameters() if id(p) not in in_blocks]
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    lora_layers = _lora_layers(blocks[-1]) if blocks and model_room.is_peft(model) else []
    linear = [m for m in lora_layers if isinstance(getattr(m, "base_layer", None), torch.nn.Linear)]
    grouped = _grouped_expert_wrappers(lora_layers)
    folded = [m.get_param().numel() for m in lora_layers
              if hasattr(m, "get_param") and m.get_param().ndim == 3 and id(m) not in grouped]  # ParamWrapper's
    grouped_wrappers = [m for m in lora_layers if id(m) in grouped]
    return Counts(
        total=total,
        trainable=trainable,
        block_total=block_total,
        block_trainable=block_trainable,
        root_total=sum(p.numel() for p in root),
        root_trainable=sum(p.numel() for p in root if p.requires_grad),
        embedding=embedding.numel(),
        tied=output is not None and getattr(output, "weight", None) is embedding,
        ends_apart=model_room.untied_ends(model)[0] is not None,
        lora_inputs_per_block=sum(m.base_layer.in_features for m in linear),
        lora_ranks_per_block=sum(sum(m.r.values()) for m in linear),
        flops=flop_shape(model),
        lora_parameters_per_block=sum(folded),
        lora_largest_parameter=max(folded, default=0),
        lora_expert_ranks_per_block=sum(sum(m.r.values()) for m in grouped_wrappers),
        lora_expert_copies_per_block=sum(sum(b.weight.numel() for b in m.lora_B.values()) for m in grouped_wrappers),
        attention_features=tuple(attention.features(model)),
        attention_dropout=getattr(model.config, "attention_dropout", 0.0) or 0.0,
        head_trainable=sum(p.numel() for p in output.parameters() if p.requires_grad) if output is not None else 0,
        experts=_expert_counts(model, blocks),
        norm_inputs_per_block=_norm_inputs(blocks[-1], shape) if blocks else 0,
        low_bit=quantized.count(model, blocks),
        attention_windows=tuple(_window(block, model.config) for block in blocks),
        blocks=_blocks(blocks, shape, model.config, model_room.is_peft(model)),
    )


def _blocks(blocks: list[torch.nn.Module], shape: Shape, config: Any, peft: bool) -> tuple[Block, ...]:
    """Each block's layers, where a state layer is among them (estimate/state_memory.py): else (). A block holding
    others (Zamba2's hybrid layer holds a Mamba block) counts only what they do not hold."""
    own = {id(block) for block in blocks}
    nested = [{id(m) for child in block.modules() if child is not block and id(child) in own for m in child.modules()}
              for block in blocks]
    found = [_state_layers(block, skip) for block, skip in zip(blocks, nested)]
    if not any(found):
        return ()
    return tuple(_block(block, layers, shape, config, peft, skip)
                 for block, layers, skip in zip(blocks, found, nested))


def _state_layers(block: torch.nn.Module, skip: set[int]) -> list[tuple[torch.nn.Module, Mixer]]:
    """The outermost state layers of a block that state_memory sizes."""
    found: list[tuple[torch.nn.Module, Mixer]] = []
    inside = set(skip)
    for module in block.modules():
        if id(module) in inside or layer_kinds.kind(module) not in layer_kinds.CARRIERS:
            continue
        mixer = mixer_of(module)
        if mixer is not None:
            found.append((module, mixer))
            inside.update(id(m) for m in module.modules())
    return found


def _block(block: torch.nn.Module, state: list[tuple[torch.nn.Module, Mixer]], shape: Shape, config: Any,
           peft: bool, skip: set[int]) -> Block:
    """What the block computes outside `skip` and its state layers: attention, an MLP or MoE, norms, adapters."""
    inside = skip | {id(m) for module, _ in state for m in module.modules()}
    modules = [m for m in block.modules() if id(m) not in inside]
    attention = [m for m in modules if layer_kinds.kind(m) == layer_kinds.ATTENTION]
    q_proj = getattr(attention[0], "q_proj", None) if attention else None
    moe = any(type(m).__name__.endswith("Experts") or "num_experts" in m.__dict__ for m in modules)
    mlp = next((m for m in modules if type(m).__name__.endswith(("MLP", "Mlp", "FeedForward"))), None)
    linears = [m for m in mlp.children() if hasattr(m, "in_features")] if mlp is not None else []
    norms = [m for m in modules if "norm" in type(m).__name__.lower() and _width(m) == shape.hidden]
    adapted = [m for m in _lora_layers(block) if id(m) not in skip] if peft else []
    plain = [m for m in adapted if isinstance(getattr(m, "base_layer", None), torch.nn.Linear)]
    return Block(
        attention=bool(attention),
        mixers=tuple(mixer for _, mixer in state),
        gated_attention=q_proj is not None and _out_features(q_proj) == 2 * shape.heads * shape.head_dim,
        window=_window(block, config) if attention else None,
        mlp=_out_features(linears[0]) if linears else 0,
        mlp_linears=len(linears) or 3,
        moe=moe,
        norms=len(norms),
        norm_inputs=_norm_inputs(block, shape, inside),
        lora_ranks=sum(sum(m.r.values()) for m in plain),
        lora_inputs=sum(m.base_layer.in_features for m in plain),
    )


def _width(module: torch.nn.Module) -> int:
    weight = getattr(module, "weight", None)
    return weight.shape[0] if isinstance(weight, torch.Tensor) and weight.dim() == 1 else 0


def _out_features(linear: torch.nn.Module) -> int:
    return getattr(linear, "out_features", None) or getattr(linear, "base_layer", linear).out_features


def _window(block: torch.nn.Module, config: Any) -> int | None:
    """The window a block's attention passes its kernel: its attention module's own (per layer, where the family
    sets one on it), else the config's (Mistral, Phi-3 pass it to every layer)."""
    for module in block.modules():
        if hasattr(module, "sliding_window"):
            return module.sliding_window or None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return getattr(config, "sliding_window", None) or None


def _norm_inputs(block: torch.nn.Module, shape: Shape, skip: set[int] | None = None) -> int:
    """Per token, what the block's norms normalise: a norm as wide as one head (q_norm, k_norm) runs over every query
    or key/value head, any other over its own width; modules in `skip` (state layers, which count their own) not."""
    total = 0
    for name, module in block.named_modules():
        weight = getattr(module, "weight", None)
        skipped = id(module) in (skip or ())
        if skipped or "norm" not in type(module).__name__.lower() or weight is None or weight.dim() != 1:
            continue
        width, leaf = weight.shape[0], name.rsplit(".", 1)[-1]
        heads = shape.heads if leaf.startswith("q") else shape.kv_heads if leaf.startswith("k") else 1
        total += width * (heads if width == shape.head_dim else 1)
    return total


def _expert_counts(model: torch.nn.Module, blocks: list[torch.nn.Module]) -> ExpertCounts:
    """The routed experts' parameters: modules of fused 3-D stacks (as expert parallelism finds them) and the
    adapters of the PEFT wrappers around them (PEFT's ParamWrapper, known by its get_param: a job without LoRA never
    imports PEFT)."""

    def expert_params(root: torch.nn.Module) -> list[torch.nn.Parameter]:
        found: dict[int, torch.nn.Parameter] = {}
        for module in root.modules():
            own = list(module.parameters(recurse=False))
            if hasattr(module, "num_experts") and any(p.dim() == 3 for p in own):
                found.update((id(p), p) for p in own)
            if hasattr(module, "get_param") and hasattr(module, "lora_A") and module.get_param().ndim == 3:
                adapters = [*module.lora_A.parameters(), *module.lora_B.parameters()]
                found.update((id(p), p) for p in adapters)
        return list(found.values())

    def sizes(params: list[torch.nn.Parameter]) -> tuple[int, int]:
        return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)

    total, trainable = sizes(expert_params(model))
    block_total, block_trainable = max((sizes(expert_params(block)) for block in blocks), default=(0, 0))
    return ExpertCounts(total, trainable, block_total, block_trainable)


def _lora_layers(block: torch.nn.Module) -> list[torch.nn.Module]:
    """The block's LoRA layers (PEFT's: imported only for a LoRA model)."""
    from peft.tuners.lora import LoraLayer

    return [m for m in block.modules() if isinstance(m, LoraLayer)]


def _grouped_expert_wrappers(lora_layers: list[torch.nn.Module]) -> set[int]:
    """ids of the ParamWrappers that lora.moe_adapter grouped runs as low-rank products (never folded)."""
    if not lora_layers:
        return set()
    from trainyard.model.moe_lora import GroupedExpertsLora, wrapper_chain

    return {id(w) for m in lora_layers if isinstance(m, GroupedExpertsLora) for w in wrapper_chain(m)}


def _sizes(block: torch.nn.Module) -> tuple[int, int]:
    params = list(block.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)
