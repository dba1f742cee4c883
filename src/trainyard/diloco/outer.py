"""DiLoCo: sites that train on their own and meet once a round.

Each site (a node, or a group of consecutive ranks) runs the inner strategy (diloco.inner: DDP, FSDP or HSDP
over the site's ranks) for diloco.sync_every steps. Then every rank takes its trainable weights' pseudo-gradient,
round-start weights minus current weights, and the ranks that hold the same position in their sites average it by
all-reduce. That all-reduce is the only traffic between sites that grows with the model. Under FSDP or HSDP a rank
holds, syncs and keeps the outer state of its own shard only. The sync walks the weights in chunks
(diloco.sync_chunk_mib) through buffers made once, so it holds about two chunks beyond the outer state. The outer
step is SGD with Nesterov momentum on the round-start weights (Douillard et al. 2023), and every rank starts the next
round from the result.

Nothing else crosses sites between syncs: an inner step's votes, non-finite check and log figures stay within the
site (`OuterSync.within`), so a slow or stalled site holds the others up only at the sync. What the sites must agree
on (a stop, a timed save, the tokens of the round) rides a few floats across sites right after the sync (the
recipe's `agree_at_sync`). The inner loss is normalised by the site's target tokens, so with one site, or with
H = 1, outer_lr 1, no momentum, a linear inner update (SGD) and equal target tokens per site, DiLoCo is DDP.

Between syncs, the sites' weights differ. An eval mid-round runs each rank's rows on its own site's weights,
so its loss averages the sites' models; after a sync every site holds the same weights. A lite checkpoint saves
rank 0's site. A full checkpoint holds the round-start weights under `model` (what export and eval read), each
site's own weights and optimizer under `site-<s>`, and the outer momentum. A resume therefore continues mid-round
exactly, as long as the number of sites is the same.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as torch_dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from trainyard import dist
from trainyard.config import DilocoConfig, JobConfig
from trainyard.dist import DistInfo
from trainyard.errors import ConfigError
from trainyard.parallel.parallelize import unwrap, within_site


def site_count(cfg: JobConfig, info: DistInfo) -> int:
    """How many sites the world splits into; they must be equal, so the count must divide the world. A
    fault-tolerant site is a world of its own (ft.py carries the sync across sites)."""
    if cfg.diloco.fault_tolerant:
        return 1
    groups = cfg.diloco.groups
    count = info.world_size // info.local_world_size if groups == "node" else groups
    if count < 1 or info.world_size % count:
        raise ConfigError(
            f"diloco.groups {groups}: {count} sites do not divide the world of {info.world_size} ranks equally",
            where=cfg.where("diloco.groups"),
            fix=f"set diloco.groups to a divisor of {info.world_size}, or node (one site per node)",
        )
    return count


def site_shard(cfg: JobConfig, info: DistInfo, sites: int) -> int:
    """The ranks of a site's shard dimension (dist.shard_size under hsdp, else the site's): what context parallelism
    is carved out of within a site (dist.build_mesh), as it is out of the world's under fsdp."""
    site = info.world_size // sites
    if cfg.diloco.inner != "hsdp":
        return site
    return dist.hsdp_shape(info, cfg.dist.shard_size, site, cfg.where("dist.shard_size"))[1]


@dataclass(frozen=True)
class _Piece:
    """A run of one parameter's values that lies in a chunk."""

    index: int
    """The parameter's position in OuterSync.params."""
    source: slice
    """Its values in the parameter, flattened."""
    target: slice
    """Where they lie in the chunk."""


@dataclass(frozen=True)
class _Chunk:
    """One step of the sync's walk over the trainable values laid end to end."""

    pieces: list[_Piece]
    length: int
    """Values in the chunk; the buffer holds zeros after them, up to `padded`."""
    padded: int
    """The length rounded up to a multiple of the slices, so that each slicer reduces padded / slices values."""


