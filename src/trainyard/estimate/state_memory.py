"""`trainyard estimate`, the layers that carry a state along the row: what Gated DeltaNet (Qwen3-Next, Qwen3.5), the
Mamba2 mixers (Falcon-H1, Nemotron-H, Granite 4, Bamba, Zamba2, Mamba2), Mamba1 (Jamba, Mamba) and LFM2's short
convolutions save for backward, per token of one layer.

Counted on the path transformers runs without the fla, mamba_ssm and causal_conv1d kernels (its torch fallbacks:
every CPU, and a GPU without those packages), an upper bound where the fused kernels load. Those fallbacks keep far
more than attention does: the delta rule's chunked form saves [heads, chunk, chunk] decay and score matrices and one
[heads, k_dim, v_dim] state per chunk, each fp32 with its bf16 copy under autocast; Mamba2's chunked scan its
[heads, chunk, chunk] scores, [heads, head_dim, d_state] states per chunk and the [heads, chunks, chunks] decay
between chunks; Mamba1's sequential scan a [d_inner, d_state] state per token. A document pads to a whole number of
chunks, so those terms are sized per document (`chunked`), as the rows are collated padded or split per document.
Measured against `estimate --trace` (train/trace.py) at 4,096 tokens in fp32 and bf16-mixed, LoRA and full.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from trainyard.estimate.elements import Dtypes

DELTA, MAMBA2, MAMBA1, SHORT_CONV = "gated delta rule", "mamba2", "mamba1", "short convolution"
DELTA_CHUNK = 64
"""The chunk torch_chunk_gated_delta_rule takes by default (the layers do not pass one)."""


@dataclass(frozen=True)
class Mixer:
    """One state layer's sizes. heads: value heads (delta rule) or SSM heads; key_dim: the delta rule's k_dim or the
    SSM's d_state; value_dim: v_dim or head_dim; conv: the convolution's channels; inner: Mamba's d_inner (the
    gate's width), the delta rule's values, the short convolution's width; projected: in_proj's output width (the
    storage its views keep)."""

    kind: str
    heads: int = 0
    key_dim: int = 0
    value_dim: int = 0
    conv: int = 0
    chunk: int = 1
    inner: int = 0
    projected: int = 0
    inputs: int = 1
    """Linear layers reading the layer's input (in_proj_qkvz and in_proj_ba: two): under autocast each casts it."""
    gated_norm: bool = True
    """Mamba2: a gated RMSNorm after the scan (Falcon-H1 without mamba_rms_norm multiplies by silu(gate) alone)."""
    out_saved: bool = True
    """out_proj keeps its input: trainable, or carrying LoRA adapters (Falcon-H1's goes to a fused kernel: not)."""
    multiplied: bool = False
    """in_proj's output is multiplied by a vector in the weights' dtype (Falcon-H1's mup_vector)."""


def mixer_of(module: torch.nn.Module) -> Mixer | None:
    """The state layer `module` is, by the sizes transformers' classes keep (None: a kind not counted here)."""
    get = module.__dict__.get
    out = getattr(module, "out_proj", None)
    out_saved = out is None or any(p.requires_grad for p in out.parameters())  # trainable, or LoRA's
    inputs = sum(1 for name, _ in module.named_children() if name.startswith("in_proj"))
    if get("num_v_heads") and get("head_k_dim") and get("conv_dim"):
        heads, key_dim, value_dim = module.num_v_heads, module.head_k_dim, module.head_v_dim
        return Mixer(DELTA, heads, key_dim, value_dim, conv=module.conv_dim, chunk=DELTA_CHUNK,
                     inner=heads * value_dim, inputs=inputs, out_saved=out_saved)
    if get("chunk_size") and get("num_heads") and get("ssm_state_size") and get("conv_dim"):
        return Mixer(MAMBA2, module.num_heads, module.ssm_state_size, module.head_dim, module.conv_dim,
                     module.chunk_size, module.intermediate_size, module.in_proj.out_features, inputs,
                     gated_norm=get("mamba_rms_norm", True), out_saved=out_saved,
                     multiplied=hasattr(module, "mup_vector"))
    if get("ssm_state_size") and get("intermediate_size") and get("time_step_rank"):
        return Mixer(MAMBA1, key_dim=module.ssm_state_size, conv=module.intermediate_size,
                     inner=module.intermediate_size, projected=module.in_proj.out_features, inputs=inputs,
                     out_saved=out_saved)
    conv = getattr(module, "conv", None)
    if isinstance(conv, torch.nn.Conv1d) and hasattr(module, "in_proj"):
        return Mixer(SHORT_CONV, conv=conv.in_channels, inner=conv.in_channels, inputs=inputs, out_saved=out_saved)
    return None


def chunked(document: int, chunk: int) -> float:
    """Tokens a document of `document` tokens runs as once padded to whole chunks, per real token."""
    return math.ceil(document / chunk) * chunk / document if document else 1.0


def saved_per_token(mixer: Mixer, document: int, size: Dtypes, trainable: bool) -> float:
    """Bytes one state layer keeps for backward per token, its input (the block's norm output) not included. Under
    autocast fp32 intermediates are cast to the compute dtype for each matmul (and those casts saved); under FSDP2's
    mixed precision they multiply in fp32. `trainable`: full fine-tuning (norm weights, D and the convolution's
    weight take gradients)."""
    a, w, autocast = size.compute, size.residual, size.autocast
    out = mixer.inner * a if mixer.out_saved else 0.0
    if mixer.kind == SHORT_CONV:  # in_proj's B, C, x (one storage), B * x (the conv's input), the conv's output
        return 5 * mixer.conv * a + out
    if mixer.kind == DELTA:
        return _delta(mixer, document, a, w, autocast, trainable) + out
    if mixer.kind == MAMBA2:
        stored = size.master if trainable else size.frozen  # the buffers' dtype (FSDP2 gathers only parameters)
        return _mamba2(mixer, document, a, max(a, stored) if mixer.multiplied else a, w, autocast, trainable) + out
    return _mamba1(mixer, a) + out


