"""Fault-tolerant DiLoCo (torchft) on localhost: two sites of one process, each its own `trainyard launch`, the
lighthouse its own `trainyard lighthouse`. Site 1 is SIGKILLed mid-run and started again: site 0 never stops and
syncs alone while site 1 is gone; site 1 heals from site 0 (its weights and inner optimizer state become site 0's)
and the two average together again. Then the lighthouse is SIGKILLed: both sites go on alone, and once it is back
one heals from the other, so they never average from different weights."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

from tests import warm
from tests.conftest import REPO, TINY
from tests.dist.checkpoint_helpers import kill_tree, written_events
from tests.world import free_port

pytest.importorskip("torchft")
pytestmark = pytest.mark.dist

SITE = [
    "dist.strategy=diloco", "diloco.fault_tolerant=true", "diloco.sites=2", "diloco.sync_every=2",
    "train.max_steps=100000", "log.every_steps=1", "log.progress=false", "log.tensorboard=false",
    "eval.every_steps=0", "eval.at_end=false", "checkpoint.at_end=false", "dist.timeout_s=60",
    "diloco.quorum_timeout_s=75",
]
"""Sites that would train for hours: the test stops them once it has seen what it waits for."""
SHORT_WAITS = ["diloco.quorum_timeout_s=30", "diloco.join_timeout_s=20"]
"""For the lighthouse's outage: a quorum in flight when the lighthouse dies waits out diloco.quorum_timeout_s (75 s
above, 45 s of the suite's wall). A site slower than the join timeout to reach a sync heals there instead (the
tests allow it); the first test keeps 75 s, as its lighthouse wants both sites, however long one takes to start."""

BACKGROUND = 10
"""The niceness of a site once it trains: the tests wait on heartbeats, quorum timeouts and relaunches, and a site
at full speed (~15 steps/s of a 90k-parameter model) took a core from the suite's other processes all that time.
Niced, it trains as fast as spare cores allow and yields them to the rest; its start-up keeps the normal priority,
as a relaunch's start is part of what the test times."""
SHARE = 0.25
"""And at most this share of a core (a cgroup's CPU quota, where the machine lets the tests make one): niced alone,
two sites still spun both cores through every wait (~95 s of CPU in a 55 s test), training steps nothing waits for.
A quarter of a core is ~4 steps/s: a sync every half second, and heartbeats late by at most 75 ms."""


