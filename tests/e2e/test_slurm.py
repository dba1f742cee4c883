"""A real one-node Slurm cluster runs the script `trainyard slurm` writes, end to end.

The test installs Debian's slurmctld, slurmd and munge if they are missing, configures a
cluster of this machine in a temporary folder, starts the daemons and stops them after.
The job is preempted the way `#SBATCH --signal=USR1@90` would do it, must commit a
checkpoint, exit 75, requeue itself, resume and finish.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import TINY, events, trainyard

pytestmark = pytest.mark.e2e

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]


def _install_slurm() -> None:
    if all(shutil.which(tool) for tool in ("slurmctld", "slurmd", "sbatch", "munged")):
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update"], ["apt-get", "install", "-y", *PACKAGES]):
        result = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
        if result.returncode != 0:
            pytest.skip(f"could not install Slurm ({' '.join(command)}): {result.stderr[-500:]}")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


def _start_munge(root: Path) -> subprocess.Popen:
    """munged as the munge user, with its own key and socket under root."""
    munge = pwd.getpwnam("munge")
    keydir, sockdir = root / "munge-key", root / "munge"
    for folder, mode in ((keydir, 0o700), (sockdir, 0o755)):
        folder.mkdir(mode=mode)
        os.chown(folder, munge.pw_uid, munge.pw_gid)
    key = keydir / "munge.key"
    key.write_bytes(os.urandom(1024))
    os.chown(key, munge.pw_uid, munge.pw_gid)
    key.chmod(0o600)
    socket_path = sockdir / "munge.socket"
    daemon = subprocess.Popen(
        ["munged", "--foreground", f"--socket={socket_path}", f"--key-file={key}",
         f"--pid-file={keydir / 'munged.pid'}", f"--log-file={keydir / 'munged.log'}", f"--seed-file={keydir / 'seed'}"],
        user=munge.pw_uid, group=munge.pw_gid, extra_groups=[], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    _wait(socket_path.exists, 20, "the munge socket")
    return daemon


def _write_conf(root: Path, socket_path: Path) -> Path:
    host = socket.gethostname()
    node_line = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True).stdout.splitlines()[0]
    for folder in ("state", "spool", "log"):
        (root / folder).mkdir()
    conf = root / "slurm.conf"
    conf.write_text(
        "\n".join([
            "ClusterName=trainyard",
            f"SlurmctldHost={host}",
            "SlurmUser=root",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={socket_path}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "MpiDefault=none",
            "ReturnToService=2",
            f"StateSaveLocation={root / 'state'}",
            f"SlurmdSpoolDir={root / 'spool'}",
            f"SlurmctldPidFile={root / 'slurmctld.pid'}",
            f"SlurmdPidFile={root / 'slurmd.pid'}",
            f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={root / 'log' / 'slurmd.log'}",
            "JobCompType=jobcomp/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            f"{node_line} State=UNKNOWN",
            f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP",
        ]) + "\n"
    )
    return conf


@pytest.fixture(scope="module")
def slurm() -> Iterator[dict[str, str]]:
    """Environment for Slurm clients (SLURM_CONF) while a one-node cluster runs."""
    if os.geteuid() != 0:
        pytest.skip("a Slurm cluster needs root (daemons, munge user)")
    _install_slurm()
    root = Path(tempfile.mkdtemp(prefix="trainyard-slurm-"))
    root.chmod(0o755)  # munged, as the munge user, must reach its socket folder
    daemons: list[subprocess.Popen] = []
    try:
        daemons.append(_start_munge(root))
        conf = _write_conf(root, root / "munge" / "munge.socket")
        env = {**os.environ, "SLURM_CONF": str(conf)}
        for daemon in (["slurmctld", "-D", "-c", "-f", str(conf)], ["slurmd", "-D", "-f", str(conf)]):
            daemons.append(subprocess.Popen(daemon, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

        def node_idle() -> bool:
            state = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, env=env, check=False).stdout.strip()
            return state == "idle"

        _wait(node_idle, 60, "the Slurm node to become idle")
        yield {"SLURM_CONF": str(conf)}
        subprocess.run(["scancel", "--user", "root"], capture_output=True, check=False, env=env)
        _wait(lambda: not subprocess.run(["squeue", "-h"], capture_output=True, text=True, check=False, env=env).stdout.strip(), 60, "the queue to drain")
    finally:
        for daemon in reversed(daemons):
            daemon.terminate()
        for daemon in daemons:
            try:
                daemon.wait(timeout=15)
            except subprocess.TimeoutExpired:
                daemon.kill()
        shutil.rmtree(root, ignore_errors=True)


def job_field(job_id: str, field: str, env: dict[str, str]) -> str:
    line = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, env={**os.environ, **env}, check=False).stdout
    match = re.search(rf"\b{field}=(\S+)", line)
    return match.group(1) if match else ""


def test_generated_script_trains_is_preempted_requeues_and_finishes(slurm: dict[str, str], tmp_path: Path) -> None:
    script = tmp_path / "job.sbatch"
    job = [TINY, "train.max_steps=40", "log.every_steps=1", "eval.every_steps=0", "eval.at_end=false"]
    submitted = trainyard("slurm", *job, "--nodes", "1", "--gpus-per-node", "0", "--nproc-per-node", "2", "--out", str(script), "--submit", cwd=tmp_path, env=slurm)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    assert job_id.isdigit(), submitted.stdout
    run_dir, log = tmp_path / "runs" / "tiny", tmp_path / "runs" / "tiny" / "logs" / f"slurm-{job_id}.out"

    def training() -> bool:
        state = job_field(job_id, "JobState", slurm)
        assert state in ("PENDING", "RUNNING"), f"job {state}:\n{log.read_text() if log.exists() else ''}"
        return (run_dir / "metrics.jsonl").is_file() and len(events(run_dir, "train")) >= 3

    _wait(training, 120, "three training steps")
    subprocess.run(["scancel", "--signal=USR1", job_id], check=True, env={**os.environ, **slurm})  # what --signal=USR1@90 does
    _wait(lambda: job_field(job_id, "Restarts", slurm) == "1", 90, "the job to requeue itself")

    def resumed() -> bool:
        if job_field(job_id, "JobState", slurm) == "PENDING":  # a requeued job waits ~2 minutes to begin; release it
            subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], capture_output=True, check=False, env={**os.environ, **slurm})
        return "resumed from" in log.read_text()

    _wait(resumed, 180, "the requeued job to resume")
    _wait(lambda: job_field(job_id, "JobState", slurm) in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 120, "the requeued job to end")

    text = log.read_text()
    rank_logs = "".join(f"\n--- {path.name}\n{path.read_text()[-1500:]}" for path in sorted((run_dir / "logs").glob("rank-*.log")))
    assert job_field(job_id, "JobState", slurm) == "COMPLETED", text[-4000:] + rank_logs
    assert f"requeueing job {job_id}" in text and "checkpoint step-" in text
    assert "resumed from" in text, text[-4000:]
    summary = (run_dir / "summary.json").read_text()
    assert '"steps": 40' in summary and '"world_size": 2' in summary
