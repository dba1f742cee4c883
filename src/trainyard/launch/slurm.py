"""An sbatch script for a job: one task per node, each runs `trainyard launch`.

Seed 002's two-node script was right in its bones (srun one task per node, torchrun per
node, the head node's NIC address, c10d rendezvous, node rank from SLURM_NODEID) and
wrong in its details (hard-coded paths, no requeue, no per-job log). This writes that
script from the job config, commented so it can be read and edited before submitting.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass, replace
from pathlib import Path

from trainyard.config import JobConfig
from trainyard.errors import ConfigError, OptionError
from trainyard.hardware import kind_of_gres_type
from trainyard.launch.stop_lead import SignalLead, estimated_lead
from trainyard.launch.torchrun import PREEMPTED_EXIT_CODE
from trainyard.network import network_env
from trainyard.redaction import is_secret_name, redact_text
from trainyard.runs import layout as run_layout

SHUTDOWN_MARGIN_S = 10
"""The agent kills workers this long before Slurm would, so its own exit is clean."""
DEFAULT_GPU = "h100-80gb"
"""The device kind the signal lead is estimated for when neither --gpu nor the partition's GRES type names one
(CPU-only nodes: cpu)."""
_SAFE_VALUE = re.compile(r"[A-Za-z0-9_.:,@%+=/\-\[\]]+")
_GRES_GPUS = re.compile(r"\bgpu(?::[^:,(]+)?:(\d+)")
_GRES_GPU_TYPE = re.compile(r"\bgpu:([^:,(]+):\d+")
_TIME = re.compile(r"(?:(\d+)-)?(\d+(?::\d+){0,2})")


@dataclass(frozen=True)
class SlurmJob:
    config: str
    overrides: tuple[str, ...]
    nodes: int
    gpus_per_node: int | None
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
    signal_lead: int | None = None
    """Seconds between SIGUSR1 and the time limit; None: from the estimated step and full-save time."""
    gpu: str | None = None
    """The device kind (`trainyard estimate --gpu`) the signal lead is estimated for; None: the partition's GRES
    type where sinfo names one (`with_node_defaults`), else assumed."""
    node_source: str | None = None
    name: str | None = None
    """The Slurm job's name (default: the run name); a fault-tolerant DiLoCo site's is <run>-site-S."""
    """Where gpus_per_node / cpus_per_task came from when not from the command line (e.g. sinfo)."""


def _check(job: SlurmJob) -> None:
    if job.nodes < 1:
        raise OptionError(f"--nodes {job.nodes} must be at least 1", fix="for example --nodes 2")
    if job.gpus_per_node is not None and job.gpus_per_node < 0:
        raise OptionError(f"--gpus-per-node {job.gpus_per_node} is negative", fix="use 0 for CPU-only nodes")
    if job.nproc_per_node is not None and job.nproc_per_node < 1:
        raise OptionError(
            f"--nproc-per-node {job.nproc_per_node} must be at least 1", fix="for example --nproc-per-node 2"
        )
    if job.cpus_per_task is not None and job.cpus_per_task < 1:
        raise OptionError(f"--cpus-per-task {job.cpus_per_task} must be at least 1", fix="for example 32")
    if job.signal_lead is not None and job.signal_lead <= SHUTDOWN_MARGIN_S:
        raise OptionError(
            f"--signal-lead {job.signal_lead} leaves the workers no time to save",
            fix=f"give more than {SHUTDOWN_MARGIN_S} seconds, or leave it out to use the estimated save time",
        )
    if job.env_file is not None and not Path(job.env_file).is_file():
        raise OptionError(
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
            raise OptionError(
                f"{option} '{value}' has characters Slurm does not take here", fix=f"pass {option} as one plain word"
            )


def sinfo_node_shape(text: str) -> tuple[int, int]:
    """(CPUs, GPUs) of the smallest node in `sinfo --Node --format '%c %G'` output: a job sized for it fits all."""
    nodes = [line.split(maxsplit=1) for line in text.splitlines() if line.strip()]
    cpus = min(int(fields[0].rstrip("+")) for fields in nodes)
    gpus = min(sum(int(n) for n in _GRES_GPUS.findall(fields[1] if len(fields) > 1 else "")) for fields in nodes)
    return cpus, gpus


def sinfo_gpu_kind(text: str) -> str | None:
    """The device kind (`trainyard estimate --gpu`) of the GPUs in `sinfo --Node --format '%c %G'` output, from
    their GRES type (`gpu:h100:8` names h100); None where a node's GPUs have no type, or no type or more than one
    kind matches: then nothing is guessed from it."""
    types = [set(_GRES_GPU_TYPE.findall(line)) for line in text.splitlines() if _GRES_GPUS.search(line)]
    if not types or not all(types):
        return None
    kinds = {kind_of_gres_type(name) for names in types for name in names}
    return kinds.pop() if len(kinds) == 1 and None not in kinds else None


def partition_nodes(partition: str) -> str | None:
    """`sinfo --Node --format '%c %G'` of the partition: each node's CPUs and GRES; None where Slurm is not
    installed here."""
    if shutil.which("sinfo") is None:
        return None
    command = ["sinfo", "--noheader", "--Node", "--partition", partition, "--format", "%c %G"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    if result.returncode != 0 or not result.stdout.strip():
        raise OptionError(
            f"--partition {partition}: sinfo lists no node in it ({result.stderr.strip() or 'empty'})",
            fix="check the name with `sinfo -s`, or pass --gpus-per-node and --cpus-per-task yourself",
        )
    return result.stdout


def with_node_defaults(job: SlurmJob) -> SlurmJob:
    """GPUs and CPUs per node, and the GPUs' kind, from the partition when the command line leaves them out.

    A missing --gpus-per-node used to mean 0: a GPU job then ran CPU-only with one process per node. A missing
    --gpu estimated an A100 node's save as an H100's."""
    wants_shape = job.gpus_per_node is None or job.cpus_per_task is None
    wants_kind = job.gpu is None and job.gpus_per_node != 0
    nodes = None
    if job.partition and wants_shape:
        nodes = partition_nodes(job.partition)
    elif job.partition and wants_kind:
        try:  # the kind alone: a partition sinfo cannot read keeps the default kind, as before
            nodes = partition_nodes(job.partition)
        except (OptionError, OSError, subprocess.SubprocessError):
            nodes = None
    if nodes is None:
        if job.gpus_per_node is None:
            raise OptionError(
                "--gpus-per-node is missing: it says how many processes each node runs and whether on GPUs",
                fix="pass --gpus-per-node N (each node's GPUs), or --gpus-per-node 0 for CPU-only nodes "
                "(with Slurm installed here, --partition NAME reads it from the partition)",
            )
        return job
    cpus, gpus = sinfo_node_shape(nodes) if wants_shape else (0, 0)
    kind = sinfo_gpu_kind(nodes) if wants_kind else None
    read = [f"--gpus-per-node {gpus}"] if job.gpus_per_node is None else []
    read += [f"--cpus-per-task {cpus}"] if job.cpus_per_task is None else []
    said = [f"{' and '.join(read)} read from partition {job.partition}'s smallest node (sinfo)"] if read else []
    said += [f"--gpu {kind} read from partition {job.partition}'s GRES type (sinfo)"] if kind else []
    return replace(
        job,
        gpus_per_node=gpus if job.gpus_per_node is None else job.gpus_per_node,
        cpus_per_task=cpus if job.cpus_per_task is None else job.cpus_per_task,
        gpu=kind or job.gpu,
        node_source="; ".join(said) or None,
    )


def signal_lead(job: SlurmJob, cfg: JobConfig) -> SignalLead:
    """How long before the time limit SIGUSR1 comes: enough to finish a step and commit a full checkpoint
    (launch/stop_lead.py), for the device kind of --gpu, the partition's GRES type, or else assumed;
    --signal-lead overrides it."""
    if job.signal_lead is not None:
        return SignalLead(job.signal_lead, "--signal-lead", SHUTDOWN_MARGIN_S)
    kind = job.gpu or (DEFAULT_GPU if job.gpus_per_node else "cpu")
    assumed = "" if job.gpu or kind == "cpu" else " (assumed: pass --gpu KIND)"
    return estimated_lead(cfg, kind, nproc_per_node(job), job.nodes, SHUTDOWN_MARGIN_S, "--signal-lead", assumed)


def time_limit_s(text: str) -> int | None:
    """Seconds of an sbatch --time (minutes, minutes:seconds, hours:minutes:seconds, days-hours,
    days-hours:minutes, days-hours:minutes:seconds); None for no limit (UNLIMITED, INFINITE)."""
    if text.upper() in ("UNLIMITED", "INFINITE", "-1"):
        return None
    match = _TIME.fullmatch(text)
    if match is None:
        raise OptionError(
            f"--time {text} is not a Slurm time limit",
            fix="write it as MINUTES, HH:MM:SS or DAYS-HH[:MM[:SS]], e.g. --time 24:00:00",
        )
    days, clock = int(match[1] or 0), [int(part) for part in match[2].split(":")]
    if match[1] is not None:  # days-hours[:minutes[:seconds]]
        hours, minutes, seconds = [*clock, 0, 0][:3]
    else:  # minutes, minutes:seconds or hours:minutes:seconds
        hours, minutes, seconds = [0, *clock] if len(clock) == 2 else [0, *clock, 0] if len(clock) == 1 else clock
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


def _check_time(job: SlurmJob, lead: SignalLead) -> None:
    """A limit that the signal's lead and one step do not fit in would signal before the first step ends: the job
    would save, requeue and start again without ever training."""
    limit = time_limit_s(job.time) if job.time is not None else None
    step_s = lead.step_s or 0.0
    needed = lead.seconds + step_s
    if limit is not None and limit < needed:
        shown = f"the signal's lead {lead.seconds} s" + (f" plus one step ({step_s:.3g} s)" if step_s else "")
        raise OptionError(
            f"--time {job.time} ({limit} s) is shorter than {shown}: SIGUSR1 would come before a step is trained",
            fix=f"give --time at least {_hms(needed)} (more, to train for longer than a step), "
            "or a shorter --signal-lead",
        )


def _hms(seconds: float) -> str:
    minutes, secs = divmod(int(seconds) + 1, 60)
    return f"{minutes // 60:02d}:{minutes % 60:02d}:{secs:02d}"


def nproc_per_node(job: SlurmJob) -> int:
    """GPU nodes run one process per GPU; CPU nodes as many as --nproc-per-node says."""
    if job.nproc_per_node is not None:
        return job.nproc_per_node
    return job.gpus_per_node or 1


def default_venv() -> str | None:
    """The virtual environment this command runs from, if any: the usual thing to activate."""
    return sys.prefix if sys.prefix != sys.base_prefix else None


def _cpu_lines(job: SlurmJob) -> list[str]:
    """The CPUs of each node's one task: torchrun and all its workers share them, so never Slurm's default of 1."""
    if job.cpus_per_task is None:
        return [
            "#SBATCH --exclusive                     # whole nodes: every CPU for the launcher and its workers",
            "#                                         (pass --cpus-per-task N to share nodes instead)",
        ]
    return [f"#SBATCH --cpus-per-task={job.cpus_per_task}        # the launcher and its workers share these"]


def _sbatch_lines(job: SlurmJob, cfg: JobConfig, log_dir: Path, lead: SignalLead) -> list[str]:
    lines = [
        f"#SBATCH --job-name={job.name or cfg.run_name}",
        f"#SBATCH --nodes={job.nodes}",
        "#SBATCH --ntasks-per-node=1            # one launcher per node; torchrun starts the workers",
    ]
    if job.gpus_per_node:
        lines.append(f"#SBATCH --gres=gpu:{job.gpus_per_node}")
    if job.node_source:
        lines.append(f"# {job.node_source}")
    lines += _cpu_lines(job)
    optional = (
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
        f"# SIGUSR1 {lead.seconds} s before the time limit: end the step, save, exit {PREEMPTED_EXIT_CODE}, requeue.",
        *textwrap.wrap(f"{lead.seconds} s: {lead.reason}.", 110, initial_indent="# ", subsequent_indent="#   "),
        f"#SBATCH --signal=USR1@{lead.seconds}",
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


def _node_function(job: SlurmJob, lead: SignalLead) -> list[str]:
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
        f"    --shutdown-timeout {lead.save_window_s}",
        "}",
        "export -f run_node",
    ]


def resolve(job: SlurmJob, cfg: JobConfig) -> tuple[SlurmJob, SignalLead]:
    """The options checked, the node's GPUs and CPUs filled in, and the preemption signal's lead."""
    _check(job)
    job = with_node_defaults(job)
    lead = signal_lead(job, cfg)
    _check_time(job, lead)
    return job, lead


def shell_setup(job: SlurmJob) -> list[str]:
    """The batch script's first commands: fail on unset variables, the job's folder, its venv."""
    setup = ["set -uo pipefail", f"cd {shlex.quote(job.workdir)}"]
    if job.venv:
        setup.append(f"source {shlex.quote(job.venv + '/bin/activate')}")
    return setup


def render_sbatch(job: SlurmJob, cfg: JobConfig, lead: SignalLead | None = None, about: tuple[str, ...] = ()) -> str:
    """The whole script, as text. Secrets stay in --env-file, read on the nodes at run time.
    `lead`: from `resolve` (which `job` then came from), else resolved here. `about`: comment lines said first."""
    if lead is None:
        job, lead = resolve(job, cfg)
    nic = job.nic or cfg.dist.nic
    log_dir = Path(job.workdir) / cfg.run_dir / run_layout.LOGS
    nproc = nproc_per_node(job)
    header = [
        "#!/bin/bash",
        f"# trainyard job '{cfg.run_name}': {job.nodes} node(s) x {nproc} process(es), written by `trainyard slurm`.",
        *(f"# {line}" for line in about),
        "# Read it, edit it, then: sbatch THIS_FILE. Slurm runs it on the first node of the allocation;",
        "# srun starts one `trainyard launch` per node, each starts torchrun with its workers, and the",
        "# nodes meet at a c10d rendezvous on the first node. Training resumes from checkpoints/LATEST.",
        f"# The log folder must exist before sbatch: mkdir -p {log_dir}",
        "#",
    ]
    setup = shell_setup(job)
    if job.env_file:
        setup += [
            "# Secrets (W&B, HF tokens) come from this file on the nodes; no value is written here.",
            f"set -a; source {shlex.quote(job.env_file)}; set +a",
        ]
    run = [
        "# srun does not pass the job's CPUs on to its one task per node (Slurm >= 22.05): say it.",
        'srun --ntasks-per-node=1 --cpus-per-task="$SLURM_CPUS_ON_NODE" bash -c run_node',
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
        header + _sbatch_lines(job, cfg, log_dir, lead),
        setup,
        _network_lines(cfg, nic),
        _master_lines(nic, job.master_port_base),
        _node_function(job, lead),
        run,
    ]
    return "\n\n".join("\n".join(block) for block in blocks) + "\n"


def write_sbatch(text: str, path: Path, cfg: JobConfig, workdir: str) -> Path:
    """Write the script and create its log folder (sbatch does not, and then logs nothing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    (Path(workdir) / cfg.run_dir / run_layout.LOGS).mkdir(parents=True, exist_ok=True)
    return path


def submit(path: Path) -> str:
    """`sbatch --parsable PATH`; returns the job id."""
    try:
        result = subprocess.run(
            ["sbatch", "--parsable", str(path)], capture_output=True, text=True, timeout=60, check=False
        )
    except FileNotFoundError:
        raise OptionError(
            "sbatch is not on PATH", fix="run --submit on a Slurm login node, or submit the written script there"
        ) from None
    if result.returncode != 0:
        raise OptionError(
            f"sbatch refused {path}: {result.stderr.strip()}",
            fix="check the #SBATCH lines (partition, account, time) and submit again",
        )
    return result.stdout.strip().split(";")[0]
