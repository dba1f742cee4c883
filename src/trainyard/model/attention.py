"""Attention over padding-free batches: several documents in one row, each attending only to itself,
computing exactly what the model's family defines.

A padding-free micro-batch (data.padding_free) is one row of concatenated documents whose
position_ids restart at 0 at each document, with no attention_mask. transformers' own backends
isolate the documents from those position_ids, each in its own way: flash_attention_2/3 run
varlen kernels (no mask at all); sdpa and eager build a dense [B, 1, T, T] mask in which most
entries are masked and still computed; flex_attention builds a block mask (compiled kernels).

`varlen` (registered with transformers as "trainyard_varlen") is the CPU-friendly varlen path: it
cuts the row at the document boundaries and runs each document's attention on its own, so no T x T
mask is built and no cross-document score is computed. The boundaries are the collator's, made on the host
(documents.py); only a forward without them reads position_ids back from the device. On CUDA, auto runs torch's own
varlen kernel (torch_varlen.py) for every family whose features it keeps. Whatever a family adds is kept, from the
arguments its attention layer passes: `sliding_window` (per layer), `scaling`, `softcap` (Gemma 2's
attention-logit soft-capping) and `s_aux` (gpt-oss's attention sinks). Documents of a family with
soft-capping or sinks run through that family's own eager attention (transformers' code), given a
causal (and windowed) mask of the document alone; on CUDA, auto runs those families through flex_attention
instead (flex.py), which holds no [heads, L, L] scores. Measured on SmolLM2-135M + LoRA (4 documents of
60-420 tokens, bf16 on one CPU core) a step took 2.2 s, against 2.7 s with sdpa's dense mask and
6.2 s padded (benchmarks/RESULTS.md). On a GPU a stretch of many short documents instead runs as one sdpa
call over a mask that keeps each document to itself (MASKED_CALL_DOCUMENTS): one call per document left the host's
dispatch the bound there. Batches with an attention_mask (padded rows, generation) go
to transformers' sdpa, or the family's eager attention where sdpa cannot honour the family.

Chunked attention (Llama 4's attention_chunk_size on its "chunked_attention" layers) sees the keys of its own chunk,
chunks counted from each document's start: transformers' sdpa and eager count them from the restarting position_ids
in the mask they build, and auto chooses sdpa for it. Layers that carry state across documents (linear attention,
state-space, short causal convolutions: layers.py) run each document on its own (state_layers.py) where the blocks get
the collator's bounds; elsewhere, and for recurrences, the family gets padded rows instead of one row
(collation.padded_rows).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
import sys
from collections.abc import Callable
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from trainyard.config.data import DataConfig
from trainyard.errors import ModelError
from trainyard.model import documents, layers
from trainyard.model.documents import DOCUMENT_KWARGS, document_bounds, documents_in_kwargs

VARLEN = "trainyard_varlen"
TORCH_VARLEN = "trainyard_torch_varlen"
"""torch's own varlen attention (torch_varlen.py): auto's choice on CUDA for a family whose features it keeps."""
FLEX = "trainyard_flex"
"""flex_attention with a block mask per document (flex.py): what model.attn_implementation flex_attention runs, and
auto's choice on CUDA for soft-capping or sinks where flash-attention cannot keep them."""
FLASH = ("flash_attention_2", "flash_attention_3")
IMPLEMENTATIONS = ("varlen", "sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")

