"""DiLoCo: sites that train on their own and meet once a round.

Each site (a node, or a group of consecutive ranks) runs the inner strategy (diloco.inner: DDP or FSDP over the
site's ranks) for diloco.sync_every steps. Then every rank takes its trainable weights' pseudo-gradient, round-start
weights minus current weights, and the ranks that hold the same position in their sites average it in one
all-reduce. That all-reduce is the only traffic between sites that grows with the model. Under FSDP a rank holds,
syncs and keeps the outer state of its own shard only. The outer step is SGD with Nesterov
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
from trainyard.parallel import unwrap


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
        self.group, self.local = mesh["site"].get_group(), mesh["local"].get_group()
        self.sites, self.local_size = mesh.size(0), mesh.size(1)
        self.site, self.local_rank = divmod(info.rank, self.local_size)
        named = [(name, p) for name, p in unwrap(model).named_parameters() if p.requires_grad]
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.sharded = any(isinstance(p, DTensor) for p in self.params)
        """Inner FSDP: each rank's shard differs from its site neighbours', so it syncs all of it, no slices."""
        self.start = [_own(p).float().clone() for p in self.params]
        self.momentum = [torch.zeros_like(s) for s in self.start]

    def due(self, step: int) -> bool:
        return step % self.cfg.sync_every == 0

    @torch.no_grad()
    def sync(self) -> dict[str, float]:
        """Average the pseudo-gradients over sites, take the outer step, start the next round.

        A site's ranks hold the same pseudo-gradient, so each takes one slice of it across sites (its own
        all-reduce with its counterparts) and the site gathers the slices back over its fast local links: the
        bytes between sites are one model's worth per site, not one per rank."""
        started = time.monotonic()
        dtype = torch.bfloat16 if self.cfg.pseudo_grad_dtype == "bf16" else torch.float32
        flat = torch.cat([(s - _own(p).float()).flatten() for s, p in zip(self.start, self.params, strict=True)])
        if self.sharded:
            sent = flat.to(dtype)
            torch_dist.all_reduce(sent, group=self.group)
            average = sent.float() / self.sites
        else:
            size = -(-flat.numel() // self.local_size)
            padded = torch.nn.functional.pad(flat, (0, size * self.local_size - flat.numel()))
            sent = padded[self.local_rank * size : (self.local_rank + 1) * size].to(dtype)
            torch_dist.all_reduce(sent, group=self.group)
            slices = [torch.empty_like(sent) for _ in range(self.local_size)]
            torch_dist.all_gather(slices, sent, group=self.local)
            average = torch.cat(slices)[: flat.numel()].float() / self.sites
        lr, mu = self.cfg.outer_lr, self.cfg.outer_momentum
        offset = 0
        for start, momentum, param in zip(self.start, self.momentum, self.params, strict=True):
            pseudo_grad = average[offset : offset + start.numel()].view_as(start)
            offset += start.numel()
            momentum.mul_(mu).add_(pseudo_grad)
            start.sub_(pseudo_grad.add(momentum, alpha=mu) if mu else pseudo_grad, alpha=lr)  # Nesterov
            _own(param).copy_(start)
        ring = 2 * (self.sites - 1) / self.sites  # what a ring all-reduce sends per rank
        sent_bytes = ring * sent.numel() * sent.element_size()
        return {"outer_sync_s": time.monotonic() - started, "outer_sync_bytes": sent_bytes}

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
