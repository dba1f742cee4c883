"""Which dtypes a job keeps its weights in, computes in and reduces gradients in.

`bf16-mixed` is what large-model training means by mixed precision: trainable weights (the
masters) and AdamW's moments stay fp32, so updates far below bf16's resolution still land;
matrix products run in bf16; gradients are reduced in fp32. Frozen base weights of a LoRA job
have no update to lose, so they are stored in bf16 and cost half the memory.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch

from trainyard.config import JobConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# CPU flags of native bf16 matrix units: there bf16 products are ~8x faster than fp32 ones.
_BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


@dataclass(frozen=True)
class Precision:
    name: str
    """bf16-mixed, fp32 or bf16 (never auto: resolved for the device)."""
    trainable_dtype: torch.dtype
    """Master weights and optimizer moments."""
    frozen_dtype: torch.dtype
    """Frozen base weights (LoRA jobs)."""
    compute_dtype: torch.dtype
    why: str
    """How `auto` decided, for the first log line."""
    fp8_scaling: str | None = None
    """fp8: bf16-mixed whose linear products run in FP8 with these scales (tensorwise, rowwise); None otherwise."""

    @property
    def mixed(self) -> bool:
        return self.trainable_dtype != self.compute_dtype


def cpu_bf16_units(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """The CPU's native bf16 matrix unit (amx_bf16 or avx512_bf16), None if it has neither."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return next((flag for flag in _BF16_CPU_FLAGS if flag in flags), None)


def _auto(device: torch.device) -> tuple[str, str]:
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return "bf16-mixed", f"{torch.cuda.get_device_name(device)} computes in bf16"
        return "fp32", f"{torch.cuda.get_device_name(device)} has no bf16"
    unit = cpu_bf16_units()
    if not unit:
        return "fp32", "this CPU has no native bf16 matrix units (amx_bf16, avx512_bf16)"
    if not torch_uses_bf16_units():
        return "fp32", f"this CPU has {unit} matrix units, but torch's matrix library is held below them"
    return "bf16-mixed", f"this CPU has {unit} matrix units"


def torch_uses_bf16_units() -> bool:
    """Whether torch's bf16 matrix products reach the CPU's bf16 units. Where oneDNN is held below them
    (ONEDNN_MAX_CPU_ISA=AVX2, as on an avx2-only machine) they run on torch's fallback, ~80x slower than fp32 on
    the same machine (a 512x1024x1024 product: 1.0 s against 13 ms), so bf16 would slow the job down. The check is
    torch's own (a private op, read where the build has it)."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    try:
        return bool(check()) if check is not None else True
    except RuntimeError:  # an op this build declares but did not compile
        return True


def resolve(cfg: JobConfig, device: torch.device) -> Precision:
    """train.precision for this device; model.dtype sets how frozen weights are stored."""
    name, why = _auto(device) if cfg.train.precision == "auto" else (cfg.train.precision, "train.precision")
    if name == "fp32":
        trainable = compute = torch.float32
    elif name == "bf16":
        trainable = compute = torch.bfloat16
    else:  # bf16-mixed, and fp8: bf16-mixed with FP8 products (parallel/float8.py converts the linears)
        trainable, compute = torch.float32, torch.bfloat16
    frozen = _DTYPES.get(cfg.model.dtype, compute)
    return Precision(name, trainable, frozen, compute, why, cfg.train.fp8_scaling if name == "fp8" else None)


def describe(precision: Precision, lora: bool) -> str:
    """One line: what is stored and computed in which dtype, and why."""
    names = {torch.float32: "fp32", torch.bfloat16: "bf16"}
    words = f"{precision.name}: weights {names[precision.trainable_dtype]}"
    if lora:
        words = f"{precision.name}: adapters {names[precision.trainable_dtype]}, frozen base "
        words += names[precision.frozen_dtype]
    words += f", compute {names[precision.compute_dtype]}"
    if precision.fp8_scaling:
        words += f" with FP8 linear products ({precision.fp8_scaling} scales)"
    if precision.mixed:
        words += ", gradients reduced in fp32"
    return f"{words} ({precision.why})"


def autocast(precision: Precision, device: torch.device, enabled: bool = True) -> contextlib.AbstractContextManager:
    """bf16 products for a model whose weights are fp32 (DDP, one process). FSDP2 casts the
    gathered weights itself (its MixedPrecisionPolicy), so it needs no autocast."""
    if not (enabled and precision.mixed):
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=precision.compute_dtype)


# FP8 matrix kernels (cuBLAS, torch._scaled_mm) take a linear whose both dimensions are multiples of this.
FP8_DIVISOR = 16


def fp8_linears(model: torch.nn.Module) -> tuple[list[str], list[str]]:
    """The linear layers train.precision fp8 runs in FP8, and those that stay bf16 because FP8 kernels cannot take
    their shape, by name. Candidates are every linear but the output head and LoRA's adapters (kept bf16: rank r is
    small, and their gradients are the training); one rule for the conversion and the estimate."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    converted: list[str] = []
    kept: list[str] = []
    for name, module in model.named_modules():
        if type(module) is not torch.nn.Linear or module is head or "lora_" in name:
            continue
        fits = module.in_features % FP8_DIVISOR == 0 and module.out_features % FP8_DIVISOR == 0
        (converted if fits else kept).append(name)
    return converted, kept
