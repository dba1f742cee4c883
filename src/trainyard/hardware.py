"""What the machines are: dense matmul peaks by the exact device name CUDA reports, the device kinds a plan or an
estimate targets (memory, links, the network their nodes usually have), and the one FLOP counter that MFU and
the estimate share. Imports no other room.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import psutil
import torch

from trainyard.errors import OptionError

# Dense (no sparsity) tensor-core peaks in FLOP/s, keyed by the exact name CUDA reports, then by
# the precision the matmuls run in. Substrings would mistake an L40 for an L4 and a PCIe H100 for
# an SXM one; a device not listed reports achieved FLOP/s and an MFU of null.
_HOPPER_SXM = {"bf16": 989e12, "fp16": 989e12, "tf32": 494.5e12, "fp32": 67e12}


_HOPPER_NVL = {"bf16": 835.5e12, "fp16": 835.5e12, "tf32": 417.5e12, "fp32": 60e12}


_A100 = {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}


DEVICE_PEAK_FLOPS: dict[str, dict[str, float]] = {
    "NVIDIA H100 80GB HBM3": _HOPPER_SXM,
    "NVIDIA H100 PCIe": {"bf16": 756.5e12, "fp16": 756.5e12, "tf32": 378e12, "fp32": 51e12},
    "NVIDIA H100 NVL": _HOPPER_NVL,
    "NVIDIA H200": _HOPPER_SXM,
    "NVIDIA H200 NVL": _HOPPER_NVL,
    "NVIDIA GH200 480GB": _HOPPER_SXM,
    "NVIDIA A100-SXM4-80GB": _A100,
    "NVIDIA A100-SXM4-40GB": _A100,
    "NVIDIA A100 80GB PCIe": _A100,
    "NVIDIA A100-PCIE-40GB": _A100,
    "NVIDIA L40S": {"bf16": 362e12, "fp16": 362e12, "tf32": 183e12, "fp32": 91.6e12},
    "NVIDIA L40": {"bf16": 181e12, "fp16": 181e12, "tf32": 90.5e12, "fp32": 90.5e12},
    "NVIDIA L4": {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12},
    "NVIDIA A10": {"bf16": 125e12, "fp16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12},
}


_PRECISIONS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def peak_flops(device_name: str, precision: str) -> float | None:
    """The dense peak of this exact device in this precision (bf16, fp16, tf32, fp32), or None."""
    return DEVICE_PEAK_FLOPS.get(device_name.strip(), {}).get(precision)


def matmul_precision(dtype: torch.dtype) -> str | None:
    """The precision the matmuls of `dtype` tensors run in: fp32 ones use TF32 cores when allowed."""
    precision = _PRECISIONS.get(dtype)
    if precision == "fp32" and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return precision


def device_peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """MFU's denominator; None (MFU null) off CUDA or on a device or precision not listed."""
    if device.type != "cuda":
        return None
    precision = matmul_precision(dtype)
    return peak_flops(torch.cuda.get_device_name(device), precision) if precision else None


@dataclass(frozen=True)
class FlopShape:
    """What a training token costs in FLOPs, read from the model once (`flop_shape`); the documents come per step."""

    active: float
    """Matmul weights a token passes through: every weight of two or more dimensions but the embedding lookup (a
    tied lm_head counts once, as the lm_head), routed experts at top-k of all (shared experts and dense layers in
    full). Norms and biases are not matmuls. A state layer's weights count so too: its projections, its convolution
    (2 FLOPs per weight and token, as a depthwise kernel runs), its A (one multiply-add per state and token)."""
    trainable: float
    """Of those, the ones with weight gradients (LoRA: the adapters alone)."""
    heads: int
    qk_head_dim: int
    """Per head, the width queries and keys multiply over (MLA: its nope + rope dims)."""
    v_head_dim: int
    windows: tuple[int | None, ...]
    """Per attention layer, its sliding window (None: full causal attention); () where no layer attends."""


