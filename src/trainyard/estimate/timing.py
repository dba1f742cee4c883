"""`trainyard estimate`, time and cost: step time from FLOPs at a stated MFU plus collectives from a bandwidth
model, the job's total time, the Young/Daly checkpoint interval with the work expected to be lost, and cost.

Collectives are ring algorithms: an all-reduce moves 2(n-1)/n of the bytes through each link, an all-gather or
reduce-scatter (n-1)/n. A ring that spans nodes is as fast as its slowest link (min of NVLink and the network);
HSDP keeps gathers and reduce-scatters inside a node and sends only the gradient all-reduce across nodes, which
DiLoCo (`--diloco-h H`) makes once every H steps. Communication is not assumed to overlap compute: the step
time is an upper bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainyard import hardware
from trainyard.batch import data_ranks, largest_micro_batch
from trainyard.config import JobConfig
from trainyard.config.preference import REFERENCE_FREE
from trainyard.estimate import context as context_room
from trainyard.estimate import experts as experts_room
from trainyard.estimate import quantized
from trainyard.estimate.efficiency import Efficiency
from trainyard.estimate.memory import Dtypes, Layout, MicroBatch, Model, micro_batch_bound
from trainyard.hardware import kind_peak_flops

# Sustained write bandwidth of the checkpoint store for the whole job (stated, not measured).
DEFAULT_DISK_GBYTES_S = 2.0
# A pair's entry in full fine-tuning's kept reference file (preference/reference.py): two float64 log-probabilities
# as JSON writes them, e.g. "[-41.53203582763672, -157.90121841430664], " (stated: 42.6 bytes a pair measured on
# random log-probabilities of -40 +- 20).
REFERENCE_BYTES_PER_PAIR = 44


def dpo_reference(cfg: JobConfig) -> str | None:
    """What DPO's reference costs the job: "adapters" (LoRA: one more forward per micro-batch, without gradients,
    with the adapters off; no weights held), "precomputed" (full fine-tuning: one forward over the data before the
    first step, kept in a small file), or None (SFT, or a reference-free loss)."""
    if cfg.train.objective != "dpo" or cfg.dpo.loss in REFERENCE_FREE:
        return None
    return "adapters" if cfg.lora.enabled else "precomputed"


def documents_per_row(cfg: JobConfig) -> int:
    """A DPO row is a pair: its chosen and rejected documents, each with the prompt, each cut at data.max_length."""
    return 2 if cfg.train.objective == "dpo" else 1


@dataclass(frozen=True)
class Lengths:
    """Token lengths of the job's documents (truncated at data.max_length), read from its data, or unknown."""

    documents: tuple[int, ...] = ()
    source: str = "data.max_length (the data was not read)"
    rows: float = 0.0
    """Usable rows of the whole data, where it was read."""
    batch_why: str = "the data was not read"
    """Where the micro-batch memory is planned for comes from: with documents, which rows they are; without, why
    every row is taken to fill data.max_length."""

    def rows_of(self, cfg: JobConfig) -> list[int]:
        """Each training row's tokens: a document, or a DPO pair's two."""
        per_row = documents_per_row(cfg)
        return [sum(self.documents[i : i + per_row]) for i in range(0, len(self.documents), per_row)]

    def largest_micro_batch(self, cfg: JobConfig) -> MicroBatch:
        """The micro-batch memory is planned for: the data's largest as the job collates it (the first step's under
        train.worst_batch_first), or where the data was not read every row filling data.max_length. Under
        train.micro_batch_tokens N: N tokens, or the longest row where it is longer (a micro-batch of its own);
        auto, before the plan resolves it, plans as micro_batch_size rows do."""
        budget = cfg.train.micro_batch_tokens
        tokens_words = f"train.micro_batch_tokens {budget:,}, " if isinstance(budget, int) else ""
        if not self.documents and tokens_words:
            row = documents_per_row(cfg) * cfg.data.max_length
            return MicroBatch(max(budget, row), cfg.data.max_length, tokens_words + self.batch_why)
        if not self.documents:
            bound = micro_batch_bound(cfg)
            return MicroBatch(bound.tokens, bound.longest, f"micro_batch_size x data.max_length: {self.batch_why}")
        tokens, _ = largest_micro_batch(self.rows_of(cfg), cfg)
        return MicroBatch(tokens, max(self.documents), tokens_words + self.batch_why)

    def row_tokens(self, cfg: JobConfig) -> list[int]:
        """Each training row's tokens as collated, longest first: packed rows each fill data.max_length (as many as
        the documents fill), others are a document or a DPO pair; unread, one row of data.max_length (x 2 a pair)."""
        if not self.documents:
            return [documents_per_row(cfg) * cfg.data.max_length]
        if cfg.data.packing:
            full, left = divmod(sum(self.documents), cfg.data.max_length)
            return [cfg.data.max_length] * full + ([left] if left else [])
        return sorted(self.rows_of(cfg), reverse=True)

    def per_row(self, cfg: JobConfig) -> tuple[float, tuple[float, ...]]:
        """(tokens computed per micro-batch row, the documents whose tokens and attention the rows compute) as the
        job batches: packing fills rows of max_length with whole documents, each attending to itself;
        padding-free computes each document's own tokens; padding computes the longest of the micro-batch's
        rows for each. A DPO row holds a pair's two documents."""
        data, length, per_row = cfg.data, cfg.data.max_length, documents_per_row(cfg)
        if not self.documents:
            return per_row * length, (length,) * per_row
        if data.packing:
            return length, self.documents
        if data.padding_free:
            return per_row * sum(self.documents) / len(self.documents), self.documents
        padded = expected_max(sorted(self.rows_of(cfg)), cfg.train.micro_batch_size)
        return padded, (padded,)