WINDOW, SOFTCAP, SINKS, MASK_WITHOUT_POSITIONS, CHUNKED, POSITIONS_NOT_PASSED, WINDOW_IN_MASK = (
    "sliding windows", "attention-logit soft-capping", "attention sinks",
    "document isolation (its mask ignores position_ids)", "chunked attention",
    "document isolation (its layers do not give their attention position_ids)",
    "sliding windows (its layers do not give their attention the window)",
)
SUPPORTED_BY = {
    WINDOW: ("varlen", "sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3"),
    SOFTCAP: ("varlen", "eager", "flex_attention", "flash_attention_2", "flash_attention_3"),
    SINKS: ("varlen", "eager", "flex_attention"),
    MASK_WITHOUT_POSITIONS: ("varlen", "flex_attention", "flash_attention_2", "flash_attention_3"),
    CHUNKED: ("sdpa", "eager"),
    POSITIONS_NOT_PASSED: ("sdpa", "eager"),
    WINDOW_IN_MASK: ("sdpa", "eager"),
}
"""Which implementations compute each feature exactly on padding-free rows (tests/unit/model/test_families.py).
sdpa has no soft-capping (transformers refuses it); the flash_attn package's kernels have no sinks; a family
whose mask ignores position_ids (gpt-oss) lets packed documents see each other under sdpa and eager (trainyard's
flex reads the documents from position_ids). Chunks: trainyard's varlen and flex keep documents, not chunks, and
transformers refuses flash-attention on rows longer than a chunk. A family whose decoder layers keep position_ids from
their attention (Llama 4) leaves varlen, flex and flash-attention no way to see the documents; transformers' own mask
(sdpa, eager) is built from them."""
MASK_ONLY = (CHUNKED, POSITIONS_NOT_PASSED, WINDOW_IN_MASK)
"""What only the mask transformers builds from position_ids keeps: auto chooses sdpa for it."""
TORCH_VARLEN_DROPS = (SOFTCAP, SINKS, *MASK_ONLY)
"""What torch's varlen kernel has no way to keep: soft-capping, sinks, and what only transformers' mask keeps."""
CPU_TRAINING = ("varlen", "sdpa", "eager")
"""flex_attention has no backward on CPU (torch 2.13); flash-attention needs CUDA."""
_MASK_WITHOUT_POSITIONS = frozenset({"gpt_oss"})
"""Families whose model builds its attention mask without position_ids (transformers 5.24)."""
_POSITIONS_NOT_PASSED = frozenset({"llama4_text", "llama4"})
"""Families whose decoder layer does not pass position_ids on to its attention (transformers 5.24)."""


def packed_rows(data: DataConfig) -> bool:
    """Whether a training row may hold several documents with no mask between them (padding-free rows, packing, a
    pretraining mixture's rows): then an implementation must read the documents from position_ids. Otherwise each
    row is one document and a 2-D attention_mask covers its padding."""
    return data.padding_free or data.packing or data.mixture is not None


def features(model: torch.nn.Module, packed: bool = True) -> list[str]:
    """What the model's attention adds to causal attention that an implementation might drop; `packed`: on rows
    holding several documents (packed_rows), where a mask that ignores position_ids joins them."""
    config = model.config
    found = []
    windows = [getattr(m, "sliding_window", None) for m in model.modules() if hasattr(m, "sliding_window")]
    if any(windows) or (getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)):
        found.append(WINDOW)
    if getattr(config, "attn_logit_softcapping", None):
        found.append(SOFTCAP)
    if any(name.endswith(".sinks") or name == "sinks" for name, _ in model.named_parameters()):
        found.append(SINKS)
    if packed and config.model_type in _MASK_WITHOUT_POSITIONS:
        found.append(MASK_WITHOUT_POSITIONS)
    if getattr(config, "attention_chunk_size", None) and "chunked_attention" in (getattr(config, "layer_types", None)
                                                                                  or []):
        found.append(CHUNKED)
    if packed and config.model_type in _POSITIONS_NOT_PASSED:
        found.append(POSITIONS_NOT_PASSED)
    if layers.window_only_in_mask(model):
        found.append(WINDOW_IN_MASK)
    return found


def choose(
    requested: str, model: torch.nn.Module, device: torch.device, training: bool = True, where: str | None = None,
    packed: bool = True, checkpointing: bool | str = False,
) -> str:
    """The transformers implementation for model.attn_implementation, refusing one that would drop a feature on
    the job's rows (`packed`: see packed_rows).

    auto: flash-attention varlen on a GPU with the flash_attn package where its kernels keep every feature of
    the family; else on CUDA, torch's own varlen kernel where it keeps them (TORCH_VARLEN_DROPS, no dropout), and
    flex_attention for soft-capping or sinks (the family's eager attention would hold [heads, L, L] scores per
    layer); else sdpa where only transformers' mask keeps the family (MASK_ONLY); else `varlen`."""
    refuse_dropped(requested, model, where, packed)
    if requested == "auto" and layers.own_attention(model):  # its own mask kinds: sdpa's or eager's, not varlen's
        return "sdpa" if getattr(model, "_supports_sdpa", False) else "eager"
    if requested == "auto":
        return auto_choice(features(model, packed), device.type, device.type == "cuda" and _has_flash_attn(),
                           getattr(model.config, "attention_dropout", 0.0) or 0.0, checkpointing)
    if requested in FLASH and not (device.type == "cuda" and _has_flash_attn()):
        raise ModelError(
            f"model.attn_implementation: {requested} needs a CUDA GPU and a flash_attn package that imports",
            where=where,
            fix="install flash-attn on a GPU machine, or use auto, varlen or sdpa",
        )
    if training and device.type == "cpu" and requested not in CPU_TRAINING:
        raise ModelError(
            f"model.attn_implementation: {requested} cannot train on a CPU (no backward there in torch "
            f"{torch.__version__.split('+')[0]})",
            where=where,
            fix=f"use one of {', '.join(CPU_TRAINING)}, or auto",
        )
    return {"varlen": VARLEN, "flex_attention": FLEX}.get(requested, requested)


