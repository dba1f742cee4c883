"""tests/warm.py: a command forked from the warm server says what a fresh interpreter running it says."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from tests import warm
from tests.conftest import TINY
from tests.world import World


def test_a_warm_command_exits_and_writes_as_a_fresh_interpreter_does(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    argv = ["status", "run"]  # relative: read from the command's own working directory
    env = {**os.environ, "COLUMNS": "1000"}
    warmed = warm.run(argv, cwd=tmp_path, env=env, timeout=300)
    fresh = warm.run(argv, cwd=tmp_path, env=env, timeout=300, fresh=True)
    assert warm.server().serves(env)
    assert (warmed.returncode, warmed.stdout, warmed.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert warmed.returncode == 2 and "run is not a run dir" in warmed.stderr, warmed.stderr


def test_a_command_in_its_own_session_leads_it_and_a_kill_reads_as_popen_says_it(tmp_path: Path) -> None:
    process = warm.start(["train", TINY, f"output_dir={tmp_path}", "train.max_steps=100000"], new_session=True)
    assert isinstance(process, warm.Command)
    assert os.getsid(process.pid) == process.pid and os.getpgid(process.pid) == process.pid
    os.killpg(process.pid, signal.SIGKILL)
    process.communicate(timeout=300)
    assert process.returncode == -signal.SIGKILL


def test_a_changed_variable_that_libraries_read_when_they_load_gets_a_fresh_interpreter() -> None:
    env = {**os.environ, "HF_HOME": "/nonexistent"}  # huggingface_hub reads it when it loads
    assert not warm.server().serves(env)
    process = warm.start(["--help"], env=env)
    assert isinstance(process, subprocess.Popen)
    process.communicate(timeout=300)
    assert process.returncode == 0


def test_a_forked_rank_runs_the_threads_its_environment_asks_for(tmp_path: Path) -> None:
    """OMP_NUM_THREADS is read once, when torch loads in the server: the forked process applies it itself."""
    world = World(1, tmp_path)  # its rank's environment sets OMP_NUM_THREADS=1
    try:
        assert world.run("torch:get_num_threads") == [1]
        assert isinstance(world.ranks[0], warm.Command)
    finally:
        world.close()