def expected_max(ordered: list[int], draws: int) -> float:
    """E[max of `draws` documents drawn from the empirical lengths]: the length a padded micro-batch computes."""
    n = len(ordered)
    return sum(x * ((i / n) ** draws - ((i - 1) / n) ** draws) for i, x in enumerate(ordered, start=1))


@dataclass(frozen=True)
class Timing:
    """Seconds per optimizer step and for the job, with the failure model's figures."""

    flops_per_token: float
    tokens_per_step: int
    compute_s: float
    comm_s: float
    checkpoint_bytes: float
    save_s: float
    mtbf_s: float
    interval_s: float
    """Young/Daly: sqrt(2 x save time x MTBF of the job)."""
    steps: int
    train_s: float
    expected_failures: float
    lost_work_s: float
    """Per failure half an interval is recomputed on average."""
    checkpoint_overhead_s: float
    reference: str | None = None
    """dpo_reference: what DPO's reference costs, in words (None: no reference)."""
    reference_s: float = 0.0
    """Full fine-tuning's DPO: the one forward over the data that computes the reference before the first step."""
    reference_bytes: float = 0.0
    """Full fine-tuning's DPO: the kept reference file."""
    within_node_bytes: float = 0.0
    """Collective bytes each GPU sends over NVLink per step."""
    across_nodes_bytes: float = 0.0
    """Collective bytes each node sends over its network link per step."""
    expert_gathered_bytes: float = 0.0
    """Routed experts' weights FSDP2 gathers into each GPU per step (part of the bytes above)."""
    expert_exchanged_bytes: float = 0.0
    """Hidden states each GPU's EP all-to-alls send per step (part of the bytes above); 0 without EP."""
    expert_exchange_link: str = "none"
    context_exchanged_bytes: float = 0.0
    """What each GPU's CP all-to-alls around attention send per step (part of the bytes above); 0 without CP."""
    compile_s: float = 0.0
    """train.compile: what the first step spends compiling the decoder blocks (estimate/efficiency.py: measured for
    the path, else stated; a GPU's auto compiles)."""

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_s

    @property
    def total_s(self) -> float:
        return self.train_s + self.lost_work_s + self.checkpoint_overhead_s + self.reference_s + self.compile_s