def auto_choice(
    found: list[str], device_type: str, flash: bool, dropout: float = 0.0, checkpointing: bool | str = False
) -> str:
    """auto's implementation for a family's `features` on a device (`flash`: flash_attn imports there): the one
    rule for the job, the estimate and its trace. flex has no attention dropout. Soft-capping under activation
    checkpointing stays on the family's eager attention: torch 2.13's flex gave wrong gradients for a score_mod
    recomputed by checkpointing (dense CPU path; not yet checked on a GPU), and a wrong gradient costs more than
    the [heads, L, L] scores."""
    if flash and all("flash_attention_2" in SUPPORTED_BY[feature] for feature in found):
        return "flash_attention_2"
    if device_type == "cuda" and _has_torch_varlen() and not dropout and not set(TORCH_VARLEN_DROPS) & set(found):
        return TORCH_VARLEN
    flex_keeps_it = (SOFTCAP in found or SINKS in found) and not (SOFTCAP in found and checkpointing)
    if device_type == "cuda" and flex_keeps_it and not dropout:
        return FLEX
    return "sdpa" if set(MASK_ONLY) & set(found) else VARLEN


def refuse_dropped(requested: str, model: torch.nn.Module, where: str | None = None, packed: bool = True) -> None:
    """A user's choice that would silently train another function than the family's on the job's rows (`packed`:
    see packed_rows), or a layer of no known kind on rows of several documents: exit 2, naming what."""
    unknown = layers.unknown_layers(model) if packed else []
    if unknown:
        raise ModelError(
            f"data.padding_free: {config_name(model)} has {', '.join(unknown)} layers, which trainyard does not know "
            "to keep the documents of a padding-free or packed row apart",
            where=where,
            fix="set data.padding_free: false (and data.packing: false): rows of one document each are exact",
        )
    layers.refuse_other_masks(requested, model, where)
    found = features(model, packed)
    dropped = [feature for feature in found if requested != "auto" and requested not in SUPPORTED_BY[feature]]
    if dropped:
        able = sorted(set.intersection(*(set(SUPPORTED_BY[feature]) for feature in found)), key=IMPLEMENTATIONS.index)
        raise ModelError(
            f"model.attn_implementation: {requested} drops the {' and '.join(dropped)} of "
            f"{config_name(model)} on {'packed or padding-free' if packed else 'padded'} rows; implementations that "
            f"keep them: {', '.join(able)}",
            where=where,
            fix="use auto (or one of those)",
        )


def config_name(model: torch.nn.Module) -> str:
    return getattr(model.config, "model_type", type(model).__name__)


@functools.cache
def _has_flash_attn() -> bool:
    """flash_attn imports here. A build made for another torch or CUDA is found by find_spec and fails at import
    ("undefined symbol"): auto then keeps to torch's or trainyard's varlen, saying why once, instead of failing the
    model load."""
    if importlib.util.find_spec("flash_attn") is None:
        return False
    try:
        importlib.import_module("flash_attn")
    except (ImportError, OSError) as err:
        logging.getLogger("trainyard").warning(
            "flash_attn is installed but does not import (%s): auto chooses among the others; reinstall "
            "flash-attn for this torch (pip install flash-attn --no-build-isolation)", str(err).splitlines()[0])
        return False
    return True