def _walk(sizes: list[int], chunk: int, slices: int) -> list[_Chunk]:
    """The parameters' values, flattened and laid end to end, cut every `chunk` values (a multiple of `slices`)."""
    chunks: list[_Chunk] = []
    pieces: list[_Piece] = []
    filled = 0
    for index, size in enumerate(sizes):
        taken = 0
        while taken < size:
            take = min(size - taken, chunk - filled)
            pieces.append(_Piece(index, slice(taken, taken + take), slice(filled, filled + take)))
            taken, filled = taken + take, filled + take
            if filled == chunk:
                chunks.append(_Chunk(pieces, chunk, chunk))
                pieces, filled = [], 0
    if pieces:
        chunks.append(_Chunk(pieces, filled, -(-filled // slices) * slices))
    return chunks


@dataclass(frozen=True)
class _Buffers:
    """The sync's working memory, made once and reused every round (empty where pseudo_grad_dtype needs none)."""

    values: torch.Tensor
    """fp32, the largest chunk: its pseudo-gradient, then the sites' average."""
    wire: torch.Tensor
    """bf16: this rank's slice of a chunk as sent."""
    codes: torch.Tensor
    """int8: this rank's slice as sent."""
    every_codes: torch.Tensor
    """int8: every site's codes of the slice, site after site."""
    worth: torch.Tensor
    """int8: one site's codes times their scales, fp32."""


def _buffers(chunks: list[_Chunk], slices: int, sites: int, dtype: str, device: torch.device) -> _Buffers:
    """Room for the largest chunk, and for what its slice is sent as."""
    largest = max((chunk.padded for chunk in chunks), default=0)
    part = largest // slices

    def made(size: int, kind: torch.dtype, needed: bool) -> torch.Tensor:
        return torch.empty(size if needed else 0, dtype=kind, device=device)

    int8 = dtype == "int8"
    return _Buffers(made(largest, torch.float32, True), made(part, torch.bfloat16, dtype == "bf16"),
                    made(part, torch.int8, int8), made(sites * part, torch.int8, int8), made(part, torch.float32, int8))


class OuterSync:
    """The outer loop's state on one rank: round-start weights (fp32) and the outer momentum, per trainable
    parameter, the group of this rank's counterparts in the other sites, and the sync's buffers."""

    def __init__(self, model: torch.nn.Module, cfg: DilocoConfig, mesh: DeviceMesh, info: DistInfo) -> None:
        self.cfg = cfg
        self.group, self.sites, self.site = mesh["site"].get_group(), mesh.size(0), mesh.get_local_rank("site")
        self.within = _site_ranks_group(mesh, info)
        """The ranks of this rank's site: an inner step's collectives outside the inner strategy span them only."""
        copies = _copies_within_site(cfg.inner)
        """The site's ranks that hold the same weights (all of them under DDP, the replicas of a shard under HSDP,
        none under FSDP): they split the sync between them, one slice each."""
        self.slices = mesh.size(mesh.mesh_dim_names.index(copies)) if copies else 1
        self.slicers = mesh[copies].get_group() if self.slices > 1 else None
        self.slice = mesh.get_local_rank(copies) if copies else 0
        named = [(name, p) for name, p in unwrap(model).named_parameters() if p.requires_grad]
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.start = [_own(p).float().clone() for p in self.params]
        self.momentum = [torch.zeros_like(s) for s in self.start]
        self.chunks = _walk([s.numel() for s in self.start], cfg.chunk_elements(self.slices), self.slices)
        self.buffers = _buffers(self.chunks, self.slices, self.sites, cfg.pseudo_grad_dtype, info.device)

    def due(self, step: int) -> bool:
        return step % self.cfg.sync_every == 0

    @torch.no_grad()
    def sync(self) -> dict[str, float]:
        """Average the pseudo-gradients over sites, take the outer step, start the next round.

        One chunk at a time, through buffers made once: the sync holds about two chunks beyond the outer state,
        not copies of the model. Ranks of a site that hold the same weights hold the same pseudo-gradient, so
        each takes one slice of a chunk across sites (its own all-reduce with its counterparts) and they gather
        the slices back over the site's fast links: the bytes between sites are one model's worth per site, not
        one per rank."""
        started = time.monotonic()
        scales = self._int8_scales() if self.cfg.pseudo_grad_dtype == "int8" else None
        for chunk in self.chunks:
            values = self._pseudo_grad(chunk)
            part = chunk.padded // self.slices
            mine = values[self.slice * part : (self.slice + 1) * part]
            if scales is None:
                self._sum(mine)
            else:
                self._sum_int8(mine, self._pieces_in_slice(chunk, part), scales)
            if self.slicers is not None:
                torch_dist.all_gather(list(values.split(part)), mine, group=self.slicers)
            values[: chunk.length].div_(self.sites)
            self._outer_step(chunk, values)
        return {"outer_sync_s": time.monotonic() - started, "outer_sync_bytes": self._sent_bytes()}

    def _pseudo_grad(self, chunk: _Chunk) -> torch.Tensor:
        """The chunk's round-start weights minus current weights, in the buffer, zero-padded."""
        values = self.buffers.values[: chunk.padded]
        for piece in chunk.pieces:
            start = self.start[piece.index].view(-1)[piece.source]
            values[piece.target].copy_(start).sub_(_own(self.params[piece.index]).view(-1)[piece.source])
        values[chunk.length :].zero_()
        return values

    def _outer_step(self, chunk: _Chunk, average: torch.Tensor) -> None:
        """Nesterov SGD on the chunk's round-start weights, which the parameters then take."""
        lr, mu = self.cfg.outer_lr, self.cfg.outer_momentum
        for piece in chunk.pieces:
            pseudo_grad = average[piece.target]
            start = self.start[piece.index].view(-1)[piece.source]
            momentum = self.momentum[piece.index].view(-1)[piece.source]
            momentum.mul_(mu).add_(pseudo_grad)
            if mu:  # the step looks ahead along the momentum
                pseudo_grad.add_(momentum, alpha=mu)
            start.sub_(pseudo_grad, alpha=lr)
            _own(self.params[piece.index]).view(-1)[piece.source].copy_(start)

    def _sum(self, mine: torch.Tensor) -> None:
        """The sites' sum of this rank's slice, in place, by one all-reduce of pseudo_grad_dtype."""
        if self.cfg.pseudo_grad_dtype == "bf16":
            sent = self.buffers.wire[: mine.numel()].copy_(mine)
            torch_dist.all_reduce(sent, group=self.group)
            mine.copy_(sent)
        else:
            torch_dist.all_reduce(mine, group=self.group)

    def _int8_scales(self) -> torch.Tensor:
        """Every site's scale per tensor, sites x tensors: its pseudo-gradient's largest magnitude / 127 (1 where
        that is 0). A tensor spans chunks, so this walks them once before the sums."""
        peaks = self.buffers.values.new_zeros(len(self.params))
        for chunk in self.chunks:
            values = self._pseudo_grad(chunk)
            for piece in chunk.pieces:
                low, high = torch.aminmax(values[piece.target])
                peaks[piece.index] = torch.maximum(peaks[piece.index], torch.maximum(-low, high))
        scales = peaks / 127
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))
        every = scales.new_empty(self.sites, scales.numel())
        torch_dist.all_gather(list(every), scales, group=self.group)
        return every

    def _pieces_in_slice(self, chunk: _Chunk, part: int) -> list[tuple[slice, int]]:
        """Where each parameter's values lie in this rank's slice of the chunk, with the parameter's index."""
        first, last = self.slice * part, (self.slice + 1) * part
        overlaps = [(max(p.target.start, first), min(p.target.stop, last), p.index) for p in chunk.pieces]
        return [(slice(low - first, high - first), index) for low, high, index in overlaps if low < high]

    def _sum_int8(self, mine: torch.Tensor, pieces: list[tuple[slice, int]], scales: torch.Tensor) -> None:
        """The same sum, in place, from int8 codes with one fp32 scale per tensor. Summing int8 would overflow, so
        every site's codes are gathered and summed in fp32 on each rank, in site order: the same result
        everywhere. A quarter of fp32's bytes between 2 sites, half of bf16's."""
        for where, index in pieces:
            mine[where].div_(scales[self.site, index])
        codes = self.buffers.codes[: mine.numel()].copy_(mine.round_().clamp_(-127, 127))
        every_codes = self.buffers.every_codes[: self.sites * mine.numel()].view(self.sites, -1)
        torch_dist.all_gather(list(every_codes), codes, group=self.group)
        worth = self.buffers.worth[: mine.numel()]
        mine.zero_()
        for site_codes, site_scales in zip(every_codes, scales, strict=True):
            worth.copy_(site_codes)
            for where, index in pieces:
                worth[where].mul_(site_scales[index])
            mine.add_(worth)

    def _sent_bytes(self) -> float:
        """What this rank sent to other sites: a ring all-reduce's share, or int8's gathered codes and scales."""
        values = sum(chunk.padded for chunk in self.chunks) // self.slices
        if self.cfg.pseudo_grad_dtype == "int8":
            return (self.sites - 1) * (values + 4 * len(self.params))
        ring = 2 * (self.sites - 1) / self.sites
        return ring * values * (2 if self.cfg.pseudo_grad_dtype == "bf16" else 4)

    def arrangement(self) -> Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]]:
        """How a full checkpoint lays out this rank's state (see checkpoint.Arrange): `model` holds the round-start
        weights, the same on every rank; this site's weights and optimizer go under `site-<s>`, written once per
        site; the momentum is the same everywhere."""
        start = {name: _like(param, own) for name, param, own in zip(self.names, self.params, self.start, strict=True)}
        momentum = {name: _like(param, own) for name, param, own in zip(self.names, self.params, self.momentum,
                                                                         strict=True)}

        held = {_storage(param): name for name, param in zip(self.names, self.params, strict=True)}

        def arrange(model_state: dict[str, Any], optim_state: dict[str, Any]) -> dict[str, Any]:
            missing = set(start) - set(model_state)
            assert not missing, f"trainable parameters outside the state dict: {sorted(missing)[:3]}"
            # A tied head is the embedding under a second name: it must be saved and loaded as the round-start
            # embedding too, or loading it would overwrite this site's embedding with another site's.
            shared = {name: start[name] if name in start else start.get(held.get(_storage(value), ""), value)
                      for name, value in model_state.items()}
            return {
                "model": shared,
                f"site-{self.site}": {"model": model_state, "optim": optim_state},
                "diloco": {"momentum": momentum},
            }

        return arrange


