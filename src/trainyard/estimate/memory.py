"""`trainyard estimate`, memory: per-device memory of a job before launch, from its config alone (no weights read), and
whether it fits; step time and cost are in estimate_time.py.

Memory is the sum of named parts, each a count times the bytes its dtype takes (precision.py's dtypes): weights,
gradients and AdamW's two moments (divided by the shard group under FSDP2/HSDP), DDP's gradient buckets, DiLoCo's
outer state and sync chunks, autocast's bf16 copies of fp32 weights, FSDP2's unsharded buffers, activations
(layer_memory.py's per-layer formula of the tensors autograd saves, block by block where state layers differ:
state_memory.py; with or without activation checkpointing) and the loss's logits. Their sum at the step's worst
moment is `peak_tensor_bytes`, the live tensor bytes. `peak` is what the process holds at its peak, the figure an
OOM is about: on a GPU the caching allocator's reservation (`max_memory_reserved`: live bytes and its slack) and the
CUDA context; on a CPU the process's RSS (live bytes, what malloc keeps of freed memory, and the interpreter with
its libraries, measured in benchmarks/RESULTS.md).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trainyard import precision as precision_room
from trainyard.batch import MicroBatch, accumulation_steps, data_ranks
from trainyard.config import JobConfig
from trainyard.config.preference import REFERENCE_FREE
from trainyard.estimate import arch as estimate_arch
from trainyard.estimate import attention_memory
from trainyard.estimate import context as context_room
from trainyard.estimate import experts as experts_room
from trainyard.estimate import layer_memory
from trainyard.estimate import quantized as quantized_room
from trainyard.estimate.arch import Counts, Shape
from trainyard.estimate.elements import Dtypes
from trainyard.hardware import GIB, Gpu, device_bytes

# The CUDA caching allocator's fragmentation and rounding, as a share of live tensor bytes (stated, not measured).
ALLOCATOR_SLACK = 0.10
# CUDA context, cuBLAS/NCCL workspaces: device memory no tensor accounts for.
CUDA_CONTEXT_BYTES = 1 * GIB
# On a CPU device: what malloc keeps of freed tensor memory, as a share of live tensor bytes, and the process's
# interpreter, torch, transformers, peft and process group before any model (RSS), under the malloc the launcher
# preloads (launch/allocator.py). Measured (benchmarks/memory/estimate_accuracy.py, benchmarks/RESULTS.md).
CPU_MALLOC_SLACK = 0.10
CPU_RUNTIME_BYTES = 0.45 * GIB
# Logits at target positions, bytes per element at the loss's backward: log_softmax's saved fp32 output, the
# fp32 gradient arriving from the loss, and log_softmax's fp32 input gradient, alive at once.
LOGIT_BYTES = 12
# A chunk of the chunked loss at its largest: fp32 logits (4 bytes, turned into their gradient in place) and, in
# bf16, that gradient cast for the products (2); in fp32 the cast is the same tensor.
CHUNK_LOGIT_BYTES = 6
# With final_logit_softcapping, at the chunk's gradient: its fp32 logits, their tanh, its square and 1 - square.
CAPPED_CHUNK_LOGIT_BYTES = 16
LOSS_CHUNK_BYTES = 256 * 2**20  # as loss.LOSS_CHUNK_BYTES (the estimate never imports torch-side rooms)
CHUNKED_LOSS_FAMILIES = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3_text", "phi3", "olmo2",
    "glm4_moe", "deepseek_v3", "gpt_oss",
})
"""As loss.CHUNKED_FAMILIES: the families whose loss runs in chunks; any other keeps its whole logits."""


@dataclass(frozen=True)
class Layout:
    """Where the job runs: device kind, processes per node and nodes, the strategy and its shard group."""

    gpu: Gpu
    gpus_per_node: int
    nodes: int
    strategy: str
    shard: int
    """Ranks the training state is divided over: 1 (none, ddp), the world (fsdp), the shard group (hsdp)."""
    expert_parallel: int = 1
    """EP size: each rank holds experts / it of every MoE layer's routed experts (estimate/experts.py)."""
    expert_parallel_why: str = ""
    """dist.expert_parallel auto: why this size."""
    context_parallel: int = 1
    """CP size: each rank holds tokens / it of every row through the block (estimate/context.py)."""

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass
class Memory:
    """Bytes per device, by part. Activations and logits are for one micro-batch."""

    weights: float
    lora_adapters: float
    gradients: float
    optimizer: float
    ddp_buckets: float
    diloco_outer: float
    """DiLoCo's round-start weights and outer momentum, fp32."""
    diloco_sync: float
    """DiLoCo's outer sync: its chunk buffers, made once, and what its collectives hold (diloco/outer.py)."""
    mixed_precision_copies: float
    fsdp_buffers: float
    activations: float
    logits: float
    recomputed_layer: float = 0.0
    """With activation checkpointing: the one layer's activations rebuilt in backward (part of `activations`)."""
    tied_gradient: float = 0.0
    """A trainable tied embedding's second gradient at the end of backward, while the head's is held."""
    expert_exchange: float = 0.0
    """EP's all-to-all buffers of one MoE layer: the routed (token, expert) rows sent and those received."""
    context_exchange: float = 0.0
    """CP's all-to-all buffers of one layer's attention: q, k and v sent and received."""
    embedding_gather: float = 0.0
    """FSDP2's all-gather of an untied embedding at the forward's start (its own moment, beside the static state)."""
    low_bit_copies: float = 0.0
    """nf4: the one weight a product dequantizes at a time; fp8: the one weight cast to FP8, and its transpose."""
    attention_workspace: float = 0.0
    """One layer's attention at its worst moment, beside every layer's saved tensors (attention_memory.workspace)."""
    head_activations: float = 0.0
    """The final norm's and the head's saved inputs (part of `activations`): freed before any layer's backward."""
    layer_workspace: float = 0.0
    """One layer's backward at its widest op beside its saved tensors: its MLP's or state layer's input gradients
    (layer_memory.workspace_per_token)."""
    head_gradient: float = 0.0
    """A trainable head's gradient, whole (FSDP2 reduces the root's only after the backward): the chunked loss makes
    it in its forward (loss.py), the plain head in the first op of backward; either way beside every activation."""
    peak_tensor_bytes: float = 0.0
    """Live tensor bytes at the step's peak."""
    allocator_slack: float = 0.0
    """What the allocator holds beyond live tensors: CUDA's caching allocator, or malloc's retention on a CPU."""
    cuda_context: float = 0.0
    runtime: float = 0.0
    """On a CPU device, the interpreter and its libraries (on a GPU they are host memory: estimate/host.py)."""
    notes: list[str] = field(default_factory=list)

    @property
    def peak(self) -> float:
        """The process's peak: reserved device memory and context on a GPU, RSS on a CPU."""
        return self.peak_tensor_bytes + self.allocator_slack + self.cuda_context + self.runtime


