"""NF4 quantization bit-identical to torchao's `to_nf4`, fast on CPU, and from row chunks of a tensor.

torchao finds each value's code as the argmin of its distance to NF4's 16 levels (a 16-wide intermediate a value,
~80 ns a value on one core): ~95% of `to_nf4`. The code is a function of the scaled value's bits alone, so here it
is a table look-up built from torchao's own function: every bit pattern of a 16-bit dtype, and for fp32 each group
of 65536 patterns sharing the top 16 bits, with the one pattern inside the group where the code steps, found by
bisection (the argmin is monotone in the value, and two steps are far more than a group apart in [-1, 1], where
every scaled value lies).

A weight's double-quantized scales need the mean of all its blocks' absmax, but a block's absmax and codes only
its own 64 values: `quantize_rows` streams the whole tensor in row chunks for the absmax (1/64 of its values kept)
and quantizes only the rows asked for; the mean is taken over the same full vector torchao takes it over.

torchao quantizes the blocks' scales in scaler blocks of a size it takes as an argument, which must divide the
weight's blocks: each weight takes the largest power of two up to 256 that does and leaves a multiple of 8 scaler
blocks, so that FSDP2 can split it into 2, 4 or 8 shards (`scaler_block`): any weight of whole blocks is quantized
(SmolLM2's 576 x 576 attention: 5184 blocks, scaler blocks of 8; 4096 x 4096: 256).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from types import ModuleType

import torch

from trainyard.errors import ModelError

BLOCK = 64
SCALER_BLOCK = 256
UNIT = BLOCK * SCALER_BLOCK
"""Values per NF4 scaler block of the largest size (the levels are made from one)."""
SPLITS = 8
"""The shard counts (its divisors) every weight's scaler blocks split into where its size allows."""


