"""Context parallelism (CP, Ulysses style): the ranks of a CP group train the same rows, each holding a contiguous
1/N of every row's tokens through the whole block; around attention an all-to-all trades the sequence shard for a
head shard, so each rank attends whole documents for 1/N of the heads, then trades back.

CP is carved out of the shard dimension (`dist.build_mesh`: "shard" = "shard_mod_cp" x "cp"), as expert
parallelism is: the ranks that split a row still shard the weights under FSDP2/HSDP. With expert parallelism each EP
group is made of whole CP groups (`dist.carved_dims`): a rank's slice goes to the experts like any rank's rows. It
enters the job in two places only: `attach` (from parallelize.apply) swaps the model's attention for
`context_attention`, which wraps the implementation `attention.choose` picked (varlen); the collator slices each row
(data/collate.py: context_slice) for the rank `slice_of` names. The loop is unchanged: each target token is counted
on the one rank that holds it, so the step's global count is already right, and FSDP sums the ranks' gradients as
for any other data-parallel rank.

Rotary positions come from each token's global position_ids, which the slice keeps; the inner attention gets the
whole row's position_ids (all-gathered once per forward), so it finds the same documents, windows included, as on
one process. Evaluation (the model in eval mode) runs whole rows on each rank, without the exchange.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as torch_dist
from torch.distributed.device_mesh import DeviceMesh
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from trainyard import dist
from trainyard.config.data import DataConfig
from trainyard.errors import ConfigError
from trainyard.model import collation
from trainyard.model import attention, documents, layers

CONTEXT = "trainyard_context"
"""The name transformers' AttentionInterface knows `context_attention` by."""
INNER = (attention.VARLEN, attention.TORCH_VARLEN)
"""Inner implementations that see whole documents under the exchange: trainyard's varlen (proven exact), and torch's
varlen kernel, auto's choice on CUDA, which reads the same whole-row bounds the collator made (context_slice; not yet
checked under the exchange on a GPU). Without those bounds varlen reads the whole row's position_ids. flash-attention's
varlen kernels are not yet checked on a GPU; sdpa and eager build their mask from the rank's slice, which would be
wrong."""
STRATEGIES = ("fsdp", "hsdp")
FAMILIES = documents.CONTEXT_PARALLEL_FAMILIES


@dataclass(frozen=True)
class ContextGroup:
    """What every attention module of a CP model carries: its CP group and the implementation it wraps."""

    group: torch_dist.ProcessGroup
    size: int
    rank: int
    inner: str


