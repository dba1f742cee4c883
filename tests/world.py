"""Long-lived worlds for the tests that check what one run, one step or one collective does.

A process costs seconds before it trains (interpreter, torch, transformers, PEFT); a launch of `trainyard train
--nproc 2` pays that three times over. A `World` starts its ranks once (torch's `MultiProcContinuousTest` pattern)
and feeds them tasks: a task is `module:function` and its arguments, run on every rank at once, and each rank's
return value comes back. A rank that raises reports its traceback, named by rank; the world is then restarted
for the next task, since its peers may be stuck in a collective the failed rank never joined.

Tests about a process's life (kill, resume, preemption, hangs, hosts, sites) keep real launches."""

from __future__ import annotations

import json
import os
import random
import select
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests import warm

REPO = Path(__file__).resolve().parents[1]
RANK_MODULE = "tests.world_rank"
GROUP_LIMIT = 8
"""A world is started again after a task that left its ranks more process groups than this. The groups of every
task stay (destroying them leaves stale meshes in torch's DTensor caches, which compare meshes by shape, not by
group), and each gloo group keeps a thread that wakes every 10 ms: one world had ~120 a rank by its last test,
~50,000 wake-ups a second over its ranks, a third of the suite's two cores. A new world costs ~0.2 s (its ranks
fork from the warm server)."""


class TaskFailed(AssertionError):
    """A task raised on some rank, or did not finish in time: the ranks' tracebacks and logs."""


def free_port() -> int:
    """A port for a process about to be started to listen on, below the kernel's ephemeral range: a port the kernel
    handed out (bind to port 0) was free when asked, but under the suite's load another process's own port-0 bind
    or outgoing connection took it before the launch bound it (EADDRINUSE in a site's relaunch). Below that range
    only a port asked for by number can collide."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    while True:
        port = random.randrange(min(10_000, low // 2), low)
        with socket.socket() as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
            return port


STARTED: list[World] = []
"""Every world this process made: `live_ranks_cpu_seconds` reads their ranks."""


def live_ranks_cpu_seconds() -> float:
    """The CPU the worlds' ranks not yet reaped have used so far (and their own reaped children), from /proc. Once
    reaped, a rank's CPU is this process's children's, whole: tests/conftest.py adds this to that, so each task's CPU
    counts in the test that ran it, not all of a world's life in whichever test the world ended under."""
    return sum(cpu_with_reaped(rank.pid) for world in STARTED for rank in world.ranks if rank.returncode is None)


KILLED_CPU_S = [0.0]
"""The CPU of processes tests SIGKILLed together with their parents (`count_killed`)."""


def count_killed(pids: list[int]) -> None:
    """Count the CPU of processes about to be SIGKILLed with their parent (tests/dist/checkpoint_helpers.py:
    kill_tree): init reaps them, so it never reaches this process's children's."""
    KILLED_CPU_S[0] += sum(cpu_with_reaped(pid) for pid in pids)
    warm.COUNTED.update(pids)


def uncounted_cpu_seconds() -> float:
    """The CPU this process's own and its reaped children's times miss: the worlds' live ranks, and killed trees."""
    return live_ranks_cpu_seconds() + KILLED_CPU_S[0] + warm.CPU_S[0]