def flops_per_token(cfg: JobConfig, model: Model, documents: tuple[float, ...]) -> float:
    """hardware's counter (active parameters, LoRA-aware, attention per document) over the documents the rows
    compute, plus the forward that activation checkpointing recomputes: it takes time, though it is no model FLOP."""
    shape = model.counts.flops
    flops = hardware.flops_per_token(shape, documents)
    if cfg.model.gradient_checkpointing:
        flops += hardware.forward_flops(shape, documents) / sum(documents)
    return flops


def ring_all_reduce_s(size: float, ranks: int, bytes_per_s: float) -> float:
    return 2 * (ranks - 1) / ranks * size / bytes_per_s if ranks > 1 else 0.0


def all_gather_s(size: float, ranks: int, bytes_per_s: float) -> float:
    """Also a reduce-scatter's: (n-1)/n of the unsharded size through each link."""
    return (ranks - 1) / ranks * size / bytes_per_s if ranks > 1 else 0.0


@dataclass
class Traffic:
    """Bytes of collectives per optimizer step by link, and their seconds: within a node (NVLink) each GPU's,
    across nodes each node's, since a node's GPUs share its network link."""

    within_node: float = 0.0
    """Bytes each GPU sends over NVLink."""
    across_nodes: float = 0.0
    """Bytes each node sends over its network link."""
    seconds: float = 0.0

    def ring(self, size: float, ranks: int, passes: float, spans_nodes: bool, intra: float, inter: float) -> None:
        """`passes` collectives over a ring of `ranks` moving (n-1)/n of `size` through each link (an all-reduce
        is 2 passes); a ring across nodes is as fast as its slowest link, and one of its links leaves each node."""
        if ranks <= 1:
            return
        moved = passes * (ranks - 1) / ranks * size
        self.within_node += moved
        self.across_nodes += moved if spans_nodes else 0.0
        self.seconds += passes * all_gather_s(size, ranks, min(intra, inter) if spans_nodes else intra)

    def across(self, per_node: float, inter: float) -> None:
        """Bytes only the network carries (HSDP's all-reduce across replicas, DiLoCo's outer sync)."""
        self.across_nodes += per_node
        self.seconds += per_node / inter

    def exchange(self, per_gpu: float, ep: int, gpus_per_node: int, intra: float, inter: float) -> None:
        """EP's all-to-all: each GPU's bytes to peers in its node go over NVLink, the rest leave the node."""
        if ep <= 1 or not per_gpu:
            return
        outside = max(0, ep - gpus_per_node) / (ep - 1)
        self.within_node += per_gpu * (1 - outside)
        self.across_nodes += per_gpu * outside * gpus_per_node
        self.seconds += per_gpu * (1 - outside) / intra + per_gpu * outside * gpus_per_node / inter