def context_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The CP dimension of a mesh `dist.build_mesh` made with context_parallel > 1."""
    root = mesh._get_root_mesh()
    assert "cp" in (root.mesh_dim_names or ()), f"not a context-parallel mesh: {root.mesh_dim_names}"
    return root["cp"]


def check(model: torch.nn.Module, size: int, shard: int, data: DataConfig, where: str | None) -> None:
    """Refuse, before any weight is read, a CP size this job cannot run exactly (`shard`: the ranks of the shard
    dimension it is carved out of)."""
    if size == 1:
        return
    if shard % size:
        raise ConfigError(
            f"dist.context_parallel {size} must divide the shard dimension ({shard} ranks)", where=where,
            fix="set dist.context_parallel to one of "
            + ", ".join(str(d) for d in range(1, shard + 1) if shard % d == 0),
        )
    refuse_family(model, size, where)
    family, inner = attention.config_name(model), model.config._attn_implementation
    if not collation.model_one_row(model, data):
        why = collation.padded_rows(model, data) or "data.padding_free is off"
        raise ConfigError(
            f"dist.context_parallel {size} slices padding-free rows, but this job collates padded rows ({why})",
            where=where, fix="set data.padding_free: true, or dist.context_parallel: 1",
        )
    if inner not in INNER:
        raise ConfigError(
            f"dist.context_parallel {size} runs trainyard's varlen attention inside its exchange; {family} runs "
            f"{inner} here", where=where,
            fix="set model.attn_implementation: varlen, or dist.context_parallel: 1",
        )
    heads = model.config.num_attention_heads
    if heads % size:
        raise ConfigError(
            f"dist.context_parallel {size} must divide the attention heads ({heads}): each rank attends heads / N",
            where=where, fix="set dist.context_parallel to one of "
            + ", ".join(str(d) for d in range(1, heads + 1) if heads % d == 0),
        )


def refuse_family(model: torch.nn.Module, size: int, where: str | None) -> None:
    """Refuse a family CP is not proven exact for (the dry run asks too: it needs the model alone). A layer that
    carries a state along the row (layers.CARRIERS) would run on the rank's 1/N slice of each document only: the
    exchange reaches attention, not it, so it is named with its kind."""
    family = attention.config_name(model)
    carried = {name: kind for name, kind in layers.block_layers(model).items() if kind in layers.CARRIERS}
    fix = f"set dist.context_parallel: 1 (it runs {', '.join(FAMILIES)})"
    if carried:
        named = ", ".join(f"{name} layers ({kind})" for name, kind in carried.items())
        raise ConfigError(
            f"dist.context_parallel {size}: {family}'s {named} need the whole document on one rank; Ulysses "
            f"exchanges only attention's tokens, so each rank would run them on its 1/{size} of every row alone",
            where=where, fix=fix,
        )
    if family not in FAMILIES:
        raise ConfigError(
            f"dist.context_parallel {size}: context parallelism is not proven exact for {family} yet",
            where=where, fix=fix,
        )


def attach(model: torch.nn.Module, mesh: DeviceMesh) -> ContextGroup:
    """Route every attention module of `model` through `context_attention` over the mesh's CP group."""
    cp = context_mesh(mesh)
    config = model.config
    found = ContextGroup(cp.get_group(), cp.size(), cp.get_local_rank(), config._attn_implementation)
    for module in model.modules():
        if hasattr(module, "config") and hasattr(module, "num_key_value_groups"):
            module.context_parallel = found
    config._attn_implementation = CONTEXT
    return found


def group_of(model: torch.nn.Module) -> ContextGroup | None:
    """The CP group `attach` gave the model's attention modules, or None without context parallelism."""
    for module in model.modules():
        found = getattr(module, "context_parallel", None)
        if found is not None:
            return found
    return None


def slice_of(model: torch.nn.Module) -> tuple[int, int]:
    """(this rank's place in its CP group, the group's size): which slice of each row the collator gives it."""
    found = group_of(model)
    return (0, 1) if found is None else (found.rank, found.size)


def summed_over_slices(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A figure of whole rows from each rank's partial one over its slices (DPO's per-document sums): the CP group's
    sum, on every rank, differentiable; its backward sums the ranks' gradients, each rank computing the same loss."""
    found = group_of(model)
    return x if found is None else dist.group_sum(x, found.group)


