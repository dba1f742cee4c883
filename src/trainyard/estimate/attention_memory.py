"""`trainyard estimate`, attention's memory: what the attention kernel the job runs on its device keeps for backward
in each layer, and what its worst moment adds beside that (its workspace), per family, window and document length.

On a GPU auto runs flash-attention or flex_attention (output and log-sum-exp, no scores), or eager where asked. On a
CPU auto runs trainyard's varlen, each document on its own (model/attention.py), and the kernel depends on the
document: a short one (SHORT_DOCUMENT) as two matmuls around an fp32 softmax; a longer one through sdpa, whose fused
CPU kernel keeps no scores, and a window shorter than the document its [L, L] mask in the compute dtype, one for all
layers, and whose math path (values narrower than keys: MLA) keeps the fp32 softmax; soft-capping (Gemma 2) and sinks
(gpt-oss) through the family's own eager attention, whose [heads, L, L] tensors differ by family. Measured on
`estimate --trace` (train/trace.py) for each path at 4,096 tokens, in fp32 and bf16-mixed.
"""

from __future__ import annotations

from trainyard.estimate.arch import Counts, Shape
from trainyard.hardware import Gpu
from trainyard.model import attention as attention_room

FUSED, MASKED, WINDOWED, MATH, SHORT, SOFTCAP, SINKS, EAGER, GPU_EAGER = (
    "fused", "masked", "windowed", "math", "short", "softcap", "sinks", "eager", "gpu eager")


def path(requested: str, shape: Shape, counts: Counts, kind: Gpu, document: int, window: int | None) -> str:
    """The kernel one layer's attention runs for a document of `document` tokens under `window`."""
    found = list(counts.attention_features)
    if kind.device_name is not None:
        return GPU_EAGER if _gpu_eager(requested, found, counts) else FUSED
    if requested == "auto":
        requested = attention_room.auto_choice(found, "cpu", False, counts.attention_dropout)
    if requested == "eager" or attention_room.SOFTCAP in found or attention_room.SINKS in found:
        return SOFTCAP if attention_room.SOFTCAP in found else SINKS if attention_room.SINKS in found else EAGER
    short = requested != "sdpa" and document <= attention_room.SHORT_DOCUMENT and not counts.attention_dropout
    if short:
        return SHORT
    narrow_values = bool(shape.value_head_dim) and shape.value_head_dim != shape.head_dim
    if narrow_values or counts.attention_dropout:
        return MATH
    if requested == "sdpa":
        return MASKED
    return WINDOWED if window is not None and window < document else FUSED


def _gpu_eager(requested: str, found: list[str], counts: Counts) -> bool:
    """On a GPU: eager itself, or varlen where it runs the family's eager attention (soft-capping, sinks); not
    flash-attention or flex_attention, auto's choices for those (attention.auto_choice, flash_attn assumed)."""
    if requested == "auto":
        requested = attention_room.auto_choice(found, "cuda", True, counts.attention_dropout)
    eager_documents = attention_room.SOFTCAP in found or attention_room.SINKS in found
    return requested == "eager" or (requested in ("varlen", attention_room.VARLEN) and eager_documents)


def _paths(requested: str, shape: Shape, counts: Counts, kind: Gpu, document: int) -> list[str]:
    """Each layer's kernel (every layer alike where the model's windows are unknown)."""
    windows = counts.attention_windows or (None,) * shape.layers
    return [path(requested, shape, counts, kind, document, window) for window in windows]


def saved_per_token(requested: str, shape: Shape, counts: Counts, kind: Gpu, document: int, a: int, w: int,
                    context: int = 1) -> float:
    """Bytes one layer's attention keeps per token for backward, averaged over the layers; `a`: the compute dtype's
    bytes, `w`: the weights' as ops outside autocast meet them; per token a rank holds under context parallelism
    `context`. The o_proj input and rotated q, k and v are the caller's."""
    paths = _paths(requested, shape, counts, kind, document)
    return sum(_saved(one, shape, document, a, w, context) for one in paths) / len(paths)


