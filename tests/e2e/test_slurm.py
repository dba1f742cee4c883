"""A real one-node Slurm cluster runs the script `trainyard slurm` writes, end to end.

The test installs Debian's slurmctld, slurmd and munge if they are missing, configures a
cluster of this machine in a temporary folder, starts the daemons and stops them after.
The job is preempted the way `#SBATCH --signal=USR1@90` would do it, must commit a
checkpoint, exit 75 with a notice (no error, no traceback), requeue itself, and be started
again by Slurm alone, resume from that checkpoint and finish.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import TINY, events, run_cli, trainyard
from tests.dist.checkpoint_helpers import last_step
from tests.world import free_port

pytestmark = pytest.mark.e2e

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
CRED_EXPIRE_S = 10
"""Slurm holds a requeued job for cred_expire + 1 s, so that its new launch credential is dated
a later second than the revocation of the old one (the default, 120 s, is too long for a test).
Releasing the job sooner by hand (`scontrol update StartTime=now`) can relaunch it within that
second: slurmd then refuses it ("Job N already killed, do not launch batch job") and the job
ends FAILED instead of resuming."""
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL")
NOTICE = re.compile(
    r"trainyard: preempted by SIGUSR1 after step (\d+); checkpoint step-(\d{8}) committed"
    r" — run the same command again to resume"
)


def _install_slurm() -> None:
    if all(shutil.which(tool) for tool in ("slurmctld", "slurmd", "sbatch", "munged")):
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update"], ["apt-get", "install", "-y", *PACKAGES]):
        result = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
        if result.returncode != 0:
            pytest.skip(f"could not install Slurm ({' '.join(command)}): {result.stderr[-500:]}")




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
        [
            "munged",
            "--foreground",
            f"--socket={socket_path}",
            f"--key-file={key}",
            f"--pid-file={keydir / 'munged.pid'}",
            f"--log-file={keydir / 'munged.log'}",
            f"--seed-file={keydir / 'seed'}",
        ],
        user=munge.pw_uid,
        group=munge.pw_gid,
        extra_groups=[],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
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
        "\n".join(
            [
                "ClusterName=trainyard",
                "GresTypes=gpu",
                f"SlurmctldHost={host}",
                "SlurmUser=root",
                f"SlurmctldPort={free_port()}",
                f"SlurmdPort={free_port()}",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                f"AuthInfo=socket={socket_path},cred_expire={CRED_EXPIRE_S}",
                "SchedulerParameters=sched_interval=1",  # a requeued job starts as soon as its hold ends
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
                # Never up (no slurmd answers there): only for sinfo, which lists a node's configured GRES.
                "NodeName=gpu-absent NodeAddr=127.0.0.2 CPUs=64 Gres=gpu:h100:8 State=UNKNOWN",
                "PartitionName=h100 Nodes=gpu-absent State=UP",
            ]
        )
        + "\n"
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
            state = subprocess.run(
                ["sinfo", "-h", "-p", "debug", "-o", "%T"], capture_output=True, text=True, env=env, check=False
            ).stdout.strip()
            return state == "idle"

        _wait(node_idle, 60, "the Slurm node to become idle")
        yield {"SLURM_CONF": str(conf)}
        subprocess.run(["scancel", "--user", "root"], capture_output=True, check=False, env=env)
        _wait(
            lambda: (
                not subprocess.run(
                    ["squeue", "-h"], capture_output=True, text=True, check=False, env=env
                ).stdout.strip()
            ),
            60,
            "the queue to drain",
        )
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
    line = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        check=False,
    ).stdout
    match = re.search(rf"\b{field}=(\S+)", line)
    return match.group(1) if match else ""


def _story(log: Path, run_dir: Path, slurm: dict[str, str]) -> str:
    """The job's log, each rank's log and the daemons' logs: what a failure message needs."""
    parts = [("job log", log), *((path.name, path) for path in sorted((run_dir / "logs").glob("rank-*.log")))]
    parts += [(name, Path(slurm["SLURM_CONF"]).parent / "log" / name) for name in ("slurmctld.log", "slurmd.log")]
    return "".join(f"\n--- {name}\n{_tail_and_traceback(path.read_text())}" for name, path in parts if path.is_file())


def _tail_and_traceback(text: str) -> str:
    """A log's end, and its first traceback wherever it is: the tail alone hides an early one."""
    start = text.find("Traceback")
    first = f"{text[max(0, start - 1500):start + 4000]}\n[...]\n" if 0 <= start < len(text) - 2500 else ""
    return first + text[-2500:]