def traffic(cfg: JobConfig, model: Model, layout: Layout, size: Dtypes, accum: int, network_gbps: float,
            diloco_h: int, tokens_per_micro_batch: float) -> tuple[Traffic, experts_room.ExpertTraffic]:
    """Collectives per optimizer step: bytes by link and seconds, and what EP's experts move. Gradients are
    reduced in fp32 (bf16-mixed) or the master dtype."""
    counts, moved = model.counts, Traffic()
    intra = layout.gpu.intra_node_gbytes_s * 1e9
    inter = network_gbps * 1e9 / 8
    spans = layout.nodes > 1
    gradients = counts.trainable * (4 if size.mixed else size.master)
    element = (size.compute, size.frozen if cfg.lora.enabled else size.master, size.master, size.mixed)
    ep = layout.expert_parallel
    experts = experts_room.traffic(cfg, model.shape, counts, ep, layout.shard, layout.gpus_per_node, accum,
                                   tokens_per_micro_batch / layout.context_parallel, element)  # a rank's CP slice
    if layout.strategy == "ddp":
        if spans and diloco_h > 1:  # inner steps sync a node; outer steps every H cross nodes
            moved.ring(gradients, layout.gpus_per_node, 2, False, intra, inter)
            moved.across(2 * (layout.nodes - 1) / layout.nodes * gradients / diloco_h, inter)
        else:
            moved.ring(gradients, layout.world, 2, spans, intra, inter)
        return moved, experts
    if layout.strategy not in ("fsdp", "hsdp"):
        return moved, experts
    ring_spans = spans and layout.strategy == "fsdp"
    reduces = 1 if cfg.dist.defer_grad_sync else accum
    held_apart = layout.shard // ep
    expert_part = experts_room.gathered_bytes(counts.experts.total, counts.experts.trainable, *element) if ep > 1 else 0
    gathered = experts_room.gathered_bytes(counts.total, counts.trainable, *element) - expert_part
    gathered -= quantized.gather_saving(cfg, counts.low_bit, size.compute if size.mixed else size.master, size.frozen)
    moved.ring(gathered, layout.shard, accum * 2, ring_spans, intra, inter)  # forward, and again for backward
    moved.ring(expert_part / ep, held_apart, accum * 2, ring_spans, intra, inter)
    expert_gradients = counts.experts.trainable * (4 if size.mixed else size.master) if ep > 1 else 0
    moved.ring(gradients - expert_gradients, layout.shard, reduces, ring_spans, intra, inter)
    moved.ring(expert_gradients / ep, held_apart, reduces, ring_spans, intra, inter)
    moved.exchange(experts.exchanged, ep, layout.gpus_per_node, intra, inter)
    moved.exchange(context_bytes(cfg, model, layout, size, accum, tokens_per_micro_batch), layout.context_parallel,
                   layout.gpus_per_node, intra, inter)
    replicas = layout.world // layout.shard
    if replicas > 1:  # a node's shards share its network link: the whole gradient crosses it
        moved.across(2 * (replicas - 1) / replicas * gradients / diloco_h, inter)
    return moved, experts


def context_bytes(cfg: JobConfig, model: Model, layout: Layout, size: Dtypes, accum: int,
                  tokens_per_micro_batch: float) -> float:
    """What each GPU's CP all-to-alls send per step (estimate/context.py): its 1/N of each micro-batch's tokens."""
    cp = layout.context_parallel
    return context_room.exchange_bytes_per_step(model.shape, size.compute, cp, tokens_per_micro_batch / cp, accum,
                                                cfg.model.gradient_checkpointing)


def checkpoint_bytes(cfg: JobConfig, model: Model, size: Dtypes) -> float:
    """A full checkpoint: trainable weights and AdamW's moments (frozen weights only with save_frozen)."""
    counts = model.counts
    frozen = (counts.total - counts.trainable) * size.frozen if cfg.checkpoint.save_frozen else 0.0
    return counts.trainable * size.master * 3 + frozen


def compiles(cfg: JobConfig, layout: Layout) -> bool:
    """train.compile as parallel/compile.py resolves it: auto compiles on GPUs, not on CPU."""
    return cfg.train.compile is True or (cfg.train.compile == "auto" and layout.gpu.name != "cpu")


def young_daly_interval_s(save_s: float, mtbf_s: float) -> float:
    """The checkpoint interval that minimises save time plus expected rework: sqrt(2 C M)."""
    return math.sqrt(2 * save_s * mtbf_s)