@pytest.fixture
def in_background() -> Iterator[Callable[[warm.Command | subprocess.Popen[bytes]], None]]:
    """Puts a site's process tree in the background (BACKGROUND, SHARE); the cgroups go when the test ends."""
    groups: list[Path] = []

    def to_background(site: warm.Command | subprocess.Popen[bytes]) -> None:
        try:
            processes = [psutil.Process(site.pid), *psutil.Process(site.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        group = cpu_capped(f"trainyard-tests-{os.getpid()}-{site.pid}")
        if group is not None:
            groups.append(group)
        for process in processes:
            niced(process)
            if group is not None:
                with contextlib.suppress(OSError):  # a process gone since
                    (group / "cgroup.procs").write_text(str(process.pid))

    yield to_background
    for group in groups:  # emptied: the test killed every site
        with contextlib.suppress(OSError):
            group.rmdir()


def niced(process: psutil.Process) -> None:
    """Every thread at BACKGROUND (Linux nices threads one by one; new threads inherit their creator's niceness)."""
    try:
        threads = process.threads()
    except psutil.NoSuchProcess:
        return
    for thread in threads:
        with contextlib.suppress(ProcessLookupError):
            os.setpriority(os.PRIO_PROCESS, thread.id, BACKGROUND)


def cpu_capped(name: str) -> Path | None:
    """A new cgroup allowed SHARE of a core (cgroup v1's cpu controller or v2's cpu.max), or None where the tests
    may not make one: the site is then only niced."""
    period = 100_000
    for root, limit, value in ((Path("/sys/fs/cgroup/cpu"), "cpu.cfs_quota_us", f"{int(SHARE * period)}"),
                               (Path("/sys/fs/cgroup"), "cpu.max", f"{int(SHARE * period)} {period}")):
        if not (root / "cgroup.procs").is_file():
            continue
        group = root / name
        try:
            group.mkdir()
            (group / limit).write_text(value)
            return group
        except OSError:
            with contextlib.suppress(OSError):
                group.rmdir()
    return None


def launch(out: Path, site: int, lighthouse: int, *flags: str) -> warm.Command | subprocess.Popen[bytes]:
    """One site's launch, its output appended to a file (a pipe nobody reads would fill and stall it)."""
    args = ["launch", TINY, "--nnodes", "1", "--node-rank", "0", "--master", f"127.0.0.1:{free_port()}",
            "--nproc", "1", f"output_dir={out}", *SITE, f"diloco.site={site}",
            f"diloco.lighthouse=127.0.0.1:{lighthouse}", *flags]
    with open(out / f"site-{site}.out", "ab") as sink:
        return warm.start(args, new_session=True, output=sink.fileno())


def run_lighthouse(out: Path, lighthouse: int, *flags: str) -> warm.Command | subprocess.Popen[bytes]:
    """The job's lighthouse as its own process, as `trainyard lighthouse` runs it."""
    args = ["lighthouse", TINY, *SITE, "diloco.site=0", f"diloco.lighthouse=127.0.0.1:{lighthouse}", *flags]
    with open(out / "site-lighthouse.out", "ab") as sink:
        return warm.start(args, new_session=True, output=sink.fileno())


def syncs(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e.get("event") == "outer_sync"]


def wait_until(seen: Callable[[], bool], sites: list[subprocess.Popen[bytes]], what: str, out: Path) -> None:
    deadline = time.monotonic() + 240
    while not seen():
        ended = [p.args for p in sites if p.poll() is not None]
        if ended or time.monotonic() > deadline:
            logs = "\n".join(path.read_text()[-3000:] for path in sorted(out.glob("site-*.out")))
            raise AssertionError(f"{'a site ended' if ended else 'timed out'} waiting for {what}:\n{logs}")
        time.sleep(0.2)


def test_without_failures_the_outer_step_is_nesterov_sgd_on_the_average_as_in_one_world(tmp_path: Path) -> None:
    """Each site its own torchrun: two syncs take the outer step the one-world sync is held to in test_diloco.py
    (Nesterov SGD on the mean of the sites' pseudo-gradients), the same on both sites."""
    from torchft.coordination import LighthouseServer

    # both sites in every quorum: with 1, a site whose peer's heartbeat had not reached the lighthouse yet (its
    # manager made, the ready file written) synced alone under a loaded suite, and the peer then healed from it
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=60_000)
    try:
        env = {**os.environ, "TORCHFT_LIGHTHOUSE": lighthouse.address()}
        sites = [subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
             str(REPO / "tests" / "dist" / "scripts" / "diloco_ft_outer_step.py"), str(tmp_path), str(site)],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        ) for site in range(2)]
        outputs = [site.communicate(timeout=300)[0] for site in sites]
    finally:
        lighthouse.shutdown()
    assert [site.returncode for site in sites] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    ranks = [json.loads((tmp_path / f"site-{s}.json").read_text()) for s in range(2)]
    buffers = None
    for round_index in range(2):
        assert [r[round_index]["sites"] for r in ranks] == [2, 2]
        start = [np.array(t, dtype=np.float64) for t in ranks[0][round_index]["start"]]
        assert all(np.array_equal(a, b) for a, b in zip(start, ranks[1][round_index]["start"], strict=True))
        pseudo = [np.mean([s - np.array(site[round_index]["before"][i]) for site in ranks], axis=0)
                  for i, s in enumerate(start)]
        buffers = pseudo if buffers is None else [0.9 * m + g for m, g in zip(buffers, pseudo, strict=True)]
        expected = [s - 0.7 * (g + 0.9 * m) for s, g, m in zip(start, pseudo, buffers, strict=True)]
        for site in ranks:
            for want, got in zip(expected, site[round_index]["after"], strict=True):
                np.testing.assert_allclose(np.array(got), want, rtol=1e-6, atol=1e-7)


