"""The products of an NF4 base: each weight dequantized in row chunks into one dense copy, then multiplied.

torchao's `NF4Tensor.get_original_weight` widens every 4-bit code to int64 and builds the copy from six
intermediates the size of the weight: its peak rose by 205 MiB for one 6400 x 2048 MLP weight, whose bf16 copy is 25
MiB (benchmarks/memory/nf4_dequantize.py). `dequantize` gives the same values bit for bit (each value is one level
times one block scale, multiplied in the same dtypes) with a byte-pair table and a chunk of codes at a time, so a
product holds the dense copy and a few MB beside it (20 MiB there), and runs 2.2x faster on a CPU.

Quantized linears compute through `NF4Linear` (torchao's `linear_nf4` contract: the NF4 weight is saved for the
backward, which dequantizes it again; nothing dense outlives a product), and fused expert stacks through
`dequantize_stack`.
"""

from __future__ import annotations

import torch

CHUNK_BYTES = 1 << 19
"""Packed code bytes dequantized at a time (1M values: ~10 MB of intermediates)."""


def dequantize(weight: torch.Tensor, dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """An NF4Tensor's dense value as torchao's `weight.to(dtype)` gives it (bit for bit), into `out` if given."""
    if not weight.is_contiguous():  # a transposed view, as torchao takes it
        return dequantize(weight.t(), dtype).t()
    dtype = dtype or weight.dtype
    scalers = weight.dequantize_scalers(weight.quantized_scalers, weight.quantization_factor, weight.scaler_block_size)
    pairs = _byte_pairs(weight.nf4)
    codes = weight.quantized_data.view(-1)
    product = torch.promote_types(pairs.dtype, scalers.dtype)
    out = torch.empty(weight.shape, dtype=dtype, device=codes.device) if out is None else out
    flat = out.view(-1, weight.block_size)
    step = CHUNK_BYTES - CHUNK_BYTES % (weight.block_size // 2)
    for start in range(0, codes.numel(), step):
        chunk = codes[start:start + step]
        blocks = slice(start * 2 // weight.block_size, (start + chunk.numel()) * 2 // weight.block_size)
        values = pairs.index_select(0, chunk.to(torch.int32)).view(-1, weight.block_size)
        if product == dtype:
            torch.mul(values, scalers[blocks, None], out=flat[blocks])
        else:
            flat[blocks] = (values * scalers[blocks, None]).to(dtype)
    return out


def _byte_pairs(levels: torch.Tensor) -> torch.Tensor:
    """[256, 2]: the two levels a packed byte codes, high nibble first (torchao's layout: [ab, cd] for a, b, c, d)."""
    byte = torch.arange(256, device=levels.device)
    return torch.stack([levels[byte >> 4], levels[byte & 0b1111]], dim=-1)


def dequantize_stack(weights: list[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """Experts' NF4 weights as one dense [experts, out, in] stack, each dequantized in place into it."""
    first = weights[0]
    stack = torch.empty((len(weights), *first.shape), dtype=dtype or first.dtype, device=first.quantized_data.device)
    for index, weight in enumerate(weights):
        dequantize(weight, stack.dtype, out=stack[index])
    return stack


def product_dtype(input: torch.Tensor) -> torch.dtype:
    """The dtype a product with `input` computes in: autocast's where it is on (a copy in the input's dtype would be
    cast to it at once: the same values, twice the bytes), else the input's."""
    device = input.device.type
    if torch.is_autocast_enabled(device) and input.is_floating_point():
        return torch.get_autocast_dtype(device)
    return input.dtype


class _DequantizedLinear(torch.autograd.Function):
    """y = x W^T for a frozen NF4 W: saves W in 4 bits and dequantizes it again for dx (W never needs a grad)."""

    @staticmethod
    def forward(ctx, input: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(weight)
        return torch.nn.functional.linear(input, dequantize(weight, product_dtype(input)))

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        (weight,) = ctx.saved_tensors
        return grad_output @ dequantize(weight, grad_output.dtype), None


class NF4Linear(torch.nn.Linear):
    """A linear layer whose weight is a frozen NF4Tensor (set by quantize.quantize_meta on the plain layer)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        out = _DequantizedLinear.apply(input, self.weight)
        return out if self.bias is None else out + self.bias
