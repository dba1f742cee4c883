"""Commands that take a job to many machines: launch, lighthouse, slurm, k8s, doctor."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from trainyard.cli.app import (
    ConfigArgs,
    _check_out,
    _config_and_overrides,
    _fail,
    _positive,
    _write_out,
    app,
    err_console,
)
from trainyard.redaction import redact_text

if TYPE_CHECKING:
    from trainyard.config import JobConfig
    from trainyard.launch.ft_cluster import Script
    from trainyard.plan import Target

# Options that `slurm` and `k8s` share, declared once so both keep the same flag and help.
ForceOption = Annotated[bool, typer.Option("--force", help="replace the file at --out if it exists")]
SkipDataCheckOption = Annotated[
    bool, typer.Option("--skip-data-check", help="do not read the data here (it exists only on the cluster)")
]


@app.command()
def launch(
    args: ConfigArgs,
    nnodes: Annotated[
        Optional[str],
        typer.Option("--nnodes", help="nodes: N, or MIN:MAX with --rdzv c10d (or PET_NNODES, SLURM_NNODES)"),
    ] = None,
    node_rank: Annotated[
        Optional[int],
        typer.Option(
            "--node-rank",
            min=0,
            help="this node's rank, 0 on the head node (or PET_NODE_RANK, SLURM_NODEID)",
        ),
    ] = None,
    master: Annotated[
        Optional[str],
        typer.Option(
            "--master", help="head node HOST:PORT, the same on every node (or PET_MASTER_ADDR/PORT, MASTER_ADDR/PORT)"
        ),
    ] = None,
    nproc: Annotated[
        Optional[str],
        typer.Option("--nproc", help="processes on this node (or PET_NPROC_PER_NODE; default: GPUs, or 1)"),
    ] = None,
    rdzv: Annotated[
        str, typer.Option("--rdzv", help="static (fixed node ranks) or c10d (elastic, ranks taken on joining)")
    ] = "static",
    rdzv_id: Annotated[
        Optional[str],
        typer.Option("--rdzv-id", help="c10d: job id shared by all nodes (or SLURM_JOB_ID; default: run_name)"),
    ] = None,
    rdzv_conf: Annotated[
        Optional[list[str]],
        typer.Option("--rdzv-conf", help="k=v passed to the c10d rendezvous, e.g. is_host=1; repeatable"),
    ] = None,
    max_restarts: Annotated[
        int,
        typer.Option("--max-restarts", min=0, help="restart this node's workers this many times"),
    ] = 0,
    shutdown_timeout: Annotated[
        Optional[int],
        typer.Option("--shutdown-timeout", min=1, help="seconds workers get to save after a stop signal"),
    ] = None,
    local_addr: Annotated[
        Optional[str],
        typer.Option(
            "--local-addr", help="this node's address for c10d (default: the address of dist.nic / GLOO_SOCKET_IFNAME)"
        ),
    ] = None,
    preempt_exit_code: Annotated[
        int,
        typer.Option(
            "--preempt-exit-code",
            min=1,
            max=255,
            help="exit with this instead of 75 when preempted after a checkpoint",
        ),
    ] = 75,
    lighthouse: Annotated[
        bool, typer.Option("--lighthouse", help="fault-tolerant DiLoCo: host the job's torchft lighthouse here")
    ] = False,
) -> None:
    """Run this node's share of a multi-node job under torchrun (one command on every node)."""
    import os

    from trainyard import config_file as config_room
    from trainyard.doctor.preflight import check_job_inputs
    from trainyard.launch import allocator
    from trainyard.launch import torchrun as tr
    from trainyard.launch.lighthouse import hosted as hosted_lighthouse

    config_path, overrides = _config_and_overrides(args)
    cfg = config_room.load_config(config_path, overrides)
    check_job_inputs(cfg)
    plan = tr.resolve_plan(
        nnodes=nnodes,
        node_rank=node_rank,
        master=master,
        nproc=nproc,
        rdzv=rdzv,
        rdzv_id=rdzv_id,
        rdzv_conf=rdzv_conf or [],
        max_restarts=max_restarts,
        shutdown_timeout_s=shutdown_timeout,
        local_addr=local_addr,
        nic=cfg.dist.nic,
        default_rdzv_id=cfg.run_name,
    )
    tr.check_node_range(cfg, plan)
    added, network_lines = tr.network_settings(cfg.dist, os.environ)
    added.update(allocator.preload_env(os.environ))
    argv = tr.torchrun_argv(plan, config_path, overrides)
    summary = "\n".join([tr.describe_launch(plan), *network_lines, f"running: {tr.format_command(argv)}"])
    err_console.print(redact_text(summary), highlight=False, markup=False, soft_wrap=True)
    with hosted_lighthouse(cfg, lighthouse):
        code, message = tr.run_torchrun(argv, {**os.environ, **added}, preempt_exit_code)
    if code:
        fallback = f"torchrun exited with {code}; each rank's log is under {cfg.run_dir}/logs/"
        _fail(code, message or fallback, preempt_exit_code)