def test_a_site_killed_mid_run_heals_from_the_live_one_which_never_stops(
    tmp_path: Path, in_background: Callable[[warm.Command], None]
) -> None:
    """One launch sequence proves both failures: a site lost and back, then the lighthouse lost and back."""
    lighthouse = free_port()
    tower = run_lighthouse(tmp_path, lighthouse, *SHORT_WAITS)
    site0 = launch(tmp_path, 0, lighthouse, *SHORT_WAITS)
    site1 = launch(tmp_path, 1, lighthouse, *SHORT_WAITS)
    dir0, dir1 = tmp_path / "tiny" / "site-0", tmp_path / "tiny" / "site-1"
    try:
        wait_until(lambda: any(e["outer_sites"] == 2 for e in syncs(written_events(dir1))), [tower, site0, site1],
                   "a sync of both sites", tmp_path)
        in_background(site0)
        kill_tree(site1)
        first_life = len(written_events(dir1))
        killed_at = max(e["step"] for e in syncs(written_events(dir0)))
        wait_until(lambda: any(e["outer_sites"] == 1 and e["step"] > killed_at for e in syncs(written_events(dir0))),
                   [tower, site0], "site 0 syncing alone", tmp_path)
        site1 = launch(tmp_path, 1, lighthouse, *SHORT_WAITS)
        second_life: Callable[[], list[dict[str, Any]]] = lambda: written_events(dir1)[first_life:]  # noqa: E731
        wait_until(lambda: len([e for e in syncs(second_life()) if e["outer_sites"] == 2]) >= 2,
                   [tower, site0, site1], "two syncs of both sites after site 1 returned", tmp_path)
        in_background(site1)
        before_outage = [len(written_events(d)) for d in (dir0, dir1)]
        kill_tree(tower)
        outage = [lambda d=d, n=n: written_events(d)[n:] for d, n in zip((dir0, dir1), before_outage, strict=True)]
        wait_until(lambda: all(any(e.get("outer_alone") for e in syncs(o())) for o in outage), [site0, site1],
                   "both sites syncing alone without the lighthouse", tmp_path)
        tower = run_lighthouse(tmp_path, lighthouse, *SHORT_WAITS)
        wait_until(lambda: all(len(rejoined(o())) >= 2 for o in outage), [tower, site0, site1],
                   "two syncs of both sites after the lighthouse returned", tmp_path)
    finally:
        kill_tree(site1)
        kill_tree(site0)
        kill_tree(tower)

    events0 = written_events(dir0)[: before_outage[0]]
    sites0 = [e["outer_sites"] for e in syncs(events0)]
    both = sites0.index(2)  # a site slower to start than the lighthouse's join timeout heals at its first sync
    assert 1 in sites0[both:] and 2 in sites0[sites0.index(1, both):], f"site 0's syncs: {sites0}"
    by_step0 = {e["step"]: e for e in syncs(events0)}
    first = syncs(events0)[both]["step"]
    steps0 = [e["step"] for e in events0 if e["kind"] == "train" and e["step"] >= first]
    assert steps0 == list(range(first, first + len(steps0))), "site 0 lost or repeated a step"

    back = written_events(dir1)[first_life : before_outage[1]]
    healed = [e for e in back if e.get("event") == "healed"]
    assert len(healed) == 1, back[:5]
    step = healed[0]["step"]
    assert by_step0[step]["outer_sites"] == 1, "site 1 healed at a sync of site 0 alone, adding nothing to it"
    assert healed[0]["outer_start_norm"] == by_step0[step]["outer_start_norm"], "site 1 took site 0's weights"
    assert healed[0]["inner_fingerprint"] == by_step0[step]["inner_fingerprint"], "and site 0's inner optimizer state"
    after_heal = back[back.index(healed[0]):]
    going_on = [e["step"] for e in after_heal if e["kind"] == "train"]  # the healing step's own event first
    assert going_on == list(range(step, step + len(going_on))), "site 1 goes on from site 0's step"
    after = syncs(after_heal)
    assert after and after[0]["step"] == step + 2
    whole0 = {e["step"]: e for e in syncs(written_events(dir0))}  # a sync site 1 logged before site 0 did is there
    for sync in after:
        assert sync["outer_sites"] == whole0[sync["step"]]["outer_sites"] == 2
        assert sync["outer_start_norm"] == whole0[sync["step"]]["outer_start_norm"], "the sites disagree"

    outages = [o() for o in outage]
    for events in outages:  # neither site stopped: every step trained once, alone or not
        steps = [e["step"] for e in events if e["kind"] == "train"]
        assert steps == list(range(steps[0], steps[0] + len(steps))) or any(e.get("event") == "healed"
                                                                            for e in events), steps
    alone_norms = [[e["outer_start_norm"] for e in syncs(events) if e.get("outer_alone")] for events in outages]
    assert alone_norms[0][-1] != alone_norms[1][-1], "alone, the sites' weights part"
    reheal = [(site, e) for site, events in enumerate(outages) for e in events if e.get("event") == "healed"]
    assert reheal, "once the lighthouse is back, a site heals from the other"
    for site, healed_event in reheal:  # a restarted lighthouse may form a quorum of one site before the other's
        lender = {e["step"]: e for e in syncs(outages[1 - site])}  # heartbeat: they part again, and heal again
        assert healed_event["inner_fingerprint"] == lender[healed_event["step"]]["inner_fingerprint"], "took theirs"
    joined = [{e["step"]: e["outer_start_norm"] for e in rejoined(events)} for events in outages]
    shared = sorted(set(joined[0]) & set(joined[1]))
    assert shared and all(joined[0][k] == joined[1][k] for k in shared), f"the sites disagree after: {joined}"