@functools.cache
def _has_torch_varlen() -> bool:
    """torch.nn.attention.varlen.varlen_attn is in this torch with `window_size` (2.11 and later: 2.10's took
    `is_causal` instead, and trainyard's path makes causal and sliding attention through the window)."""
    if importlib.util.find_spec("torch.nn.attention.varlen") is None:
        return False
    kernel = getattr(importlib.import_module("torch.nn.attention.varlen"), "varlen_attn", None)
    return kernel is not None and "window_size" in inspect.signature(kernel).parameters


documents.HOST_BOUNDS.update({VARLEN, TORCH_VARLEN})  # they read the collator's bounds


_last_bounds: tuple[torch.Tensor | None, list[list[tuple[int, int]]]] = (None, [])
_masks: dict[tuple[Any, ...], torch.Tensor] = {}
"""The stretches' and windows' masks of the forward whose bounds _bounds_of holds (it empties this when they
change)."""


def _bounds_of(position_ids: torch.Tensor, cu_seq_lens: torch.Tensor | None) -> list[list[tuple[int, int]]]:
    """The row's documents, once per forward (every layer gets the same tensors): from the collator's host
    cu_seq_lens (model_inputs), or, without them (evaluation's and generation's own calls, a caller's plain
    forward), read back from position_ids on the device."""
    global _last_bounds
    source = position_ids if cu_seq_lens is None else cu_seq_lens
    if _last_bounds[0] is not source:
        if cu_seq_lens is None:
            bounds = document_bounds(position_ids)
        else:
            starts = cu_seq_lens.tolist()
            bounds = [list(zip(starts, starts[1:]))]
        _last_bounds = (source, bounds)
        _masks.clear()  # another forward's documents: the stretches' masks go with the bounds they were made for
    return _last_bounds[1]


