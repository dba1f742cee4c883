"""Fault-tolerant DiLoCo's inputs: a site that is not told which it is, a reduction torchft cannot do, or a lighthouse
asked of a job that is not fault-tolerant exit 2 naming the field; each site reads its own slice of the data. A rank
that heals takes its peer's inner optimizer state and steps on as the peer does. The sites themselves run in
tests/dist/test_diloco_ft.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as torch_dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from tests.conftest import TINY, run_cli
from trainyard import config_file
from trainyard.config import JobConfig
from trainyard.diloco.ft import data_slice, inner_fingerprint, inner_state, load_inner
from trainyard.diloco.outer import _own
from trainyard.dist import DistInfo
from trainyard.train.optim import build_optimizer

FT = ["dist.strategy=diloco", "diloco.fault_tolerant=true"]


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        (FT, ["diloco.site", "diloco.sites"]),
        ([*FT, "diloco.site=2", "diloco.sites=2"], ["diloco.site below diloco.sites"]),
        ([*FT, "diloco.site=0", "diloco.sites=2", "diloco.pseudo_grad_dtype=int8"], ["int8", "fp32 or bf16"]),
        (["dist.strategy=ddp", "diloco.fault_tolerant=true", "diloco.site=0", "diloco.sites=2"],
         ["dist.strategy: diloco"]),
    ],
)
def test_bad_fault_tolerant_settings_exit_2_naming_the_field(overrides: list[str], needles: list[str]) -> None:
    result = run_cli("train", TINY, *overrides, "--dry-run")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in result.stderr


@pytest.mark.parametrize("command", [
    ["launch", "--lighthouse", "--nnodes", "1", "--node-rank", "0", "--master", "127.0.0.1:29999", "--nproc", "1"],
    ["lighthouse"],
], ids=["launch", "lighthouse"])
def test_a_lighthouse_needs_a_fault_tolerant_job(tmp_path, command: list[str]) -> None:
    result = run_cli(command[0], TINY, f"output_dir={tmp_path}", *command[1:])
    assert result.returncode == 2, result.stderr
    assert "diloco.fault_tolerant" in result.stderr and "Traceback" not in result.stderr


def test_each_site_reads_its_slice_of_one_world_and_keeps_its_own_run_dir() -> None:
    cfg = config_file.load_config(TINY, [*FT, "diloco.site=1", "diloco.sites=3"])
    info = DistInfo(1, 2, 1, 2, torch.device("cpu"), "gloo")
    assert data_slice(cfg, info) == (3, 6)  # the second rank of the second site of 3 sites of 2
    assert cfg.run_dir.name == "site-1" and cfg.run_dir.parent.name == cfg.run_name


def test_a_site_outside_torchrun_is_told_to_launch_it(tmp_path) -> None:
    result = run_cli("train", TINY, f"output_dir={tmp_path}", *FT, "diloco.site=0", "diloco.sites=2",
                     "diloco.lighthouse=127.0.0.1:29999")
    assert result.returncode == 2, result.stderr
    assert "trainyard launch" in result.stderr and "Traceback" not in result.stderr


@pytest.fixture
def one_rank() -> Iterator[DeviceMesh]:
    """A 1-rank gloo world and its mesh: FSDP2 on it makes every parameter (and moment) a DTensor."""
    torch_dist.init_process_group("gloo", store=torch_dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        torch_dist.destroy_process_group()


def trained(steps: int, first_batch: int, mesh: DeviceMesh | None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A tiny model (sharded by FSDP2 on `mesh`) and its inner optimizer as the recipe builds it, after `steps`."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    if mesh is not None:
        fully_shard(model, mesh=mesh)
    optimizer, _ = build_optimizer(model, JobConfig())
    for batch in range(first_batch, first_batch + steps):
        inner_step(model, optimizer, batch)
    return model, optimizer


def inner_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: int) -> None:
    inputs = torch.randn(3, 4, generator=torch.Generator().manual_seed(batch))
    model(inputs).pow(2).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize("sharded", [False, True], ids=["plain", "fsdp2"])
@pytest.mark.parametrize(("peer_steps", "own_steps"), [(3, 0), (3, 1), (0, 2)],
                         ids=["never-stepped", "stale-moments", "peer-never-stepped"])
def test_a_healed_rank_steps_on_exactly_as_its_peer(request: pytest.FixtureRequest, sharded: bool, peer_steps: int,
                                                    own_steps: int) -> None:
    """The peer's state goes over the transport as plain tensors, copied on arrival; the healing rank's weights come
    with the outer state. Its next step then gives the peer's weights and state, bit for bit, placed as the
    peer's are."""
    mesh = request.getfixturevalue("one_rank") if sharded else None
    peer, peer_optimizer = trained(peer_steps, 0, mesh)
    healing, optimizer = trained(own_steps, 100, mesh)
    sent = inner_state(peer_optimizer)
    assert all(type(value) is torch.Tensor for entry in sent for value in entry.values())
    load_inner(optimizer, [{key: value.clone() for key, value in entry.items()} for entry in sent])
    with torch.no_grad():
        for mine, theirs in zip(healing.parameters(), peer.parameters(), strict=True):
            _own(mine).copy_(_own(theirs))
    assert inner_fingerprint(optimizer) == inner_fingerprint(peer_optimizer)

    inner_step(peer, peer_optimizer, 200)
    inner_step(healing, optimizer, 200)
    for mine, theirs in zip(healing.parameters(), peer.parameters(), strict=True):
        assert torch.equal(_own(mine), _own(theirs))
        ours, peers = optimizer.state[mine], peer_optimizer.state[theirs]
        assert ours.keys() == peers.keys() == {"step", "exp_avg", "exp_avg_sq"}
        for key, value in ours.items():
            assert type(value) is type(peers[key]) and value.device == peers[key].device, key
            assert not isinstance(value, DTensor) or value.placements == peers[key].placements, key
            assert torch.equal(_own(value), _own(peers[key])), key


