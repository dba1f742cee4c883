"""Fault-tolerant DiLoCo: sites that drop out and come back, on torchft.

With diloco.fault_tolerant each site is its own launch and its own torch world (the inner strategy runs in it as
in one world: its mesh is ("site" 1, "local")), and the outer sync crosses sites through a torchft `Manager` per
rank: replica id = the site, a gloo process group across sites that torchft reconfigures at each sync, and a
quorum asked of the lighthouse at each sync (min_replica_size 1). The outer step is outer.py's: Nesterov SGD on
the round-start weights, walked in chunks; the average is over the sites whose pseudo-gradient is in the sum.

A site that starts (fresh, restarted, or resumed from its own checkpoint) trains its round and meets the others
at its first sync. Each manager's step is the loop's step, and torchft heals a replica behind the quorum's
highest, so a site that returns to live peers heals there: its pseudo-gradient is left out (zeroed by torchft), the
peer sends over the same process group the round-start weights, the outer momentum, its inner optimizer state (each
rank its counterpart's shard: sites have the same world size) and the loop's step, data position, schedule and
random streams, and the site takes the round's outer step with the others' average and trains the next round as
the peer would (the round it trained on its own is lost: at most one). Sites that start together, or resume
together from their full checkpoints, meet at the same step: nobody heals, and a resume stays exact. Managers
heartbeat from the start, so a sync waits (up to the lighthouse's join timeout) for a site that is alive but
slower to reach it.

The survivors never stop: a site gone counts as gone once its heartbeats stop (the lighthouse's timeout), and a
sync whose peer died mid-way is not committed: the site keeps its weights, so its next sync's pseudo-gradient
holds both rounds' progress. Each site decides its own stops (preemption, ended data, timed saves) at its syncs.
The sync holds one model's worth of averaged pseudo-gradient until it commits, beyond OuterSync's state.

Nor does a lost lighthouse stop them: a site that cannot reach it takes its round's outer step alone and asks again
at the next sync. A quorum already asked when the lighthouse went away ends at diloco.quorum_timeout_s: torchft's
manager server retries its lighthouse and does not answer its ranks when that fails; a retry that reaches the
lighthouse once it is back may put the site in a quorum with the step it had then, so a peer may form the group with
a site that is not forming it: the formation then fails within seconds (formations.py), the sync is not committed,
and the group forms again at the next quorum. Sites that trained alone, or that disagree for any other reason (one
committed a sync the other did not), would average pseudo-gradients of different round-start weights for the rest of
the run: at each sync the sites compare a fingerprint of their round-start weights, and the sites that differ from
the lowest site present heal from it in a second quorum. Sites of different world sizes are refused at the first
quorum that holds both, before any heal (formations.py).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as torch_dist
from torch.distributed import ReduceOp

from trainyard.config import JobConfig
from trainyard.diloco.outer import OuterSync, _Chunk, _own
from trainyard.dist import DistInfo
from trainyard.errors import ConfigError

log = logging.getLogger("trainyard")

QUORUM_RETRIES = 10
"""The lighthouse's quorum asked again on a failure: a lighthouse restarted between two syncs is found at once."""


def _reachable(url: str, timeout_s: float = 2.0) -> bool:
    """Whether the lighthouse accepts a connection: asked before a quorum, which would wait out its timeout."""
    address = urlparse(url)
    try:
        with socket.create_connection((address.hostname or "localhost", address.port or 29510), timeout=timeout_s):
            return True
    except OSError:
        return False


def _not_a_refusal(record: logging.LogRecord) -> bool:
    """torchft logs what the group's configure raised with its traceback; a refusal is trainyard's own error, which
    the site prints as such (exit 2, no traceback)."""
    return not (record.exc_info and isinstance(record.exc_info[1], ConfigError))


