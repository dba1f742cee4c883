"""The cross-site gloo group on store keys of its own at every formation, a lighthouse restarted or not.

torchft reconfigures the group at each new quorum under `<store>/torchft/<quorum id>/<rank>`, and each member's
gloo writes its address there and reads the others'. Its contract is a prefix never used before, but a lighthouse
counts quorum ids from 0 again when it restarts: the next formation of an id used before reads the addresses
that id's old members left in the same store, and whoever reads one before its new owner overwrites it connects to
a process long gone ("Connection refused") and the sync is lost, then the next, for as long as the ids repeat.
Here each formation counts itself in: every member adds 1 to a counter under the prefix (one per group size), and
member n of formation k reads k*size + n, so the members of one formation agree on k without talking, and k is new
wherever the id is not. A member that died between its quorum and here leaves its formation a seat short, and
the count would then pair later members of different formations for as long as that id repeats (a site killed
mid-run, then the lighthouse restarted: the sites' group never formed again). So the first member of each formation
stamps when it opened, and a member whose seat is in a formation opened longer ago than the group's timeout takes
the next seat instead, until it is in a formation opened since. Only torchft's extension point for a group
(`_create_pg`) is used; its store is the one torchft made for the prefix. Imported only by fault-tolerant jobs
(torchft is optional).

The members also tell each other their site and its world size there, before gloo connects: sites of different
sizes are refused at the first formation that holds both, before torchft heals one from the other (whose transfer
of one rank's state into another's shard aborts the process in gloo, while the other site never notices).

Then gloo connects them, bounded by FORMATION_TIMEOUT rather than the group's timeout: gloo waits five times its
timeout for a pair to connect, and every member is known to be there by then. A pair that never connected (seen in
1 of 5 lighthouse restarts under load: both members in gloo's connect, neither socket opened) held both sites 5 x
dist.timeout_s (50 minutes by default) instead of failing the sync; the sites' next quorum forms the group again
(ft.py). The group's collectives keep the group's timeout.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import PrefixStore, Store
from torch.distributed.distributed_c10d import ProcessGroup
from torchft.process_group import ProcessGroupGloo

from trainyard.errors import ConfigError


def formation_store(store: Store, world_size: int, stale_after: timedelta) -> PrefixStore:
    """The keys of this formation of the group: the members that join it under one prefix, `world_size` of them,
    count themselves in together, and a later formation under that prefix counts on from where they ended. A seat
    in a formation opened more than `stale_after` ago (a member of it never came) is passed over."""
    while True:
        formation, seat = divmod(store.add(f"formations-of-{world_size}", 1) - 1, world_size)
        opened = f"opened-{world_size}-{formation}"
        if seat == 0:
            store.set(opened, repr(time.time()))
        if seat == 0 or _opened_since(store, opened, stale_after):
            return PrefixStore(f"formation-{formation}", store)


def _opened_since(store: Store, opened: str, stale_after: timedelta) -> bool:
    """Whether the formation was opened within `stale_after` (its opener stamps it right after taking seat 0; one
    that died in between never does)."""
    try:
        store.wait([opened], timedelta(seconds=OPENER_WAIT_S))
    except (RuntimeError, TimeoutError):  # c10d's store timeout (DistStoreError is a RuntimeError)
        return False
    return time.time() - float(store.get(opened).decode()) <= stale_after.total_seconds()


OPENER_WAIT_S = 5.0
"""How long a member waits for its formation's opener to stamp it: the opener does right after taking its seat."""
FORMATION_TIMEOUT = timedelta(seconds=10)
"""How long a member waits for the others to name their sites, and gloo's rendezvous for their addresses (it waits 5x
this for a pair to connect)."""


class GlooOnFreshKeys(ProcessGroupGloo):
    """torchft's reconfigurable gloo group, each formation on keys no earlier one wrote, of sites of one size."""

    def __init__(self, *args: Any, site: int, site_world_size: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.site, self.site_world_size = site, site_world_size
        self.refused: ConfigError | None = None
        """Set where a formation held a site of another world size (torchft only logs what configure raises)."""

    def _create_pg(self, store: Store, rank: int, world_size: int) -> ProcessGroup:
        fresh = formation_store(store, world_size, self._timeout)
        fresh.set(f"site-of-{rank}", f"{self.site} {self.site_world_size}")
        members = [f"site-of-{member}" for member in range(world_size)]
        fresh.wait(members, FORMATION_TIMEOUT)  # the quorum told every member at once: a late one is not coming
        sizes = dict(_site_size(fresh.get(member)) for member in members)
        if len(set(sizes.values())) > 1:
            self.refused = ConfigError(
                "the sites of a fault-tolerant DiLoCo job must have the same number of processes, and they differ: "
                + ", ".join(f"site {site} has {size}" for site, size in sorted(sizes.items())),
                fix="launch every site with the same --nproc (and --nnodes)",
            )
            raise self.refused
        return self._connected(fresh, rank, world_size)

    def _connected(self, store: Store, rank: int, world_size: int) -> ProcessGroup:
        """torchft's gloo group on `store`, connected within FORMATION_TIMEOUT, its collectives on the group's own."""
        timeout, self._timeout = self._timeout, min(self._timeout, FORMATION_TIMEOUT)
        try:
            group = super()._create_pg(store, rank, world_size)
        finally:
            self._timeout = timeout
        group._get_backend(torch.device("cpu"))._set_default_timeout(timeout)
        return group


def _site_size(value: bytes) -> tuple[int, int]:
    site, size = value.decode().split()
    return int(site), int(size)