@app.command("lighthouse")
def lighthouse_command(args: ConfigArgs) -> None:
    """Run a fault-tolerant DiLoCo job's torchft lighthouse in the foreground, with a life of its own: sites that
    lose it take their rounds alone and re-join once it is back (run it under systemd, a Slurm step or a
    Kubernetes Deployment that restarts it)."""
    import os

    from trainyard.launch.ft_cluster import load_job
    from trainyard.launch.lighthouse import command

    config_path, overrides = _config_and_overrides(args)
    argv = command(load_job(config_path, overrides))  # no diloco.site: the lighthouse serves every site
    err_console.print(f"running: {' '.join(argv)}", highlight=False, markup=False, soft_wrap=True)
    os.execve(argv[0], argv, {"RUST_LOG": "warn", **os.environ})


def _load_job_and_check_out(
    args: list[str], out: Path | None, force: bool, files_per_site: bool = False
) -> tuple[str, list[str], "JobConfig"]:
    """CONFIG and its overrides read into the job (a fault-tolerant one as site 0's), then --out checked: a file
    that would be refused fails before any script is built. `files_per_site`: a fault-tolerant job's --out names
    the files written beside it (checked when they are known)."""
    from trainyard.launch.ft_cluster import load_job

    config_path, overrides = _config_and_overrides(args)
    cfg = load_job(config_path, overrides)
    if out is not None and not (files_per_site and cfg.diloco.fault_tolerant):
        _check_out(out, force, config_path)
    return config_path, overrides, cfg


def _write_site_scripts(
    scripts: list[Script], out: Path | None, force: bool, submit: bool, config_path: str, cfg: "JobConfig"
) -> None:
    """A fault-tolerant DiLoCo job's scripts (the lighthouse's, then one per site) beside --out (default: in the
    run dir), each checked as --out is; with --submit, sbatch on each, in that order."""
    from trainyard.launch import ft_cluster
    from trainyard.launch.slurm import submit as sbatch

    base = out or ft_cluster.job_root(cfg) / f"{cfg.run_name}.sbatch"
    paths = [ft_cluster.script_path(base, script.role) for script in scripts]
    for path in paths:
        _check_out(path, force, config_path)
    for script, path in zip(scripts, paths):
        _write_out(path, script.text)
        script.log_dir.mkdir(parents=True, exist_ok=True)  # sbatch would not create it, and would log nothing
    err_console.print(ft_cluster.submit_order(cfg, paths), highlight=False, markup=False, soft_wrap=True)
    for script, path in zip(scripts, paths):
        print(f"{script.role} {sbatch(path)}" if submit else path)