def flop_shape(model: torch.nn.Module) -> FlopShape:
    """The model's FlopShape, from its parameters (meta ones too) and its HF config."""
    config = model.config
    routed_share = _routed_share(config)
    lookup = _lookup_only(model)
    active = trainable = 0.0
    for name, weight in model.named_parameters():
        if weight.ndim < 2 or name.endswith("bias") or weight is lookup:
            continue
        share = routed_share if "experts" in name.split(".") else 1.0
        active += weight.numel() * share
        trainable += weight.numel() * share if weight.requires_grad else 0.0
    heads = getattr(config, "num_attention_heads", None) or 0  # 0: no attention layer (Mamba, Mamba2)
    if not heads:
        return FlopShape(active, trainable, 0, 0, 0, ())
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if getattr(config, "qk_nope_head_dim", None):  # MLA: head_dim names the rope part alone
        head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    return FlopShape(active, trainable, heads, head_dim, getattr(config, "v_head_dim", None) or head_dim,
                     _windows(config))


def _routed_share(config) -> float:  # type: ignore[no-untyped-def]
    """The share of a routed expert stack one token runs through: top-k of the experts (1 on a dense model)."""
    experts = next((getattr(config, field) for field in ("n_routed_experts", "num_local_experts", "num_experts")
                    if getattr(config, field, None)), 0)
    return (getattr(config, "num_experts_per_tok", None) or experts) / experts if experts else 1.0


def _lookup_only(model: torch.nn.Module) -> torch.nn.Parameter | None:
    """The input embedding, unless the lm_head multiplies by it too (tied): a lookup costs no FLOPs."""
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    return None if head is not None and head.weight is embedding else embedding


def _windows(config) -> tuple[int | None, ...]:  # type: ignore[no-untyped-def]
    """Per layer, the window its attention sees: transformers' layer_types, else sliding_window on every layer."""
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    kinds = getattr(config, "layer_types", None) or ["sliding_attention"] * config.num_hidden_layers
    return tuple(window if kind == "sliding_attention" else None for kind in kinds)


def attended_pairs(length: float, window: int | None) -> float:
    """(query, key) pairs a causal document of `length` tokens scores: query i sees keys 0..i, or the last `window`
    of them (transformers' rule, key > query - window)."""
    if window is None or window >= length:
        return length * (length + 1) / 2
    return window * (window + 1) / 2 + (length - window) * window


def attention_flops(shape: FlopShape, documents: Sequence[float]) -> float:
    """Forward scores (Q K^T) and weighted values (P V) of every layer, each document on its own: 2 x heads x
    (qk + v head dims) per attended pair. Causal attention counts only the pairs a query sees, what varlen and
    flash kernels compute (torch's FlopCounterMode counts sdpa's full length x length square)."""
    width = 2 * shape.heads * (shape.qk_head_dim + shape.v_head_dim)
    return width * sum(count * sum(attended_pairs(n, window) for n in documents)
                       for window, count in Counter(shape.windows).items())


def forward_flops(shape: FlopShape, documents: Sequence[float]) -> float:
    """One forward over the documents' tokens: 2 x active per token, and attention."""
    return 2 * shape.active * sum(documents) + attention_flops(shape, documents)


def training_flops(shape: FlopShape, documents: Sequence[float]) -> float:
    """Model FLOPs of forward and backward over these documents (real tokens: padding computed is not counted).
    Backward: activation gradients cost the forward's matmuls again (2 x active) and attention's twice (dQ, dK,
    dV and the scores'); weight gradients 2 x trainable per token (LoRA: frozen weights take none). Recomputation
    (activation checkpointing) is not model FLOPs."""
    attention = attention_flops(shape, documents)
    return (4 * shape.active + 2 * shape.trainable) * sum(documents) + 3 * attention


def flops_per_token(shape: FlopShape, documents: Sequence[float]) -> float:
    """training_flops over these documents, per token."""
    return training_flops(shape, documents) / max(sum(documents), 1)


MIB = 2**20


GIB = 2**30


# Nominal dense peak of a CPU node in bf16/fp32 (no table can know it): only for step-time orders of magnitude.
CPU_PEAK_FLOPS = 1e12


@dataclass(frozen=True)
class Gpu:
    """One device kind: memory as nvidia-smi reports it, its entry in metrics' peak table, the
    intra-node bandwidth one direction of its links gives a ring collective (GB/s), and the network a node of
    that kind usually has (Gb/s per node, its reference design's NICs)."""

    name: str
    memory_bytes: int
    device_name: str | None
    intra_node_gbytes_s: float
    node_network_gbps: float = 100.0
    network_words: str = "100 Gb/s Ethernet"