@dataclass(frozen=True)
class Model:
    """What the formulas need of a job's model."""

    shape: Shape
    counts: Counts


_MODELS: dict[str, Model] = {}
"""model_of's results by what decides them: a plan estimates one job several times (each strategy `auto` weighs,
CP's and the micro-batch's choices), and a meta build with LoRA costs a second for 135M, tens for a 108B MoE."""


def model_of(cfg: JobConfig) -> Model:
    """The job's model, meta-built: shapes and parameter counts, nothing read."""
    key = _model_key(cfg)
    if key in _MODELS:
        return _MODELS[key]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        config = estimate_arch.hf_config(cfg)
        shape = estimate_arch.shape_of(config)
        model = Model(shape, estimate_arch.count(estimate_arch.meta_model(cfg, config), shape))
    if len(_MODELS) >= 32:  # a process that plans many jobs (the tests) keeps the newest
        _MODELS.pop(next(iter(_MODELS)))
    _MODELS[key] = model
    return model


def _model_key(cfg: JobConfig) -> str:
    """The model and LoRA settings, with a local folder's config.json as it reads now (a folder rewritten in place
    is built again; its modification time can repeat within a clock tick)."""
    path = Path(cfg.model.path).expanduser() / "config.json" if cfg.model.path else None
    written = path.read_text() if path is not None and path.is_file() else None
    return f"{cfg.model.model_dump_json()}|{cfg.lora.model_dump_json()}|{written}"