def _form(group_class: type, port: int, prefix: str, rank: int, results: dict, timeout_s: float = 3.0,
          site_world_size: int = 1) -> None:
    """One member (site `rank`) of a cross-site group formed as torchft forms it at a quorum: configured on
    `prefix`, then one all-reduce; what it summed (or the error) goes into `results[rank]`, the group into
    `results[("group", rank)]`."""
    from datetime import timedelta

    group = group_class(timeout=timedelta(seconds=timeout_s), site=rank, site_world_size=site_world_size)
    results[("group", rank)] = group
    try:
        group.configure(f"127.0.0.1:{port}/{prefix}", "site", rank, 2)
        assert group.parent._get_backend(torch.device("cpu")).options._timeout == timedelta(seconds=timeout_s)
        value = torch.tensor([float(rank + 1)])
        group.allreduce([value], torch_dist.ReduceOp.SUM).wait()
        results[rank] = float(value.item())
    except Exception as err:  # noqa: BLE001 - the test reads what failed
        results[rank] = repr(err)


def _formation(group_class: type, port: int, prefix: str, stagger_s: float, sizes: tuple[int, int] = (1, 1)) -> dict:
    """Two members of a group under `prefix` (sites 0 and 1, of `sizes` processes), the second `stagger_s` after
    the first; both groups aborted after."""
    import threading
    import time

    results: dict = {}
    first = threading.Thread(target=_form, args=(group_class, port, prefix, 0, results),
                             kwargs={"site_world_size": sizes[0]})
    first.start()
    time.sleep(stagger_s)
    _form(group_class, port, prefix, 1, results, site_world_size=sizes[1])
    first.join()
    for rank in (0, 1):
        results.pop(("group", rank)).abort(errored=False)
    return results


