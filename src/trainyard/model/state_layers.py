"""Layers that carry a state along the row (linear attention, state-space mixers, short causal convolutions:
layers.py), kept to each document of a padding-free row: each such layer runs its documents as a batch of rows of
one document each, right-padded, and its outputs are put back in the row's order.

Why not the kernels' own boundaries: transformers 5.24 hands `cu_seq_lens_q` to the gated delta rule and `seq_idx`
to Mamba's fused kernels where the hub or fla kernels load, but its torch fallbacks (CPU, and a GPU without those
packages) refuse or ignore them, and so do its convolutions: a boundary given one kernel of a layer is not given the
others. Splitting the row in front of the layer is exact for whichever kernels run inside it, since a causal layer's
output at a real token reads no padding after it. Documents are grouped by length (GROUP_SLACK), so the padding stays
small and a row of many short documents is a few calls, not one per document.

The row's documents come from the collator's host bounds (documents.model_inputs), which every decoder block is
given as transformers' flash kwargs: a pre-hook on the block hands them to its state layers, again at the backward's
recompute under activation checkpointing. The split runs outside compiled graphs (documents.HOST_LOOP)."""

from __future__ import annotations

import functools
import types
from typing import Any

import torch
import torch.nn.functional as F

from trainyard.model import layers
from trainyard.model.documents import DOCUMENT_KWARGS, HOST_BOUNDS, HOST_LOOP, documents_in_kwargs

SPLIT_KINDS = (layers.LINEAR_ATTENTION, layers.STATE_SPACE, layers.SHORT_CONVOLUTION)
"""Carrier kinds split per document. Recurrences (RG-LRU, xLSTM, RWKV) keep padded rows."""
GROUP_SLACK = 1.25
"""A group of documents run as one padded batch holds at most this many times its real tokens."""
KERNEL_BOUNDS = (*DOCUMENT_KWARGS, "seq_idx")
"""Row boundaries a kernel inside the layer might read: its rows are single documents once split."""
BOUNDS = "_trainyard_bounds"
INSTALLED = "_trainyard_split"


def split_classes(model: torch.nn.Module) -> list[str]:
    """The carrier classes of the model that are split per document (the outermost of SPLIT_KINDS), where the blocks
    are given the row's bounds (_blocks_get_bounds)."""
    if not _blocks_get_bounds(model):
        return []
    return [name for name, kind in layers.block_layers(model).items() if kind in SPLIT_KINDS]


def _blocks_get_bounds(model: torch.nn.Module) -> bool:
    """transformers hands the flash kwargs to the blocks where an attention layer in them reads them through its
    attention interface; a family without one (Mamba, FalconMamba) may drop them on the way, and keeps padded rows."""
    found = {type(m).__name__ for block in layers.blocks(model) for m in block.modules()
             if layers.kind(m) == layers.ATTENTION}
    return bool(found - set(layers.own_attention(model)))


def installed(model: torch.nn.Module) -> bool:
    return any(getattr(module, INSTALLED, False) for module in model.modules())


def unsplit_carriers(model: torch.nn.Module) -> tuple[list[str], str]:
    """layers.carriers that no split keeps to their documents, and why those of a split kind are not split ("")."""
    implementation = model.config._attn_implementation
    split = {type(m).__name__ for m in model.modules() if getattr(m, INSTALLED, False)}
    kinds = layers.block_layers(model)
    found = [name for name in layers.carriers(model) if name not in split or implementation not in HOST_BOUNDS]
    if not any(kinds.get(name) in SPLIT_KINDS for name in found):
        return found, ""
    if implementation not in HOST_BOUNDS:
        return found, f"under {implementation}, whose rows come without the documents' bounds"
    return found, "no attention layer has the blocks given the documents' bounds"


def install(model: torch.nn.Module) -> int:
    """Split every state layer of a split kind per document, once, where the model's attention implementation reads
    the collator's host bounds (none reach the blocks otherwise, and those rows are padded); the layers wrapped."""
    if model.config._attn_implementation not in HOST_BOUNDS:
        return 0
    names = set(split_classes(model))
    wrapped = 0
    for block in layers.blocks(model):
        carriers = [m for m in block.modules() if type(m).__name__ in names and not getattr(m, INSTALLED, False)]
        if not carriers:
            continue
        block.register_forward_pre_hook(_hand_bounds, with_kwargs=True)
        for module in carriers:
            module.forward = types.MethodType(_per_document, module)  # a copy of the module binds its own
            setattr(module, INSTALLED, True)
            wrapped += 1
    return wrapped


def _hand_bounds(block: torch.nn.Module, _args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    bounds = kwargs.get("cu_seq_lens_q")
    for module in block.modules():
        if getattr(module, INSTALLED, False):
            setattr(module, BOUNDS, bounds)


@torch.compiler.disable(reason=HOST_LOOP)
def _per_document(self: torch.nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """The layer's own forward on each group of the row's documents (or on its input as it is: a padded batch, a row
    of one document, a forward given no bounds)."""
    forward = functools.partial(type(self).forward, self)
    kwargs = {key: value for key, value in kwargs.items() if key not in KERNEL_BOUNDS}
    if documents_in_kwargs(kwargs.get("attention_mask")):
        kwargs["attention_mask"] = None
    bounds = getattr(self, BOUNDS, None)
    length = hidden_states.shape[1]
    if bounds is None or hidden_states.shape[0] != 1 or len(bounds) < 3 or int(bounds[-1]) != length:
        return forward(hidden_states, *args, **kwargs)
    starts = bounds.tolist()
    spans = list(zip(starts, starts[1:]))
    pieces: list[torch.Tensor] = [hidden_states] * len(spans)
    extras = 0
    for group in groups([end - start for start, end in spans]):
        batch = [spans[i] for i in group]
        output = forward(_rows(hidden_states, batch, length), *(_rows(a, batch, length) for a in args),
                         **{key: _rows(value, batch, length) for key, value in kwargs.items()})
        if isinstance(output, tuple):  # (output, state or weights): training keeps no cache, callers drop it
            output, extras = output[0], len(output) - 1
        for row, i in enumerate(group):
            pieces[i] = output[row, : spans[i][1] - spans[i][0]]
    joined = torch.cat(pieces, dim=0).unsqueeze(0)
    return (joined, *(None,) * extras) if extras else joined


def groups(lengths: list[int]) -> list[list[int]]:
    """Documents (by index) grouped longest first, each group padded to its longest at most GROUP_SLACK times its
    real tokens."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    found: list[list[int]] = []
    for i in order:
        current = found[-1] if found else None
        if current and lengths[current[0]] * (len(current) + 1) <= GROUP_SLACK * (
                sum(lengths[j] for j in current) + lengths[i]):
            current.append(i)
        else:
            found.append([i])
    return found


def _rows(value: Any, spans: list[tuple[int, int]], length: int) -> Any:
    """A [1, T, ...] tensor of the row as rows of the spans' documents, right-padded with zeros; anything else
    unchanged."""
    if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[:2] != (1, length):
        return value
    longest = max(end - start for start, end in spans)
    rows = [value[0, start:end] for start, end in spans]
    pad = [0, 0] * (value.dim() - 2)
    return torch.stack([F.pad(row, [*pad, 0, longest - row.shape[0]]) for row in rows])
