"""The fork server: forked from a launcher fresh from its command line, a new interpreter for any other caller."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

PROBE = """
import json, multiprocessing, os, sys
{before}
from trainyard.launch import forked

def report(queue):
    queue.put({{"torch": "torch" in sys.modules, "preloaded": "tomllib" in sys.modules, "server": os.getppid()}})

if __name__ == "__main__":
    here = forked.forks_from_here()
    forked.start_fork_server(["tomllib"], ("SIGUSR1",))
    context = multiprocessing.get_context("forkserver")
    queue = context.Queue()
    worker = context.Process(target=report, args=(queue,))
    worker.start()
    seen = queue.get(timeout=120)
    worker.join()
    with open(f"/proc/{{seen['server']}}/cmdline", "rb") as cmdline:
        seen["server_cmdline"] = cmdline.read().decode(errors="replace")
    with open(f"/proc/{{seen['server']}}/stat") as stat:
        seen["server_parent"] = int(stat.read().rsplit(")", 1)[1].split()[1])
    forked.stop_fork_server()
    seen.update(here=here, launcher=os.getpid(), alive=os.path.exists(f"/proc/{{seen['server']}}"))
    print(json.dumps(seen))
"""


def probe(folder: Path, before: str) -> dict:
    """A script (a new interpreter's workers find `report` in it by its path) that starts a server and a worker."""
    script = folder / "launcher.py"
    script.write_text(PROBE.format(before=before))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=REPO, timeout=300,
                            env={**os.environ, "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{REPO}"})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_a_fresh_launcher_forks_the_server_itself_after_importing_torch_once_for_both(tmp_path: Path) -> None:
    seen = probe(tmp_path, before="")
    assert seen["here"] is True
    assert seen["server_parent"] == seen["launcher"]
    assert "multiprocessing.forkserver" not in seen["server_cmdline"]  # a fork of this process, not a new one
    assert seen["torch"] and seen["preloaded"]  # torch from the launcher, the preloaded module from the server
    assert not seen["alive"]


def test_a_process_that_imported_torch_or_changed_the_workers_malloc_starts_a_new_interpreter(tmp_path: Path) -> None:
    for before in ("import torch", "os.environ['LD_PRELOAD'] = 'libc.so.6'"):
        seen = probe(tmp_path, before=before)
        assert seen["here"] is False, before
        assert "multiprocessing.forkserver" in seen["server_cmdline"], before
        assert seen["preloaded"] and not seen["alive"], before



def test_the_cli_s_own_process_may_fork_the_server_though_torch_is_imported() -> None:
    """As tests/warm.py starts commands: the stack imported, then `trainyard.cli` run as the main module."""
    probe = ("import importlib.util, os, sys, torch\n"
             "from trainyard.launch import forked\n"
             "print(forked.forks_from_here(), flush=True)\n"
             "if os.fork() == 0:  # one thread, as a process forked from tests/warm.py's server\n"
             "    sys.modules['__main__'].__spec__ = importlib.util.find_spec('trainyard.cli.__main__')\n"
             "    print(forked.forks_from_here(), flush=True)\n"
             "    os._exit(0)\n"
             "os.wait()\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert result.stdout.split() == ["False", "True"], result.stderr[-3000:]
