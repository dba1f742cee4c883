"""Shared helpers: run the real `trainyard` command and read what a run wrote."""

from __future__ import annotations

import gc
import io
import json
import os
import random
import subprocess
import traceback
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests import warm
from tests.world import World, uncounted_cpu_seconds

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")
TINY_MOE = str(REPO / "configs" / "tiny-moe.yaml")
# Interruption steps are random but replayable: a failure names the seed that draws them again.
SEED = int(os.environ.get("TRAINYARD_TEST_SEED") or random.SystemRandom().randrange(10**6))


SHARED_FIXTURES = {"world", "solo", "worlds", "hosts"}
SERIAL_FILES = {"test_node_range.py", "test_diloco_ft.py"}
"""Single-process test files that bind fixed ports or launch ranks."""
SHARED_LANE = {
    "test_activation_checkpointing.py", "test_adapter_gather.py", "test_checkpoint_contents.py",
    "test_checkpoint_errors.py", "test_checkpoint_export.py", "test_checkpoint_resume.py", "test_diloco.py",
    "test_diloco_ft.py", "test_diloco_preemption.py", "test_doctor_dist.py", "test_download.py", "test_dpo.py",
    "test_elastic_resume.py", "test_errors.py", "test_expert_load.py", "test_expert_parallel_resume.py",
    "test_expert_parallel_training.py", "test_flight_record.py", "test_gradient_reductions.py", "test_health.py",
    "test_mesh_timeouts.py", "test_mixture_resume.py", "test_moe.py", "test_network.py", "test_preemption_notice.py",
    "test_sinks_and_secrets.py",
}
"""tests/dist modules that either lane of `ranks` tests may run under `make test` (marked `either_lane`): they bind no
fixed port, make no namespace host and start no cluster, so they may run beside any other ranks test. The first lane
runs the other `ranks` tests first, then these in file order; the second runs these from the last module back; each
module goes to the lane that reaches it first (CLAIMS), so the two lanes end together however the tests' times
change. A launch mostly waits (start-up, rendezvous, timeouts), on cores the other lane uses. Each lane has worlds
and reference runs of its own."""
CLAIMED_TOGETHER = {"test_checkpoint_export.py": "test_checkpoint_resume.py", "test_expert_load.py": "test_moe.py"}
"""Modules that read the same reference runs (tests/dist/conftest.py) go to one lane: the claim of the module named
here is theirs too, so no reference is trained once in each lane."""
CLAIMS = "TRAINYARD_SUITE_CLAIMS"
"""A folder shared by the two lanes (tests/suite.py sets it): a SHARED_LANE module's file there, made by the lane
that runs it. Without it (plain pytest) a process runs every test it selects."""
LANE = "TRAINYARD_SUITE_LANE"
"""`2` for the second lane, which takes the SHARED_LANE modules from the last one back."""


CPU_AT_START = pytest.StashKey[float]()


def cpu_seconds() -> float:
    """This process's CPU and its reaped children's (a launch's agent and workers once it ended), with what those
    miss (tests/world.py: `uncounted_cpu_seconds`): the shared worlds' ranks as they go, and killed process trees."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system + uncounted_cpu_seconds()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
    """The CPU at the test's start; a SHARED_LANE module the other lane claimed is not run here, nor reported (True:
    this hook did all there was to do)."""
    item.stash[CPU_AT_START] = cpu_seconds()
    folder = os.environ.get(CLAIMS)
    if not folder or not item.get_closest_marker("either_lane"):
        return None
    return None if claimed(Path(folder), item.path) else True


CLAIMED: dict[str, bool] = {}


def claimed(folder: Path, module: Path) -> bool:
    """Whether this process runs `module`: the first lane to reach it (or the module it is CLAIMED_TOGETHER with)
    makes their file in `folder` (O_EXCL)."""
    name = CLAIMED_TOGETHER.get(module.name, module.name)
    if name not in CLAIMED:
        try:
            os.close(os.open(folder / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            CLAIMED[name] = True
        except FileExistsError:
            CLAIMED[name] = False
    return CLAIMED[name]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Each test's CPU seconds (setup to teardown) as a junit property: on a machine of 2 cores the suite's wall is
    its CPU, so `tests/suite.py` lists the tests that use the most, beside the slowest (a test waiting on a timeout
    is slow and cheap; one beside it then looks slow and costs nothing). A launch's processes count once reaped
    (in the test that launched them); a shared world's ranks as their tasks run."""
    outcome = yield
    if call.when == "teardown" and CPU_AT_START in item.stash:
        outcome.get_result().user_properties.append(("cpu_s", f"{cpu_seconds() - item.stash[CPU_AT_START]:.2f}"))