def cpu_with_reaped(pid: int) -> float:
    """A process's CPU and its reaped children's, from /proc (0 where it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return sum(int(value) for value in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime


def forked_rank(env: dict[str, str], log: int, result: int) -> warm.Command | None:
    """A rank forked from the warm server (tests/warm.py), its imports done, in its own session: stdin a pipe, stdout
    and stderr the log, the result pipe its fd 3; None where the server does not serve `env`."""
    stdin_r, stdin_w = os.pipe()
    try:
        process = warm.start_module(RANK_MODULE, {**env, "TRAINYARD_WORLD_RESULT_FD": "3"}, [stdin_r, log, log, result])
    finally:
        os.close(stdin_r)
    if process is None:
        os.close(stdin_w)
        return None
    process.stdin = os.fdopen(stdin_w, "wb")  # type: ignore[attr-defined]
    return process


class World:
    """`nproc` ranks that share one process group (formed by the first task that calls `dist.init`), or one
    process with no group at all (`nproc=1`: the single-process reference runs of trainyard)."""

    def __init__(self, nproc: int, logs: Path) -> None:
        self.nproc, self.logs = nproc, logs
        self.ranks: list[subprocess.Popen[bytes] | warm.Command] = []
        self.starts = 0
        STARTED.append(self)

    def start(self) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        port = free_port()
        self.ranks = []
        for rank in range(self.nproc):
            read_end, write_end = os.pipe()
            # Each rank writes one JSON line per task to this pipe; its stdout and stderr go to its log file.
            env = {**os.environ, **self._rank_env(rank, port), "TRAINYARD_WORLD_RESULT_FD": str(write_end)}
            log = open(self.logs / f"world-{self.starts}-rank-{rank}.log", "wb")  # noqa: SIM115 (the rank owns it)
            process = forked_rank(env, log.fileno(), write_end) or subprocess.Popen(
                [sys.executable, "-m", RANK_MODULE], cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=log,
                stderr=subprocess.STDOUT, pass_fds=(write_end,), start_new_session=True,
            )
            os.close(write_end)
            log.close()
            process.result_pipe = os.fdopen(read_end, "rb")  # type: ignore[attr-defined]
            process.log_path = log.name  # type: ignore[attr-defined]
            self.ranks.append(process)

    def _rank_env(self, rank: int, port: int) -> dict[str, str]:
        env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        if self.nproc == 1:
            return env
        return {
            **env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(self.nproc),
            "LOCAL_WORLD_SIZE": str(self.nproc), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": f"world-{port}",
        }

    def run(self, function: str, *args: Any, timeout: float = 600, **kwargs: Any) -> list[Any]:
        """`module:function(*args, **kwargs)` on every rank; their return values in rank order."""
        if not self.ranks or any(rank.poll() is not None for rank in self.ranks):
            self.close()
            self.start()
        task = json.dumps({"function": function, "args": args, "kwargs": kwargs}).encode() + b"\n"
        for rank in self.ranks:
            rank.stdin.write(task)
            rank.stdin.flush()
        replies = self._replies(timeout)
        failed = {r: reply for r, reply in replies.items() if reply is None or not reply["ok"]}
        if failed:
            message = self._describe(function, failed)
            self.close()  # peers of a failed rank may wait in a collective it never joined
            raise TaskFailed(message)
        if max(reply["groups"] for reply in replies.values() if reply) > GROUP_LIMIT:
            self.close()  # the next task starts a new world
        return [replies[r]["value"] for r in range(self.nproc)]

    def _replies(self, timeout: float) -> dict[int, dict[str, Any] | None]:
        """Each rank's reply; once one rank fails, the others get a few seconds to say theirs."""
        replies: dict[int, dict[str, Any] | None] = {}
        deadline = time.monotonic() + timeout
        pipes = {rank.result_pipe.fileno(): r for r, rank in enumerate(self.ranks)}  # type: ignore[attr-defined]
        while len(replies) < self.nproc and time.monotonic() < deadline:
            waiting = [fd for fd, r in pipes.items() if r not in replies]
            ready, _, _ = select.select(waiting, [], [], min(1.0, max(0.0, deadline - time.monotonic())))
            for fd in ready:
                line = self.ranks[pipes[fd]].result_pipe.readline()  # type: ignore[attr-defined]
                replies[pipes[fd]] = json.loads(line) if line else None  # EOF: the rank died
            if any(reply is None or not reply["ok"] for reply in replies.values()):
                deadline = min(deadline, time.monotonic() + 5)
        for r in range(self.nproc):
            replies.setdefault(r, None)
        return replies

    def _describe(self, function: str, failed: dict[int, dict[str, Any] | None]) -> str:
        parts = [f"{function} failed on rank(s) {sorted(failed)}"]
        for r, reply in sorted(failed.items()):
            if reply is not None:
                parts.append(f"--- rank {r} raised:\n{reply['error']}")
            else:
                log = Path(self.ranks[r].log_path).read_text(errors="replace")  # type: ignore[attr-defined]
                parts.append(f"--- rank {r} gave no reply (died or timed out); its log ends:\n{log[-4000:]}")
        return "\n".join(parts)

    def close(self) -> None:
        for rank in self.ranks:
            if rank.poll() is None:
                try:
                    os.killpg(rank.pid, 9)
                except ProcessLookupError:
                    pass
            rank.wait()
            rank.stdin.close()
            rank.result_pipe.close()  # type: ignore[attr-defined]
        self.ranks = []