def resolve_precision(cfg: JobConfig, kind: Gpu) -> precision_room.Precision:
    """train.precision on that device: auto is bf16-mixed on every GPU listed (all have bf16), this CPU's own
    choice on cpu."""
    if kind.device_name is not None and cfg.train.precision == "auto":
        cfg = cfg.model_copy(deep=True)
        cfg.train.precision = "bf16-mixed"
    return precision_room.resolve(cfg, torch.device("cpu"))


def dtypes(cfg: JobConfig, precision: precision_room.Precision, strategy: str) -> Dtypes:
    """Bytes per element of each kind of tensor the job holds, for this precision and strategy."""
    size = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}
    master, frozen, compute = (size[precision.trainable_dtype], size[precision.frozen_dtype],
                               size[precision.compute_dtype])
    base = frozen if cfg.lora.enabled else master
    sharded = _sharded(cfg, strategy)
    residual = compute if (precision.mixed and sharded) else base
    return Dtypes(master, frozen, compute, residual, precision.mixed, precision.compute_dtype, residual,
                  precision.mixed and not sharded)


def resolve_strategy(cfg: JobConfig, model: Model, kind: Gpu, gpus_per_node: int, nodes: int) -> Layout:
    """The layout of dist.strategy, as given or as estimate.auto_strategy resolved auto (by the peaks it
    estimates: the rule the dry run and `train` share)."""
    world = gpus_per_node * nodes
    strategy = "none" if world == 1 else cfg.dist.strategy
    if strategy == "auto":
        raise ValueError("dist.strategy auto reaches the layout unresolved: resolve it with estimate.auto_strategy")
    shard = shard_size(cfg, strategy, world, gpus_per_node)
    ep, why = expert_parallel(cfg, model, kind, strategy, shard, gpus_per_node, world)
    return Layout(kind, gpus_per_node, nodes, strategy, shard, ep, why, context_room.context_size(cfg, strategy))


def expert_parallel(cfg: JobConfig, model: Model, kind: Gpu, strategy: str, shard: int, gpus_per_node: int,
                    world: int) -> tuple[int, str]:
    """dist.expert_parallel's size in this layout, and for auto why (experts_room.choose: the plan's decision)."""
    requested = cfg.dist.expert_parallel
    if requested != "auto":
        return (requested if strategy in ("fsdp", "hsdp") else 1), ""
    size = dtypes(cfg, resolve_precision(cfg, kind), strategy)
    element = (size.compute, size.frozen if cfg.lora.enabled else size.master, size.master, size.mixed)
    context = cfg.dist.context_parallel  # auto: resolved on the EP size this picks (estimate.context_parallel_auto)
    context = 1 if context == "auto" else context_room.context_size(cfg, strategy)
    return experts_room.choose(cfg, model.shape, model.counts, strategy, shard, gpus_per_node,
                               accumulation_steps(cfg, data_ranks(cfg, world)),
                               tokens_per_micro_batch(cfg) / context, element, context)