def saved_in_layer(requested: str, shape: Shape, counts: Counts, kind: Gpu, document: int, a: int, w: int,
                   window: int | None, context: int = 1) -> float:
    """Bytes per token one layer's attention under `window` keeps for backward (`saved_per_token`'s, for one layer)."""
    return _saved(path(requested, shape, counts, kind, document, window), shape, document, a, w, context)


def workspace(requested: str, shape: Shape, counts: Counts, kind: Gpu, document: int, a: int, w: int,
              context: int = 1) -> float:
    """Bytes beside every layer's saved tensors at attention's worst moment in one layer (the largest over the
    layers): its [heads, L, L] gradients in backward, or the forward's chain of score tensors (sinks); under
    context parallelism `context` a rank's heads / N of them."""
    paths = _paths(requested, shape, counts, kind, document)
    return max(_workspace(one, shape, document, a, w, context) for one in paths)


def window_masks(requested: str, shape: Shape, counts: Counts, kind: Gpu, document: int, tokens: int, a: int,
                 context: int = 1) -> float:
    """Bytes of the windows' additive masks a micro-batch of `tokens` a rank keeps, its longest document `document`
    tokens: varlen makes each window's [L, L] mask once per forward for every layer (model/attention.py) in the
    compute dtype, one a document length (bounded here by the longest's); under context parallelism each rank the
    whole documents'."""
    windows = counts.attention_windows or (None,) * shape.layers
    shared = {window for window in windows if path(requested, shape, counts, kind, document, window) == WINDOWED}
    return float(len(shared) * tokens * context * document * a)


def _saved(kernel: str, shape: Shape, document: int, a: int, w: int, context: int) -> float:
    """Per token. fused and windowed: the output and its fp32 log-sum-exp (a window's mask is `window_masks`', one
    for all layers); masked (transformers' sdpa): and its mask, [L, L] in the compute dtype, sdpa's own in each layer;
    math: the fp32 softmax (sdpa's math path upcasts); short and eager: the fp32 softmax and its cast; softcap: the
    tanh besides; sinks: the softmax over the keys and the sink, in the query's dtype (`_workspace`), and its cast
    to the compute dtype; eager on a GPU its softmax in the compute dtype (its backward workspace not counted
    there). Every score path also keeps k and v repeated to all heads. Under context parallelism a rank holds
    heads / N over the whole document (the same bytes per token it holds), but the mask is the whole document's, one
    for all heads: N times its share of the rank's tokens."""
    q, heads = shape.heads * shape.head_dim, shape.heads
    fused = q * a + heads * 4
    cast = a if a != 4 else 0
    repeated = 2 * q * a if shape.heads != shape.kv_heads else 0
    per_score = {MATH: 4, SHORT: 4 + cast, EAGER: 4 + cast, SOFTCAP: a + 4 + cast, SINKS: w + (a if w != a else 0),
                 GPU_EAGER: a}
    if kernel in (FUSED, WINDOWED):
        return fused
    if kernel == MASKED:
        return fused + document * a * context
    return heads * document * per_score[kernel] + repeated


def _workspace(kernel: str, shape: Shape, document: int, a: int, w: int, context: int) -> float:
    """One layer, bytes: the softmax's backward (its fp32 input gradient beside the arriving gradient); sinks
    (gpt-oss): the forward's masked scores and their max-shifted concatenation with the sink alive at the softmax,
    and the additive mask, in the query's dtype (the weights': rotary's fp32 cos and sin promote an autocast query
    over fp32 weights), which the mask's sum promotes the scores to. The fused kernel's backward makes no [L, L]
    tensor."""
    scores = shape.heads / context * document * document
    if kernel in (FUSED, MASKED, WINDOWED, GPU_EAGER):
        return 0.0
    if kernel == MATH:
        return scores * 8.0
    if kernel == SINKS:
        return scores * 2.0 * w + document * document * w
    return scores * (4.0 + a)
