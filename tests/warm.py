"""The `trainyard` command in a new process forked from one that has already imported the training stack.

A test that runs the CLI as a user would starts a new process; a fresh interpreter then imports torch, transformers
and trainyard again (~4 s of CPU for a launch: the launcher's torch, its fork server's stack, rank 0's TensorBoard),
and the suite does that dozens of times on two cores. Here one server per pytest process imports the stack once and
forks a process per command, which runs `trainyard.cli` as `python -m trainyard.cli` does, from its own working
directory, environment, arguments and pipes, and leaves as an interpreter leaves (its atexit handlers, its exit
code, a traceback where an exception escapes). The launcher it becomes forks its workers' server from itself, as a
launcher fresh from its command line does (launch/forked.py). Workers, process groups and signals are as real as
ever: only the interpreter's start is shared. The shared worlds' ranks (tests/world.py) start the same way
(`start_module`), as do the DiLoCo sites and their lighthouse.

What a command could read at import time keeps a fresh interpreter: an environment that differs from the server's in
a variable read when a library loads (FRESH_PREFIXES), a caller that asks for one (`fresh=True`), or a run with
TRAINYARD_TESTS_FRESH=1. A failed start of the server falls back to fresh interpreters for the rest of the run.

    python -m tests.warm SOCKET     # the server: pytest starts it at its first command, it leaves with its stdin
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import runpy
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

STACK = ["trainyard.cli", "trainyard.train.recipe", "trainyard.model.lora", "datasets", "torch.utils.tensorboard"]
"""What the server imports: the CLI, a worker's stack (launch/forked.py modules_for) and rank 0's TensorBoard."""
FRESH_PREFIXES = (
    "PYTHON", "LD_", "OMP_", "MKL_", "KMP_", "GOMP", "OPENBLAS", "TORCH_", "TORCHINDUCTOR", "TORCHDYNAMO", "PYTORCH",
    "CUDA", "NCCL_", "ATEN_", "ONEDNN_", "DNNL_", "HF_", "TRANSFORMERS", "DATASETS", "TOKENIZERS", "MALLOC", "GLIBC",
    "TRAINYARD_GPU",
)
"""Variables a library may read when it loads: a command whose environment changes one gets a fresh interpreter."""
REAPPLIED = {"OMP_NUM_THREADS", "PYTHONUNBUFFERED"}
"""What a forked process applies itself, as the workers' fork server does (launch/forked.py as_fresh_interpreter)."""
FRESH_SWITCH = "TRAINYARD_TESTS_FRESH"
"""Set to 1, every command gets a fresh interpreter (to compare, or to rule this module out)."""
REPO = Path(__file__).resolve().parents[1]
CPU_S = [0.0]
"""The CPU of the commands this process ran here: the server's forks are not this process's children."""
COUNTED: set[int] = set()
"""Commands whose CPU was counted as they were killed (tests/world.py count_killed)."""


# -- the server --------------------------------------------------------------------------------------------------

def serve(address: str) -> dict[str, Any] | None:
    """Import the stack, then fork a process per request. Returns in each such process only (its request); the server
    itself leaves when its stdin closes (the pytest process is gone)."""
    for module in STACK:
        importlib.import_module(module)
    if threading.active_count() != 1:  # a Python thread would be lost in every fork: no warm starts
        print("threads", flush=True)
        return None
    # The native threads that loading starts (numpy's OpenBLAS pool, pyarrow's jemalloc) are there in the workers'
    # own fork server too (launch/forked.py): their libraries re-make them after a fork.
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(address)
    listener.listen(16)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the waiters
    print("ready", flush=True)
    watch = selectors.DefaultSelector()
    watch.register(listener, selectors.EVENT_READ)
    watch.register(sys.stdin, selectors.EVENT_READ)
    while True:
        ready = [key.fileobj for key, _ in watch.select()]
        if sys.stdin in ready:
            os._exit(0)
        connection, _ = listener.accept()
        message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 16)
        if os.fork() == 0:
            return wait_on_command(json.loads(message), connection, listener, fds)
        connection.close()
        for fd in fds:
            os.close(fd)


def wait_on_command(
    request: dict[str, Any], connection: socket.socket, listener: socket.socket, fds: list[int]
) -> dict[str, Any]:
    """In the server's fork: fork the command, send its pid, wait, send its exit code and CPU, leave. Returns in the
    command's process, its stdin, stdout and stderr the caller's."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    listener.close()
    started_r, started_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        connection.close()
        os.close(started_r)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        if request["new_session"]:
            os.setsid()
        os.close(started_w)  # what Popen's return promises: the session is made
        return request
    for fd in (*fds, started_w):
        os.close(fd)
    os.read(started_r, 1)
    connection.send(str(pid).encode())
    _, status, usage = os.wait4(pid, 0)
    connection.send(json.dumps([os.waitstatus_to_exitcode(status), usage.ru_utime + usage.ru_stime]).encode())
    os._exit(0)


def run_command(request: dict[str, Any]) -> None:
    """`python -m MODULE ARGV` in this process, from the request's directory and environment."""
    os.chdir(request["cwd"])
    sys.path[0] = request["cwd"]  # what `python -m` puts first
    os.environ.clear()
    os.environ.update(request["env"])
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # read once, when torch loaded in the server
        import torch

        torch.set_num_threads(int(threads))
    if os.environ.get("PYTHONUNBUFFERED"):
        sys.stdout.reconfigure(write_through=True, line_buffering=True)  # type: ignore[union-attr]
    sys.argv = ["-m", *request["argv"]]
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


# -- the caller ----------------------------------------------------------------------------------------------------

