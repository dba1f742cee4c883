"""One node's share of a multi-node job: resolve where it stands, build torchrun, run it.

Seed 001 kept a launch script per node that differed in one number (the node rank) and
broke whenever someone edited only one of them. Here every node runs the same command;
what differs comes from flags or from the variables schedulers already set (PET_* from
the Kubeflow operators and torchrun itself, SLURM_* from Slurm). The command that runs
is printed first, so a hang can be reproduced by pasting it.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from trainyard.batch import accumulation_steps, data_ranks
from trainyard.config import DistConfig, JobConfig
from trainyard.errors import ConfigError
from trainyard.launch.local import EXIT_FILE_ENV, SIGNALS_TO_FORWARD
from trainyard.network import interface_ipv4, network_env

PREEMPTED_EXIT_CODE = 75
USER_ERROR_EXIT_CODE = ConfigError.exit_code
AGENT_MODULE = "trainyard.launch.agent"
"""Runs torchrun's agent (`agent.main`); takes exactly torchrun's flags."""
DEFAULT_MASTER_PORT = 29500
SHARED_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
NPROC_WORDS = ("auto", "cpu", "gpu")


@dataclass(frozen=True)
class LaunchPlan:
    """Where this node stands in the job: everything torchrun needs besides the command."""

    nnodes: str
    nproc: str
    node_rank: int | None
    master_addr: str | None
    master_port: int
    rdzv: str
    rdzv_id: str | None
    rdzv_conf: tuple[str, ...] = ()
    max_restarts: int = 0
    shutdown_timeout_s: int | None = None
    local_addr: str | None = None
    """How this node is advertised at a c10d rendezvous (else its host name, which nodes
    in containers or network namespaces may share, or which may resolve to the wrong NIC)."""
    sources: dict[str, str] = field(default_factory=dict)
    """Which flag or variable each value came from, for the printed summary."""


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: 'gpu[07-09,12],cpu1' -> 'gpu07'."""
    match = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?([^,]*)", nodelist.strip())
    if not match or not (match.group(1) or match.group(2)):
        raise ConfigError(f"cannot read the Slurm node list '{nodelist}'", fix="pass --master HOST:PORT")
    prefix, ranges, suffix = match.groups()
    first = ranges.split(",")[0].split("-")[0] if ranges else ""
    return f"{prefix}{first}{suffix or ''}"


def split_host_port(value: str, option: str = "--master") -> tuple[str, int | None]:
    """'host:29500', '[fe80::1]:29500' or a bare host."""
    match = re.fullmatch(r"\[([^\]]+)\](?::(\d+))?|([^:\[\]]+)(?::(\d+))?", value.strip())
    if not match:
        raise ConfigError(f"{option} '{value}' is not HOST or HOST:PORT", fix=f"for example {option} 10.0.0.1:29500")
    host = match.group(1) or match.group(3)
    port = match.group(2) or match.group(4)
    return host, int(port) if port else None


def _first_set(env: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str] | None:
    for name in names:
        if env.get(name):
            return env[name], name
    return None


def _pick(
    value: object, option: str, env: Mapping[str, str], names: tuple[str, ...], sources: dict[str, str]
) -> str | None:
    """The flag if given, else the first scheduler variable that is set; remembers which."""
    if value is not None:
        sources[option] = option
        return str(value)
    found = _first_set(env, names)
    if found is None:
        return None
    sources[option] = found[1]
    return found[0]


def _check_nnodes(nnodes: str, rdzv: str) -> str:
    if not re.fullmatch(r"\d+(:\d+)?", nnodes):
        raise ConfigError(
            f"--nnodes '{nnodes}' is not N or MIN:MAX", fix="for example --nnodes 2, or --nnodes 1:4 with --rdzv c10d"
        )
    low, _, high = nnodes.partition(":")
    if int(low) < 1 or (high and int(high) < int(low)):
        raise ConfigError(f"--nnodes '{nnodes}' must be at least 1 (and MIN <= MAX)", fix="for example --nnodes 2")
    if high and rdzv != "c10d":
        raise ConfigError(
            "--nnodes MIN:MAX (elastic) needs --rdzv c10d", fix="add --rdzv c10d --rdzv-id ID, or give one number"
        )
    return nnodes


def _check_nproc(nproc: str) -> str:
    if nproc in NPROC_WORDS or (nproc.isdigit() and int(nproc) >= 1):
        return nproc
    raise ConfigError(
        f"--nproc '{nproc}' is not a positive number", fix=f"give a count, or one of {', '.join(NPROC_WORDS)}"
    )