GPUS: dict[str, Gpu] = {
    # NVLink 4: 900 GB/s both ways; DGX/HGX H100 and H200 nodes: 8 ConnectX-7 at 400 Gb/s (one per GPU)
    "h100-80gb": Gpu("h100-80gb", 81559 * MIB, "NVIDIA H100 80GB HBM3", 450.0, 3200.0, "8 x 400 Gb/s InfiniBand"),
    "h100-pcie": Gpu("h100-pcie", 81559 * MIB, "NVIDIA H100 PCIe", 64.0, 400.0, "one 400 Gb/s NIC"),  # PCIe 5 x16
    "h200": Gpu("h200", 143771 * MIB, "NVIDIA H200", 450.0, 3200.0, "8 x 400 Gb/s InfiniBand"),
    # NVLink 3; DGX A100: 8 ConnectX-6 at 200 Gb/s
    "a100-80gb": Gpu("a100-80gb", 81920 * MIB, "NVIDIA A100-SXM4-80GB", 300.0, 1600.0, "8 x 200 Gb/s InfiniBand"),
    "a100-40gb": Gpu("a100-40gb", 40960 * MIB, "NVIDIA A100-SXM4-40GB", 300.0, 1600.0, "8 x 200 Gb/s InfiniBand"),
    "l4": Gpu("l4", 23034 * MIB, "NVIDIA L4", 32.0, 100.0, "100 Gb/s Ethernet"),  # PCIe 4 x16; cloud L4 nodes
    # shared-memory gloo, order of magnitude; CPU nodes on 10 Gb/s Ethernet
    "cpu": Gpu("cpu", psutil.virtual_memory().total, None, 10.0, 10.0, "10 Gb/s Ethernet"),
}


NETWORK_PRESETS = {"socket": (100.0, "TCP sockets (dist.network: socket)"), "wan": (1.0, "a WAN (dist.network: wan)")}
"""Links a dist.network preset implies, Gb/s per node: TCP on 100 Gb/s Ethernet (seed 000's cluster), a 1 Gb/s WAN."""


def network_of(kind: Gpu, preset: str) -> tuple[float, str]:
    """The inter-node link assumed when none is given: the preset's, else the device kind's usual network."""
    if preset in NETWORK_PRESETS:
        gbps, words = NETWORK_PRESETS[preset]
        return min(gbps, kind.node_network_gbps), words
    return kind.node_network_gbps, f"{kind.network_words}, usual for {kind.name} nodes"


def kind_of_gres_type(name: str) -> str | None:
    """The device kind a Slurm GRES type names (`gpu:h100:8`), or None. Sites name types freely (h100, H100-80GB,
    AutoDetect=nvml's nvidia_h100_80gb_hbm3): matched by the model, then form factor and memory. An A100 without
    80 GB in its name is taken as the 40 GB one (the smaller, so a job that fits is sure to); an H100 NVL or a
    GH200 has no kind here."""
    name = name.lower().replace("_", "-")
    if "gh200" in name or "nvl" in name:
        return None
    if "h200" in name:
        return "h200"
    if "h100" in name:
        return "h100-pcie" if "pcie" in name else "h100-80gb"
    if "a100" in name:
        return "a100-80gb" if "80g" in name else "a100-40gb"
    return "l4" if name in ("l4", "nvidia-l4") else None


def gpu(name: str) -> Gpu:
    """The device kind by name; an unknown one lists the known."""
    if name not in GPUS:
        raise OptionError(f"--gpu {name} is not a known device", fix=f"use one of: {', '.join(GPUS)}")
    return GPUS[name]


def kind_peak_flops(kind: Gpu, dtype: torch.dtype) -> float:
    """Dense matmul peak of one device in the compute dtype (metrics' table; fp32 matmuls as TF32)."""
    if kind.device_name is None:
        return CPU_PEAK_FLOPS
    precision = "tf32" if dtype == torch.float32 else matmul_precision(dtype)
    return peak_flops(kind.device_name, precision or "bf16") or CPU_PEAK_FLOPS


def device_bytes(kind: Gpu, processes_per_node: int) -> int:
    """One rank's memory: the GPU's, or on CPU the machine's shared by its processes (as parallel.py counts)."""
    return kind.memory_bytes // processes_per_node if kind.device_name is None else kind.memory_bytes