def scaler_block(blocks: int) -> int:
    """The scaler block (blocks per second-level scale) of a weight of `blocks` NF4 blocks: the largest power of two
    up to SCALER_BLOCK dividing them (torchao's double quantization wants whole scaler blocks) that leaves a number
    of scaler blocks SPLITS divides, so the weight shards over up to a node's 8 ranks whatever the job's shard count
    (the export quantizes as training did without knowing it); the largest dividing them where none does."""
    largest = math.gcd(blocks, SCALER_BLOCK)
    size = largest
    while size > 1 and (blocks // size) % SPLITS:
        size //= 2
    return size if (blocks // size) % SPLITS == 0 else largest


def nf4_module() -> ModuleType:
    """torchao's NF4, imported here only (trainyard's package quiets its import chatter)."""
    try:
        from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    except ImportError:
        raise ModelError("model.quantize nf4 needs torchao, which is not installed",
                         fix="pip install 'trainyard[quant]' (torchao), or set model.quantize: none") from None
    return nf4_tensor


CHUNK_VALUES = 1 << 22
"""Values a streamed row chunk holds at most (16 MB in fp32): small next to any weight worth quantizing."""


@dataclass
class Parts:
    """An NF4Tensor's inner tensors for some of a weight's rows, as torchao's `to_nf4` of the whole weight and its
    split would hold them."""

    quantized_data: torch.Tensor
    quantized_scalers: torch.Tensor
    quantization_factor: torch.Tensor
    scaler_mean: torch.Tensor
    nf4: torch.Tensor


@cache
def levels(dtype: torch.dtype) -> torch.Tensor:
    """NF4's 16 levels as torchao makes them for a tensor of `dtype`."""
    return nf4_module().to_nf4(torch.zeros(UNIT, dtype=dtype), BLOCK, SCALER_BLOCK).nf4


def _nearest(values: torch.Tensor) -> torch.Tensor:
    """torchao's code of each value (the oracle the tables are built from)."""
    return nf4_module().NF4Tensor.quantize_tensor_nearest(values, levels(values.dtype)).to(torch.uint8)


@cache
def _table16(dtype: torch.dtype) -> torch.Tensor:
    """The code of every bit pattern of a 16-bit dtype, indexed by the pattern read as unsigned."""
    patterns = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(dtype)
    return torch.cat([_nearest(part) for part in patterns.split(1 << 12)])


@cache
def _table32() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each fp32 group of patterns sharing the top 16 bits: its first pattern's code, its last one's, and the
    low 16 bits from which the last one's holds (1 << 16 where the code does not step in the group)."""
    top = torch.arange(1 << 16, dtype=torch.int32) << 16
    first, last = _nearest(top.view(torch.float32)), _nearest((top | 0xFFFF).view(torch.float32))
    steps = torch.full((1 << 16,), 1 << 16, dtype=torch.int32)
    stepping = (first != last).nonzero().flatten()
    low = torch.zeros(len(stepping), dtype=torch.int32)  # its code is first's; high's is not
    high = torch.full((len(stepping),), 0xFFFF, dtype=torch.int32)
    for _ in range(16):
        middle = (low + high) // 2
        same = _nearest((top[stepping] | middle).view(torch.float32)) == first[stepping]
        low, high = torch.where(same, middle, low), torch.where(same, high, middle)
    steps[stepping] = high
    return first, last, steps


def codes(scaled: torch.Tensor) -> torch.Tensor:
    """torchao's NF4 code (uint8) of each value of `scaled` (1-D: values divided by their block's absmax, so in
    [-1, 1], or NaN where the absmax is 0 or not finite)."""
    if scaled.dtype in (torch.bfloat16, torch.float16):
        return _table16(scaled.dtype).index_select(0, scaled.view(torch.int16).to(torch.int32) & 0xFFFF)
    if scaled.dtype != torch.float32:
        return _nearest(scaled)
    first, last, steps = _table32()
    bits = scaled.view(torch.int32)
    group, low = (bits >> 16) & 0xFFFF, bits & 0xFFFF
    return torch.where(low >= steps.index_select(0, group), last.index_select(0, group), first.index_select(0, group))


def _absmax(values: torch.Tensor, size: int) -> torch.Tensor:
    """Each block of `size` values' largest magnitude, as torchao's get_block_absmax gives it."""
    return values.view(-1, size).abs().max(dim=1).values


def _packed(values: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    """Blocks' values (flat) as NF4 codes, two to a byte (the first in the high half), as torchao packs them."""
    quantized = codes((values.view(-1, BLOCK) / absmax.unsqueeze(-1)).flatten())
    return quantized[::2] << 4 | quantized[1::2]


def _scalers(absmax: torch.Tensor, mean: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks' absmax double-quantized around the whole tensor's mean in scaler blocks of `size`: int8 scalers and
    their blocks' factors, in torchao's operations (one scaler block never needs another)."""
    blocks = (absmax - mean).view(-1, size)
    factor = 256 / (2 * _absmax(blocks.flatten(), size))
    scalers = (blocks * factor.unsqueeze(-1)).round().clamp(-128, 127)
    return scalers.flatten().to(torch.int8), factor.contiguous()


def chunk_rows(columns: int) -> int:
    """Rows a streamed chunk holds: whole NF4 blocks, about CHUNK_VALUES values."""
    unit = BLOCK // math.gcd(columns, BLOCK)
    return max(unit, CHUNK_VALUES // columns // unit * unit)


@torch.no_grad()
def quantize_rows(read: Callable[[int, int], torch.Tensor], shape: tuple[int, int], start: int, stop: int,
                  dtype: torch.dtype, size: int) -> Parts:
    """Rows [start, stop) of a tensor of `shape`, read by `read(a, b)` in row chunks and cast to `dtype`, quantized
    as the whole tensor in scaler blocks of `size`: every chunk's absmax, only the asked rows' codes. The rows must
    hold whole scaler blocks."""
    absmax, data, own = [], [], []
    for a, b in _chunks(shape, start, stop):
        values = read(a, b).to(dtype).flatten()
        scales = _absmax(values, BLOCK)
        absmax.append(scales)
        if start <= a and b <= stop:
            data.append(_packed(values, scales))
            own.append(scales)
    mean = torch.cat(absmax).mean()
    scalers, factor = _scalers(torch.cat(own), mean, size)
    return Parts(torch.cat(data), scalers, factor, mean, levels(dtype))


def to_nf4(tensor: torch.Tensor, size: int | None = None) -> torch.Tensor:
    """torchao's `to_nf4(tensor, BLOCK, size)` of a 2-D CPU tensor, bit for bit; `size` the tensor's own
    `scaler_block` unless given."""
    rows, size = tensor.shape[0], size or scaler_block(tensor.numel() // BLOCK)
    parts = quantize_rows(lambda a, b: tensor[a:b], tuple(tensor.shape), 0, rows, tensor.dtype, size)
    return as_nf4(parts, tensor.shape, tensor.dtype, size)


def as_nf4(parts: Parts, shape: torch.Size, dtype: torch.dtype, size: int) -> torch.Tensor:
    """An NF4Tensor of `shape` holding `parts` in scaler blocks of `size` (its blocks counted from the shape)."""
    nf4 = nf4_module()
    meta = nf4.SubclassTensorArgs(torch.Size(shape), (shape[1], 1), 0, dtype, parts.quantized_data.device, False)
    return nf4.NF4Tensor(meta, BLOCK, math.prod(shape) // BLOCK, size, parts.quantized_scalers,
                         parts.quantization_factor, parts.scaler_mean, parts.quantized_data, parts.nf4)


def _chunks(shape: tuple[int, int], start: int, stop: int) -> list[tuple[int, int]]:
    """Row chunks [a, b) of whole blocks covering the tensor, none straddling `start` or `stop`."""
    rows, columns = shape
    bounds = sorted({*range(0, rows, chunk_rows(columns)), start, stop, rows})
    return list(zip(bounds, bounds[1:]))


def meta_nf4(nf4: ModuleType, shape: torch.Size, dtype: torch.dtype, device: torch.device,
             size: int) -> torch.Tensor:
    """An NF4Tensor of `shape` in scaler blocks of `size` on the meta device (torchao quantizes only real tensors):
    one scaler block of zeros quantized, its sharded parts grown to the weight's size on meta. Its scales' mean and
    NF4's 16 levels, which torchao never shards nor moves when FSDP2 or materialising does, are real on `device` at
    once (the load copies the mean into them)."""
    probe = nf4.to_nf4(torch.zeros(BLOCK * size, dtype=dtype), BLOCK, size)
    grow = shape.numel() // (BLOCK * size)
    parts = {name: torch.empty(getattr(probe, name).numel() * grow, dtype=getattr(probe, name).dtype, device="meta")
             for name in nf4._INNER_TENSOR_NAMES_FOR_SHARDING}
    return nf4.NF4Tensor(*nf4.construct_nf4_args(probe, {
        **parts, "size": shape, "stride": (shape[1], 1), "device": torch.device("meta"),
        "n_blocks": shape.numel() // BLOCK, "scaler_mean": probe.scaler_mean.to(device), "nf4": probe.nf4.to(device)}))


def check_shards(name: str, shape: torch.Size, size: int, shards: int) -> None:
    """Refuse a weight FSDP2 cannot split into `shards` row shards of whole scaler blocks of `size`, naming it."""
    rows, numel = shape[0], shape.numel()
    if shards > 1 and (rows % shards or numel % (BLOCK * size * shards)):
        raise ModelError(
            f"model.quantize nf4: {name} {tuple(shape)} cannot be split into {shards} shards of whole NF4 scaler "
            f"blocks (each rank's rows must hold a multiple of {BLOCK * size} values)",
            fix="shard over fewer ranks (dist.strategy ddp, or hsdp with a smaller dist.shard_size), "
            "or set model.quantize: none",
        )
