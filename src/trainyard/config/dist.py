"""The dist and diloco sections: process groups and the strategy across ranks, and DiLoCo's sites and outer step."""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import Field, model_validator

from trainyard.config.section import Section


class DilocoConfig(Section):
    """DiLoCo (Douillard et al. 2023): each site takes sync_every inner steps on its own, then the sites average
    their pseudo-gradients (round-start weights minus current weights) and take one outer Nesterov step."""

    sync_every: int = Field(50, ge=1)
    """H: inner steps per round; the outer all-reduce of the trainable weights' size happens once per round."""
    outer_lr: float = Field(0.7, gt=0)
    outer_momentum: float = Field(0.9, ge=0.0, lt=1.0)
    """Nesterov momentum of the outer SGD step; 0 turns momentum off."""
    groups: Literal["node"] | int = "node"
    """How the world splits into sites: node (one site per node), or a number of equal sites of consecutive ranks."""
    inner: Literal["ddp", "fsdp", "hsdp"] = "ddp"
    """The strategy inside a site. fsdp shards the site's weights, gradients and optimizer over its ranks (and the
    outer state with them): each rank then sends only its own shard's pseudo-gradient to its counterparts. hsdp,
    for a site of several nodes: shard within dist.shard_size ranks (a node by default), replicate across the
    site's shard groups; the replicas split their shard's outer sync between them."""
    pseudo_grad_dtype: Literal["fp32", "bf16", "int8"] = "fp32"
    """What the outer sync sends: bf16 halves the bytes between sites; int8 (one scale per tensor) sends a quarter
    of fp32's between 2 sites (it is gathered, not reduced: (sites - 1) bytes per value per rank)."""
    sync_chunk_mib: float = Field(64.0, gt=0)
    """The outer sync walks the pseudo-gradient in chunks of this many MiB of fp32 values, through buffers made
    once: it holds about two chunks beyond the outer state instead of several copies of the model. Smaller chunks
    take more collectives per sync."""
    fault_tolerant: bool = False
    """Sites that drop out and come back (torchft, the `ft` extra): each site is its own launch and torch world, the
    outer average is over the sites present at each sync, and a returning site loads the round-start weights and
    outer state from a live peer. Needs diloco.site, diloco.sites and a lighthouse."""
    site: int | None = Field(None, ge=0)
    """fault_tolerant: this launch's site, 0 to sites - 1 (e.g. `diloco.site=1` on the launch's command line)."""
    sites: int | None = Field(None, ge=1)
    """fault_tolerant: how many sites the job has; each reads its own slice of the data, as one world would."""
    lighthouse: str | None = None
    """fault_tolerant: the torchft lighthouse, HOST:PORT (default: the TORCHFT_LIGHTHOUSE variable)."""
    quorum_timeout_s: float = Field(3600.0, gt=0)
    """fault_tolerant: how long a site waits at a sync for the quorum. A returning site waits in it for the others'
    next sync, so make it longer than a round."""
    join_timeout_s: float = Field(60.0, gt=0)
    """fault_tolerant: how long a sync waits for a site that is alive (it heartbeats) but has not reached the sync
    yet; past it the sites present sync without it, and it heals from them at its own sync, losing its round. Make
    it longer than the slowest site lags the fastest per round. A site gone (no heartbeat for 5 s) is never waited
    for. The lighthouse reads it (`trainyard lighthouse` with the job's file)."""

    @model_validator(mode="after")
    def _fault_tolerant_needs_its_site(self) -> "DilocoConfig":
        if not self.fault_tolerant:
            return self
        if self.site is None or self.sites is None or self.site >= self.sites:
            raise ValueError(
                f"diloco.fault_tolerant needs diloco.site below diloco.sites (site {self.site}, sites {self.sites}): "
                "set diloco.sites to the job's number of sites and diloco.site=S on each site's launch"
            )
        if self.join_timeout_s >= self.quorum_timeout_s:
            raise ValueError(
                f"diloco.join_timeout_s ({self.join_timeout_s:g}) must be below diloco.quorum_timeout_s "
                f"({self.quorum_timeout_s:g}): a site would give up its quorum while the lighthouse still waits for a "
                "slower site; raise diloco.quorum_timeout_s or lower diloco.join_timeout_s"
            )
        if self.pseudo_grad_dtype == "int8":
            raise ValueError(
                "diloco.pseudo_grad_dtype int8 is gathered, not reduced: torchft reduces only; with "
                "diloco.fault_tolerant use fp32 or bf16"
            )
        return self

    def chunk_elements(self, slices: int) -> int:
        """Values per chunk of the outer sync: a multiple of the ranks that split each chunk between them."""
        values = math.ceil(self.sync_chunk_mib * 2**20 / 4)
        return -(-values // slices) * slices


class DistConfig(Section):
    strategy: Literal["auto", "none", "ddp", "fsdp", "hsdp", "diloco"] = "auto"
    """auto: none alone, ddp while replicated state fits, else hsdp across nodes or fsdp within one.
    hsdp shards within a node and replicates across nodes: only a gradient all-reduce crosses the
    slow link, instead of every block's all-gather and reduce-scatter. diloco (the `diloco` section): sites
    train on their own for sync_every steps, then average once; for sites joined by a WAN."""
    shard_size: int | None = Field(None, ge=1)
    """hsdp (and diloco with inner hsdp): ranks per shard group (default: the processes per node); must divide
    the world size (a site's size under diloco)."""
    expert_parallel: Annotated[int, Field(ge=1)] | Literal["auto"] = 1
    """MoE models under fsdp/hsdp: each group of this many ranks splits every MoE block's routed experts between
    them (whole experts: experts / N per rank) and sends each token to the rank holding its expert, so no step
    all-gathers the experts. Carved out of the shard dimension: must divide it and the number of experts. Routers,
    attention, shared experts and dense layers stay sharded as before. 1: no expert parallelism. auto: the plan
    picks the largest size within a node that divides the experts and the shard group where the estimate shows
    the all-to-all sends fewer bytes than FSDP2's gathers of the experts, else 1 (dense models: 1)."""
    context_parallel: Annotated[int, Field(ge=1)] | Literal["auto"] = 1
    """fsdp/hsdp, padding-free rows: each group of this many ranks trains the same rows, each rank holding a
    contiguous 1/N of every row's tokens through the whole block (Ulysses: an all-to-all around attention trades the
    sequence shard for a head shard, so each rank attends whole documents for heads / N). Carved out of the shard
    dimension: must divide it (and the heads). Activations per rank fall by about N; the data-parallel size, the
    sampler's and the global batch's, is the world / N. Full checkpoints resume at another CP size; DPO sums each
    reply over the group. With dist.expert_parallel: each EP group is made of whole CP groups (EP a multiple of
    CP; a row's tokens are routed to experts within its EP group). diloco: within a site (diloco.inner fsdp or
    hsdp). 1: none. Not yet with dpo.loss orpo, or families whose layers carry a state along the row (linear
    attention, state-space, short convolutions: refused naming them); proven for llama, qwen3, mistral, gemma2,
    gpt_oss, and with EP for qwen3_moe and glm4_moe.
    auto: where the estimate shows the job does not fit a device as it is (a document's activations), the plan takes
    the fewest of a node's GPUs that fit it (the cheapest fix's split), under fsdp/hsdp; else 1 (it fits, no split
    fits, the family or the job cannot run CP, one process). The dry run says which and why."""
    defer_grad_sync: bool = False
    """fsdp/hsdp with accumulation: reduce gradients only on a window's last micro-batch. Trades memory
    for speed: unsharded gradients of the whole model live until then (off: each micro-batch
    reduce-scatters and frees them; hsdp still all-reduces across nodes once per step). DDP always
    defers: it keeps one full gradient per rank whether it syncs or not."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    timeout_s: float = Field(600.0, gt=0)
    """Collective timeout: a lost rank fails the job after this, not after 30 minutes."""
    network: Literal["default", "socket", "infiniband", "wan"] = "default"
    """wan: sites joined by the internet or a slow link. With more than a few MB of gradients per step, pick
    dist.strategy: diloco there, which crosses the link once per diloco.sync_every steps instead of every step."""
    nic: str | None = None
    desync_check_steps: int = Field(100, ge=0)
    """Every N steps DDP replicas compare weight norms (one all-gather); 0 turns it off."""
    desync_tolerance: float = Field(1e-6, ge=0.0)

    @model_validator(mode="after")
    def _shard_size_only_for_hsdp(self) -> "DistConfig":
        if self.shard_size is not None and self.strategy not in ("hsdp", "auto", "diloco"):
            raise ValueError(
                f"dist.shard_size is set but dist.strategy is {self.strategy}: only hsdp has shard groups; "
                "set dist.strategy: hsdp, or remove dist.shard_size"
            )
        return self

    @model_validator(mode="after")
    def _expert_parallel_only_when_sharded(self) -> "DistConfig":
        if self.expert_parallel != "auto" and self.expert_parallel > 1 and self.strategy not in ("fsdp", "hsdp"):
            raise ValueError(
                f"dist.expert_parallel {self.expert_parallel} needs dist.strategy fsdp or hsdp (EP is carved out of "
                f"the shard dimension), not {self.strategy}: set dist.strategy: fsdp, or dist.expert_parallel: 1"
            )
        return self

    @model_validator(mode="after")
    def _context_parallel_only_when_sharded(self) -> "DistConfig":
        size = self.context_parallel
        if size == "auto":  # the plan resolves it to a size these rules allow, or 1
            return self
        if size > 1 and self.strategy not in ("fsdp", "hsdp", "diloco"):  # diloco: diloco.inner is JobConfig's
            raise ValueError(
                f"dist.context_parallel {size} needs dist.strategy fsdp, hsdp or diloco (CP is carved out of the "
                f"shard dimension), not {self.strategy}: set dist.strategy: fsdp, or dist.context_parallel: 1"
            )
        experts = self.expert_parallel
        if size > 1 and experts != "auto" and experts > 1 and experts % size:
            divisors = ", ".join(str(d) for d in range(1, experts + 1) if experts % d == 0)
            raise ValueError(
                f"dist.context_parallel {size} with dist.expert_parallel {experts}: each EP group is made of whole "
                f"CP groups, so dist.expert_parallel must be a multiple of dist.context_parallel; set "
                f"dist.expert_parallel to {size}, {2 * size}, ... (a multiple of {size} that divides the shard "
                f"dimension and the experts), or dist.context_parallel to one of {divisors}"
            )
        return self