def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Each document of each row on its own; [B, H, T, D] in, [B, T, H, D] out like transformers' sdpa. The
    documents come from the host bounds model_inputs passes, else from position_ids (_bounds_of)."""
    position_ids = kwargs.pop("position_ids", None)
    kwargs.pop("is_causal", None)
    cu_seq_lens = kwargs.pop("cu_seq_lens_q", None)
    for name in DOCUMENT_KWARGS[1:]:
        kwargs.pop(name, None)
    refuse_unknown(module, kwargs)
    if documents_in_kwargs(attention_mask):
        attention_mask = None
    given = cu_seq_lens is not None and query.shape[0] == 1
    if attention_mask is not None or (position_ids is None and not given) or query.shape[2] != key.shape[2]:
        return _masked_attention(module, query, key, value, attention_mask, kwargs), None
    bounds = _bounds_of(position_ids, cu_seq_lens if given else None)
    if len(bounds) == 1:  # position_ids [1, T] stand for every row
        bounds = bounds * query.shape[0]
    masked = masked_calls(query, kwargs)
    rows = []
    for row, spans in enumerate(bounds):
        parts = []
        for segment in _segments(spans, MASKED_CALL_ROW) if masked else [[span] for span in spans]:
            a, b = segment[0][0], segment[-1][1]
            q, k, v = query[row : row + 1, :, a:b], key[row : row + 1, :, a:b], value[row : row + 1, :, a:b]
            if masked and len(segment) >= MASKED_CALL_DOCUMENTS:
                mask = _segment_mask(segment, kwargs.get("sliding_window"), query.device)
                parts.append(sdpa_attention_forward(module, q, k, v, mask, is_causal=False, **kwargs)[0])
                continue
            parts.extend(_document_attention(module, q[:, :, x - a : y - a], k[:, :, x - a : y - a],
                                             v[:, :, x - a : y - a], kwargs) for x, y in segment)
        rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=1))
    return (rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)), None


MASKED_CALL_DEVICES = ("cuda",)
MASKED_CALL_DOCUMENTS = 4
MASKED_CALL_ROW = 2048
"""On a GPU, consecutive documents of a row, up to MASKED_CALL_ROW tokens together, run as one sdpa call over a mask
that keeps each document to itself when there are at least MASKED_CALL_DOCUMENTS of them, instead of one call per
document: with many short documents the loop is bound by the host's dispatch. Measured on an H100 (llama-1b.yaml,
FSDP, bf16-mixed, rows of 2048 tokens holding ~26 documents of ~77 tokens): 1.84-2.0 s a step through the loop
(py-spy: ~90% of the forward inside its per-document sdpa calls), 0.54 s through one masked call per row of 2048
(this path), 0.29 s through transformers' sdpa (one call over both rows' dense mask) and 0.17 s through flex_attention
after a 16 s compile (benchmarks/RESULTS.md, 2026-11-28). The bound is that measured stretch: the masked call computes
every score of a stretch, cross-document ones included (its share of the step grows with the stretch: ~14% extra
for llama-1b at 2048), and a stretch's mask is 4 MiB of booleans, made once per forward. Where the loop wins
between 1 and 26 documents a stretch was not measured. Both ways compute the same per-document attention."""


def masked_calls(query: torch.Tensor, kwargs: dict[str, Any]) -> bool:
    """Whether stretches of documents may run as one masked sdpa call (MASKED_CALL_DOCUMENTS): on a GPU, for a family
    sdpa keeps (no soft-capping or sinks, which go through the family's eager attention)."""
    plain = kwargs.get("softcap") is None and kwargs.get("s_aux") is None
    return query.device.type in MASKED_CALL_DEVICES and plain


def _segments(spans: list[tuple[int, int]], limit: int) -> list[list[tuple[int, int]]]:
    """A row's documents in consecutive stretches of at most `limit` tokens (a longer document alone)."""
    segments: list[list[tuple[int, int]]] = []
    for a, b in spans:
        if segments and b - segments[-1][0][0] <= limit:
            segments[-1].append((a, b))
        else:
            segments.append([(a, b)])
    return segments


def _segment_mask(segment: list[tuple[int, int]], window: int | None, device: torch.device) -> torch.Tensor:
    """[1, 1, L, L] booleans over a stretch: each token sees itself and the earlier tokens of its own document
    (within the window, transformers' rule). Every layer of one forward asks for the same ones: made once."""
    start = segment[0][0]
    key = (tuple((a - start, b - start) for a, b in segment), window)
    if key not in _masks:
        lengths = torch.tensor([b - a for a, b in segment])
        document = torch.repeat_interleave(torch.arange(len(segment)), lengths).to(device)
        same = (document[:, None] == document[None, :])[None, None]
        _masks[key] = same & _keep(int(lengths.sum()), window, device)
    return _masks[key]


KNOWN_ARGUMENTS = frozenset({
    "dropout", "scaling", "sliding_window", "softcap", "s_aux",  # what the attention computes: all honoured
    "use_cache", "output_attentions", "output_hidden_states", "output_router_logits", "return_dict",  # the rest:
    "cache_position", "position_embeddings", "layer_idx", "logits_to_keep",  # what the model passes everywhere
    "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
})


def refuse_unknown(module: torch.nn.Module, kwargs: dict[str, Any]) -> None:
    """A family that passes its attention something this file does not know would lose it silently: stop."""
    unknown = [name for name, value in kwargs.items() if name not in KNOWN_ARGUMENTS and value not in (None, False)]
    if unknown:
        raise ModelError(
            f"{type(module).__name__} passes its attention {', '.join(sorted(unknown))}, which trainyard's varlen "
            "attention does not implement",
            fix="set model.attn_implementation: eager (or sdpa) to run transformers' own code for this family",
        )


SHORT_DOCUMENT = 1024
"""Up to this many tokens a CPU document's attention runs as two bf16 matmuls around an fp32 softmax:
torch's CPU flash kernel is 1.4-2.8x slower there in bf16 (60-420 tokens, benchmarks/RESULTS.md). Its
[heads, L, L] scores stay small (36 MB at 9 heads and 1024 tokens in fp32)."""


def _document_attention(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kwargs: dict[str, Any]
) -> torch.Tensor:
    """One document's attention as its family defines it, [1, L, H, D] out."""
    length = query.shape[2]
    window = kwargs.get("sliding_window")
    window = window if window is not None and window < length else None
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        mask = _additive(_keep(length, window, query.device), query.dtype)
        return family_eager(module)(module, query, key, value, mask, **kwargs)[0]
    if query.device.type != "cpu" or length > SHORT_DOCUMENT or kwargs.get("dropout", 0.0) > 0:
        if window is None:
            return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kwargs)[0]
        mask = _window_mask(length, window, query)
        return sdpa_attention_forward(module, query, key, value, mask, is_causal=False, **kwargs)[0]
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scaling = kwargs.get("scaling")
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    # Scale and mask inside the product (baddbmm's alpha and input): no [H, L, L] pass for either, forward or back.
    mask = _additive(_keep(length, window, query.device)[0], query.dtype, float("-inf"))
    scores = torch.baddbmm(mask, query[0], key[0].transpose(-1, -2), alpha=scaling)
    # fp32 softmax read straight from the scores' dtype, its gradient written back in it: the same values as
    # scores.float().softmax(), without the two [H, L, L] copies (forward and backward) of .float()
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32)
    return torch.matmul(weights.to(value.dtype), value[0]).transpose(0, 1)[None]