def shard_size(cfg: JobConfig, strategy: str, world: int, gpus_per_node: int) -> int:
    """How many ranks hold one copy of the state between them."""
    if strategy == "fsdp":
        return world
    if strategy == "hsdp":
        return min(cfg.dist.shard_size or gpus_per_node, world)
    if _sharded(cfg, strategy):  # DiLoCo with FSDP within a site: a site's ranks; with HSDP: its shard groups
        groups = cfg.diloco.groups
        site = gpus_per_node if groups == "node" else max(1, world // groups)
        return min(cfg.dist.shard_size or gpus_per_node, site) if cfg.diloco.inner == "hsdp" else site
    return 1


def _sharded(cfg: JobConfig, strategy: str) -> bool:
    return strategy in ("fsdp", "hsdp") or (strategy == "diloco" and cfg.diloco.inner in ("fsdp", "hsdp"))


def tokens_per_micro_batch(cfg: JobConfig) -> int:
    """An upper bound: a padding-free or packed micro-batch holds at most micro_batch_size x max_length tokens, a
    DPO micro-batch twice that (a row is a pair: two documents, each cut at max_length)."""
    return cfg.train.micro_batch_size * cfg.data.max_length * (2 if cfg.train.objective == "dpo" else 1)


def micro_batch_bound(cfg: JobConfig) -> MicroBatch:
    """Where the data is unknown: every row fills data.max_length."""
    return MicroBatch(tokens_per_micro_batch(cfg), cfg.data.max_length)


def memory(cfg: JobConfig, model: Model, layout: Layout, precision: precision_room.Precision,
           batch: MicroBatch | None = None) -> Memory:
    """Every part of one device's memory at the step's peak, and the peak itself, for the micro-batch `batch`
    (default: micro_batch_bound); under context parallelism, the rank's 1/N of its tokens."""
    batch = context_room.rank_batch(batch or micro_batch_bound(cfg), layout.context_parallel)
    size = dtypes(cfg, precision, layout.strategy)
    counts, shard = model.counts, layout.shard
    frozen = counts.total - counts.trainable
    trainable = counts.trainable * size.master / shard
    sharded = _sharded(cfg, layout.strategy)
    replicas_bucket = layout.strategy == "ddp" or (layout.strategy == "diloco" and not sharded)
    parts = Memory(
        weights=frozen * size.frozen / shard + (0.0 if cfg.lora.enabled else trainable),
        lora_adapters=trainable if cfg.lora.enabled else 0.0,
        gradients=trainable,
        optimizer=2 * trainable,
        ddp_buckets=counts.trainable * size.master if replicas_bucket else 0.0,
        diloco_outer=2 * counts.trainable * 4 / shard if layout.strategy == "diloco" else 0.0,
        diloco_sync=_diloco_sync(cfg, counts, layout) if layout.strategy == "diloco" else 0.0,
        mixed_precision_copies=0.0 if sharded or not size.mixed else _autocast_copies(counts, size),
        fsdp_buffers=_fsdp_buffers(counts, size, layout) if sharded else 0.0,
        embedding_gather=_embedding_gather(counts, size) if sharded else 0.0,
        expert_exchange=_expert_exchange(batch, model.shape, size, layout.expert_parallel),
        context_exchange=context_room.exchange_buffer_bytes(model.shape, size.compute, layout.context_parallel,
                                                            batch.tokens),
        activations=activation_bytes(cfg, model.shape, counts, size, layout.gpu, batch),
        recomputed_layer=recomputed_layer_bytes(cfg, model.shape, counts, size, layout.gpu, batch),
        logits=_logit_bytes(cfg, model.shape, batch),
        head_activations=batch.tokens * _head_bytes_per_token(cfg, model.shape, size),
        layer_workspace=batch.tokens * layer_memory.workspace_per_token(cfg, model.shape, counts, size, layout.gpu,
                                                                        batch.longest),
        attention_workspace=attention_memory.workspace(cfg.model.attn_implementation, model.shape, counts,
                                                       layout.gpu, batch.longest, size.compute, size.residual,
                                                       layout.context_parallel),
        tied_gradient=_tied_gradient(counts, size, shard),
        head_gradient=counts.head_trainable * (size.compute if sharded and size.mixed else size.master),
    )
    if layout.expert_parallel > 1:
        parts.notes.append(_experts_note(model, layout, size, cfg.model.quantize == "nf4"))
    if layout.context_parallel > 1:
        parts.notes.append(context_room.note(layout.context_parallel, batch))
    quantized_room.adjust(parts, cfg, counts.low_bit, size, layout, sharded)
    _add_peak(parts, cfg, layout)
    if cfg.train.objective == "dpo":
        parts.notes.append(_dpo_words(cfg))
    return parts


def _dpo_words(cfg: JobConfig) -> str:
    """DPO's memory, beyond SFT's formulas over rows of two documents: no second model is held."""
    if cfg.dpo.loss in REFERENCE_FREE:
        return f"dpo ({cfg.dpo.loss}): a pair per row, chosen and rejected; no reference"
    if cfg.lora.enabled:
        return ("dpo: a pair per row, chosen and rejected; the reference is the same weights with the adapters off, "
                "a forward without gradients before the policy's (its activations freed as it goes): no extra weights")
    return ("dpo: a pair per row, chosen and rejected; the reference is the initial model's log-probabilities, "
            "computed before the first step: no second model")


def _experts_note(model: Model, layout: Layout, size: Dtypes, nf4: bool) -> str:
    """What each rank holds of the routed experts under EP (in weights and lora adapters above); with `nf4` the
    frozen ones as 4-bit codes and their int8 block scales (the weights above count the second-level scales too)."""
    ep, experts, shape = layout.expert_parallel, model.counts.experts, model.shape
    frozen = experts.total - experts.trainable
    base = (quantized_room.nf4_gathered_bytes(frozen, 0, size.frozen) if nf4 else frozen * size.frozen)
    base += experts.trainable * size.master
    again = f", sharded again over {layout.shard // ep} ranks" if layout.shard > ep else ", whole (not sharded)"
    return (f"expert parallel {ep}: each rank holds {shape.experts // ep} of the {shape.experts} routed experts of "
            f"each MoE layer{again}: {base / layout.shard / GIB:.2f} GiB of expert weights and adapters per rank")

def _autocast_copies(counts: Counts, size: Dtypes) -> float:
    """autocast casts each fp32 weight a matmul uses to bf16 once per forward and autograd saves the copy:
    trainable weights but an untied input embedding (embedding lookups are not autocast)."""
    untied_embedding = counts.embedding if not counts.tied and counts.root_trainable else 0
    return (counts.trainable - untied_embedding) * size.compute


def _diloco_sync(cfg: JobConfig, counts: Counts, layout: Layout) -> float:
    """The outer sync's largest fp32 chunk of this rank's pseudo-gradient, and the gather of its slices where a
    site's ranks split it (the collective's own copy); bf16 adds a bf16 slice; int8 the slice's codes, every site's
    codes (twice: the collective's copy) and their fp32 worth. Counted as held throughout: the buffers are."""
    site = layout.gpus_per_node if cfg.diloco.groups == "node" else max(1, layout.world // cfg.diloco.groups)
    sites, slices = layout.world // site, max(1, site // layout.shard)
    chunk = min(cfg.diloco.chunk_elements(slices), counts.trainable / layout.shard)
    part = chunk / slices
    held = 4 * chunk * (2 if slices > 1 else 1)
    if cfg.diloco.pseudo_grad_dtype == "bf16":
        held += 2 * part
    elif cfg.diloco.pseudo_grad_dtype == "int8":
        held += part * (1 + 2 * sites + 4)
    return held


def _tied_gradient(counts: Counts, size: Dtypes, shard: int) -> float:
    """The embedding's backward comes last and adds a whole new gradient to the head's, which a tied weight already
    holds: the new one and their sum (one process), or the new one and its reduce-scatter output (FSDP2) live at
    once. Measured on SmolLM2-135M full fine-tuning with checkpointing: 2 and 1.5 embeddings (shard group of 2)."""
    if not counts.tied or counts.root_trainable < counts.embedding:
        return 0.0
    return counts.embedding * size.master * (1 + 1 / shard)


def _fsdp_buffers(counts: Counts, size: Dtypes, layout: Layout) -> float:
    """FSDP2's unsharded tensors: the root (the final norm, a tied embedding) and an untied head stay gathered from
    forward to backward (an untied embedding only for its lookup: _embedding_gather); the
    largest block gathered twice at once (the current one and the prefetched next), in compute dtype under
    bf16-mixed; and that block's unsharded gradient plus its fp32 copy for the reduce-scatter. Under EP a block's
    routed experts are this rank's experts / N, gathered only where they are sharded again (shard group > N)."""
    gather = size.compute if size.mixed else size.master
    ep, experts = layout.expert_parallel, counts.experts
    block_total, block_trainable = counts.block_total, counts.block_trainable
    if ep > 1:
        again = 1 if layout.shard > ep else 0
        block_total -= experts.block_total * (1 - again / ep)
        block_trainable -= experts.block_trainable * (1 - again / ep)
    outer = counts.root_total - (counts.embedding if counts.ends_apart else 0)
    return (outer + 2 * block_total) * gather + block_trainable * (size.compute + 4)


def _embedding_gather(counts: Counts, size: Dtypes) -> float:
    """An untied embedding's all-gather as the forward starts: its output buffer and the unsharded copy FSDP2 copies
    it out into, alive together, before any block or the head is gathered."""
    return 2.0 * counts.embedding * (size.compute if size.mixed else size.master) if counts.ends_apart else 0.0


def _expert_exchange(batch: MicroBatch, shape: Shape, size: Dtypes, ep: int) -> float:
    """EP's all-to-all of one MoE layer: its rows out and the rows arriving, alive together (balanced routing)."""
    if ep <= 1:
        return 0.0
    return 2.0 * batch.tokens * shape.experts_per_token * shape.hidden * size.compute


def _logit_bytes(cfg: JobConfig, shape: Shape, batch: MicroBatch) -> float:
    """The loss's logits: one chunk of train.loss_chunk_tokens (loss.py; its fp32 logits, turned into their
    gradient in place, and that gradient in the compute dtype; soft-capped, the tanh's tensors at the gradient),
    else (chunking off, or a family loss.py does not chunk) the micro-batch's whole fp32 logits, their
    compute-dtype source and their gradient (LOGIT_BYTES each)."""
    tokens, vocab = batch.tokens, shape.vocab
    chunk = cfg.train.loss_chunk_tokens
    if chunk == 0 or shape.family not in CHUNKED_LOSS_FAMILIES:
        return float(tokens * vocab * LOGIT_BYTES)
    chunk = chunk or max(1, LOSS_CHUNK_BYTES // (4 * vocab))
    element = CAPPED_CHUNK_LOGIT_BYTES if shape.logit_softcap else CHUNK_LOGIT_BYTES
    return float(min(tokens, chunk) * vocab * element)


def _add_peak(parts: Memory, cfg: JobConfig, layout: Layout) -> None:
    """Static state, then the larger of the forward's saved tensors and the full gradients (with a tied embedding's
    second one): gradients are freed after each step (set_to_none) and fill in as activations are freed, so both
    peak at different times. With accumulation the gradients of earlier micro-batches stay while the next one's
    activations build up."""
    static = (parts.weights + parts.lora_adapters + parts.optimizer + parts.ddp_buckets + parts.diloco_outer
              + parts.diloco_sync + parts.mixed_precision_copies + parts.fsdp_buffers + parts.expert_exchange
              + parts.context_exchange + parts.low_bit_copies)
    # The logits and their gradients, and the head's saved inputs, are gone before the last layer's backward (and
    # its recompute, with checkpointing); attention's workspace comes in one layer's forward or backward, the
    # MLP's backward before it.
    recomputed = parts.recomputed_layer + max(parts.attention_workspace, parts.layer_workspace)
    head = parts.head_activations
    forward = (parts.activations - parts.recomputed_layer - head + max(recomputed, head + parts.logits)
               + parts.head_gradient)
    accumulates = accumulation_steps(cfg, data_ranks(cfg, layout.world)) > 1
    held = parts.gradients if accumulates else 0.0
    lookup = static - parts.fsdp_buffers + parts.embedding_gather
    parts.peak_tensor_bytes = max(static + max(forward + held, parts.gradients + parts.tied_gradient), lookup)
    if accumulates:
        parts.notes.append("accumulation: gradients held while the next micro-batch's activations build up")
    on_gpu = layout.gpu.device_name is not None
    parts.allocator_slack = (ALLOCATOR_SLACK if on_gpu else CPU_MALLOC_SLACK) * parts.peak_tensor_bytes
    parts.cuda_context = CUDA_CONTEXT_BYTES if on_gpu else 0.0
    parts.runtime = 0.0 if on_gpu else CPU_RUNTIME_BYTES


def activation_bytes(cfg: JobConfig, shape: Shape, counts: Counts, size: Dtypes, kind: Gpu,
                     batch: MicroBatch) -> float:
    """Saved tensors of one micro-batch: every layer's (or, with activation checkpointing, every layer's input
    plus one layer being recomputed), then the final norm and the head's input at target positions."""
    tokens = batch.tokens
    head = _head_bytes_per_token(cfg, shape, size)
    # The first whole-stack gradient of a folded expert weight, while the layer's folded weights are still saved.
    folded_gradient = counts.lora_largest_parameter * size.residual
    # The windows' masks: made once per forward, kept (saved, or cached for the recompute) until the next.
    masks = attention_memory.window_masks(cfg.model.attn_implementation, shape, counts, kind, batch.longest, tokens,
                                          size.compute, layer_memory.context_size(cfg))
    if cfg.model.gradient_checkpointing:
        inputs = tokens * shape.layers * shape.hidden * size.residual
        return (inputs + tokens * head + recomputed_layer_bytes(cfg, shape, counts, size, kind, batch) + folded_gradient
                + masks)
    # The folded expert weights (peft) or B copies (grouped) of every MoE layer stay saved until its backward.
    folded = (shape.layers - shape.dense_layers) * _expert_lora_layer_bytes(counts, size)
    per_token = head + layer_memory.stack_per_token(cfg, shape, counts, size, kind, batch.longest)
    return tokens * per_token + folded + folded_gradient + masks


def _head_bytes_per_token(cfg: JobConfig, shape: Shape, size: Dtypes) -> float:
    """The final norm (fp32 input, and its output for a trainable weight) and the head's input."""
    return layer_memory.norm_bytes(shape.hidden, size, not cfg.lora.enabled) + shape.hidden * size.residual


def recomputed_layer_bytes(cfg: JobConfig, shape: Shape, counts: Counts, size: Dtypes, kind: Gpu,
                           batch: MicroBatch) -> float:
    """Under activation checkpointing, the one layer whose activations backward rebuilds at a time; else 0."""
    return _layer_bytes(cfg, shape, counts, size, kind, batch) if cfg.model.gradient_checkpointing else 0.0


def _layer_bytes(cfg: JobConfig, shape: Shape, counts: Counts, size: Dtypes, kind: Gpu, batch: MicroBatch) -> float:
    """The largest layer's saved tensors for a micro-batch, what its expert adapters save included."""
    per_token = layer_memory.largest_per_token(cfg, shape, counts, size, kind, batch.longest)
    return batch.tokens * per_token + _expert_lora_layer_bytes(counts, size)


def _expert_lora_layer_bytes(counts: Counts, size: Dtypes) -> float:
    """What one MoE layer's expert adapters save apart from per-token tensors: lora.moe_adapter peft, the folded
    W + B·A of every adapted expert stack; grouped, only the B factors copied into grouped_mm's layout."""
    return (counts.lora_parameters_per_block + counts.lora_expert_copies_per_block) * size.residual
