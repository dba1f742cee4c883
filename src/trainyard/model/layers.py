"""Which layers of a decoder block make a token's output depend on earlier tokens, by kind: attention, which trainyard's
paths keep to each document of a padding-free row (attention.py), and the kinds that carry a state from one document
of a row into the next: linear attention (Gated DeltaNet and its kin), state-space layers (Mamba) and short causal
convolutions, recurrences (RG-LRU, xLSTM, RWKV and its token shift). state_layers.py runs the first three per
document of a padding-free row; collation.padded_rows pads the rows of the others, and of attention a family computes
itself rather than through transformers' attention interface (`own_attention`: trainyard's attention never sees its
documents).

A class of no kind known here might mix tokens in a way nothing checks: `unknown_layers` names it, and attention
refuses it on rows that hold several documents. The rule is by class name, as transformers names its modules
(Qwen3NextGatedDeltaNet, FalconH1Mixer, Lfm2ShortConv; LlamaAttention, LlamaMLP, Qwen3MoeTopKRouter, LlamaRMSNorm),
plus torch's own layers and the wrappers PEFT, FSDP and trainyard put around them.
"""

from __future__ import annotations

import functools
import inspect
import re

import torch
from transformers.pytorch_utils import Conv1D

from trainyard.errors import ModelError

LINEAR_ATTENTION, STATE_SPACE, SHORT_CONVOLUTION, RECURRENT = (
    "linear attention", "state-space", "short causal convolution", "recurrent")
CARRIERS = {
    LINEAR_ATTENTION: ("DeltaNet", "DeltaAttention", "LinearAttention", "LightningAttention"),
    STATE_SPACE: ("Mamba", "Mixer", "SSM"),
    SHORT_CONVOLUTION: ("ShortConv", "CausalConv"),
    RECURRENT: ("Recurrent", "LSTM", "Rwkv"),
}
"""Words in a class name that make it a layer carrying state along the row (checked after PER_TOKEN, so that a
MambaRMSNorm is a norm, and before ATTENTION: a KimiDeltaAttention is linear attention, RwkvSelfAttention a
recurrence)."""
ATTENTION = "Attention"
ATTENTION_ENDINGS = (ATTENTION, "MLA")
"""Class-name endings of attention layers (LongCat-Flash names its MLA so)."""
PER_TOKEN = ("MLP", "Mlp", "FeedForward", "Experts", "Moe", "MoE", "MoeBlock", "MoEBlock", "MoELayer", "Router",
             "Gate", "Gating", "Norm", "NormGated", "Embedding", "Activation", "Gelu", "Statics", "MoA", "AltUp",
             "LaurelBlock")
"""Class-name endings of the layers that compute each token on its own: MLPs, experts and their routers and routing
statistics (Ernie's), norms, JetMoE's mixture of attention heads' projections (MoA), Gemma 3n's per-token
alternating updates (AltUp) and low-rank residuals (Laurel)."""
CONTAINERS = ("DecoderLayer",)
"""Class-name endings of layers that hold others (Zamba's shared attention block): what they hold decides."""
TORCH_PER_TOKEN = (torch.nn.Linear, torch.nn.Embedding, torch.nn.LayerNorm, torch.nn.RMSNorm, torch.nn.Dropout,
                   torch.nn.Identity, torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential,
                   torch.nn.ParameterList, torch.nn.ParameterDict, Conv1D)
"""transformers' Conv1D (GPT-2's) is a linear map with its weight transposed."""
INTERFACE = "ALL_ATTENTION_FUNCTIONS"
"""What an attention layer's forward names when it hands its scores to transformers' attention interface, where
trainyard's implementations run."""
OWN_MASK = ("DogeAttention",)
"""Attention layers that call the interface with a mask of their own making (Doge's dynamic mask, from the row's)."""
PER_TOKEN_MODULES = ("torch.nn.modules.activation", "transformers.activations")
WRAPPERS = ("peft.", "trainyard.", "torch.distributed.")
"""Modules of these packages wrap a family's layers (adapters, sharding, checkpointing): what they wrap decides."""
UNKNOWN = "unknown"


def kind(module: torch.nn.Module) -> str | None:
    """A carrier kind, ATTENTION, UNKNOWN, or None for a layer that mixes no tokens itself (its children might)."""
    cls = type(module)
    if (isinstance(module, TORCH_PER_TOKEN) or cls.__name__.endswith(PER_TOKEN + CONTAINERS)
            or cls.__module__ in PER_TOKEN_MODULES or cls.__module__.startswith(WRAPPERS)):
        return None
    if cls.__name__.endswith(ATTENTION_ENDINGS) and _hands_scores_to_interface(cls):
        return ATTENTION  # Kimi Linear's MLA is named KimiLinearAttention
    for carried, words in CARRIERS.items():
        if any(word in cls.__name__ for word in words):
            return carried
    if isinstance(module, (torch.nn.Conv1d, torch.nn.ZeroPad2d)):  # a causal convolution or token shift (RWKV's)
        return SHORT_CONVOLUTION
    if cls.__name__.endswith(ATTENTION_ENDINGS):
        return ATTENTION
    return UNKNOWN