def _site_ranks_group(mesh: DeviceMesh, info: DistInfo) -> torch_dist.ProcessGroup:
    """One process group of the site's ranks: the "local" dimension, or replicate x shard flattened (every rank
    calls it; the new group waits dist.timeout_s like the mesh's own)."""
    inner = within_site(mesh)
    if inner.ndim == 1:
        return inner.get_group()
    return inner._flatten("site_ranks", backend_override=dist.group_backend(info)).get_group()


def _copies_within_site(inner: str) -> str | None:
    """The mesh dimension along which a site's ranks hold the same weights, if any."""
    return {"ddp": "local", "hsdp": "replicate"}.get(inner)


def _own(param: torch.Tensor) -> torch.Tensor:
    """The part of a parameter this rank holds: its FSDP shard, or all of it."""
    return (param.to_local() if isinstance(param, DTensor) else param).detach()


def _storage(tensor: Any) -> tuple[int, tuple[int, ...]] | None:
    """Where a tensor's (local) values live, with its shape: equal for a parameter and its aliases."""
    if not isinstance(tensor, torch.Tensor) or not _own(tensor).numel():
        return None
    return _own(tensor).untyped_storage().data_ptr(), tuple(tensor.shape)


def _like(param: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """`own` laid out as `param` is, sharing its memory: a checkpoint then writes and loads it in place."""
    if not isinstance(param, DTensor):
        return own
    return DTensor.from_local(own, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())
