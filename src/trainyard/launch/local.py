"""Re-execute `trainyard train` under torchrun's elastic agent on this machine.

The agent runs in-process (not the torchrun script) so a failed worker becomes an exit
code and one clear message here instead of the agent's traceback. Workers report a
user error through a per-rank exit file that this side reads back.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import tempfile
import traceback
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainyard.config import JobConfig
from trainyard.launch import allocator, forked

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.api import SignalException

EXIT_FILE_ENV = "TRAINYARD_EXIT_FILE"
# The agent passes these to its workers instead of dying on them: Slurm's --signal
# sends SIGUSR1 to every process of the step, the agent included.
SIGNALS_TO_FORWARD = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1")


def stop_on_first_signal() -> None:
    """Make the agent act on the first stop signal only and ignore the ones after it.

    torch's agent raises SignalException on every delivery. Slurm delivers a signal to every
    process of the step and the launcher forwards it again, so a second delivery lands in the
    agent's own clean-up (which then sends SIGTERM to workers mid-save) or at interpreter exit,
    where it prints a traceback. torch has no hook for this, so its module-level handler, which
    it installs by name when workers start, is wrapped. The agent still passes the first signal
    to its workers and kills them after its shutdown timeout; this process exits soon after.
    """
    from torch.distributed.elastic.multiprocessing import api

    raise_signal = api._terminate_process_handler
    if getattr(raise_signal, "trainyard_once", False):
        return

    def first_only(signum: int, frame: object) -> None:
        for name in SIGNALS_TO_FORWARD:
            signal.signal(getattr(signal, name), signal.SIG_IGN)
        raise_signal(signum, frame)

    first_only.trainyard_once = True  # type: ignore[attr-defined]
    api._terminate_process_handler = first_only


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def worker_command(argv: list[str]) -> list[str]:
    return [sys.executable, "-m", "trainyard.cli", *argv]


def torchrun_equivalent(nproc: int, argv: list[str], max_restarts: int) -> str:
    parts = ["torchrun", "--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}"]
    return shlex.join(parts + ["-m", "trainyard.cli", *argv])


def write_exit_file(code: int, message: str) -> None:
    """Called by a worker on a user error: the launcher prints it once and exits with code."""
    target = os.environ.get(EXIT_FILE_ENV)
    if target:
        rank = os.environ.get("RANK", "0")
        Path(f"{target}.rank{rank}").write_text(f"{code}\n{message}")


def read_exit_files(prefix: str) -> tuple[int, str] | None:
    """The lowest rank's reported error, if any worker reported one."""
    reports = sorted(Path(prefix).parent.glob(Path(prefix).name + ".rank*"), key=lambda p: int(p.suffix[5:]))
    if not reports:
        return None
    code, _, message = reports[0].read_text().partition("\n")
    return int(code), message


def run_local(
    nproc: int, argv: list[str], max_restarts: int = 0, cfg: JobConfig | None = None
) -> tuple[int, str | None]:
    """Start nproc workers running `trainyard <argv>` (the job `cfg`); return (exit code, error message). torch's
    agent is imported here: a worker reporting a user error, or a command that fails before launching, never needs
    it. Where this torch build allows it the workers are forked from a fork server (`forked`); their environment is
    complete before that server starts: they inherit it."""
    with tempfile.TemporaryDirectory(prefix="trainyard-exit-") as tmp:
        prefix = str(Path(tmp) / "exit")
        os.environ[EXIT_FILE_ENV] = prefix
        preload = allocator.preload_env(os.environ)  # the workers inherit it; this process keeps its malloc
        os.environ.update(preload)
        # Each worker gets its share of the cores instead of all of them (oversubscription).
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
        fork = forked.forks_safely()
        if fork:
            forked.start_fork_server(forked.modules_for(cfg), SIGNALS_TO_FORWARD)
        try:
            return _launch(nproc, argv, max_restarts, fork, prefix)
        finally:
            if fork:
                forked.stop_fork_server()
            for name in (EXIT_FILE_ENV, *preload):
                os.environ.pop(name, None)


def _launch(nproc: int, argv: list[str], max_restarts: int, fork: bool, prefix: str) -> tuple[int, str | None]:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=max_restarts,
        monitor_interval=0.1,  # torchrun's own: a finished or failed worker group is seen at once
        start_method="forkserver" if fork else "spawn",
        signals_to_handle=",".join(SIGNALS_TO_FORWARD),
    )
    command = worker_command(argv)
    entrypoint, args = (forked.worker(), (argv, SIGNALS_TO_FORWARD)) if fork else (command[0], command[1:])
    if fork:
        forked.quiet_agent_tracebacks()
    stop_on_first_signal()
    try:
        elastic_launch(config, entrypoint=entrypoint)(*args)
    except ChildFailedError as err:
        reported = read_exit_files(prefix)
        if reported:
            return reported
        rank, failure = min(err.failures.items())
        code = failure.exitcode if failure.exitcode > 0 else 1
        return code, f"worker rank {rank} failed (exit {failure.exitcode}); see its log under the run dir's logs/"
    except Exception as err:  # this launcher was told to stop; workers saved and left
        stop = signal_behind(err)
        if stop is None:
            raise
        ignore_keep_alive_self_join()
        reported = read_exit_files(prefix)
        return reported or (128 + int(stop.sigval), f"stopped by {stop.sigval.name}")
    return 0, None


def signal_behind(err: BaseException) -> SignalException | None:
    """The stop signal an exception stands for: torch's agent raises SignalException wherever its main thread is,
    and where that is the gap in torch's own timing wrapper before it notes the start, the wrapper's `finally`
    raises UnboundLocalError over it (a preempted run then exited 1 with a traceback, not 75)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    seen: BaseException | None = err
    while seen is not None and not isinstance(seen, SignalException):
        seen = seen.__cause__ or seen.__context__
    return seen


def ignore_keep_alive_self_join() -> None:
    """Keep one message of torch's out of a stopped launch's output. On a stop signal torch's agent leaves its
    rendezvous open (other nodes may still scale) and its keep-alive thread beating; the thread holds the rendezvous
    while it beats, so once this launcher lets go of it, the thread may be the one that frees it. The keep-alive
    timer's finalizer then joins the thread it runs on, and Python prints "Exception ignored ... cannot join current
    thread" with a traceback after the preemption notice. The finalizer has already told the thread to stop, so
    nothing is lost but the traceback; any other unraisable exception still reaches the previous hook."""
    previous = sys.unraisablehook
    if getattr(previous, "trainyard_keep_alive", False):
        return

    def unless_keep_alive_self_join(unraisable: Any) -> None:
        if not _is_keep_alive_self_join(unraisable):
            previous(unraisable)

    unless_keep_alive_self_join.trainyard_keep_alive = True  # type: ignore[attr-defined]
    sys.unraisablehook = unless_keep_alive_self_join


def _is_keep_alive_self_join(unraisable: Any) -> bool:
    if not isinstance(unraisable.exc_value, RuntimeError) or "cannot join current thread" not in str(
            unraisable.exc_value):
        return False
    frames = traceback.extract_tb(unraisable.exc_traceback)
    return any(frame.name == "_stop_thread" and frame.filename.endswith(os.path.join("rendezvous", "utils.py"))
               for frame in frames)
