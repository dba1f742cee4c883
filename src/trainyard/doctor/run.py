"""`trainyard doctor`: preflight checks of a machine, and with `--nnodes` of the cluster, before a job burns hours.

`run_doctor` gathers rows from `checks` (versions, GPUs, storage, environment), `network`
(NIC, master port) and, for a cluster, `probe` (a small job on every node). Everything
printed goes through `redact_text`, so a secret in the environment never reaches the screen. `preflight` checks a
job's paths before torch is imported. Never imports models, data, parallelism, the plan, the estimate, training or
checkpoints.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from trainyard.config_file import load_config
from trainyard.doctor.checks import (
    Check,
    check_cuda,
    check_disk,
    check_environment,
    check_gpus,
    check_hf_cache,
    check_topology,
    check_versions,
    check_writable,
    fail,
    package_versions,
)
from trainyard.doctor.network import check_master, check_nic, parse_master
from trainyard.doctor.options import DEFAULT_OUTPUT_DIR, DoctorOptions, JobTargets
from trainyard.errors import OptionError
from trainyard.redaction import redact_text

_STYLE = {"pass": "green", "warn": "yellow", "fail": "bold red"}


def validate_options(opts: DoctorOptions) -> None:
    nnodes = opts.nnodes or 1
    if opts.nnodes is not None and opts.nnodes < 1:
        raise OptionError(f"--nnodes {opts.nnodes} must be at least 1", fix="pass --nnodes 1 for one machine")
    if nnodes > 1 and not opts.master:
        raise OptionError(
            f"--nnodes {nnodes} needs --master HOST:PORT",
            fix="pass node 0's address and a free port, the same on every node",
        )
    if opts.node_rank < 0 or (opts.nnodes is not None and opts.node_rank >= nnodes):
        raise OptionError(
            f"--node-rank {opts.node_rank} is outside 0..{nnodes - 1}",
            fix="give each node its own rank from 0 to nnodes-1; node 0 hosts the rendezvous",
        )
    if opts.nproc is not None and opts.nproc < 1:
        raise OptionError(f"--nproc {opts.nproc} must be at least 1", fix="pass the number of ranks on this node")
    if opts.master:
        parse_master(opts.master)


def job_targets(opts: DoctorOptions) -> JobTargets:
    """The dirs, NIC and network preset to check: from CONFIG when given, else the defaults."""
    from huggingface_hub import constants

    output_dir, cache_dirs = Path(DEFAULT_OUTPUT_DIR), [Path(constants.HF_HUB_CACHE)]
    nic, network = None, "default"
    if opts.config:
        cfg = load_config(opts.config)
        output_dir, nic, network = Path(cfg.output_dir), cfg.dist.nic, cfg.dist.network
        cache_dirs += [Path(d) for d in (cfg.data.cache_dir, cfg.model.cache_dir) if d]
    shared = [Path(d) for d in opts.dirs] or [output_dir, *cache_dirs]
    return JobTargets(output_dir, _unique(cache_dirs), _unique(shared), opts.nic or nic, network)


def _unique(paths: list[Path]) -> list[Path]:
    return list(dict.fromkeys(p.expanduser().absolute() for p in paths))


def ranks_on_this_node(opts: DoctorOptions) -> int:
    return opts.nproc or max(torch.cuda.device_count(), 1)


def local_checks(opts: DoctorOptions, job: JobTargets) -> list[Check]:
    versions = package_versions()
    ranks = ranks_on_this_node(opts)
    checks = check_versions(versions) + check_cuda(versions) + check_gpus(ranks) + check_topology()
    checks += [check_disk(path) for path in _unique([job.output_dir, *job.cache_dirs])]
    checks += [check_writable(path) for path in job.shared_dirs]
    checks.append(check_hf_cache())
    checks += check_nic(job.nic, multi_node=(opts.nnodes or 1) > 1)
    checks += check_master(opts.master, opts.node_rank, opts.nnodes)
    checks += check_environment(job.network, ranks)
    return checks


def run_doctor(opts: DoctorOptions) -> list[Check]:
    """Local checks; with --nnodes also the cluster probe (not started when this node fails)."""
    validate_options(opts)
    job = job_targets(opts)
    checks = local_checks(opts, job)
    if opts.nnodes is None:
        return checks
    if any(c.status == "fail" for c in checks):
        return checks + [
            fail(
                "cluster probe",
                "not started: this node fails a local check",
                "fix the failures above, then rerun on every node",
            )
        ]
    from trainyard.doctor.probe import probe_cluster

    return checks + probe_cluster(opts, job, ranks_on_this_node(opts))


def exit_code(checks: list[Check]) -> int:
    return 1 if any(c.status == "fail" for c in checks) else 0


def print_checks(checks: list[Check], as_json: bool, node_rank: int = 0) -> None:
    """The table (or JSON) on stdout; cluster rows only on node 0, where the probe's rank 0 runs."""
    shown = [c for c in checks if not c.cluster or node_rank == 0]
    if as_json:
        print(redact_text(json.dumps({"ok": exit_code(checks) == 0, "checks": [asdict(c) for c in shown]}, indent=2)))
        return
    table = Table(title="trainyard doctor")
    for column in ("check", "status", "detail", "fix"):
        table.add_column(column, overflow="fold")
    for c in shown:
        name, detail, fix = (escape(redact_text(text)) for text in (c.name, c.detail, c.fix))
        table.add_row(name, f"[{_STYLE[c.status]}]{c.status}[/]", detail, fix)
    console = Console(highlight=False, width=max(Console().width, 140))
    console.print(table)
    counts = {status: sum(c.status == status for c in checks) for status in _STYLE}
    console.print(f"{counts['pass']} passed, {counts['warn']} warnings, {counts['fail']} failed")
    if len(shown) < len(checks):
        console.print("the cluster table prints on node 0")