def pytest_unconfigure(config: pytest.Config) -> None:
    """The test process's exit skips the collections over all it imported and made, as `trainyard.cli.exit_process`
    does for the command's (seconds of CPU after hundreds of tests)."""
    gc.freeze()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`ranks`: the tests that start ranks, share a world or bind a fixed port. `make test` (tests/suite.py) runs
    them one at a time in two lanes (`either_lane`: SHARED_LANE's, which either may run), the modules marked `worlds`
    (tasks on the shared worlds only: no launch, no fixed port, no reference run) in a third process, the
    single-process tests in a fourth and a fifth."""
    for item in items:
        folder = item.path.relative_to(REPO / "tests").parts[0]
        if item.get_closest_marker("worlds"):
            if folder != "dist":  # tests/suite.py's worlds process collects tests/dist only (SCOPES)
                raise pytest.UsageError(f"{item.nodeid}: `worlds` tests live in tests/dist")
            continue
        if folder in ("dist", "e2e", "gpu") or item.path.name in SERIAL_FILES or \
                SHARED_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.ranks)
            if folder == "dist" and item.path.name in SHARED_LANE:
                item.add_marker(pytest.mark.either_lane)
    if os.environ.get(CLAIMS):
        items[:] = lane_order(items, second=os.environ.get(LANE) == "2")


SLOW_FIRST = ["test_quickstart.py", "test_elastic_hosts.py", "test_multihost.py", "test_slurm.py"]
"""The first lane's own modules that take longest (most of it waiting on start-ups, timeouts and a cluster): run
first, while the other processes fill the cores they leave, never alone at the end. The rest keep their order."""


def lane_order(items: list[pytest.Item], second: bool) -> list[pytest.Item]:
    """The first lane: its own tests (SLOW_FIRST's modules first), then the shared modules in file order; the
    second: the shared modules from the last back (each module's tests in their order), so the lanes meet in the
    middle."""
    own = [item for item in items if not item.get_closest_marker("either_lane")]
    own.sort(key=lambda item: SLOW_FIRST.index(item.path.name) if item.path.name in SLOW_FIRST else len(SLOW_FIRST))
    modules: dict[Path, list[pytest.Item]] = {}
    for item in items:
        if item.get_closest_marker("either_lane"):
            modules.setdefault(item.path, []).append(item)
    shared = list(modules.values())
    return own + [item for module in (shared[::-1] if second else shared) for item in module]


def trainyard(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: float = 600, fresh: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run the CLI as a user would, in a separate process: forked from one that imported the stack (tests/warm.py),
    or a fresh interpreter (`fresh`)."""
    return warm.run(list(args), cwd or REPO, {**os.environ, **(env or {})}, timeout, fresh)


def run_cli(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The CLI's entry point called in this process, for commands that stop before any rank, group or
    training exists (bad input, dry runs, generated scripts): an interpreter start costs seconds, this costs
    milliseconds. A few tests keep `trainyard` (a real process) to prove the exit code and no traceback."""
    import torch.distributed

    from trainyard.cli import main

    out, err = io.StringIO(), io.StringIO()
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    os.environ.update(env or {})
    os.chdir(cwd or REPO)
    code = 0
    try:
        with redirect_stdout(out), redirect_stderr(err):
            try:
                main(list(args))
            except SystemExit as stop:
                code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
            except Exception:  # what the user would see: an uncaught error is exit 1 with its traceback
                traceback.print_exc()
                code = 1
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
    assert not torch.distributed.is_initialized(), f"`trainyard {' '.join(args)}` formed a process group"
    return subprocess.CompletedProcess(["trainyard", *args], code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="session")
def worlds(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[int], World]]:
    """Worlds of N ranks (tests/world.py), each started at its first use and kept for the whole test run. One
    rank is a process with no group: where `trainyard train` without --nproc runs."""
    started: dict[int, World] = {}

    def world_of(nproc: int) -> World:
        if nproc not in started:
            started[nproc] = World(nproc, tmp_path_factory.mktemp(f"world-{nproc}"))
        return started[nproc]

    yield world_of
    for shared in started.values():
        shared.close()


@pytest.fixture(scope="session")
def world(worlds: Callable[[int], World]) -> World:
    """Two ranks in one gloo group."""
    return worlds(2)


@pytest.fixture(scope="session")
def solo(worlds: Callable[[int], World]) -> World:
    """One process, no group."""
    return worlds(1)


def train_in(world: World, config: str, *overrides: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """`trainyard train CONFIG overrides` on a shared world's ranks: rank 0's summary."""
    return world.run("tests.world_tasks:train", config, list(overrides), env=env)[0]


def run_script(world: World, name: str, *argv: str) -> None:
    """tests/dist/scripts/<name>.py on a shared world's ranks, as `torchrun --nproc-per-node N` would run it."""
    world.run("tests.world_tasks:script", str(REPO / "tests" / "dist" / "scripts" / f"{name}.py"), list(argv))


def events(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["kind"] == kind]


def assert_ok(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, (
        f"exit {result.returncode}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-5000:]}"
    )


@pytest.fixture
def tiny() -> str:
    return TINY


@pytest.fixture
def draw_step(request: pytest.FixtureRequest):
    """A step in [low, high] from this test's own seeded RNG, printed with how to replay it."""
    rng = random.Random(f"{SEED}:{request.node.nodeid}")

    def draw(low: int, high: int) -> int:
        step = rng.randint(low, high)
        print(f"interrupting at step {step} (TRAINYARD_TEST_SEED={SEED} replays it)")
        return step

    return draw