def block_layers(model: torch.nn.Module) -> dict[str, str]:
    """Each class inside the decoder blocks that carries state, or is of no known kind, with its kind: the outermost
    such class (a Mamba mixer, not its Conv1d)."""
    found: dict[str, str] = {}
    for block in blocks(model):
        _walk(block, found)
    return found


def carriers(model: torch.nn.Module) -> list[str]:
    """The classes that carry state across the documents of a row; Llama 4's NoPE layers too, whose temperature
    tuning scales each query by its index in the row (from floor_scale tokens on), not in its document."""
    found = [name for name, found in block_layers(model).items() if found in CARRIERS]
    row_indexed = {type(m).__name__ for m in model.modules()
                   if getattr(m, "attn_temperature_tuning", False) and not getattr(m, "use_rope", True)}
    own = [f"{name} (its own attention, not transformers' attention interface)" for name in own_attention(model)]
    return found + [f"{name} (NoPE: queries scaled by their index in the row)" for name in sorted(row_indexed)] + own


def own_attention(model: torch.nn.Module) -> list[str]:
    """Attention classes that compute their scores themselves, or mask them with a mask of their own making:
    trainyard's attention never sees their documents, so they would read a row of documents as one."""
    classes = dict.fromkeys(type(m) for block in blocks(model) for m in block.modules() if kind(m) == ATTENTION)
    return [cls.__name__ for cls in classes if cls.__name__ in OWN_MASK or INTERFACE not in _source(cls.forward)]


def refuse_other_masks(requested: str, model: torch.nn.Module, where: str | None) -> None:
    """A family whose attention is its own code reads the mask transformers makes for sdpa or eager (auto picks one
    of them): another implementation's mask kind would have it train another function, with no error of its own."""
    own = own_attention(model)
    if own and requested not in ("auto", "sdpa", "eager"):
        raise ModelError(f"model.attn_implementation: {requested}: {', '.join(own)} computes attention in its own "
                         "code, which reads only the masks sdpa and eager make", where=where,
                         fix="use auto, sdpa or eager")


def window_only_in_mask(model: torch.nn.Module) -> list[str]:
    """Attention classes of a family with sliding windows that do not give their window to the attention interface
    (PhiMoE): only the mask transformers builds keeps it."""
    if not getattr(model.config, "sliding_window", None):
        return []
    classes = dict.fromkeys(type(m) for block in blocks(model) for m in block.modules() if kind(m) == ATTENTION)
    return [cls.__name__ for cls in classes
            if INTERFACE in (source := _source(cls.forward)) and "sliding_window" not in source]


@functools.cache
def _hands_scores_to_interface(cls: type) -> bool:
    return INTERFACE in _source(cls.forward)


def _source(function: object) -> str:
    try:
        return inspect.getsource(function)  # type: ignore[arg-type]
    except (OSError, TypeError):
        return ""


def unknown_layers(model: torch.nn.Module) -> list[str]:
    return [name for name, found in block_layers(model).items() if found == UNKNOWN]


def _walk(module: torch.nn.Module, found: dict[str, str]) -> None:
    for child in module.children():
        child_kind = kind(child)
        if child_kind in CARRIERS or child_kind == UNKNOWN:
            found.setdefault(type(child).__name__, child_kind)
        else:
            _walk(child, found)


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated decoder blocks (the family's _no_split_modules; else the first ModuleList's entries). A PEFT
    model hands attribute reads to the model it wraps."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [module for module in model.modules() if type(module).__name__ in names]
    if blocks:
        return blocks
    lists = [module for module in model.modules() if isinstance(module, torch.nn.ModuleList)][:1]
    return list(lists[0]) if lists else []


def not_plain_linear(model: torch.nn.Module) -> dict[str, str]:
    """The Linear layers whose output is not x·Wᵀ + b through their own forward, by full name, with why."""
    found = {}
    for parent_name, parent in model.named_modules():
        read = weights_read_directly(type(parent))
        for name, child in parent.named_children():
            if not isinstance(child, torch.nn.Linear):
                continue
            full = f"{parent_name}.{name}" if parent_name else name
            if type(child).forward is not torch.nn.Linear.forward:
                found[full] = f"{type(child).__name__}'s forward is not a plain linear map"
            elif name in read:
                found[full] = f"{type(parent).__name__} hands its weight to a fused kernel, past any adapter"
    return found


@functools.cache
def weights_read_directly(cls: type) -> frozenset[str]:
    """Children whose weight the class's own code reads as a tensor (`self.out_proj.weight` given to a kernel), not
    only its dtype or device. A class without source (built at run time) reads none that can be seen."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return frozenset()
    return frozenset(re.findall(r"self\.(\w+)\.weight\b(?!\s*\.\s*(?:dtype|device|shape|size|ndim|is_meta))", source))
