"""`make test`: the whole suite as five pytest processes side by side, then one report.

Every test that starts ranks, shares a world or binds a fixed port is marked `ranks` (tests/conftest.py); those run
one at a time in two lanes, each with shared worlds of its own: the first runs the `ranks` tests that must not run
beside another (fixed ports, namespace hosts, a cluster), then the tests/dist modules of SHARED_LANE (marked
`either_lane`) in file order; the second runs those from the last module back, and each module goes to the lane that
reaches it first, so the lanes end together. Modules marked `worlds` (tasks on the shared worlds only) run in a
third process with worlds of their own, and the single-process tests in a fourth and a fifth: on the cores a launch
leaves idle while it waits on start-up, rendezvous and timeouts. (pytest-xdist's `loadgroup` would do this, but its
groups are lost under pytest 9.2: it renames items through an attribute pytest no longer reads.)

Usage: python tests/suite.py [pytest arguments, e.g. -x or tests/unit]
TRAINYARD_SUITE_REPORTS=DIR keeps each process's junit report and log in DIR (each test's seconds, CPU and order)."""

from __future__ import annotations

import compileall
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

SLOWEST = 40


SECOND_HALF = ("tests/unit/model", "tests/unit/train", "tests/unit/estimate")
"""The single-process tests' folders a second process takes: half their time (4 of 8 minutes, alone). With one
process for them all, it ran on alone for the suite's last two minutes, with a core idle."""
SIDES = {
    "ranks": "ranks", "ranks-lane-2": "either_lane", "worlds": "worlds",
    "single-process": "not ranks and not worlds", "single-process-2": "not ranks and not worlds",
}
"""Each process's name and its marker expression; the first prints as it goes, the others when all have ended."""
SCOPES = {
    "ranks": ["tests"], "ranks-lane-2": ["tests/dist"], "worlds": ["tests/dist"],
    "single-process": ["tests", "--ignore=tests/dist", "--ignore=tests/e2e", "--ignore=tests/gpu",
                       *(f"--ignore={folder}" for folder in SECOND_HALF)],
    "single-process-2": list(SECOND_HALF),
}
"""What each process collects when `make test` names no tests: only the folders its marker can select. Every test of
tests/dist, e2e and gpu is `ranks` or `worlds`, and only tests/dist holds `worlds` and `either_lane` tests
(tests/conftest.py refuses others). Each pytest process imports every module it collects."""


def pytest(side: str, work: Path, extra: list[str], output: Path | None) -> subprocess.Popen[bytes]:
    """One pytest process over the tests of one side (its marker expression); the two lanes of `ranks` tests share
    a folder of claims on the SHARED_LANE modules (tests/conftest.py)."""
    command = [
        sys.executable, "-m", "pytest", "-q", "-rs", "-m", SIDES[side], f"--junitxml={work / side}.xml",
        f"--basetemp={work / side}", *(["-p", "no:cacheprovider"] if output else []), *extra,
    ]
    stdout = open(output, "wb") if output else None  # noqa: SIM115 (closed when the process has ended)
    lanes = {"TRAINYARD_SUITE_CLAIMS": str(work / "claims"),
             "TRAINYARD_SUITE_LANE": "2" if side == "ranks-lane-2" else "1"}
    env = {**quiet_waits(), **(lanes if side.startswith("ranks") else {})}
    return subprocess.Popen(command, stdout=stdout, stderr=subprocess.STDOUT if output else None, env=env)


def quiet_waits() -> dict[str, str]:
    """The environment of every process the suite starts, with OpenMP's idle threads asleep instead of spinning:
    four sides on two cores run several times as many threads as cores, and a spinning thread holds a core its
    straggling sibling needs (a one-process tiny run took 60 s beside 4 busy processes, 30 s with this, 11 s alone).
    The same threads split the same work, so every result is the same; the user's own setting wins."""
    return {"OMP_WAIT_POLICY": "PASSIVE", **os.environ}


def durations(report: Path, cpu: bool = False) -> list[tuple[float, str]]:
    """Each test's seconds (wall, or CPU where `cpu`: tests/conftest.py records it) from a junit report."""
    if not report.is_file():
        return []
    cases = ElementTree.parse(report).getroot().iter("testcase")
    return [(_cpu_s(case) if cpu else float(case.get("time", 0)),
             f"{case.get('classname', '')}::{case.get('name', '')}") for case in cases]


def _cpu_s(case: ElementTree.Element) -> float:
    found = [prop.get("value") for prop in case.iter("property") if prop.get("name") == "cpu_s"]
    return float(found[0]) if found else 0.0


def compiled_once() -> None:
    """Byte-code for trainyard's and the tests' modules, written once before the suite: where PYTHONDONTWRITEBYTECODE
    is set (some CI images set it) every interpreter the suite starts (hundreds: launchers, fork servers, CLI
    processes) compiled the ~115 source modules again (0.24 s of CPU each time), as the editable install leaves them
    uncompiled. Reading byte-code is allowed either way."""
    repo = Path(__file__).resolve().parent.parent
    for folder in ("src", "tests"):
        compileall.compile_dir(repo / folder, quiet=1)


def cpu_ticks() -> tuple[int, int] | None:
    """The machine's busy and total CPU ticks so far (Linux's /proc/stat), or None elsewhere."""
    try:
        ticks = [int(field) for field in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)  # all but idle and iowait


def busy_share(start: tuple[int, int] | None) -> str:
    """How busy the machine's cores were since `start`: near 100%, the suite's wall is its CPU over the cores (a
    killed launch's workers, adopted by init, count here and in no test's CPU), and more lanes cannot shorten it."""
    end = cpu_ticks()
    if start is None or end is None or end[1] == start[1]:
        return ""
    return f"; the {os.cpu_count()} cores were {100 * (end[0] - start[0]) / (end[1] - start[1]):.0f}% busy"


def main(extra: list[str]) -> int:
    compiled_once()
    ticks = cpu_ticks()
    kept = os.environ.get("TRAINYARD_SUITE_REPORTS")
    with tempfile.TemporaryDirectory(prefix="trainyard-suite-") as tmp:
        work = Path(kept or tmp)
        shutil.rmtree(work / "claims", ignore_errors=True)  # a kept folder's claims are an earlier run's
        (work / "claims").mkdir(parents=True)
        logs = {side: work / f"{side}.log" for side in list(SIDES)[1:]}
        sides = [side for side in SIDES if not (extra and side == "single-process-2")]  # named tests: one process
        processes = {side: pytest(side, work, extra or SCOPES[side], logs.get(side)) for side in reversed(sides)}
        codes = {side: processes[side].wait() for side in sides}
        for side, log in logs.items():
            if side not in processes:
                continue
            print(f"\n===== the {side} tests (run beside the ones above) =====\n{log.read_text()}")
        for cpu, what in ((False, "slowest tests of all (setup + call + teardown)"),
                          (True, "tests that used the most CPU (their process and its children)")):
            ranked = sorted(sum((durations(work / f"{side}.xml", cpu) for side in SIDES), []), reverse=True)
            print(f"===== the {SLOWEST} {what}; {sum(s for s, _ in ranked) / 60:.1f} min in all =====")
            for seconds, test in ranked[:SLOWEST]:
                print(f"{seconds:8.2f}s {test}")
    # pytest's 5: no test selected (a marker or path that leaves one side empty) is not a failure here
    failed = {side: code for side, code in codes.items() if code not in (0, 5)}
    print(f"exit codes: {codes}" + ("" if not failed else f"; failed: {', '.join(failed)}") + busy_share(ticks))
    return max(failed.values(), default=0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