def _same(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(abs(a), abs(b), 1.0)


def data_slice(cfg: JobConfig, info: DistInfo) -> tuple[int, int]:
    """The rank and world the data sampler and batch rule see: a fault-tolerant site's ranks read the slice they
    would read in one world of every site, so sites never read each other's rows. The ranks of a context-parallel
    group (consecutive ranks within a site too, dist.build_mesh) read the same rows: one data-parallel rank between
    them, so a site of N ranks at CP C is N / C data ranks."""
    context = cfg.dist.context_parallel
    assert context != "auto", "dist.context_parallel auto is resolved first (build.planned_context)"
    rank, world = info.rank // context, info.world_size // context
    if not cfg.diloco.fault_tolerant:
        return rank, world
    assert cfg.diloco.site is not None and cfg.diloco.sites is not None
    return cfg.diloco.site * world + rank, cfg.diloco.sites * world


def lighthouse_url(cfg: JobConfig) -> str:
    """The lighthouse every site's managers ask for a quorum: diloco.lighthouse, else TORCHFT_LIGHTHOUSE."""
    address = cfg.diloco.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
    if not address:
        raise ConfigError(
            "diloco.fault_tolerant needs a lighthouse, and neither diloco.lighthouse nor TORCHFT_LIGHTHOUSE is set",
            where=cfg.where("diloco.lighthouse"),
            fix="set diloco.lighthouse: HOST:PORT (`trainyard launch --lighthouse` starts one on that port)",
        )
    return address if "://" in address else f"http://{address}"


class FaultTolerantSync:
    """The outer sync across sites of one rank, through its torchft manager. Made right after the process group,
    before the model: the manager's heartbeats then tell the lighthouse early that this site is coming, so the
    first quorum of a job whose sites start together waits for all of them. `attach` gives it the outer state."""

    def __init__(self, cfg: JobConfig, info: DistInfo) -> None:
        if "MASTER_ADDR" not in os.environ or not torch_dist.is_initialized():
            raise ConfigError(
                "diloco.fault_tolerant runs each site under torchrun: its master address hosts the site's store",
                where=cfg.where("diloco.fault_tolerant"),
                fix="start each site with `trainyard launch CONFIG --nproc N --master HOST:PORT diloco.site=S`",
            )
        os.environ.setdefault("RUST_LOG", "warn")  # torchft's quorum chatter; before its library starts logging
        from torchft.checkpointing.pg_transport import PGTransport
        from torchft.manager import Manager

        from trainyard.diloco.formations import GlooOnFreshKeys

        self.cfg = cfg.diloco
        self.outer: OuterSync | None = None
        self.loop: Callable[[], dict[str, Any]] = dict
        """What a returning site takes from this one besides the outer and inner optimizer state (data position,
        schedule, random streams)."""
        self.inner: torch.optim.Optimizer | None = None
        """The site's inner optimizer: a returning site takes its state too, or its moments would be its own stale
        ones (or none) where the peer's have moved on."""
        self.healed: dict[str, Any] | None = None
        """What this site took from a peer at the last sync, if it healed."""
        self.alone = False
        """The last sync took this site's outer step alone: the lighthouse was unreachable."""
        self._differs = False
        self.step = 0
        """The loop's step at the sync under way: a healing peer continues from it."""
        self.site, self.sites, self.world_size = cfg.diloco.site, cfg.diloco.sites, info.world_size
        self.device = info.device
        self.lighthouse = lighthouse_url(cfg)
        timeout = timedelta(seconds=cfg.dist.timeout_s)
        # a restarted lighthouse's quorum ids repeat; a site of another size is refused before any heal
        self.across = GlooOnFreshKeys(timeout=timeout, site=cfg.diloco.site, site_world_size=info.world_size)
        logging.getLogger("torchft.manager").addFilter(_not_a_refusal)
        # The site's master address hosts its store and (rank 0) its manager server: other sites reach both there.
        self.manager = Manager(
            pg=self.across, load_state_dict=self._load, state_dict=self._state, min_replica_size=1,
            use_async_quorum=True, timeout=timeout, connect_timeout=timeout,
            quorum_timeout=timedelta(seconds=cfg.diloco.quorum_timeout_s),
            rank=info.rank, world_size=info.world_size, lighthouse_addr=self.lighthouse,
            replica_id=f"site_{cfg.diloco.site}", hostname=os.environ["MASTER_ADDR"], init_sync=False,
            quorum_retries=QUORUM_RETRIES,
            # Staged on the CPU: gloo sends what the tensor's pointer holds, so a CUDA state must be copied first.
            checkpoint_transport=PGTransport(self.across, timeout, torch.device("cpu")),
        )

    def attach(self, outer: OuterSync, loop: Callable[[], dict[str, Any]], inner: torch.optim.Optimizer) -> None:
        self.outer, self.loop, self.inner = outer, loop, inner

    def sync(self, step: int) -> dict[str, float]:
        """The round's outer sync over the sites present: `outer_sites` of them added their pseudo-gradient."""
        started, self.step = time.monotonic(), step
        present, committed = self._round()
        return {"outer_sync_s": time.monotonic() - started, "outer_sites": present, "outer_committed": committed,
                "outer_alone": self.alone, "outer_start_norm": self.start_norm(),
                "inner_fingerprint": self.inner_fingerprint()}

    def start_norm(self) -> float:
        """The norm of this rank's round-start weights after the sync: equal on every site that took the same step
        (a check that the sites agree, read from the log)."""
        assert self.outer is not None
        return float(torch.stack([start.double().pow(2).sum() for start in self.outer.start]).sum().sqrt())

    def inner_fingerprint(self) -> float:
        """This rank's inner optimizer state in one number: a healed site's equals its peer's at the sync it healed
        at (a check read from the log)."""
        assert self.inner is not None
        return inner_fingerprint(self.inner)

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)

    @torch.no_grad()
    def _round(self) -> tuple[int, bool]:
        """Quorum, the sum of the pseudo-gradients of the sites that add one (torchft zeroes a healing site's), and
        the outer step once the sync is committed. A healing site loads the peer's state in should_commit. Without
        a lighthouse, the site's own outer step."""
        assert self.outer is not None, "attach the outer state first"
        self.healed, self.alone = None, False
        if not self._quorum(self.step):
            return self._alone()
        if self._disagrees():  # every site asks again; those that differ from the lowest site heal from it
            if not self._quorum(self.step - 1 if self._differs else self.step):
                return self._alone()
        present = torch.tensor([1.0])
        self.manager.allreduce(present, reduce_op=ReduceOp.SUM).wait()
        sites = int(present.item())
        averages = [self._average(chunk, max(sites, 1)) for chunk in self.outer.chunks]
        committed = self.manager.should_commit()
        if committed and sites:
            for chunk, average in zip(self.outer.chunks, averages, strict=True):
                self.outer._outer_step(chunk, average)
        elif self.healed is not None:  # healed from a peer that had no step to take: start from its weights
            for param, start in zip(self.outer.params, self.outer.start, strict=True):
                _own(param).copy_(start)
        if not committed:
            log.warning("outer sync not committed (a site left mid-sync, or the sites' group did not form): this site "
                        "keeps its weights and forms the group again at the next sync")
            # torchft forms the group again only for a new quorum id, and the sites still there keep theirs: a group
            # that failed to form (or broke) would fail every sync until a site came or went
            self.manager._quorum_id = -1
        return sites, committed

    def _quorum(self, step: int) -> bool:
        """torchft's quorum at `step`, False (on every rank of the site) where the lighthouse cannot be reached.
        torchft heals a replica whose step is behind the quorum's highest: the step given is the loop's, so a site
        heals exactly when it is behind the live ones (whatever syncs either has committed since it started)."""
        if not self._site_agrees(_reachable(self.lighthouse)):
            log.warning("the lighthouse %s is unreachable: this site takes its outer step alone", self.lighthouse)
            return False
        self.manager.load_state_dict({"step": step, "batches_committed": self.manager.batches_committed()})
        self.manager.start_quorum()
        try:
            self.manager.wait_quorum()
        except Exception as err:  # noqa: BLE001 - whatever torchft's quorum client raised: the lighthouse went away
            # torchft 0.2 keeps the failed future and raises it again at the next start_quorum.
            self.manager._quorum_future = None
            log.warning("the quorum failed (%s): this site takes its outer step alone", err)
            return False
        if self.across.refused is not None:
            raise self.across.refused
        return True

    def _site_agrees(self, fine: bool) -> bool:
        """True where it holds on every rank of this site (a fault-tolerant site is its own torch world)."""
        flag = torch.tensor([1.0 if fine else 0.0], device=self.device)
        torch_dist.all_reduce(flag, op=ReduceOp.MIN)
        return bool(flag.item())

    def _alone(self) -> tuple[int, bool]:
        """The round's outer step on this site's own pseudo-gradient, as a world of one site would take it."""
        assert self.outer is not None
        for chunk in self.outer.chunks:
            self.outer._outer_step(chunk, self.outer._pseudo_grad(chunk)[: chunk.length])
        self.alone = True
        return 1, True

    def _disagrees(self) -> bool:
        """Whether the sites present hold different round-start weights (and `_differs`: this site from the lowest
        present). Each rank compares its fingerprint with its counterparts' (sites of another world size were
        refused when the group formed: formations.py)."""
        assert self.sites is not None and self.site is not None
        slots = torch.zeros(2 * self.sites, dtype=torch.float64)
        slots[self.site], slots[self.sites + self.site] = self.fingerprint(), 1.0
        self.manager.allreduce(slots, reduce_op=ReduceOp.SUM).wait()
        present = [site for site in range(self.sites) if slots[self.sites + site] > 0]
        if not present:
            self._differs = False
            return False
        reference = float(slots[present[0]])
        self._differs = not self._site_agrees(_same(float(slots[self.site]), reference))
        mismatch = any(not _same(float(slots[site]), reference) for site in present)
        return not self._site_agrees(not mismatch)

    def fingerprint(self) -> float:
        """This rank's round-start weights in one number: equal on sites that took the same steps."""
        assert self.outer is not None
        return float(sum((start.double() * (1 + index % 7)).sum() for index, start in enumerate(self.outer.start)))

    def _average(self, chunk: _Chunk, sites: int) -> torch.Tensor:
        """One chunk's pseudo-gradient summed across sites, over `sites`; a new tensor, kept until the sync
        commits."""
        outer = self.outer
        assert outer is not None
        values = outer._pseudo_grad(chunk)
        part = chunk.padded // outer.slices
        mine = values[outer.slice * part : (outer.slice + 1) * part]
        sent = mine if self.cfg.pseudo_grad_dtype == "fp32" else outer.buffers.wire[: mine.numel()].copy_(mine)
        self.manager.allreduce(sent, reduce_op=ReduceOp.SUM).wait()
        if sent is not mine:
            mine.copy_(sent)
        if outer.slicers is not None:
            torch_dist.all_gather(list(values.split(part)), mine, group=outer.slicers)
        return values[: chunk.length] / sites

    def _state(self) -> dict[str, Any]:
        """What a healing peer takes from this rank (called by torchft at this site's sync, before its step)."""
        assert self.outer is not None and self.inner is not None
        return {"start": self.outer.start, "momentum": self.outer.momentum, "inner": inner_state(self.inner),
                "loop": {"step": self.step, **self.loop()}}

    def _load(self, state: dict[str, Any]) -> None:
        assert self.outer is not None and self.inner is not None
        for own, theirs in zip(self.outer.start + self.outer.momentum, state["start"] + state["momentum"],
                               strict=True):
            own.copy_(theirs)
        load_inner(self.inner, state["inner"])
        self.healed = state["loop"]


