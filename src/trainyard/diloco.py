"""DiLoCo: sites that train on their own and meet once a round.

Each site (a node, or a group of consecutive ranks) runs the inner strategy (diloco.inner: DDP, FSDP or HSDP
over the site's ranks) for diloco.sync_every steps. Then every rank takes its trainable weights' pseudo-gradient,
round-start weights minus current weights, and the ranks that hold the same position in their sites average it in
one all-reduce. That all-reduce is the only traffic between sites that grows with the model. Under FSDP or HSDP a rank
holds, syncs and keeps the outer state of its own shard only. The outer step is SGD with Nesterov
momentum on the round-start weights (Douillard et al. 2023), and every rank starts the next round from the result.

What else crosses sites: the step's token-count vote (a few floats) and the logging gathers. The inner loss is
normalised by the world's target tokens, so with one site, or with H = 1, outer_lr 1 and no momentum over a
linear inner update (SGD), DiLoCo is DDP.

Between syncs, the sites' weights differ. An eval mid-round runs each rank's rows on its own site's weights,
so its loss averages the sites' models; after a sync every site holds the same weights. A lite checkpoint saves
rank 0's site. A full checkpoint holds the round-start weights under `model` (what export and eval read), each
site's own weights and optimizer under `site-<s>`, and the outer momentum. A resume therefore continues mid-round
exactly, as long as the number of sites is the same.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as torch_dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from trainyard.config import DilocoConfig, JobConfig
from trainyard.dist import DistInfo
from trainyard.errors import ConfigError
from trainyard.parallel.parallelize import unwrap


def site_count(cfg: JobConfig, info: DistInfo) -> int:
    """How many sites the world splits into; they must be equal, so the count must divide the world."""
    groups = cfg.diloco.groups
    count = info.world_size // info.local_world_size if groups == "node" else groups
    if count < 1 or info.world_size % count:
        raise ConfigError(
            f"diloco.groups {groups}: {count} sites do not divide the world of {info.world_size} ranks equally",
            where=cfg.where("diloco.groups"),
            fix=f"set diloco.groups to a divisor of {info.world_size}, or node (one site per node)",
        )
    return count


class OuterSync:
    """The outer loop's state on one rank: round-start weights (fp32) and the outer momentum, per trainable
    parameter, and the group of this rank's counterparts in the other sites."""

    def __init__(self, model: torch.nn.Module, cfg: DilocoConfig, mesh: DeviceMesh, info: DistInfo) -> None:
        self.cfg = cfg
        self.group, self.sites, self.site = mesh["site"].get_group(), mesh.size(0), mesh.get_local_rank("site")
        copies = _copies_within_site(cfg.inner)
        """The site's ranks that hold the same weights (all of them under DDP, the replicas of a shard under HSDP,
        none under FSDP): they split the sync between them, one slice each."""
        self.slicers = mesh[copies].get_group() if copies else None
        self.slices = mesh.size(mesh.mesh_dim_names.index(copies)) if copies else 1
        self.slice = mesh.get_local_rank(copies) if copies else 0
        named = [(name, p) for name, p in unwrap(model).named_parameters() if p.requires_grad]
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.start = [_own(p).float().clone() for p in self.params]
        self.momentum = [torch.zeros_like(s) for s in self.start]

    def due(self, step: int) -> bool:
        return step % self.cfg.sync_every == 0

    @torch.no_grad()
    def sync(self) -> dict[str, float]:
        """Average the pseudo-gradients over sites, take the outer step, start the next round.

        Ranks of a site that hold the same weights hold the same pseudo-gradient, so each takes one slice of it
        across sites (its own all-reduce with its counterparts) and they gather the slices back over the site's
        fast links: the bytes between sites are one model's worth per site, not one per rank."""
        started = time.monotonic()
        pseudo_grads = [(s - _own(p).float()).flatten() for s, p in zip(self.start, self.params, strict=True)]
        flat = torch.cat(pseudo_grads)
        size = -(-flat.numel() // self.slices)
        padded = torch.nn.functional.pad(flat, (0, size * self.slices - flat.numel()))
        mine = slice(self.slice * size, (self.slice + 1) * size)
        if self.cfg.pseudo_grad_dtype == "int8":
            summed, sent_bytes = self._sum_int8(pseudo_grads, padded.numel(), padded[mine], mine)
        else:
            summed, sent_bytes = self._sum(padded[mine])
        if self.slicers is not None:
            slices = [torch.empty_like(summed) for _ in range(self.slices)]
            torch_dist.all_gather(slices, summed, group=self.slicers)
            summed = torch.cat(slices)
        average = summed[: flat.numel()].float() / self.sites
        lr, mu = self.cfg.outer_lr, self.cfg.outer_momentum
        offset = 0
        for start, momentum, param in zip(self.start, self.momentum, self.params, strict=True):
            pseudo_grad = average[offset : offset + start.numel()].view_as(start)
            offset += start.numel()
            momentum.mul_(mu).add_(pseudo_grad)
            start.sub_(pseudo_grad.add(momentum, alpha=mu) if mu else pseudo_grad, alpha=lr)  # Nesterov
            _own(param).copy_(start)
        return {"outer_sync_s": time.monotonic() - started, "outer_sync_bytes": sent_bytes}

    def _sum(self, mine: torch.Tensor) -> tuple[torch.Tensor, float]:
        """The sites' sum of this rank's slice, in one all-reduce of pseudo_grad_dtype; and the bytes it sent."""
        sent = mine.to(torch.bfloat16 if self.cfg.pseudo_grad_dtype == "bf16" else torch.float32)
        torch_dist.all_reduce(sent, group=self.group)
        ring = 2 * (self.sites - 1) / self.sites  # what a ring all-reduce sends per rank
        return sent, ring * sent.numel() * sent.element_size()

    def _sum_int8(
        self, pseudo_grads: list[torch.Tensor], padded: int, mine: torch.Tensor, where: slice
    ) -> tuple[torch.Tensor, float]:
        """The same sum from int8 codes with one fp32 scale per tensor (its largest magnitude / 127). Summing int8
        would overflow, so every site's codes and scales are gathered and summed in fp32 on each rank, in site
        order: the same result everywhere. A quarter of fp32's bytes between 2 sites, half of bf16's."""
        scales = torch.stack([g.abs().amax() if g.numel() else g.new_zeros(()) for g in pseudo_grads]) / 127
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))
        sizes = torch.tensor([g.numel() for g in pseudo_grads], device=scales.device)

        def per_element(tensor_scales: torch.Tensor) -> torch.Tensor:
            spread = torch.repeat_interleave(tensor_scales, sizes)
            return torch.nn.functional.pad(spread, (0, padded - spread.numel()), value=1.0)[where]

        codes = (mine / per_element(scales)).round().clamp(-127, 127).to(torch.int8)
        every_codes = [torch.empty_like(codes) for _ in range(self.sites)]
        every_scales = [torch.empty_like(scales) for _ in range(self.sites)]
        torch_dist.all_gather(every_codes, codes, group=self.group)
        torch_dist.all_gather(every_scales, scales, group=self.group)
        summed = torch.zeros_like(mine)
        for site_codes, site_scales in zip(every_codes, every_scales, strict=True):
            summed += site_codes.float() * per_element(site_scales)
        return summed, (self.sites - 1) * (codes.numel() + scales.numel() * scales.element_size())

    def worst_norm(self, grad_norm: torch.Tensor) -> torch.Tensor:
        """The largest site's gradient norm on every rank: each site clips its own, but the non-finite branch
        gathers over the world, so every rank must take it together."""
        norm = grad_norm.detach().float().reshape(1).clone()
        torch_dist.all_reduce(norm, op=torch_dist.ReduceOp.MAX)
        return norm[0]

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