def _check_before_writing(
    cfg: JobConfig, gpu: str | None, gpus_per_node: int | None, nproc_per_node: int, nodes: int, skip_data: bool
) -> Target:
    """`train --dry-run`'s check for the cluster the script asks for (--gpu, else h100-80gb nodes, or cpu without
    GPUs): a job that does not fit, or whose data or resume point is unusable, fails here (exit 2) rather than once
    the nodes are allocated."""
    from trainyard import plan
    from trainyard.errors import PlanError
    from trainyard.hardware import gpu as known_gpu
    from trainyard.launch.slurm import DEFAULT_GPU

    plan.check_world(cfg, nodes, nproc_per_node)
    target = plan.Target(gpu or (DEFAULT_GPU if gpus_per_node else "cpu"), nproc_per_node, nodes)
    known_gpu(target.gpu)
    text, problems = plan.dry_run(cfg, target, read_data=not skip_data)
    if problems:
        err_console.print(text, highlight=False, markup=False, soft_wrap=True)
        raise PlanError("the job cannot run as planned:\n- " + "\n- ".join(problems),
                        fix="change what each line names; --skip-data-check if the data is only on the cluster")
    return target


@app.command()
def slurm(
    args: ConfigArgs,
    nodes: Annotated[int, typer.Option("--nodes", help="nodes to allocate")] = 1,
    gpus_per_node: Annotated[
        Optional[int],
        typer.Option(
            "--gpus-per-node",
            help="GPUs per node, 0 for CPU-only nodes; required unless read from --partition (Slurm installed here)",
        ),
    ] = None,
    nproc_per_node: Annotated[
        Optional[int], typer.Option("--nproc-per-node", help="processes per node (default: one per GPU, or 1)")
    ] = None,
    partition: Annotated[
        Optional[str], typer.Option("--partition", help="Slurm partition; sinfo reads missing GPUs and CPUs from it")
    ] = None,
    time_limit: Annotated[Optional[str], typer.Option("--time", help="time limit, e.g. 24:00:00")] = None,
    account: Annotated[Optional[str], typer.Option("--account", help="Slurm account to charge")] = None,
    cpus_per_task: Annotated[
        Optional[int],
        typer.Option(
            "--cpus-per-task",
            help="CPUs of each node's one task (launcher and workers) (default: the partition's, else whole nodes)",
        ),
    ] = None,
    mem: Annotated[Optional[str], typer.Option("--mem", help="memory per node, e.g. 0 (all) or 500G")] = None,
    signal_lead: Annotated[
        Optional[int],
        typer.Option(
            "--signal-lead",
            help="seconds between SIGUSR1 and the time limit, to save (default: estimated step + full save, x1.5)",
        ),
    ] = None,
    gpu: Annotated[
        Optional[str],
        typer.Option("--gpu", help="device kind the signal lead is estimated for, as in `trainyard estimate --gpu`"),
    ] = None,
    nic: Annotated[
        Optional[str],
        typer.Option("--nic", help="network interface for the rendezvous and collectives (default: dist.nic)"),
    ] = None,
    env_file: Annotated[
        Optional[Path], typer.Option("--env-file", help="file of VAR=value lines (tokens) sourced on the nodes")
    ] = None,
    venv: Annotated[
        Optional[Path], typer.Option("--venv", help="virtual environment to activate on every node (default: this one)")
    ] = None,
    out: Annotated[Optional[Path], typer.Option("--out", help="write the script here (default: stdout)")] = None,
    force: ForceOption = False,
    submit: Annotated[bool, typer.Option("--submit", help="run sbatch on the script and print the job id")] = False,
    skip_data_check: SkipDataCheckOption = False,
) -> None:
    """Write an sbatch script: one `trainyard launch` per node, requeued when preempted. A fault-tolerant DiLoCo
    job: one script per site and one for its lighthouse."""
    from trainyard.launch import ft_cluster
    from trainyard.launch import slurm as slurm_room

    config_path, overrides, cfg = _load_job_and_check_out(args, out, force, files_per_site=True)
    job = slurm_room.SlurmJob(
        config=config_path,
        overrides=tuple(overrides),
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        nproc_per_node=nproc_per_node,
        partition=partition,
        time=time_limit,
        account=account,
        cpus_per_task=cpus_per_task,
        mem=mem,
        nic=nic,
        env_file=str(env_file.resolve()) if env_file else None,
        venv=str(venv.resolve()) if venv else slurm_room.default_venv(),
        workdir=str(Path.cwd()),
        signal_lead=signal_lead,
        gpu=gpu,
    )
    job, lead = slurm_room.resolve(job, cfg)  # checks the options first
    _check_before_writing(cfg, job.gpu, job.gpus_per_node, slurm_room.nproc_per_node(job), nodes, skip_data_check)
    text = slurm_room.render_sbatch(job, cfg, lead)
    notes = [job.node_source] if job.node_source else []
    notes.append(f"SIGUSR1 {lead.seconds} s before the time limit: {lead.reason}")
    err_console.print("\n".join(notes), highlight=False, markup=False, soft_wrap=True)
    if cfg.diloco.fault_tolerant:
        _write_site_scripts(ft_cluster.slurm_scripts(job, cfg, lead), out, force, submit, config_path, cfg)
        return
    if out is None and not submit:
        print(text, end="")
        return
    path = slurm_room.write_sbatch(text, out or cfg.run_dir / f"{cfg.run_name}.sbatch", cfg, job.workdir)
    err_console.print(f"wrote {path}", highlight=False)
    if submit:
        print(slurm_room.submit(path))


