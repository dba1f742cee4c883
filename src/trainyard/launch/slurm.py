"""An sbatch script for a job: one task per node, each runs `trainyard launch`.

Seed 002's two-node script was right in its bones (srun one task per node, torchrun per
node, the head node's NIC address, c10d rendezvous, node rank from SLURM_NODEID) and
wrong in its details (hard-coded paths, no requeue, no per-job log). This writes that
script from the job config, commented so it can be read and edited before submitting.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from trainyard.config import JobConfig
from trainyard.dist import network_env
from trainyard.errors import ConfigError
from trainyard.launch.torchrun import PREEMPTED_EXIT_CODE
from trainyard.redaction import is_secret_name, redact_text

SIGNAL_LEAD_S = 90
"""Slurm sends SIGUSR1 this long before the time limit; workers save and exit 75."""
SHUTDOWN_MARGIN_S = 10
"""The agent kills workers this long before Slurm would, so its own exit is clean."""
_SAFE_VALUE = re.compile(r"[A-Za-z0-9_.:,@%+=/\-\[\]]+")


@dataclass(frozen=True)
class SlurmJob:
    config: str
    overrides: tuple[str, ...]
    nodes: int
    gpus_per_node: int
    nproc_per_node: int | None = None
    partition: str | None = None
    time: str | None = None
    account: str | None = None
    cpus_per_task: int | None = None
    mem: str | None = None
    nic: str | None = None
    env_file: str | None = None
    venv: str | None = None
    workdir: str = "."
    master_port_base: int = 29500


def _check(job: SlurmJob) -> None:
    if job.nodes < 1:
        raise ConfigError(f"--nodes {job.nodes} must be at least 1", fix="for example --nodes 2")
    if job.gpus_per_node < 0:
        raise ConfigError(f"--gpus-per-node {job.gpus_per_node} is negative", fix="use 0 for CPU-only nodes")
    if job.nproc_per_node is not None and job.nproc_per_node < 1:
        raise ConfigError(
            f"--nproc-per-node {job.nproc_per_node} must be at least 1", fix="for example --nproc-per-node 2"
        )
    if job.env_file is not None and not Path(job.env_file).is_file():
        raise ConfigError(
            f"--env-file {job.env_file} does not exist",
            fix="write VAR=value lines (e.g. WANDB_API_KEY=...) to a file every node can read",
        )
    for item in job.overrides:
        key, _, value = item.partition("=")
        if is_secret_name(key.split(".")[-1]) or redact_text(value) != value:
            raise ConfigError(
                f"override '{key}=...' carries a secret, and the script would keep it in plain text",
                fix="put the value in a file of VAR=value lines and pass it with --env-file",
            )
    for option, value in (
        ("--partition", job.partition),
        ("--time", job.time),
        ("--account", job.account),
        ("--mem", job.mem),
        ("--nic", job.nic),
    ):
        if value is not None and not _SAFE_VALUE.fullmatch(value):
            raise ConfigError(
                f"{option} '{value}' has characters Slurm does not take here", fix=f"pass {option} as one plain word"
            )


def nproc_per_node(job: SlurmJob) -> int:
    """GPU nodes run one process per GPU; CPU nodes as many as --nproc-per-node says."""
    if job.nproc_per_node is not None:
        return job.nproc_per_node
    return job.gpus_per_node or 1


def default_venv() -> str | None:
    """The virtual environment this command runs from, if any: the usual thing to activate."""
    return sys.prefix if sys.prefix != sys.base_prefix else None


def _sbatch_lines(job: SlurmJob, cfg: JobConfig, log_dir: Path) -> list[str]:
    lines = [
        f"#SBATCH --job-name={cfg.run_name}",
        f"#SBATCH --nodes={job.nodes}",
        "#SBATCH --ntasks-per-node=1            # one launcher per node; torchrun starts the workers",
    ]
    if job.gpus_per_node:
        lines.append(f"#SBATCH --gres=gpu:{job.gpus_per_node}")
    optional = (
        ("cpus-per-task", job.cpus_per_task),
        ("mem", job.mem),
        ("time", job.time),
        ("partition", job.partition),
        ("account", job.account),
    )
    lines += [f"#SBATCH --{name}={value}" for name, value in optional if value is not None]
    lines += [
        f"#SBATCH --chdir={job.workdir}",
        f"#SBATCH --output={log_dir}/slurm-%j.out   # one log per job; a requeued run appends",
        "#SBATCH --open-mode=append",
        f"#SBATCH --signal=USR1@{SIGNAL_LEAD_S}              "
        f"# before the time limit: save, exit {PREEMPTED_EXIT_CODE}, requeue",
        "#SBATCH --requeue",
    ]
    return lines


def _network_lines(cfg: JobConfig, nic: str | None) -> list[str]:
    wanted = network_env(cfg.dist.network, nic)
    if not wanted:
        return [f"# Network preset '{cfg.dist.network}' sets no variables (dist.network, dist.nic in the config)."]
    lines = [
        f"# Network preset '{cfg.dist.network}'{f', NIC {nic}' if nic else ''}. A value exported before sbatch wins."
    ]
    return lines + [f'export {name}="${{{name}:-{value}}}"' for name, value in wanted.items()]


def _master_lines(nic: str | None, port_base: int) -> list[str]:
    if nic:
        lookup = f"ip -4 -o addr show dev {nic} | awk '{{print $4}}' | cut -d/ -f1 | head -n 1"
        lines = [
            "# This script runs on the first node; the rendezvous listens on its NIC's address.",
            f"MASTER_ADDR=$({lookup})",
            f'[ -n "$MASTER_ADDR" ] || {{ echo "trainyard: no IPv4 address on {nic} on $(hostname)" >&2; exit 2; }}',
        ]
    else:
        lines = [
            "# The rendezvous listens on the first node, by name (pass --nic to use a NIC's address).",
            'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        ]
    return lines + [
        f"MASTER_PORT=$(({port_base} + SLURM_JOB_ID % 1000))   # per job, so two jobs on one node do not collide",
        "export MASTER_ADDR MASTER_PORT",
    ]


def _node_function(job: SlurmJob) -> list[str]:
    job_args = shlex.join([job.config, *job.overrides])
    activate = [f"  source {shlex.quote(job.venv + '/bin/activate')}   # on every node"] if job.venv else []
    return [
        "# What every node runs; srun starts it once per node. SLURM_NODEID differs per node",
        "# (0 is this first node, which hosts the rendezvous); trainyard reads it from the environment.",
        "run_node() {",
        *activate,
        f"  exec trainyard launch {job_args} \\",
        f'    --nnodes "$SLURM_JOB_NUM_NODES" --node-rank "$SLURM_NODEID" --nproc {nproc_per_node(job)} \\',
        '    --rdzv c10d --rdzv-id "$SLURM_JOB_ID" --master "$MASTER_ADDR:$MASTER_PORT" \\',
        f"    --shutdown-timeout {SIGNAL_LEAD_S - SHUTDOWN_MARGIN_S}",
        "}",
        "export -f run_node",
    ]


def render_sbatch(job: SlurmJob, cfg: JobConfig) -> str:
    """The whole script, as text. Secrets stay in --env-file, read on the nodes at run time."""
    _check(job)
    nic = job.nic or cfg.dist.nic
    log_dir = Path(job.workdir) / cfg.run_dir / "logs"
    nproc = nproc_per_node(job)
    header = [
        "#!/bin/bash",
        f"# trainyard job '{cfg.run_name}': {job.nodes} node(s) x {nproc} process(es), written by `trainyard slurm`.",
        "# Read it, edit it, then: sbatch THIS_FILE. Slurm runs it on the first node of the allocation;",
        "# srun starts one `trainyard launch` per node, each starts torchrun with its workers, and the",
        "# nodes meet at a c10d rendezvous on the first node. Training resumes from checkpoints/LATEST.",
        f"# The log folder must exist before sbatch: mkdir -p {log_dir}",
        "#",
    ]
    setup = ["set -uo pipefail", f"cd {shlex.quote(job.workdir)}"]
    if job.venv:
        setup.append(f"source {shlex.quote(job.venv + '/bin/activate')}")
    if job.env_file:
        setup += [
            "# Secrets (W&B, HF tokens) come from this file on the nodes; no value is written here.",
            f"set -a; source {shlex.quote(job.env_file)}; set +a",
        ]
    run = [
        "srun --ntasks-per-node=1 bash -c run_node",
        "status=$?",
        "",
        f"# {PREEMPTED_EXIT_CODE}: stopped by the USR1 above (or a preemption) after a checkpoint was committed;",
        "# trainyard printed a one-line notice, not an error. Requeue: the job keeps its id and log (appended",
        "# to) and resumes from that checkpoint after Slurm's requeue delay (AuthInfo cred_expire + 1 s, ~2 min).",
        f'if [ "$status" -eq {PREEMPTED_EXIT_CODE} ]; then',
        '  echo "requeueing job $SLURM_JOB_ID; it resumes from that checkpoint"',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        'exit "$status"',
    ]
    blocks = [
        header + _sbatch_lines(job, cfg, log_dir),
        setup,
        _network_lines(cfg, nic),
        _master_lines(nic, job.master_port_base),
        _node_function(job),
        run,
    ]
    return "\n\n".join("\n".join(block) for block in blocks) + "\n"


def write_sbatch(text: str, path: Path, cfg: JobConfig, workdir: str) -> Path:
    """Write the script and create its log folder (sbatch does not, and then logs nothing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    (Path(workdir) / cfg.run_dir / "logs").mkdir(parents=True, exist_ok=True)
    return path


def submit(path: Path) -> str:
    """`sbatch --parsable PATH`; returns the job id."""
    try:
        result = subprocess.run(
            ["sbatch", "--parsable", str(path)], capture_output=True, text=True, timeout=60, check=False
        )
    except FileNotFoundError:
        raise ConfigError(
            "sbatch is not on PATH", fix="run --submit on a Slurm login node, or submit the written script there"
        ) from None
    if result.returncode != 0:
        raise ConfigError(
            f"sbatch refused {path}: {result.stderr.strip()}",
            fix="check the #SBATCH lines (partition, account, time) and submit again",
        )
    return result.stdout.strip().split(";")[0]