class Server:
    """This pytest process's server, started at its first use."""

    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="trainyard-warm-")
        atexit.register(shutil.rmtree, self.folder, True)  # the socket's folder goes with this process
        self.address = os.path.join(self.folder, "socket")
        self.env = dict(os.environ)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.warm", self.address], cwd=REPO, env=self.env, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        assert self.process.stdout is not None
        self.ready = self.process.stdout.readline().strip() == b"ready"

    def serves(self, env: dict[str, str]) -> bool:
        """Whether `env` differs from the server's only in variables read after the libraries have loaded (or
        applied again by the forked process: REAPPLIED)."""
        changed = {key for key in env.keys() | self.env.keys() if env.get(key) != self.env.get(key)} - REAPPLIED
        return self.ready and self.process.poll() is None and not any(
            key.startswith(FRESH_PREFIXES) for key in changed)


_server: list[Server] = []


def server() -> Server:
    if not _server:
        _server.append(Server())
    return _server[0]


class Command:
    """A command forked from the server, with what tests use of subprocess.Popen (text pipes for stdout and
    stderr)."""

    def __init__(
        self, argv: list[str], cwd: Path, env: dict[str, str], new_session: bool, module: str = "trainyard.cli",
        fds: list[int] | None = None,
    ) -> None:
        """`fds`: the process's stdin, stdout, stderr and any more, in that order (the caller keeps and closes its
        own); None: stdin from /dev/null, stdout and stderr piped to `communicate`."""
        self.args = [module, *argv]
        self.returncode: int | None = None
        self._chunks: dict[int, list[bytes]] = {}
        self._open: dict[int, list[bytes]] = {}
        ours = []
        if fds is None:
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            ours = [os.open(os.devnull, os.O_RDONLY), out_w, err_w]
            fds = ours
            self._open, self._out, self._err = {out_r: [], err_r: []}, out_r, err_r
        self._status = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._status.connect(server().address)
            request = {"module": module, "argv": argv, "cwd": str(cwd), "env": env, "new_session": new_session}
            socket.send_fds(self._status, [json.dumps(request).encode()], fds)
            self.pid = int(self._status.recv(64))
        finally:
            for fd in ours:
                os.close(fd)

    def poll(self) -> int | None:
        if self.returncode is None:
            self._status.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                self._ended(self._status.recv(256))
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._status.settimeout(timeout)
            try:
                self._ended(self._status.recv(256))
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
        assert self.returncode is not None
        return self.returncode

    def _ended(self, message: bytes) -> None:
        """The waiter's last message: the exit code (-N for signal N, as Popen says it) and the CPU it used."""
        self._status.close()
        code, cpu = json.loads(message) if message else (-signal.SIGKILL, 0.0)  # the waiter itself was killed
        self.returncode = code
        if self.pid not in COUNTED:
            CPU_S[0] += cpu

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Both pipes to their end (every process holding them gone), then the exit code."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with selectors.DefaultSelector() as pipes:
            for fd in self._open:
                pipes.register(fd, selectors.EVENT_READ)
            while self._open:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                for key, _ in pipes.select(left):
                    chunk = os.read(key.fd, 1 << 16)
                    if chunk:
                        self._open[key.fd].append(chunk)
                        continue
                    pipes.unregister(key.fd)
                    os.close(key.fd)
                    self._chunks[key.fd] = self._open.pop(key.fd)
        self.wait(None if deadline is None else max(deadline - time.monotonic(), 0.001))
        return self._text(getattr(self, "_out", -1)), self._text(getattr(self, "_err", -1))

    def _text(self, fd: int) -> str:
        return b"".join(self._chunks.get(fd, [])).decode(errors="replace").replace("\r\n", "\n")

    def send_signal(self, number: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, number)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start(
    argv: list[str], cwd: Path = REPO, env: dict[str, str] | None = None, new_session: bool = False,
    fresh: bool = False, output: int | None = None,
) -> Command | subprocess.Popen[Any]:
    """`trainyard ARGV` in a new process: forked from the server where it serves the environment, else a fresh
    interpreter. stdout and stderr are text pipes for `communicate`, or both the file descriptor `output`."""
    env = dict(os.environ) if env is None else env
    if not (fresh or os.environ.get(FRESH_SWITCH) == "1") and server().serves(env):
        if output is None:
            return Command(argv, cwd, env, new_session)
        with open(os.devnull, "rb") as stdin:
            return Command(argv, cwd, env, new_session, fds=[stdin.fileno(), output, output])
    command = [sys.executable, "-m", "trainyard.cli", *argv]
    if output is not None:
        return subprocess.Popen(command, cwd=cwd, env=env, start_new_session=new_session, stdout=output,
                                stderr=subprocess.STDOUT)
    return subprocess.Popen(command, cwd=cwd, env=env, start_new_session=new_session, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def start_module(module: str, env: dict[str, str], fds: list[int], new_session: bool = True) -> Command | None:
    """`python -m MODULE` forked from the server with `fds` as its stdin, stdout, stderr and more; None where the
    server does not serve `env` (the caller starts a fresh interpreter)."""
    if os.environ.get(FRESH_SWITCH) == "1" or not server().serves(env):
        return None
    return Command([], REPO, env, new_session, module, fds)


def run(
    argv: list[str], cwd: Path = REPO, env: dict[str, str] | None = None, timeout: float = 600, fresh: bool = False,
) -> subprocess.CompletedProcess[str]:
    """subprocess.run of `trainyard ARGV`, capturing its output: a timeout kills it and raises TimeoutExpired."""
    process = start(argv, cwd, env, fresh=fresh)
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise
    assert process.returncode is not None
    return subprocess.CompletedProcess(["trainyard", *argv], process.returncode, out, err)


if __name__ == "__main__":
    request = serve(sys.argv[1])
    if request is not None:
        run_command(request)
