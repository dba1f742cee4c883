"""`trainyard estimate`, the bytes per element of each kind of tensor a job holds (memory.dtypes sets them for a
precision and strategy): what every memory formula multiplies by."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Dtypes:
    """Bytes per element: trainable masters (and AdamW moments), frozen base, compute, and the residual
    stream (fp32 under autocast over fp32 weights, since embeddings and additions are not autocast)."""

    master: int
    frozen: int
    compute: int
    residual: int
    mixed: bool
    compute_dtype: torch.dtype
    expert: int = 0
    """The routed experts' products (grouped_mm, which autocast does not cast): their weights' dtype, the compute
    dtype only where FSDP2 gathers them in it. Full fine-tuning under bf16-mixed on one process runs them in fp32."""
    autocast: bool = False
    """bf16-mixed under autocast (not FSDP2's mixed precision): fp32 intermediates are cast for each matmul."""