@app.command()
def k8s(
    args: ConfigArgs,
    nodes: Annotated[int, typer.Option("--nodes", help="pods, one per node")] = 1,
    gpus_per_node: Annotated[int, typer.Option("--gpus-per-node", help="GPUs per pod; 0 for CPU-only")] = 0,
    image: Annotated[str, typer.Option("--image", help="container image with trainyard installed (required)")] = "",
    kind: Annotated[
        str, typer.Option("--kind", help="pytorchjob (Kubeflow Training Operator) or trainjob (Kubeflow Trainer v2)")
    ] = "pytorchjob",
    namespace: Annotated[str, typer.Option("--namespace", help="namespace of every object written")] = "default",
    pvc: Annotated[
        Optional[str], typer.Option("--pvc", help="existing ReadWriteMany claim (default: write one)")
    ] = None,
    storage: Annotated[str, typer.Option("--storage", help="size of the written claim (not with --pvc)")] = "100Gi",
    storage_class: Annotated[
        Optional[str],
        typer.Option(
            "--storage-class", help="StorageClass of the written claim (default: the cluster's; not with --pvc)"
        ),
    ] = None,
    secret: Annotated[
        Optional[list[str]],
        typer.Option(
            "--secret",
            help="a Secret's name (lower case), whose keys WANDB_API_KEY and HF_TOKEN become those variables; "
            "or VAR=SECRET:KEY, e.g. WANDB_API_KEY=wandb:api-key; repeatable",
        ),
    ] = None,
    nproc_per_node: Annotated[
        Optional[int],
        typer.Option("--nproc-per-node", min=1, help="processes per pod (default: one per GPU, or 1)"),
    ] = None,
    grace: Annotated[
        Optional[int],
        typer.Option(
            "--grace",
            help="seconds between SIGTERM and SIGKILL, for the preemption save (more than 15; default: estimated "
            "step + full save, x1.5, as the Slurm signal lead)",
        ),
    ] = None,
    runtime: Annotated[
        Optional[str],
        typer.Option("--runtime", help="trainjob: use this ClusterTrainingRuntime instead of writing one"),
    ] = None,
    out: Annotated[Optional[Path], typer.Option("--out", help="write the YAML here (default: stdout)")] = None,
    force: ForceOption = False,
    gpu: Annotated[
        Optional[str],
        typer.Option("--gpu", help="device kind the job is checked to fit (default: h100-80gb, or cpu without GPUs)"),
    ] = None,
    skip_data_check: SkipDataCheckOption = False,
) -> None:
    """Write Kubernetes manifests: the job, its ConfigMap, a shared volume, secret references. A fault-tolerant
    DiLoCo job: one job per site, and a Deployment and Service for its lighthouse."""
    import dataclasses

    from trainyard.estimate import Hardware, host_memory
    from trainyard.launch import ft_cluster
    from trainyard.launch import k8s as k8s_room

    _, _, cfg = _load_job_and_check_out(args, out, force)
    job = k8s_room.K8sJob(
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        image=image,
        kind=kind,
        namespace=namespace,
        pvc=pvc,
        storage=storage,
        storage_class=storage_class,
        secrets=tuple(secret or ()),
        nproc_per_node=nproc_per_node,
        grace_s=grace if grace is not None else k8s_room.K8sJob.grace_s,  # until the estimate below
        runtime=runtime,
    )
    render = ft_cluster.render_manifests if cfg.diloco.fault_tolerant else k8s_room.render_manifests
    render(cfg, job)  # checks the options before the job is planned
    target = _check_before_writing(cfg, gpu, gpus_per_node, k8s_room.nproc_per_node(job), nodes, skip_data_check)
    host = host_memory(cfg, Hardware(target.gpu, target.gpus_per_node, target.nodes))
    if grace is None:
        job = k8s_room.with_estimated_grace(job, cfg, target.gpu)
    text = render(cfg, dataclasses.replace(job, memory_gib=host.request_gib))
    notes = [f"terminationGracePeriodSeconds {job.grace_s}: {job.grace_reason}"]
    if cfg.diloco.fault_tolerant:
        name = k8s_room.k8s_name(cfg.run_name)
        address = ft_cluster.service_address(name, namespace, ft_cluster.k8s_port(cfg))
        notes.append(f"{ft_cluster.sites(cfg)} site(s), {name}-site-0 ...; their lighthouse: Deployment and Service "
                     f"{name}-lighthouse, reached at {address}")
    moves = [f"  {move.describe()}" for move in k8s_room.volume_moves(cfg)]
    if moves:
        notes += [f"paths moved onto the shared volume at {k8s_room.DATA_MOUNT}:", *moves]
    err_console.print(redact_text("\n".join(notes)), highlight=False, markup=False, soft_wrap=True)
    if out is None:
        print(text, end="")
        return
    _write_out(out, text)
    err_console.print(f"wrote {out}", highlight=False)


