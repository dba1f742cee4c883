"""`trainyard estimate`, expert parallelism: what FSDP2 gathers of the routed experts and what EP's all-to-all
sends instead, per rank and step, and the size `dist.expert_parallel: auto` takes (the plan asks it; training
runs what the plan decides).

Under EP N, carved out of a shard group of S ranks, each rank holds experts / N whole experts of every MoE layer,
sharded again over the S / N ranks left (not at all when N = S): FSDP2 gathers only those. Each routed
(token, expert) pair's hidden state goes to its expert's rank and its output comes back (dispatch and combine),
in the forward and again, as gradients, in the backward; activation checkpointing recomputes the forward's.
A rank keeps the 1 / N of its pairs whose experts it holds (routing taken as balanced). Under context parallelism
C (each EP group made of whole CP groups: N a multiple of C) a rank routes only its 1 / C of every row's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainyard.config import JobConfig
from trainyard.estimate.arch import Counts, Shape
from trainyard.model.routing import EXPERT_PARALLEL_FAMILIES as FAMILIES


@dataclass(frozen=True)
class ExpertTraffic:
    """Bytes one rank moves per optimizer step for the routed experts under EP `size` (1: none)."""

    size: int
    gathered: float
    """Expert weights FSDP2 all-gathers into this rank (forward and backward): (S' - 1) / S' of what S' ranks
    hold between them, S' the ranks an EP rank's experts are sharded over."""
    exchanged: float
    """Hidden states this rank's all-to-alls send to other ranks (dispatch and combine, forward and backward)."""
    link: str
    """Which link the all-to-all crosses, in words."""


def all_to_all_passes(cfg: JobConfig) -> int:
    """All-to-alls per MoE layer and micro-batch: dispatch and combine in the forward and the backward, and the
    forward's again when activation checkpointing recomputes it."""
    return 6 if cfg.model.gradient_checkpointing else 4


def gathered_bytes(total: float, trainable: float, compute: int, frozen: int, master: int, mixed: bool) -> float:
    """Bytes of `total` elements as FSDP2 gathers them: the compute dtype under bf16-mixed, else as stored."""
    return total * compute if mixed else (total - trainable) * frozen + trainable * master


def traffic(cfg: JobConfig, shape: Shape, counts: Counts, size: int, shard: int, gpus_per_node: int,
            accum: int, tokens_per_micro_batch: float, element: tuple[int, int, int, bool]) -> ExpertTraffic:
    """Per rank and step, the experts' FSDP2 gathers and all-to-all bytes under EP `size` in a shard group of
    `shard` ranks. `element`: bytes of the (compute, frozen, master) dtypes and whether autocast mixes them."""
    compute, frozen, master, mixed = element
    experts = counts.experts
    held_apart = shard // size
    stacks = gathered_bytes(experts.total, experts.trainable, compute, frozen, master, mixed) / size
    gathered = accum * 2 * stacks * (held_apart - 1) / held_apart
    moe_layers = shape.layers - shape.dense_layers
    pairs = tokens_per_micro_batch * shape.experts_per_token
    exchanged = accum * all_to_all_passes(cfg) * moe_layers * pairs * shape.hidden * compute * (size - 1) / size
    return ExpertTraffic(size, gathered, exchanged if size > 1 else 0.0, link_words(size, gpus_per_node))


def link_words(size: int, gpus_per_node: int) -> str:
    if size == 1:
        return "none"
    within = size <= gpus_per_node and gpus_per_node % size == 0
    return "within a node" if within else "across nodes"


def candidates(shape: Shape, shard: int, gpus_per_node: int, context: int = 1) -> list[int]:
    """EP sizes an MoE model can run in a shard group, largest first: within a node, dividing the experts and the
    shard group, each EP rank's experts splitting evenly over the ranks left of it, made of whole CP groups of
    `context` ranks."""
    if not shape.experts or shape.family not in FAMILIES:
        return []
    sizes = [n for n in range(2, min(shard, gpus_per_node, shape.experts) + 1)
             if shape.experts % n == 0 and shard % n == 0 and gpus_per_node % n == 0
             and (shape.experts // n) % (shard // n) == 0 and n % context == 0]
    return sorted(sizes, reverse=True)


def choose(cfg: JobConfig, shape: Shape, counts: Counts, strategy: str, shard: int, gpus_per_node: int,
           accum: int, tokens_per_micro_batch: float, element: tuple[int, int, int, bool],
           context: int = 1) -> tuple[int, str]:
    """(size, why) for `dist.expert_parallel: auto`: the largest candidate whose all-to-all and remaining gathers
    move fewer bytes per rank and step than FSDP2's gathers of every expert; else 1. `tokens_per_micro_batch`: a
    rank's (its CP slice's); `context`: the CP size EP groups are made of."""
    if strategy not in ("fsdp", "hsdp") or shard == 1:
        return 1, f"expert parallelism is carved out of fsdp/hsdp's shard group ({strategy}, {shard} rank(s))"
    if not shape.experts:
        return 1, "a dense model has no routed experts"
    found = candidates(shape, shard, gpus_per_node, context)
    if cfg.model.quantize == "nf4":  # FSDP2 cannot gather an NF4 expert sharded over one rank (nf4_experts)
        found = [size for size in found if shard // size > 1]
    if not found:
        why = ("not proven exact for " + shape.family) if shape.family not in FAMILIES else "no size divides"
        why += ", NF4's experts each sharded over 2 or more ranks" if cfg.model.quantize == "nf4" else ""
        groups = f", whole CP groups of {context}" if context > 1 else ""
        return 1, f"{why} ({shape.experts} experts, shard group {shard}, {gpus_per_node} per node{groups})"
    args = (cfg, shape, counts)
    fsdp = traffic(*args, 1, shard, gpus_per_node, accum, tokens_per_micro_batch, element)
    for size in found:
        ep = traffic(*args, size, shard, gpus_per_node, accum, tokens_per_micro_batch, element)
        if ep.exchanged + ep.gathered < fsdp.gathered:
            return size, (f"FSDP2 gathers {fsdp.gathered / 1e9:.3g} GB of experts per rank and step; EP {size} "
                          f"sends {ep.exchanged / 1e9:.3g} GB by all-to-all ({ep.link}) and gathers "
                          f"{ep.gathered / 1e9:.3g} GB")
    smallest = traffic(*args, found[-1], shard, gpus_per_node, accum, tokens_per_micro_batch, element)
    return 1, (f"FSDP2 gathers {fsdp.gathered / 1e9:.3g} GB of experts per rank and step, fewer than EP "
               f"{found[-1]}'s {(smallest.exchanged + smallest.gathered) / 1e9:.3g} GB")