def _inner_params(optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, dict[str, Any]]]:
    """Each parameter with its group, in the optimizer's order: the same on every site (same model, same world)."""
    return [(param, group) for group in optimizer.param_groups for param in group["params"]]


def inner_state(optimizer: torch.optim.Optimizer) -> list[dict[str, torch.Tensor]]:
    """This rank's inner optimizer state, one entry per parameter (empty before its first step), each value the
    part this rank holds as a plain tensor: the transport sends tensors, not DTensors, and the peer's same rank
    holds the same shard."""
    return [{key: _own(value) for key, value in optimizer.state.get(param, {}).items()}
            for param, _ in _inner_params(optimizer)]


@torch.no_grad()
def load_inner(optimizer: torch.optim.Optimizer, states: list[dict[str, torch.Tensor]]) -> None:
    """Make a peer rank's `inner_state` this optimizer's own: copied into the state it has, made as it would make it
    where it has none yet (it never stepped), dropped where the peer has none, so its next step is the peer's."""
    for (param, group), theirs in zip(_inner_params(optimizer), states, strict=True):
        mine = optimizer.state.pop(param, {})
        if theirs:
            optimizer.state[param] = {key: _holding(mine.get(key), value, param, group, key)
                                      for key, value in theirs.items()}


def _holding(mine: torch.Tensor | None, theirs: torch.Tensor, param: torch.Tensor, group: dict[str, Any],
             key: str) -> torch.Tensor:
    """A state value holding the peer's: this optimizer's own tensor, or a new one placed as torch's AdamW places
    it: the step count on the parameter's device for fused or capturable kernels, else on the CPU; a moment like
    the parameter (a DTensor of its placement under FSDP2)."""
    if mine is None and key == "step":
        return theirs.to(param.device if group.get("fused") or group.get("capturable") else "cpu", copy=True)
    mine = torch.zeros_like(param) if mine is None else mine
    _own(mine).copy_(theirs)
    return mine


def inner_fingerprint(optimizer: torch.optim.Optimizer) -> float:
    """An optimizer's state on this rank in one number: equal where the state is."""
    return float(sum(value.sum(dtype=torch.float64) * (1 + index % 7)
                     for index, state in enumerate(inner_state(optimizer)) for value in state.values()))
