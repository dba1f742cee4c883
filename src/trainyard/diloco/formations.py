"""The cross-site gloo group on store keys of its own at every formation, a lighthouse restarted or not.

torchft reconfigures the group at each new quorum under `<store>/torchft/<quorum id>/<rank>`, and each member's
gloo writes its address there and reads the others'. Its contract is a prefix never used before, but a lighthouse
counts quorum ids from 0 again when it restarts: the next formation of an id used before reads the addresses
that id's old members left in the same store, and whoever reads one before its new owner overwrites it connects to
a process long gone ("Connection refused") and the sync is lost, then the next, for as long as the ids repeat.
Here each formation counts itself in: every member adds 1 to a counter under the prefix (one per group size), and
member n of formation k reads k*size + n, so the members of one formation agree on k without talking, and k is new
wherever the id is not. Only torchft's extension point for a group (`_create_pg`) is used; its store is the one
torchft made for the prefix. Imported only by fault-tolerant jobs (torchft is optional).
"""

from __future__ import annotations

from torch.distributed import PrefixStore, Store
from torch.distributed.distributed_c10d import ProcessGroup
from torchft.process_group import ProcessGroupGloo


def formation_store(store: Store, world_size: int) -> PrefixStore:
    """The keys of this formation of the group: the members that join it under one prefix, `world_size` of them,
    count themselves in together, and a later formation under that prefix counts on from where they ended."""
    arrived = store.add(f"formations-of-{world_size}", 1)
    return PrefixStore(f"formation-{(arrived - 1) // world_size}", store)


class GlooOnFreshKeys(ProcessGroupGloo):
    """torchft's reconfigurable gloo group, each formation on keys no earlier one wrote."""

    def _create_pg(self, store: Store, rank: int, world_size: int) -> ProcessGroup:
        return super()._create_pg(formation_store(store, world_size), rank, world_size)