def _local_addr(local_addr: str | None, nic: str | None, env: Mapping[str, str], sources: dict[str, str]) -> str | None:
    """--local-addr, else the address of the job's NIC (dist.nic, GLOO_/NCCL_SOCKET_IFNAME)."""
    if local_addr:
        sources["--local-addr"] = "--local-addr"
        return local_addr
    candidates = [(nic, "dist.nic")] + [(env.get(name), name) for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")]
    for name, origin in candidates:
        if name and re.fullmatch(r"[\w.:-]+", name):  # one interface, not a list or ^exclusion
            address = interface_ipv4(name)
            if address:
                sources["--local-addr"] = f"{origin} ({name})"
                return address
    return None


def _default_nproc() -> str:
    import torch

    return str(torch.cuda.device_count() or 1)


def resolve_plan(
    *,
    nnodes: str | None = None,
    node_rank: int | None = None,
    master: str | None = None,
    nproc: str | None = None,
    rdzv: str = "static",
    rdzv_id: str | None = None,
    rdzv_conf: list[str] | tuple[str, ...] = (),
    max_restarts: int = 0,
    shutdown_timeout_s: int | None = None,
    local_addr: str | None = None,
    nic: str | None = None,
    default_rdzv_id: str | None = None,
    env: Mapping[str, str] | None = None,
) -> LaunchPlan:
    """Flags first, then PET_* (Kubeflow, torchrun), then SLURM_*, then MASTER_ADDR/PORT."""
    env = os.environ if env is None else env
    if rdzv not in ("static", "c10d"):
        raise ConfigError(
            f"--rdzv '{rdzv}' is not static or c10d", fix="use --rdzv static (fixed nodes) or --rdzv c10d (elastic)"
        )
    sources: dict[str, str] = {}
    nnodes = _check_nnodes(
        _pick(nnodes, "--nnodes", env, ("PET_NNODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES"), sources) or "1", rdzv
    )
    nproc = _pick(nproc, "--nproc", env, ("PET_NPROC_PER_NODE", "SLURM_GPUS_ON_NODE"), sources) or _default_nproc()
    rank_text = _pick(node_rank, "--node-rank", env, ("PET_NODE_RANK", "SLURM_NODEID"), sources)
    if rank_text is not None and not rank_text.isdigit():
        raise ConfigError(
            f"node rank '{rank_text}' (from {sources['--node-rank']}) is not a number", fix="pass --node-rank 0, 1, ..."
        )
    rank = int(rank_text) if rank_text is not None else None
    if rank is None and nnodes == "1" and rdzv == "static":
        rank = 0  # one node is the head node: there is no other rank it could take
    addr, port = _resolve_master(master, env, sources)
    plan = LaunchPlan(
        nnodes=nnodes,
        nproc=_check_nproc(nproc),
        node_rank=rank,
        master_addr=addr,
        master_port=port,
        rdzv=rdzv,
        rdzv_id=_pick(rdzv_id, "--rdzv-id", env, ("PET_RDZV_ID", "SLURM_JOB_ID"), sources) or default_rdzv_id,
        rdzv_conf=_with_keep_alive(_with_is_host(tuple(rdzv_conf), rdzv, rank), rdzv),
        max_restarts=max_restarts,
        shutdown_timeout_s=shutdown_timeout_s,
        local_addr=_local_addr(local_addr, nic, env, sources) if rdzv == "c10d" else None,
        sources=sources,
    )
    _check_multinode(plan)
    return plan


def _resolve_master(master: str | None, env: Mapping[str, str], sources: dict[str, str]) -> tuple[str | None, int]:
    port: int | None = None
    if master is not None:
        addr, port = split_host_port(master)
        sources["--master"] = "--master"
    else:
        found = _first_set(env, ("PET_MASTER_ADDR", "MASTER_ADDR"))
        nodelist = _first_set(env, ("SLURM_JOB_NODELIST", "SLURM_NODELIST"))
        if found:
            addr, sources["--master"] = found
        elif nodelist:
            addr, sources["--master"] = first_host(nodelist[0]), f"{nodelist[1]} (first node)"
        else:
            addr = None
    if port is None:
        found_port = _first_set(env, ("PET_MASTER_PORT", "MASTER_PORT"))
        if found_port and not found_port[0].isdigit():
            raise ConfigError(
                f"{found_port[1]}='{found_port[0]}' is not a port number", fix="set it to a free TCP port, e.g. 29500"
            )
        port = int(found_port[0]) if found_port else DEFAULT_MASTER_PORT
    return addr, port


def _with_is_host(conf: tuple[str, ...], rdzv: str, node_rank: int | None) -> tuple[str, ...]:
    """Under c10d, node 0 hosts the store. Said explicitly because torch's guess compares
    host names, which fails when nodes share one (containers, network namespaces)."""
    if rdzv != "c10d" or node_rank is None or any(item.split("=")[0] == "is_host" for item in conf):
        return conf
    return (*conf, f"is_host={1 if node_rank == 0 else 0}")


KEEP_ALIVE = ("keep_alive_interval=2", "keep_alive_max_attempt=3", "last_call_timeout=10")
"""A node that stops beating is dropped from the c10d rendezvous after 6 s, not torch's 15 s (5 s x 3); and once
`--nnodes MIN:MAX` has its minimum, the round waits 10 s for more nodes, not 30: both are what the surviving nodes
wait before training again when a host is lost (benchmarks/recovery/recovery.py). Nodes that start later still join: the
world grows at their arrival."""


def _with_keep_alive(conf: tuple[str, ...], rdzv: str) -> tuple[str, ...]:
    """The user's own settings win; each default fills only the key it names."""
    if rdzv != "c10d":
        return conf
    given = {item.split("=")[0] for item in conf}
    return (*conf, *(item for item in KEEP_ALIVE if item.split("=")[0] not in given))


def _check_multinode(plan: LaunchPlan) -> None:
    if plan.nnodes == "1" and plan.rdzv == "static":
        return
    if plan.master_addr is None:
        raise ConfigError(
            "a multi-node launch needs the head node's address",
            fix="pass --master HOST:PORT (the same on every node), or set PET_MASTER_ADDR / MASTER_ADDR",
        )
    if plan.rdzv == "static" and plan.node_rank is None:
        raise ConfigError(
            "static rendezvous needs this node's rank",
            fix="pass --node-rank R (0 on the head node), or use --rdzv c10d to let nodes take ranks as they join",
        )
    if plan.rdzv == "static" and plan.node_rank is not None and plan.node_rank >= int(plan.nnodes):
        raise ConfigError(
            f"--node-rank {plan.node_rank} is not below --nnodes {plan.nnodes}", fix="node ranks run 0 .. nnodes-1"
        )
    if plan.rdzv == "c10d" and not plan.rdzv_id:
        raise ConfigError(
            "c10d rendezvous needs a job id shared by all nodes", fix="pass --rdzv-id ID (the same on every node)"
        )


def check_node_range(cfg: JobConfig, plan: LaunchPlan) -> None:
    """Every node count of --nnodes MIN:MAX must keep the job's global batch. A restart on one that cannot exits 2,
    hours into the job, when a node is lost or comes back; checked here before anything starts."""
    low, _, high = plan.nnodes.partition(":")
    if not high or not plan.nproc.isdigit():
        return  # one size (checked by the trainer at its start), or a process count torchrun decides
    nproc, counts = int(plan.nproc), range(int(low), int(high) + 1)
    train, sizes = cfg.train, ", ".join(f"{nodes} (world {nodes * nproc})" for nodes in counts)
    lcm = math.lcm(*(nodes * nproc for nodes in counts))
    if train.global_batch_size is None and train.global_batch_tokens is None:
        raise ConfigError(
            f"--nnodes {plan.nnodes} can run on {sizes} nodes, but train.global_batch_size is unset: the global "
            "batch would be micro_batch_size x the first world size, which a larger world cannot keep",
            where=cfg.where("train.global_batch_size"),
            fix=f"set train.global_batch_size to a multiple of micro_batch_size x {lcm} = "
            f"{train.micro_batch_size * lcm}, or give --nnodes one number",
        )
    kept = []
    for nodes in counts:
        try:
            accumulation_steps(cfg, data_ranks(cfg, nodes * nproc))
            kept.append(nodes)
        except ConfigError:
            pass
    if len(kept) == len(counts):
        return
    field = "train.global_batch_size" if train.global_batch_size is not None else "train.global_batch_tokens"
    can = ", ".join(f"{nodes} (world {nodes * nproc})" for nodes in kept) or "none"
    raise ConfigError(
        f"--nnodes {plan.nnodes} x --nproc {nproc}: {field}={getattr(train, field.split('.')[1])} is not a multiple "
        f"of micro_batch_size x world size for every node count in the range; node counts that keep it: {can}",
        where=cfg.where(field),
        fix=f"give --nnodes a range of those counts, or set {field} to a multiple of "
        f"micro_batch_size x {lcm}{' x data.max_length' if 'tokens' in field else ''}",
    )


def torchrun_argv(plan: LaunchPlan, config: str, overrides: list[str] | tuple[str, ...]) -> list[str]:
    """`python -m trainyard.launch.agent ... -m trainyard.cli train CONFIG overrides`: torchrun's
    own flags, run by `agent.main`."""
    argv = [sys.executable, "-m", AGENT_MODULE, f"--nnodes={plan.nnodes}", f"--nproc-per-node={plan.nproc}"]
    if plan.nnodes == "1" and plan.rdzv == "static" and plan.master_addr is None:
        argv.append("--standalone")
    elif plan.rdzv == "static":
        argv += [
            f"--node-rank={plan.node_rank}",
            f"--master-addr={plan.master_addr}",
            f"--master-port={plan.master_port}",
        ]
    else:
        endpoint = f"[{plan.master_addr}]" if ":" in str(plan.master_addr) else str(plan.master_addr)
        argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}:{plan.master_port}", f"--rdzv-id={plan.rdzv_id}"]
        if plan.rdzv_conf:
            argv.append(f"--rdzv-conf={','.join(plan.rdzv_conf)}")
        if plan.local_addr:
            argv.append(f"--local-addr={plan.local_addr}")
    argv += [f"--max-restarts={plan.max_restarts}", f"--signals-to-handle={','.join(SIGNALS_TO_FORWARD)}"]
    if plan.shutdown_timeout_s is not None:
        argv.append(f"--shutdown-timeout={plan.shutdown_timeout_s}")
    return argv + ["-m", "trainyard.cli", "train", config, *overrides]