def workspace_per_token(mixer: Mixer, document: int, a: int) -> float:
    """Bytes per token one state layer's backward holds beside its saved tensors at its widest (its block's MLP's
    freed by then): the fp32 gradients of the [heads, chunk] matrices and the keys (delta rule, Mamba2) or of the
    gated norm's tensors (about five of them), of each token's states and their discretised A and B (Mamba1), of
    the convolution's input and output (short convolution)."""
    if mixer.kind == SHORT_CONV:
        return 2 * mixer.conv * a
    if mixer.kind == MAMBA1:
        return 4 * mixer.inner * mixer.key_dim * 4
    if mixer.kind == DELTA:  # three [heads, chunk, chunk] gradients at once (the decay's, the system's, the scores')
        scan = 3 * mixer.heads * mixer.chunk + mixer.heads * mixer.key_dim
    else:
        scan = mixer.heads * mixer.chunk + mixer.inner
    return max(scan * 4 * chunked(document, mixer.chunk), 5 * mixer.inner * 4 * mixer.gated_norm)


def _delta(mixer: Mixer, document: int, a: int, w: int, autocast: bool, trainable: bool) -> float:
    """torch_chunk_gated_delta_rule with its convolution and gated norm. Per chunked token: the decay, the chunk's
    kk^T and qk^T and the triangular system (S, [heads, chunk] each); q, k, k*beta and the solved keys in fp32 with
    the matmuls' copies (K); v, the solved values and each chunk's new values (V); a state per chunk. Per token:
    the conv's input and output, q and k before their l2 norm, the gated norm's fp32 tensors."""
    heads, m = mixer.heads, (a if autocast else 4)
    scores, keys, values = heads * mixer.chunk, heads * mixer.key_dim, heads * mixer.value_dim
    state = heads * mixer.key_dim * mixer.value_dim / mixer.chunk
    copies = 4 if autocast or (a == 4 and document % mixer.chunk == 0) else 0  # the batched matmuls' (fp32: unpadded)
    per_chunked = (scores * (2 * 4 + 3 * m) + keys * (4 * 4 + copies * m + (3 if autocast else 2) * m)
                   + values * (2 * 4 + (2 if autocast else 1) * m) + state * (4 + (2 * a if autocast else 0)))
    norm = values * (3 * 4 + max(w, a) + (a if trainable else 0))
    return (per_chunked * chunked(document, mixer.chunk) + 2 * mixer.conv * a + 2 * keys * 4 + norm
            + 9 * heads * 4)


def _mamba2(mixer: Mixer, document: int, a: int, p: int, w: int, autocast: bool, trainable: bool) -> float:
    """mamba2_chunk_scan with the mixer's convolution and gate. Per chunked token: the [heads, chunk] decay L, the
    C·B scores and their masked copy; B and C in fp32 with the einsums' copies; x with its copies; the states per
    chunk; the scan's fp32 output (and D's padded x). Per document: the [heads, chunks + 1, chunks + 1] decay
    between chunks and its masks. Per token: in_proj's output (`p` bytes: Falcon-H1's mup_vector promotes it to
    the weights' stored dtype), which the conv reads in place where no cast intervenes, or the conv's cast input;
    the conv's output; x in fp32 (a copy, or a view of the activated conv output); the gate and the gated norm."""
    heads, inner, m = mixer.heads, mixer.inner, (a if autocast else 4)
    states = heads * mixer.value_dim * mixer.key_dim / mixer.chunk
    per_chunked = (heads * mixer.chunk * (4 + 2 * m) + heads * mixer.key_dim * (4 + 4 * m) + 3 * inner * m
                   + 2 * states * m + inner * 4 * (2 if trainable else 1))
    chunks = math.ceil(document / mixer.chunk) + 1
    between = chunks * chunks * (heads * (4 + (m if autocast else 0)) + 2) / document if document else 0.0
    in_place = p == w and (w == a or not autocast)
    kept = in_place or not mixer.gated_norm or p == 4  # read by the conv, by silu(gate), or as the fp32 gate
    projection = mixer.projected * p * kept + (0 if in_place else mixer.conv * (a if autocast else w))
    x = inner * 4 if p != 4 else mixer.conv * 4
    # gated norm: the gate in fp32 (unless a view of the projection), its silu, x * silu (and the normalised x)
    gate = inner * 4 * ((3 if p != 4 else 2) + trainable) if mixer.gated_norm else inner * p
    return (per_chunked * chunked(document, mixer.chunk) + between + projection + mixer.conv * a + x + gate
            + 5 * heads * 4)


def _mamba1(mixer: Mixer, a: int) -> float:
    """The sequential selective scan: exp(A·dt), dt·B and each token's state in fp32 with its cast for the product
    with C, all [d_inner, d_state]; in_proj's x and gate, the conv's output, x_proj's input."""
    inner, state = mixer.inner, mixer.key_dim
    return inner * state * (3 * 4 + (a if a != 4 else 0)) + mixer.projected * a + 2 * inner * a + inner * 4 * 3
