"""Each process imports what its command uses: reading a run dir never imports torch, and a training worker never
imports what only other jobs or other commands need. Read from `sys.modules` in a fresh interpreter after the
command ran, not from a timing."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import REPO
from tests.unit.runs.test_status import beat, make_run

PROBE = """
import contextlib, io, json, sys
from trainyard.cli import main
loaded = {}
for argv in json.loads(sys.argv[1]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            main(argv)
        except SystemExit as stop:
            code = stop.code
    loaded[argv[0]] = {"code": code, "modules": sorted(sys.modules)}
print(json.dumps(loaded))
"""
NEVER_TO_READ_A_RUN = ("torch", "torch.distributed", "transformers", "peft", "datasets", "trainyard.dist",
                       "trainyard.model")


def imported_by(*commands: list[str]) -> dict[str, dict]:
    """The modules loaded after each command, run one after another in one fresh interpreter (so a command sees
    what the ones before it loaded: list the lightest first)."""
    result = subprocess.run([sys.executable, "-c", PROBE, json.dumps(list(commands))], capture_output=True, text=True,
                            cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def test_reading_a_run_dir_never_imports_torch(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    now = time.time()
    make_run(run_dir, [10, 20, 30, 40], start=now - 100)
    beat(run_dir, 0, 40, now)
    (run_dir / "flight").mkdir()
    loaded = imported_by(["status", str(run_dir)], ["diagnose", str(run_dir)],
                         ["report", str(run_dir), "--out", str(tmp_path / "report.png")])
    for command, seen in loaded.items():
        assert seen["code"] in (0, None), command
        assert not set(NEVER_TO_READ_A_RUN) & set(seen["modules"]), command
    assert "matplotlib" not in loaded["diagnose"]["modules"]  # only the report draws


def test_a_user_error_in_status_imports_no_torch(tmp_path: Path) -> None:
    """The error path (exit 2, the message) reached no launcher code that imports torch's elastic agent."""
    seen = imported_by(["status", str(tmp_path / "no-such-run")])["status"]
    assert seen["code"] == 2
    assert not set(NEVER_TO_READ_A_RUN) & set(seen["modules"])


def test_a_training_worker_imports_no_other_commands_or_jobs_code() -> None:
    """The recipe a worker runs: no fault-tolerant DiLoCo (torchft), no plotting, no sinks it was not asked for,
    no trace or estimate of another job's memory. (torch._dynamo is not in the list: transformers' masking_utils
    imports it for every model.)"""
    probe = "import sys, trainyard.train.recipe; print('\\n'.join(sys.modules))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    modules = set(result.stdout.split())
    unwanted = {"torchft", "matplotlib", "wandb", "tensorboard", "trainyard.train.trace", "trainyard.runs.report",
                "trainyard.launch.k8s", "trainyard.launch.slurm", "trainyard.doctor.probe"}
    assert not unwanted & modules, unwanted & modules