def _window_mask(length: int, window: int, query: torch.Tensor) -> torch.Tensor:
    """A window's additive [1, 1, L, L] mask in the query's dtype, made once per forward for every layer: given the
    boolean one, sdpa would make this itself in each layer (-inf where masked, as here), and autograd keep each copy
    (a 4,096-token document: 32 MiB a layer in bf16)."""
    key = ("window", length, window, query.dtype, query.device)
    if key not in _masks:
        _masks[key] = _additive_window(length, window, query.dtype, query.device)
    return _masks[key]


def _additive_window(length: int, window: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`_additive(_keep(length, window))` with -inf, filled a stretch of rows at a time: the whole boolean masks
    beside it would double its size at the moment it is made, which is a rank's peak where its tokens are few (one
    context-parallel rank's share of a long document)."""
    mask = torch.zeros((length, length), dtype=dtype, device=device)
    key = torch.arange(length, device=device)[None, :]
    rows = max(1, MASK_FILL_ELEMENTS // length)
    for start in range(0, length, rows):
        query = torch.arange(start, min(start + rows, length), device=device)[:, None]
        mask[start : start + rows].masked_fill_((key > query) | (key <= query - window), float("-inf"))
    return mask[None, None]


MASK_FILL_ELEMENTS = 1 << 20
"""Rows of a window's mask filled at once (`_additive_window`): about this many values, a MiB of booleans."""


def _keep(length: int, window: int | None, device: torch.device) -> torch.Tensor:
    """Which keys each query sees: itself and before, and within the window (transformers' rule: key > query -
    window), as [1, 1, L, L] booleans."""
    query = torch.arange(length, device=device)[:, None]
    key = torch.arange(length, device=device)[None, :]
    keep = key <= query
    if window is not None:
        keep &= key > query - window
    return keep[None, None]


def _additive(keep: torch.Tensor, dtype: torch.dtype, masked: float | None = None) -> torch.Tensor:
    """A boolean keep-mask as an additive one: transformers' masked value (the dtype's min) unless given."""
    masked = torch.finfo(dtype).min if masked is None else masked
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, masked)


def family_eager(module: torch.nn.Module) -> Callable[..., tuple[torch.Tensor, Any]]:
    """The eager attention of the module's own modeling file: the reference of what its family computes."""
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise ModelError(
            f"{type(module).__name__} uses soft-capping or sinks, and its modeling code has no eager attention",
            fix="use model.attn_implementation: eager",
        )
    return eager


def _masked_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    kwargs: dict[str, Any],
) -> torch.Tensor:
    """Padded rows and generation: sdpa over the mask, or the family's eager where sdpa cannot honour it."""
    if kwargs.get("softcap") is None and kwargs.get("s_aux") is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)[0]
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        attention_mask = _additive(attention_mask, query.dtype)
    elif attention_mask is None and query.shape[2] > 1:  # one causal row of documents, no position_ids
        attention_mask = _additive(_keep(key.shape[2], None, query.device), query.dtype)[..., -query.shape[2] :, :]
    return family_eager(module)(module, query, key, value, attention_mask, **kwargs)[0]


def varlen_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """No mask for padding-free rows (the attention reads the documents from position_ids);
    sdpa's mask where there is a 2-D attention_mask (padding, generation)."""
    if kwargs.get("attention_mask") is None:
        return None
    return sdpa_mask(*args, **kwargs)


AttentionInterface.register(VARLEN, varlen_attention)
AttentionMaskInterface.register(VARLEN, varlen_mask)