def micro_batches_per_step(cfg: JobConfig, accum: int, per_row: float) -> tuple[int, float]:
    """(micro-batches a rank runs per step, the tokens of each): `accum` of micro_batch_size rows, or under
    train.micro_batch_tokens N as many as hold the step's rows (each at least one row), which is what FSDP gathers
    and the collectives per step count."""
    rows, budget = cfg.train.micro_batch_size * accum, cfg.train.micro_batch_tokens
    if not isinstance(budget, int):
        return accum, cfg.train.micro_batch_size * per_row
    passes = min(rows, max(1, math.ceil(rows * per_row / budget)))
    return passes, rows * per_row / passes


def timing(cfg: JobConfig, model: Model, layout: Layout, size: Dtypes, accum: int, priced: Efficiency,
           network_gbps: float, diloco_h: int, disk_gbytes_s: float, lengths: Lengths = Lengths()) -> Timing:
    """Step time, the job's time, and what failures cost it with checkpoints every Young/Daly interval; DPO's
    reference: LoRA's forward with the adapters off in every step, or full fine-tuning's pass before the first."""
    per_row, documents = lengths.per_row(cfg)
    rows_per_step = cfg.train.micro_batch_size * accum * data_ranks(cfg, layout.world)
    tokens = round(rows_per_step * per_row)
    per_token = flops_per_token(cfg, model, documents)
    forward = hardware.forward_flops(model.counts.flops, documents) / sum(documents)
    reference = dpo_reference(cfg)
    if reference == "adapters":
        per_token += forward
    flops_per_s = layout.world * kind_peak_flops(layout.gpu, size.compute_dtype) * priced.mfu
    compute = per_token * tokens / flops_per_s
    # Every row once (train and eval split alike); unread data: the rows the steps take.
    rows = lengths.rows or cfg.train.max_steps * rows_per_step
    reference_s = forward * rows * per_row / flops_per_s if reference == "precomputed" else 0.0
    passes, micro_tokens = micro_batches_per_step(cfg, accum, per_row)
    moved, experts = traffic(cfg, model, layout, size, passes, network_gbps, diloco_h, micro_tokens)
    comm = moved.seconds
    ckpt = checkpoint_bytes(cfg, model, size)
    save = ckpt / (disk_gbytes_s * 1e9)
    mtbf = cfg.checkpoint.mtbf_hours * 3600 / layout.nodes
    interval = young_daly_interval_s(save, mtbf)
    train = cfg.train.max_steps * (compute + comm)
    failures = train / mtbf
    return Timing(
        flops_per_token=per_token,
        tokens_per_step=tokens,
        compute_s=compute,
        comm_s=comm,
        checkpoint_bytes=ckpt,
        save_s=save,
        mtbf_s=mtbf,
        interval_s=interval,
        steps=cfg.train.max_steps,
        train_s=train,
        expected_failures=failures,
        lost_work_s=failures * min(interval, train) / 2,
        checkpoint_overhead_s=(train / interval) * save if interval > 0 else 0.0,
        reference=reference,
        reference_s=reference_s,
        reference_bytes=rows * REFERENCE_BYTES_PER_PAIR if reference == "precomputed" else 0.0,
        within_node_bytes=moved.within_node,
        across_nodes_bytes=moved.across_nodes,
        expert_gathered_bytes=experts.gathered,
        expert_exchanged_bytes=experts.exchanged,
        expert_exchange_link=experts.link,
        context_exchanged_bytes=context_bytes(cfg, model, layout, size, passes, micro_tokens),
        compile_s=priced.compile_s,
    )


def cost(timed: Timing, layout: Layout, price_per_gpu_hour: float | None, spot_discount: float) -> dict[str, float]:
    """GPU-hours, and their price on demand and on spot (spot preemptions beyond the MTBF are not modelled)."""
    gpu_hours = timed.total_s / 3600 * layout.world
    if price_per_gpu_hour is None:
        return {"gpu_hours": gpu_hours}
    on_demand = gpu_hours * price_per_gpu_hour
    return {"gpu_hours": gpu_hours, "on_demand": on_demand, "spot": on_demand * (1 - spot_discount)}
