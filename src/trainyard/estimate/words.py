"""The estimate's result and its words: the table `trainyard estimate` prints, its JSON, and the phrases the dry
run's estimate lines share with it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from trainyard import hardware as machines
from trainyard.estimate import memory as mem
from trainyard.estimate import timing as estimate_time
from trainyard.estimate.efficiency import DEFAULT_MFU, Efficiency


@dataclass
class Estimate:
    layout: mem.Layout
    precision: str
    accumulation: int
    total_params: int
    trainable_params: int
    memory: mem.Memory
    timing: estimate_time.Timing
    cost: dict[str, float]
    fix: str | None = None
    notes: list[str] = field(default_factory=list)
    network: str = ""
    """The inter-node link assumed, in words."""
    lengths: str = ""
    """Where the tokens per step came from."""
    micro_batch: mem.MicroBatch | None = None
    """The micro-batch memory was planned for."""
    efficiency: Efficiency = Efficiency(DEFAULT_MFU, 0.0, "full")
    """The MFU step time is priced at, and the first step's compile: measured for the path and GPU, or assumed."""
    context_parallel_why: str = ""
    """dist.context_parallel auto: why this size (context_parallel_auto)."""

    @property
    def device_bytes(self) -> int:
        return machines.device_bytes(self.layout.gpu, self.layout.gpus_per_node)

    @property
    def margin_bytes(self) -> float:
        return self.device_bytes - self.memory.peak

    @property
    def fits(self) -> bool:
        return self.margin_bytes >= 0


def to_json(result: Estimate) -> dict[str, Any]:
    """Every figure, in bytes and seconds; `fits` and `peak_bytes_per_device` first."""
    layout, memory, timed = result.layout, result.memory, result.timing
    parts = {k: v for k, v in asdict(memory).items() if k != "notes"}
    return {
        "fits": result.fits,
        "peak_bytes_per_device": memory.peak,
        "device_bytes": result.device_bytes,
        "margin_bytes": result.margin_bytes,
        "fix": result.fix,
        "gpu": layout.gpu.name,
        "gpus_per_node": layout.gpus_per_node,
        "nodes": layout.nodes,
        "strategy": layout.strategy,
        "shard_group": layout.shard,
        "expert_parallel": layout.expert_parallel,
        "context_parallel": layout.context_parallel,
        "context_parallel_why": result.context_parallel_why,
        "precision": result.precision,
        "accumulation": result.accumulation,
        "params": {"total": result.total_params, "trainable": result.trainable_params},
        "memory_bytes": parts,
        "peak_is": process_peak_words(layout),
        "assumptions": {"allocator_slack": mem.ALLOCATOR_SLACK, "cuda_context_bytes": mem.CUDA_CONTEXT_BYTES,
                        "cpu_malloc_slack": mem.CPU_MALLOC_SLACK, "cpu_runtime_bytes": mem.CPU_RUNTIME_BYTES},
        "notes": memory.notes,
        "time": {**asdict(timed), "step_s": timed.step_s, "total_s": timed.total_s},
        "efficiency": asdict(result.efficiency),
        "network": result.network,
        "tokens_from": result.lengths,
        "micro_batch": asdict(result.micro_batch) if result.micro_batch else None,
        "cost": result.cost,
    }


def render(result: Estimate) -> str:
    """The estimate as a short table for a person."""
    memory, timed, layout = result.memory, result.timing, result.layout
    parts = [("weights", memory.weights), ("lora adapters", memory.lora_adapters), ("gradients", memory.gradients),
             ("tied grad (end)", memory.tied_gradient), ("head grad (whole)", memory.head_gradient),
             ("optimizer (AdamW)", memory.optimizer), ("ddp buckets", memory.ddp_buckets),
             ("diloco outer state", memory.diloco_outer), ("diloco sync chunks", memory.diloco_sync),
             ("autocast copies", memory.mixed_precision_copies), ("fsdp buffers", memory.fsdp_buffers),
             ("nf4/fp8 weight copy", memory.low_bit_copies),
             ("ep all-to-all", memory.expert_exchange), ("cp all-to-all", memory.context_exchange),
             ("activations", memory.activations), ("logits (loss)", memory.logits),
             ("allocator slack", memory.allocator_slack), ("cuda context", memory.cuda_context),
             ("runtime (python)", memory.runtime)]
    verdict = "fits" if result.fits else "does NOT fit"
    unit, scale = ("GiB", machines.GIB) if memory.peak >= machines.GIB else ("MiB", machines.MIB)
    lines = [
        f"layout           {layout.nodes} x {layout.gpus_per_node} {layout.gpu.name}, {layout.strategy}"
        + (f" (shard group {layout.shard})" if layout.shard > 1 else "")
        + (f", expert parallel {layout.expert_parallel}" if layout.expert_parallel > 1 else "")
        + (f", context parallel {layout.context_parallel}" if layout.context_parallel > 1 else "")
        + f", {result.precision}",
        f"parameters       {result.total_params:,} total, {result.trainable_params:,} trainable",
        f"memory per device ({unit}):",
        *(f"  {name:18} {value / scale:9.2f}" for name, value in parts if value),
        f"  {'peak, live tensors':18} {memory.peak_tensor_bytes / scale:9.2f}",
        f"  {'peak, process':18} {memory.peak / scale:9.2f} of {result.device_bytes / scale:.2f}: {verdict} "
        f"(margin {result.margin_bytes / scale:+.2f}; {process_peak_words(layout)})",
        f"  {'for a micro-batch':18} {micro_batch_words(result.micro_batch)}",
    ]
    lines += [f"  note: {note}" for note in memory.notes]
    if result.fix:
        lines.append(f"cheapest fix     {result.fix}")
    lines += [
        f"step             {timed.step_s:.3g} s ({timed.compute_s:.3g} s compute at {result.efficiency.words()}; "
        f"{timed.comm_s:.3g} s communication),"
        f" {timed.tokens_per_step:,} tokens ({result.lengths}); network: {result.network}",
        f"traffic          {traffic_words(result)}",
        f"job              {timed.steps} steps: {timed.train_s / 3600:.3g} h training, "
        f"{timed.total_s / 3600:.3g} h with checkpoints and expected failures{compile_words(result)}",
        f"checkpoints      {timed.checkpoint_bytes / 1e9:.3g} GB, {timed.save_s:.3g} s each; Young/Daly interval "
        f"{timed.interval_s / 60:.3g} min (MTBF {timed.mtbf_s / 3600:.3g} h); "
        f"expected lost work {timed.lost_work_s / 60:.3g} min",
        "cost             " + ", ".join(_cost_words(result.cost)),
    ]
    if timed.reference:
        lines.insert(-3, f"reference        {reference_words(timed)}")
    return "\n".join(lines)