def test_a_group_formed_again_under_a_quorum_id_a_restarted_lighthouse_repeats_reads_no_old_member_s_address() -> None:
    """A lighthouse restarted counts quorum ids from 0 again, so torchft forms the cross-site group again under a
    store prefix an earlier formation used, whose members are gone. torchft's own gloo group then reads the old
    member's address when it reads its key before the new member overwrites it, and fails "Connection refused" (a
    race: it did in 2 of 4 suite runs). The group trainyard gives it counts each formation in and uses keys of its
    own: every formation under the prefix works whichever member comes first, and each wrote under a new count."""
    from torch.distributed import PrefixStore, TCPStore

    from trainyard.diloco.formations import GlooOnFreshKeys

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    prefix = "torchft/1/0"
    assert _formation(GlooOnFreshKeys, store.port, prefix, stagger_s=0.0) == {0: 3.0, 1: 3.0}
    for stagger_s in (1.0, 0.5):  # the old members' ports are closed: a stale address would be refused
        assert _formation(GlooOnFreshKeys, store.port, prefix, stagger_s=stagger_s) == {0: 3.0, 1: 3.0}
    assert PrefixStore(prefix, store).add("formations-of-2", 0) == 3 * 2
    assert _formation(GlooOnFreshKeys, store.port, "torchft/2/0", stagger_s=0.5) == {0: 3.0, 1: 3.0}


def test_a_formation_a_member_never_reached_does_not_pair_later_members_apart() -> None:
    """A site killed between its quorum and its group's formation leaves that formation a seat short (here: the
    seat its peer took an hour ago, as the store holds it); when the quorum id comes round again (a lighthouse
    restarted), the two members of the next formation must still meet. Counting alone put them in different
    formations, each waiting for a peer that never came, at every formation of that id."""
    import time

    from torch.distributed import PrefixStore, TCPStore

    from trainyard.diloco.formations import GlooOnFreshKeys

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    prefix = "torchft/4/0"
    left = PrefixStore(prefix, store)
    assert left.add("formations-of-2", 1) == 1  # the member that came, an hour ago; its peer never did
    left.set("opened-2-0", repr(time.time() - 3600))
    for stagger_s in (0.0, 0.5):
        assert _formation(GlooOnFreshKeys, store.port, prefix, stagger_s=stagger_s) == {0: 3.0, 1: 3.0}


def test_sites_of_different_sizes_are_refused_when_their_group_forms_before_gloo_connects() -> None:
    """Whichever site came later (a site launched with another --nproc joining a run under way would otherwise heal
    from the other first, and gloo aborts on the transfer): both members learn both sizes from the store."""
    from torch.distributed import TCPStore

    from trainyard.diloco.formations import GlooOnFreshKeys

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    results = _formation(GlooOnFreshKeys, store.port, "torchft/3/0", stagger_s=0.5, sizes=(2, 1))
    for member in (0, 1):
        assert "ConfigError" in results[member] and "site 0 has 2, site 1 has 1" in results[member], results


def test_a_member_that_never_connects_fails_the_formation_within_the_formation_timeout() -> None:
    """Its peer took its seat and named its site, then never reached gloo's connect. Gloo waits 5x its timeout for a
    pair, and under the group's own (dist.timeout_s: 600 s by default) a sync of both sites hung for 50 minutes; the
    formation fails within FORMATION_TIMEOUT instead (its collectives keep the group's timeout: `_form` checks)."""
    import time
    from datetime import timedelta

    from torch.distributed import PrefixStore, TCPStore

    from trainyard.diloco.formations import FORMATION_TIMEOUT, GlooOnFreshKeys, formation_store

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    prefix = "torchft/5/0"
    formation_store(PrefixStore(prefix, store), 2, timedelta(seconds=60)).set("site-of-1", "1 1")
    results: dict = {}
    started = time.monotonic()
    _form(GlooOnFreshKeys, store.port, prefix, 0, results, timeout_s=600.0)
    waited = time.monotonic() - started
    results.pop(("group", 0)).abort(errored=False)
    assert "imeout" in results[0] or "timed out" in results[0], results
    assert FORMATION_TIMEOUT.total_seconds() <= waited < 600, waited
