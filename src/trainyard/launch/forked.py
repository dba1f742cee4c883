"""Workers forked from one interpreter that imported the training stack, instead of one fresh interpreter each.

A worker's imports (torch, transformers, the recipe) take seconds, and every worker paid them again: on a machine
with fewer cores than workers they queue (4 workers on 2 cores import in twice the time of one), and a restart
pays them once more. Here the launcher starts a fork server first, which imports the stack while the launcher
imports torch's agent; torch's agent then forks each worker (and each restarted one) from it, imports done.

The fork server is Python's own (multiprocessing's forkserver): one process with no threads of its own and no
device touched, so forking it is safe. A launcher that has started nothing yet (the command line, not a test
calling in) forks that server from itself right after importing torch, which it needs for its agent anyway:
torch is then imported once per launch instead of twice (2-3 s of CPU each time), and the server goes on to import
the rest while the launcher starts its agent. Elsewhere the server is a fresh interpreter, as multiprocessing
starts it. It is used only with a torch build that has no GPU library: a process that initialised CUDA cannot be
forked, and a GPU machine is not here to show which import would. There the workers start as fresh interpreters,
as torchrun starts them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path

from trainyard.config import JobConfig

GPU_LIBRARIES = ("libtorch_cuda.so", "libtorch_hip.so", "libtorch_xpu.so")
WORKER = ("trainyard.cli.app", "run_forked_worker")
"""What a forked worker runs, `(argv, stop_signals)`: named, as a worker interpreter's `-m trainyard.cli` is."""


def forks_safely() -> bool:
    """Whether this torch build can only run on the CPU (read from its files: `import torch` takes seconds)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    lib = Path(next(iter(spec.submodule_search_locations))) / "lib"
    return lib.is_dir() and not any((lib / name).exists() for name in GPU_LIBRARIES)


def modules_for(cfg: JobConfig | None) -> list[str]:
    """What the job's workers import: the recipe, PEFT for LoRA, `datasets` unless the data is token shards."""
    modules = ["trainyard.cli", "trainyard.train.recipe"]
    if cfg is not None and cfg.lora.enabled:
        modules.append("trainyard.model.lora")
    if cfg is None or not cfg.data.mixture:
        modules.append("datasets")
    return modules


def start_fork_server(modules: list[str], stop_signals: tuple[str, ...]) -> None:
    """Start the fork server now: it imports `modules` beside this launcher, which goes on to import torch. It and
    multiprocessing's resource tracker (started with it) ignore the stop signals: Slurm sends them to every process
    of a step, and a server killed by one reads to torch's agent as every worker gone (exit 255), so the agent
    would close the store under workers still saving."""
    from multiprocessing import forkserver

    ignored = {name: signal.signal(getattr(signal, name), signal.SIG_IGN) for name in stop_signals}
    try:
        forkserver.set_forkserver_preload(modules)
        if forks_from_here():
            _fork_server_from_here(modules)
        else:
            forkserver.ensure_running()
    finally:
        for name, handler in ignored.items():
            signal.signal(getattr(signal, name), handler)


SERVER_MAIN_PARAMETERS = ["listener_fd", "alive_r", "preload", "main_path", "sys_path"]


def forks_from_here() -> bool:
    """Whether this process may become the fork server's parent: it is the command line's own process (it has
    imported no torch yet, or its main module is trainyard's CLI: a process forked with the stack imported, as the
    test suite starts commands) and runs one thread (not a test that calls in), its malloc is the workers' (the
    launcher adds no LD_PRELOAD for them: a forked server would keep this process's), and multiprocessing's server
    is the one this code knows (Python 3.10-3.13: a later one authenticates its clients)."""
    import inspect
    from multiprocessing import forkserver

    server = forkserver._forkserver
    return (
        ("torch" not in sys.modules or _main_is_the_cli())
        and len(os.listdir("/proc/self/task")) == 1
        and os.environ.get("LD_PRELOAD") == _started_with("LD_PRELOAD")
        and list(inspect.signature(forkserver.main).parameters) == SERVER_MAIN_PARAMETERS
        and sorted(vars(server)) == sorted(vars(forkserver.ForkServer()))
        and server._forkserver_pid is None
    )


def _main_is_the_cli() -> bool:
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return getattr(spec, "name", None) == "trainyard.cli.__main__"


def _started_with(name: str) -> str | None:
    """An environment variable as this process started with it (os.environ holds what was set since)."""
    for item in Path("/proc/self/environ").read_bytes().split(b"\0"):
        key, _, value = item.partition(b"=")
        if key == name.encode():
            return value.decode()
    return None


def _fork_server_from_here(modules: list[str]) -> None:
    """What multiprocessing's `ensure_running` does, with a fork of this process, torch imported, in place of a new
    interpreter: the server imports the rest of `modules` itself, beside this launcher. It leaves by `os._exit`,
    never through the launcher's own code, and holds no write end of the pipe that tells it the launcher is gone."""
    from multiprocessing import connection, forkserver, resource_tracker, util

    import torch  # noqa: F401  the launcher's agent needs it too: imported once for both

    resource_tracker.ensure_running()
    sys.stdout.flush()
    sys.stderr.flush()
    with socket.socket(socket.AF_UNIX) as listener:
        address = connection.arbitrary_address("AF_UNIX")
        listener.bind(address)
        if not util.is_abstract_socket_namespace(address):
            os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(alive_w)
            try:
                forkserver.main(listener.fileno(), alive_r, modules)
            finally:
                os._exit(0)
        os.close(alive_r)
    server = forkserver._forkserver
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid


def _without_exit_traceback(record: logging.LogRecord) -> bool:
    from torch.multiprocessing import ProcessExitedException

    if record.exc_info and isinstance(record.exc_info[1], ProcessExitedException):
        record.exc_info, record.exc_text = None, None
    return True


def quiet_agent_tracebacks() -> None:
    """torch's agent logs a forked worker's non-zero exit with a traceback of its own (of the exception that told
    it so); the line "failed (exitcode: N)" says all a worker interpreter's exit says, and the worker's own report
    follows, so a user error prints no traceback, as with worker interpreters. A worker that raised keeps its
    traceback: the agent's log is where it is printed (torch passes it up from the worker)."""
    logger = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    if _without_exit_traceback not in logger.filters:
        logger.addFilter(_without_exit_traceback)


def stop_fork_server() -> None:
    """End the fork server at once once the workers are done. Left to itself it tears down its imports at exit
    (1.5 s for torch and transformers), holding this launcher's stdout open all the while: a caller reading the
    launcher's output to its end waits for it. multiprocessing has no public call for this: its one server is
    killed by pid, then its own `_stop` reaps it and forgets it, so a later launch in this process starts another."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    if pid:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    stop = getattr(server, "_stop", None)
    if stop is not None:
        stop()


def worker() -> Callable[[list[str], tuple[str, ...]], None]:
    module, name = WORKER
    return getattr(importlib.import_module(module), name)


def as_fresh_interpreter(stop_signals: tuple[str, ...]) -> None:
    """In a forked worker, what a fresh interpreter would have from its start: the stop signals the server ignores
    act again, and OMP_NUM_THREADS as the agent set it for this worker (torchrun sets it after the server started,
    and the OpenMP runtime reads it once, when torch loads: 4 workers on 2 cores each ran 2 threads, 10x slower)."""
    for name in stop_signals:
        number = getattr(signal, name)
        signal.signal(number, signal.default_int_handler if number == signal.SIGINT else signal.SIG_DFL)
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