def network_settings(dist_cfg: DistConfig, env: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """The job's network preset merged under the user's own variables.

    Returns (variables to add to the environment, lines describing the effective values).
    A variable the user already exported wins over the preset, and says so.
    """
    wanted = network_env(dist_cfg.network, dist_cfg.nic)
    added = {name: value for name, value in wanted.items() if name not in env}
    shown = sorted(set(wanted) | {name for name in env if name.startswith(("NCCL_", "GLOO_"))})
    lines = []
    for name in shown:
        origin = "preset" if name in added else "yours, kept"
        lines.append(f"  {name}={added.get(name, env.get(name))}  ({origin})")
    header = f"network preset '{dist_cfg.network}'" + (f", nic {dist_cfg.nic}" if dist_cfg.nic else "")
    return added, [header + (":" if lines else ": no variables set")] + lines


def format_command(argv: list[str]) -> str:
    return shlex.join(argv)


def describe_launch(plan: LaunchPlan) -> str:
    """One line a person can check against the other nodes' lines."""
    where = ", ".join(f"{option} from {source}" for option, source in plan.sources.items() if source != option)
    node = (
        f"node {plan.node_rank} of {plan.nnodes}"
        if plan.node_rank is not None
        else f"one of {plan.nnodes} nodes (rank set at rendezvous)"
    )
    text = f"{node}, {plan.nproc} processes each, {plan.rdzv} rendezvous"
    if plan.master_addr:
        text += f" at {plan.master_addr}:{plan.master_port}"
    return text + (f" ({where})" if where else "")


def _forward_signals(child: subprocess.Popen) -> tuple[dict[int, object], list[int]]:
    """Pass termination and preemption signals on to torchrun, which passes them to workers.

    Returns the handlers to restore and the list the received signals are appended to.
    """
    received: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        received.append(signum)
        if child.poll() is None:
            child.send_signal(signum)

    previous = {}
    for name in SIGNALS_TO_FORWARD:
        signum = getattr(signal, name)
        previous[signum] = signal.signal(signum, forward)
    return previous, received


def first_reported_failure(prefix: str) -> tuple[int, str] | None:
    """The exit code and message of the worker that reported first: the root cause.

    When a peer is lost, one local rank fails on it and the others then fail on that
    rank's exit, naming a local address; the earliest report names the real one.
    """
    reports = sorted(Path(prefix).parent.glob(Path(prefix).name + ".rank*"), key=lambda path: path.stat().st_mtime_ns)
    if not reports:
        return None
    code, _, message = reports[0].read_text().partition("\n")
    return int(code), message


def run_torchrun(
    argv: list[str], env: Mapping[str, str], preempt_exit_code: int = PREEMPTED_EXIT_CODE
) -> tuple[int, str | None]:
    """Run torchrun to the end; return (exit code, message from a worker if one reported).

    torchrun exits 1 whatever its workers exited with, so the workers' own code (2 for
    a user error, 75 for "preempted after a committed checkpoint") comes back through
    the exit files that `trainyard train` writes when TRAINYARD_EXIT_FILE is set.
    """
    with tempfile.TemporaryDirectory(prefix="trainyard-launch-") as tmp:
        prefix = str(Path(tmp) / "exit")
        child = subprocess.Popen(argv, env={**env, EXIT_FILE_ENV: prefix})
        previous, received = _forward_signals(child)
        try:
            code = child.wait()
        finally:
            # Once told to stop, later copies of the signal (Slurm sends one to every process) are ignored:
            # the default action would kill this process before it reports how the workers ended.
            for signum, handler in previous.items():
                signal.signal(signum, signal.SIG_IGN if received else handler)  # type: ignore[arg-type]
        reported = first_reported_failure(prefix) if code != 0 else None
    if reported:
        worker_code, message = reported
        return (preempt_exit_code if worker_code == PREEMPTED_EXIT_CODE else worker_code), message
    if code < 0:
        return 128 - code, f"torchrun was killed by signal {-code}"
    if code != 0 and received:
        return 128 + received[0], f"stopped by signal {received[0]}"
    return code, None