@app.command()
def doctor(
    config: Annotated[
        Optional[str], typer.Argument(help="job YAML: check its output_dir, data/model cache_dir and dist.nic")
    ] = None,
    dirs: Annotated[
        Optional[list[str]],
        typer.Option(
            "--dir",
            help="a dir that must be writable (and shared, with --nnodes); repeatable "
            "(default: output dir and HF cache)",
        ),
    ] = None,
    nic: Annotated[
        Optional[str],
        typer.Option(
            "--nic", help="network interface for NCCL/Gloo (default: dist.nic, NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME)"
        ),
    ] = None,
    master: Annotated[
        Optional[str], typer.Option("--master", help="node 0's HOST:PORT: free on node 0, reachable from the others")
    ] = None,
    node_rank: Annotated[int, typer.Option("--node-rank", min=0, help="this node's rank; 0 hosts the rendezvous")] = 0,
    nnodes: Annotated[
        Optional[int], typer.Option("--nnodes", help="run the cluster probe over this many nodes (1: just this one)")
    ] = None,
    nproc: Annotated[Optional[int], typer.Option("--nproc", help="ranks on this node (default: GPUs, or 1)")] = None,
    timeout: Annotated[
        float,
        typer.Option("--timeout", callback=_positive, help="seconds to wait for every node to join the probe"),
    ] = 300.0,
    as_json: Annotated[bool, typer.Option("--json", help="print the checks as JSON")] = False,
) -> None:
    """Check this machine (and with --nnodes the cluster) before a job: exit 1 if a check fails."""
    from trainyard.doctor.run import DoctorOptions, exit_code, print_checks, run_doctor

    options = DoctorOptions(
        config=config,
        dirs=list(dirs or []),
        nic=nic,
        master=master,
        node_rank=node_rank,
        nnodes=nnodes,
        nproc=nproc,
        timeout_s=timeout,
    )
    checks = run_doctor(options)
    print_checks(checks, as_json, node_rank)
    raise typer.Exit(exit_code(checks))