def compile_words(result: Estimate) -> str:
    """train.compile's first step, where the job compiles: measured for the path, or stated (estimate/efficiency.py)."""
    timed = result.timing
    if not timed.compile_s:
        return ""
    first = timed.step_s + timed.compile_s
    return f", the first step {first:.3g} s with compile ({result.efficiency.compile_words()})"


def reference_words(timed: estimate_time.Timing) -> str:
    """What DPO's reference costs, in words: where it comes from and the time (and file) it takes."""
    if timed.reference == "adapters":
        return ("DPO: the same weights with the LoRA adapters off, one forward without gradients per micro-batch "
                "(counted in the step); no extra weights")
    return (f"DPO: the initial model's log-probabilities, one forward over the data before the first step, "
            f"{timed.reference_s:.3g} s, kept in a {size_words(timed.reference_bytes)} file beside the tokenized cache "
            "(reused on resume)")


def traffic_words(result: Estimate, why: bool = True) -> str:
    """Collective bytes per step on each link, and what the routed experts take of them."""
    timed, layout = result.timing, result.layout
    words = f"{timed.within_node_bytes / 1e9:.3g} GB per GPU over NVLink"
    if layout.nodes > 1:
        words += f", {timed.across_nodes_bytes / 1e9:.3g} GB per node over the network"
    words += " per step"
    if layout.expert_parallel > 1:
        words += (f"; experts: all-to-all {timed.expert_exchanged_bytes / 1e9:.3g} GB per GPU "
                  f"({timed.expert_exchange_link}), FSDP2 gathers {timed.expert_gathered_bytes / 1e9:.3g} GB")
    elif timed.expert_gathered_bytes:
        words += f"; experts: FSDP2 gathers {timed.expert_gathered_bytes / 1e9:.3g} GB per GPU"
    if layout.context_parallel > 1:
        words += f"; context: all-to-all {timed.context_exchanged_bytes / 1e9:.3g} GB per GPU around attention"
    if why and layout.expert_parallel_why:
        words += f"; dist.expert_parallel auto -> {layout.expert_parallel}: {layout.expert_parallel_why}"
    if why and result.context_parallel_why:
        words += f"; dist.context_parallel auto -> {layout.context_parallel}: {result.context_parallel_why}"
    return words


def process_peak_words(layout: mem.Layout) -> str:
    """What the process peak is on this device: what an OOM is about."""
    return "reserved by the caching allocator + CUDA context" if layout.gpu.device_name else "RSS"


def _cost_words(cost: dict[str, float]) -> list[str]:
    words = [f"{cost['gpu_hours']:.3g} GPU-hours"]
    if "on_demand" in cost:
        words += [f"{cost['on_demand']:,.2f} on demand", f"{cost['spot']:,.2f} on spot"]
    return words


def micro_batch_words(batch: mem.MicroBatch | None) -> str:
    """Which micro-batch the peak is for, and where its size came from."""
    return f"{batch.tokens:,} tokens, documents up to {batch.longest:,} ({batch.source})" if batch else "unknown"


def size_words(size: float) -> str:
    if size < machines.MIB:
        return f"{size / 1024:.1f} KiB"
    return f"{size / machines.GIB:.1f} GiB" if size >= machines.GIB else f"{size / machines.MIB:.1f} MiB"