def sequence_to_heads(x: torch.Tensor, group: ContextGroup) -> torch.Tensor:
    """[B, H, S, D] of this rank's S = T / N tokens -> [B, H / N, T, D]: every token, this rank's heads."""
    batch, heads, length, dim = x.shape
    n = group.size
    sent = x.permute(1, 0, 2, 3).reshape(n, heads // n, batch, length, dim).contiguous()
    got = dist.all_to_all_rows(sent.flatten(0, 1), [heads // n] * n, [heads // n] * n, group.group)
    got = got.view(n, heads // n, batch, length, dim)  # [source rank = its tokens, my heads, ...]
    return got.permute(2, 1, 0, 3, 4).reshape(batch, heads // n, n * length, dim)


def heads_to_sequence(x: torch.Tensor, group: ContextGroup) -> torch.Tensor:
    """The inverse for attention's output: [B, T, H / N, D] -> [B, S, H, D], this rank's tokens, every head."""
    batch, total, heads, dim = x.shape
    n = group.size
    length = total // n
    sent = x.view(batch, n, length, heads, dim).permute(1, 0, 2, 3, 4).contiguous()
    got = dist.all_to_all_rows(sent.flatten(0, 1), [batch] * n, [batch] * n, group.group)
    got = got.view(n, batch, length, heads, dim)  # [source rank = its heads, ...]
    return got.permute(1, 2, 0, 3, 4).reshape(batch, length, n * heads, dim)


def kv_repeats(query_heads: int, kv_heads: int, size: int) -> int:
    """How many times to repeat each KV head so the CP group splits them evenly and every rank's query heads find
    theirs among its own: the least factor f with kv_heads x f divisible by `size` and dividing query_heads."""
    return next(f for f in range(1, query_heads // kv_heads + 1)
                if (kv_heads * f) % size == 0 and query_heads % (kv_heads * f) == 0)


_gathered: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)


def whole_positions(local: torch.Tensor, group: ContextGroup) -> torch.Tensor:
    """The whole row's position_ids from every rank's slice; every layer of one forward passes the same tensor,
    so it is gathered once (the same on every rank of the group: they run the same layers)."""
    global _gathered
    if _gathered[0] is not local:
        parts = [torch.empty_like(local) for _ in range(group.size)]
        torch_dist.all_gather(parts, local.contiguous(), group=group.group)
        _gathered = (local, torch.cat(parts, dim=1))
    assert _gathered[1] is not None
    return _gathered[1]


@contextlib.contextmanager
def _groups_of(module: torch.nn.Module, groups: int) -> Iterator[None]:
    """The module's query heads per KV head while the inner attention runs on repeated KV heads (transformers'
    sdpa and eager read it from the module)."""
    saved = module.num_key_value_groups
    module.num_key_value_groups = groups
    try:
        yield
    finally:
        module.num_key_value_groups = saved


def own_heads(per_head: torch.Tensor, group: ContextGroup) -> torch.Tensor:
    """This rank's share of a per-query-head tensor: `sequence_to_heads` gives rank r the r-th contiguous block."""
    heads = per_head.shape[0] // group.size
    return per_head[group.rank * heads:(group.rank + 1) * heads]


@contextlib.contextmanager
def _own_sinks(module: torch.nn.Module, group: ContextGroup) -> Iterator[None]:
    """gpt-oss's eager attention reads `module.sinks` (one per query head) itself, not the s_aux it is passed: this
    rank's heads' sinks while the inner attention runs, a slice of the parameter, so its gradient reaches it."""
    sinks = module._parameters.get("sinks")
    if sinks is None:
        yield
        return
    module._parameters["sinks"] = own_heads(sinks, group)
    try:
        yield
    finally:
        module._parameters["sinks"] = sinks


def context_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The inner implementation on whole rows for this rank's heads, between the two all-to-alls."""
    group: ContextGroup = module.context_parallel
    inner = ALL_ATTENTION_FUNCTIONS[group.inner]
    if not module.training:  # evaluation: each rank runs its own whole rows
        return inner(module, query, key, value, attention_mask, **kwargs)
    repeats = kv_repeats(query.shape[1], key.shape[1], group.size)
    if repeats > 1:
        key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
    if kwargs.get("position_ids") is not None:
        kwargs["position_ids"] = whole_positions(kwargs["position_ids"], group)
    query, key, value = (sequence_to_heads(x, group) for x in (query, key, value))
    if kwargs.get("s_aux") is not None:
        kwargs["s_aux"] = own_heads(kwargs["s_aux"], group)
    with _groups_of(module, query.shape[1] // key.shape[1]), _own_sinks(module, group):
        output, _ = inner(module, query, key, value, attention_mask, **kwargs)
    return heads_to_sequence(output, group), None


AttentionInterface.register(CONTEXT, context_attention)
documents.HOST_BOUNDS.add(CONTEXT)
AttentionMaskInterface.register(CONTEXT, attention.varlen_mask)