def rejoined(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Syncs of both sites after this site's last sync alone."""
    together = syncs(events)
    alone = [i for i, e in enumerate(together) if e.get("outer_alone")]
    return [e for e in together[alone[-1] + 1 if alone else 0 :] if e["outer_sites"] == 2]


def test_a_site_of_another_size_joining_a_run_under_way_is_refused_with_it_naming_both(
    tmp_path: Path, in_background: Callable[[warm.Command], None]
) -> None:
    """Site 1 (1 process) syncs alone first; site 0 (2 processes) then joins behind it. Before the refusal came
    when the group formed, torchft healed site 0 from site 1 first: gloo aborted site 0, and site 1 trained on."""
    lighthouse = free_port()
    tower = run_lighthouse(tmp_path, lighthouse)
    sites = [launch(tmp_path, 1, lighthouse)]
    try:
        wait_until(lambda: any(syncs(written_events(tmp_path / "tiny" / "site-1"))), [tower, *sites],
                   "site 1 syncing alone", tmp_path)
        in_background(sites[0])
        sites.insert(0, launch(tmp_path, 0, lighthouse, "--nproc", "2"))
        codes = [site.wait(timeout=240) for site in sites]
    finally:
        for site in sites:
            kill_tree(site)
        kill_tree(tower)
    outputs = [(tmp_path / f"site-{s}.out").read_text() for s in range(2)]
    assert codes == [2, 2], outputs
    for output in outputs:  # site 0's second rank has no peer: torchft logs its own failed group set-up before it
        error = output.rpartition("trainyard: error")[2]
        assert "site 0 has 2, site 1 has 1" in error and "Traceback" not in error, output[-3000:]
    assert "Traceback" not in outputs[1]