def test_generated_script_trains_is_preempted_requeues_and_finishes(slurm: dict[str, str], tmp_path: Path) -> None:
    script = tmp_path / "job.sbatch"
    # Enough steps that the signal always lands mid-run, however fast the machine.
    job = [TINY, "train.max_steps=200", "log.every_steps=1", "eval.every_steps=0", "eval.at_end=false"]
    submitted = trainyard(
        "slurm",
        *job,
        "--nodes",
        "1",
        "--gpus-per-node",
        "0",
        "--nproc-per-node",
        "2",
        "--out",
        str(script),
        "--submit",
        cwd=tmp_path,
        env=slurm,
    )
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    assert job_id.isdigit(), submitted.stdout
    run_dir, log = tmp_path / "runs" / "tiny", tmp_path / "runs" / "tiny" / "logs" / f"slurm-{job_id}.out"

    def state(allowed: tuple[str, ...]) -> str:
        """The job's state, failing at once (with every log) when it left the path under test."""
        current = job_field(job_id, "JobState", slurm)
        reason = job_field(job_id, "Reason", slurm)
        assert current in allowed, f"job {job_id} is {current} ({reason}){_story(log, run_dir, slurm)}"
        return current

    def training() -> bool:
        state(("PENDING", "RUNNING"))
        return last_step(run_dir) >= 3

    _wait(training, 300, "three training steps")
    subprocess.run(
        ["scancel", "--signal=USR1", job_id], check=True, env={**os.environ, **slurm}
    )  # what --signal=USR1@90 does

    def requeued() -> bool:
        state(("RUNNING", "COMPLETING", "REQUEUED", "PENDING"))
        return job_field(job_id, "Restarts", slurm) == "1"

    _wait(requeued, 300, "the job to requeue itself")

    def resumed() -> bool:
        # No release by hand: Slurm holds the job for its requeue delay, then starts it again.
        state(("COMPLETING", "REQUEUED", "PENDING", "RUNNING", "COMPLETED"))
        return "resumed from" in log.read_text()

    _wait(resumed, 300, "the requeued job to resume")
    _wait(lambda: state((*TERMINAL, "RUNNING", "COMPLETING")) in TERMINAL, 300, "the requeued job to end")
    assert state(("COMPLETED",)) == "COMPLETED"

    text = log.read_text()
    assert "Traceback" not in text and "trainyard: error" not in text, _story(log, run_dir, slurm)
    notices = [line for line in text.splitlines() if line.startswith("trainyard:")]
    notice = NOTICE.fullmatch(notices[0]) if len(notices) == 1 else None
    assert notice, f"want one notice line, got {notices}{_story(log, run_dir, slurm)}"
    step = int(notice.group(1))
    assert int(notice.group(2)) == step
    # One log, appended to: the first run's notice, the requeue, then the second run resuming at that step.
    resume_line = f"resumed from runs/tiny/checkpoints/step-{step:08d} at step {step}"
    assert text.index(notice.group(0)) < text.index(f"requeueing job {job_id}") < text.index(resume_line), text[-4000:]
    assert [e["step"] for e in events(run_dir, "train") if e["step"] > step] == list(range(step + 1, 201))
    summary = (run_dir / "summary.json").read_text()
    assert '"steps": 200' in summary and '"world_size": 2' in summary


def test_the_gpu_kind_comes_from_the_partitions_gres_type(slurm: dict[str, str], tmp_path: Path) -> None:
    """sinfo names the partition's GPUs (gpu:h100:8): the signal lead is estimated for h100 nodes without --gpu. A
    partition whose GRES has no type (this node has no GPUs at all) keeps the default kind, said to be assumed."""
    typed = run_cli("slurm", TINY, "--partition", "h100", "--nodes", "1", cwd=tmp_path, env=slurm)
    said = " ".join(typed.stderr.split())
    assert typed.returncode == 0, said
    assert "--gpus-per-node 8 and --cpus-per-task 64 read from partition h100's smallest node (sinfo)" in said
    assert "--gpu h100-80gb read from partition h100's GRES type (sinfo)" in said
    assert "estimated by trainyard for 1 x 8 h100-80gb:" in said
    untyped = run_cli("slurm", TINY, "--partition", "debug", "--nodes", "1", "--gpus-per-node", "2", "--cpus-per-task",
                      "2", cwd=tmp_path, env=slurm)
    said = " ".join(untyped.stderr.split())
    assert untyped.returncode == 0, said
    assert "GRES type" not in said and "estimated by trainyard for 1 x 2 h100-80gb (assumed: pass --gpu KIND)" in said


def _lighthouses(port: int) -> list[int]:
    """The pids of the torchft lighthouse this test's job runs, found by its own port."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0") if proc.name.isdigit() else []
        except OSError:
            continue
        if any(arg.endswith(b"torchft_lighthouse") for arg in argv[:2]) and f"[::]:{port}".encode() in argv:
            pids.append(int(proc.name))
    return pids


def test_the_lighthouse_job_restarts_a_lighthouse_that_died_and_requeues_itself(
    slurm: dict[str, str], tmp_path: Path
) -> None:
    """The script `trainyard slurm` writes for a fault-tolerant job's lighthouse: killed, it is restarted within the
    same job; the time limit's USR1 (to the batch shell, as --signal=B:USR1 sends it) requeues the job."""
    port = free_port()
    job = [TINY, "dist.strategy=diloco", "diloco.fault_tolerant=true", "diloco.sites=2",
           f"diloco.lighthouse={socket.gethostname()}:{port}"]
    written = run_cli("slurm", *job, "--nodes", "1", "--gpus-per-node", "0", "--out", str(tmp_path / "job.sbatch"),
                      cwd=tmp_path, env=slurm)
    assert written.returncode == 0, written.stderr
    env = {**os.environ, **slurm}
    submitted = subprocess.run(["sbatch", "--parsable", str(tmp_path / "job-lighthouse.sbatch")], capture_output=True,
                               text=True, env=env, check=False)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    log = tmp_path / "runs" / "tiny" / "logs" / f"lighthouse-{job_id}.out"
    try:
        _wait(lambda: len(_lighthouses(port)) == 1, 40, "the lighthouse to start")
        first = _lighthouses(port)[0]
        os.kill(first, signal.SIGKILL)
        _wait(lambda: _lighthouses(port) not in ([], [first]), 120, "the lighthouse to be restarted")
        assert "; restarting it in" in log.read_text()  # said by the loop that restarted it
        subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], check=True, env=env)
        _wait(lambda: job_field(job_id, "Restarts", slurm) == "1", 60, "the job to requeue itself")
        assert "requeueing the lighthouse" in log.read_text()
    except BaseException:
        state = f"job {job_id} is {job_field(job_id, 'JobState', slurm)} ({job_field(job_id, 'Reason', slurm)})"
        print(state + _story(log, tmp_path / "runs" / "tiny", slurm))  # shown with the failure
        raise
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, check=False, env=env)
