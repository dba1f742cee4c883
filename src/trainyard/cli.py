"""The `trainyard` command: parse, call the library, turn user errors into exit codes."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from trainyard.config import redact_text
from trainyard.errors import TrainyardError

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="One YAML-described LLM training job, from a CPU to many nodes."
)
err_console = Console(stderr=True, highlight=False)


@app.callback()
def _root() -> None:
    """One YAML-described LLM training job, from a CPU to many nodes."""


def _fail(code: int, message: str, preempt_code: int | None = None) -> None:
    from trainyard.launch.torchrun import PREEMPTED_EXIT_CODE

    if code == (preempt_code or PREEMPTED_EXIT_CODE):
        _notice(message)
    else:
        err_console.print("[bold red]trainyard: error[/]")
        err_console.print(redact_text(message), markup=False)
    raise typer.Exit(code)


def _notice(message: str) -> None:
    """Preempted after a committed checkpoint (exit 75): one line saying how to go on, not an error."""
    what, _, fix = message.partition("\nFix: ")
    err_console.print(redact_text(f"trainyard: {what}" + (f" — {fix}" if fix else "")), markup=False, soft_wrap=True)


def _split_config_and_overrides(items: list[str]) -> tuple[str | None, list[str]]:
    """`train [CONFIG] [k=v ...]`: the first item is the config unless it is an override."""
    if items and "=" not in items[0]:
        return items[0], items[1:]
    return None, items


def _positive(value: float) -> float:
    """Option callback: seconds and thresholds of 0 or less make no sense."""
    if value is not None and value <= 0:
        raise typer.BadParameter(f"{value:g} is not a positive number of seconds; for example 60")
    return value


def _check_out(out: Path, force: bool, config_path: str | None) -> None:
    """`--out FILE` never replaces a file without --force, and never the job config being read."""
    import os

    from trainyard.config import PRESETS, preset_path
    from trainyard.errors import OptionError

    config_file = Path(config_path) if config_path else None
    if config_file is not None and not config_file.exists() and config_path in PRESETS:
        config_file = preset_path(config_path)
    if config_file is not None and out.exists() and config_file.exists() and os.path.samefile(out, config_file):
        raise OptionError(
            f"--out {out} is the job config this command reads; writing there would lose the job",
            fix="write the generated file somewhere else, e.g. --out job.k8s.yaml (even --force does not allow this)",
        )
    if out.is_dir():
        raise OptionError(f"--out {out} is a folder", fix=f"give a file path, e.g. --out {out / 'job.yaml'}")
    if out.exists() and not force:
        raise OptionError(f"--out {out} already exists", fix="choose a new file name, or pass --force to replace it")
    blocker = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise OptionError(f"--out {out}: {blocker} is a file, not a folder", fix="choose a path in a folder")


def _write_out(out: Path, text: str) -> None:
    """Write a generated file whole: a temp file beside it, then an atomic rename."""
    from trainyard.errors import OptionError

    tmp = out.parent / f".{out.name}.tmp"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text)
        tmp.replace(out)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise OptionError(f"--out {out}: cannot write ({err.strerror})", fix="choose a writable path") from None


@app.command(context_settings={"allow_extra_args": False})
def train(
    args: Annotated[
        Optional[list[str]], typer.Argument(help="CONFIG (YAML file or preset name) then key=value overrides")
    ] = None,
    nproc: Annotated[
        Optional[int],
        typer.Option("--nproc", min=1, help="processes on this machine; >1 re-executes under torchrun (quickstart: 2)"),
    ] = None,
    max_restarts: Annotated[
        int,
        typer.Option("--max-restarts", min=0, help="restart failed workers this many times"),
    ] = 0,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="print the resolved plan without loading weights")] = False,
    world_size: Annotated[
        Optional[int],
        typer.Option("--world-size", min=1, help="plan for this many ranks (dry run)"),
    ] = None,
) -> None:
    """Train. No CONFIG runs the built-in quickstart."""
    from trainyard import config as config_room
    from trainyard.preflight import check_job_inputs

    config_path, overrides = _split_config_and_overrides(list(args or []))
    cfg = config_room.load_config(config_path, overrides)
    if nproc is None:
        nproc = 2 if config_path is None else 1  # the quickstart is a 2-process DDP job
    if dry_run:
        from trainyard.plan import describe_plan

        print(describe_plan(cfg, world_size or nproc))
        return
    check_job_inputs(cfg)  # before torch is imported: bad input fails in seconds
    from trainyard.dist import launched_by_torchrun
    from trainyard.launch.local import run_local, torchrun_equivalent

    if nproc > 1 and not launched_by_torchrun():
        argv = ["train", *([config_path] if config_path else []), *overrides]
        err_console.print(
            redact_text(f"launching: {torchrun_equivalent(nproc, argv, max_restarts)}"), markup=False, soft_wrap=True
        )
        code, message = run_local(nproc, argv, max_restarts)
        if code:
            _fail(code, message or "a worker failed")
        return
    from trainyard.trainer import run

    summary = run(cfg)
    _print_outcome(summary, cfg.run_dir)


def _print_outcome(summary: dict, run_dir: Path) -> None:
    import os

    if os.environ.get("RANK", "0") != "0":
        return
    lines = [f"done: {summary['steps']} steps in {summary['wall_time_s']:.0f}s, run dir {run_dir}"]
    if summary.get("baseline_eval_accuracy") is not None:
        lines.append(f"held-out exact match before training: {summary['baseline_eval_accuracy']:.1%}")
    if summary.get("final_eval_accuracy") is not None:
        lines.append(f"held-out exact match after training:  {summary['final_eval_accuracy']:.1%}")
    if summary.get("final_eval_loss") is not None:
        lines.append(f"final eval loss {summary['final_eval_loss']:.4f}")
    err_console.print("\n".join(lines), markup=False)


def _config_and_overrides(args: list[str]) -> tuple[str, list[str]]:
    """`CONFIG [k=v ...]` where CONFIG is required (multi-node commands have no default job)."""
    config_path, overrides = _split_config_and_overrides(args)
    if config_path is None:
        from trainyard.errors import ConfigError

        raise ConfigError("no CONFIG given", fix="pass a YAML file (or a preset name) before the key=value overrides")
    return config_path, overrides


@app.command()
def launch(
    args: Annotated[list[str], typer.Argument(help="CONFIG then key=value overrides")],
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
) -> None:
    """Run this node's share of a multi-node job under torchrun (one command on every node)."""
    import os

    from trainyard import config as config_room
    from trainyard.launch import torchrun as tr
    from trainyard.preflight import check_job_inputs

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
    added, network_lines = tr.network_settings(cfg.dist, os.environ)
    argv = tr.torchrun_argv(plan, config_path, overrides)
    summary = "\n".join([tr.describe_plan(plan), *network_lines, f"running: {tr.format_command(argv)}"])
    err_console.print(config_room.redact_text(summary), highlight=False, markup=False, soft_wrap=True)
    code, message = tr.run_torchrun(argv, {**os.environ, **added}, preempt_exit_code)
    if code:
        fallback = f"torchrun exited with {code}; each rank's log is under {cfg.run_dir}/logs/"
        _fail(code, message or fallback, preempt_exit_code)


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
    from trainyard.doctor import DoctorOptions, exit_code, print_checks, run_doctor

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


@app.command()
def report(
    run_dirs: Annotated[list[Path], typer.Argument(help="run dirs (<output_dir>/<run_name>); several share each plot")],
    out: Annotated[
        Optional[Path],
        typer.Option(
            "--out",
            help="where to write PNGs and report.md (default: RUN_DIR/report, or ./trainyard-report for several runs)",
        ),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="replace report files already in --out")] = False,
) -> None:
    """Plot loss, eval, tokens/s, memory and lr of runs, with a markdown summary."""
    from trainyard.report import write_report

    for path in write_report(run_dirs, out, force=force):
        print(path)


@app.command()
def slurm(
    args: Annotated[list[str], typer.Argument(help="CONFIG then key=value overrides")],
    nodes: Annotated[int, typer.Option("--nodes", help="nodes to allocate")] = 1,
    gpus_per_node: Annotated[int, typer.Option("--gpus-per-node", help="GPUs per node; 0 for CPU-only nodes")] = 0,
    nproc_per_node: Annotated[
        Optional[int], typer.Option("--nproc-per-node", help="processes per node (default: one per GPU, or 1)")
    ] = None,
    partition: Annotated[Optional[str], typer.Option("--partition")] = None,
    time_limit: Annotated[Optional[str], typer.Option("--time", help="time limit, e.g. 24:00:00")] = None,
    account: Annotated[Optional[str], typer.Option("--account")] = None,
    cpus_per_task: Annotated[Optional[int], typer.Option("--cpus-per-task", min=1)] = None,
    mem: Annotated[Optional[str], typer.Option("--mem", help="memory per node, e.g. 0 (all) or 500G")] = None,
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
    force: Annotated[bool, typer.Option("--force", help="replace the file at --out if it exists")] = False,
    submit: Annotated[bool, typer.Option("--submit", help="run sbatch on the script and print the job id")] = False,
) -> None:
    """Write an sbatch script: one `trainyard launch` per node, requeued when preempted."""
    from trainyard import config as config_room
    from trainyard.launch import slurm as slurm_room

    config_path, overrides = _config_and_overrides(args)
    cfg = config_room.load_config(config_path, overrides)
    if out is not None:
        _check_out(out, force, config_path)
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
    )
    text = slurm_room.render_sbatch(job, cfg)
    if out is None and not submit:
        print(text, end="")
        return
    path = slurm_room.write_sbatch(text, out or cfg.run_dir / f"{cfg.run_name}.sbatch", cfg, job.workdir)
    err_console.print(f"wrote {path}", highlight=False)
    if submit:
        print(slurm_room.submit(path))


@app.command()
def k8s(
    args: Annotated[list[str], typer.Argument(help="CONFIG then key=value overrides")],
    nodes: Annotated[int, typer.Option("--nodes", help="pods, one per node")] = 1,
    gpus_per_node: Annotated[int, typer.Option("--gpus-per-node", help="GPUs per pod; 0 for CPU-only")] = 0,
    image: Annotated[str, typer.Option("--image", help="container image with trainyard installed")] = "",
    kind: Annotated[
        str, typer.Option("--kind", help="pytorchjob (Kubeflow Training Operator) or trainjob (Kubeflow Trainer v2)")
    ] = "pytorchjob",
    namespace: Annotated[str, typer.Option("--namespace")] = "default",
    pvc: Annotated[
        Optional[str], typer.Option("--pvc", help="existing ReadWriteMany claim (default: write one)")
    ] = None,
    storage: Annotated[str, typer.Option("--storage", help="size of the written claim")] = "100Gi",
    storage_class: Annotated[Optional[str], typer.Option("--storage-class")] = None,
    secret: Annotated[
        Optional[list[str]],
        typer.Option("--secret", help="Secret NAME (WANDB_API_KEY, HF_TOKEN), or VAR=NAME:KEY; repeatable"),
    ] = None,
    nproc_per_node: Annotated[
        Optional[int],
        typer.Option("--nproc-per-node", min=1, help="processes per pod (default: one per GPU, or 1)"),
    ] = None,
    grace: Annotated[
        int, typer.Option("--grace", help="seconds between SIGTERM and SIGKILL, for the preemption save")
    ] = 300,
    runtime: Annotated[
        Optional[str],
        typer.Option("--runtime", help="trainjob: use this ClusterTrainingRuntime instead of writing one"),
    ] = None,
    out: Annotated[Optional[Path], typer.Option("--out", help="write the YAML here (default: stdout)")] = None,
    force: Annotated[bool, typer.Option("--force", help="replace the file at --out if it exists")] = False,
) -> None:
    """Write Kubernetes manifests: the job, its ConfigMap, a shared volume, secret references."""
    from trainyard import config as config_room
    from trainyard.launch import k8s as k8s_room

    config_path, overrides = _config_and_overrides(args)
    cfg = config_room.load_config(config_path, overrides)
    if out is not None:
        _check_out(out, force, config_path)
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
        grace_s=grace,
        runtime=runtime,
    )
    text = k8s_room.render_manifests(cfg, job)
    if out is None:
        print(text, end="")
        return
    _write_out(out, text)
    err_console.print(f"wrote {out}", highlight=False)


@app.command()
def status(
    run_dir: Annotated[Path, typer.Argument(help="the run dir: <output_dir>/<run_name>")],
    stale_after: Annotated[
        float,
        typer.Option("--stale-after", callback=_positive, help="a rank silent this many seconds is reported"),
    ] = 60.0,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object instead of text")] = False,
) -> None:
    """Progress of a run from its run dir: step, loss, tokens/s, ETA, checkpoint, silent ranks."""
    import json

    from trainyard.status import format_status, read_status

    report = read_status(run_dir, stale_after_s=stale_after)
    print(json.dumps(report, indent=2, default=str) if as_json else format_status(report))


@app.command()
def diagnose(
    run_dir: Annotated[Path, typer.Argument(help="the run dir: <output_dir>/<run_name>")],
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object instead of text")] = False,
) -> None:
    """After a hang: which ranks did not join which collective, read from the flight records."""
    import json

    from trainyard.diagnose import diagnose as read_diagnosis, format_diagnosis

    report = read_diagnosis(run_dir)
    print(json.dumps(report, indent=2, default=str) if as_json else format_diagnosis(report))


@app.command()
def export(
    ckpt: Annotated[
        Path,
        typer.Argument(help="a run dir (its newest committed full checkpoint) or a checkpoints/step-XXXXXXXX folder"),
    ],
    out: Annotated[Path, typer.Option("--out", help="new (or empty) folder to write the model into")],
    merge_lora: Annotated[
        bool,
        typer.Option("--merge-lora", help="LoRA jobs: fold the adapter into the weights (default: base + adapter/)"),
    ] = False,
) -> None:
    """Write a checkpoint as a folder transformers (and PEFT) load directly."""
    from trainyard.export import export as export_checkpoint

    print(export_checkpoint(ckpt, out, merge_lora))


@app.command("eval")
def eval_checkpoint(
    args: Annotated[list[str], typer.Argument(help="CONFIG then key=value overrides")],
    checkpoint: Annotated[Path, typer.Option("--checkpoint", help="a run dir or a checkpoints/step-XXXXXXXX folder")],
    nproc: Annotated[
        int,
        typer.Option("--nproc", min=1, help="processes on this machine; >1 re-executes under torchrun"),
    ] = 1,
) -> None:
    """Evaluate a checkpoint on the job's eval set: loss, perplexity, exact match (eval.generate)."""
    import os

    from trainyard import config as config_room
    from trainyard.preflight import check_job_inputs

    config_path, overrides = _config_and_overrides(args)
    cfg = config_room.load_config(config_path, overrides)
    check_job_inputs(cfg)
    from trainyard.dist import launched_by_torchrun
    from trainyard.launch.local import run_local, torchrun_equivalent

    if nproc > 1 and not launched_by_torchrun():
        argv = ["eval", config_path, *overrides, "--checkpoint", str(checkpoint)]
        err_console.print(
            redact_text(f"launching: {torchrun_equivalent(nproc, argv, 0)}"), markup=False, soft_wrap=True
        )
        code, message = run_local(nproc, argv)
        if code:
            _fail(code, message or "a worker failed")
        return
    from trainyard.eval_checkpoint import evaluate_checkpoint, format_figures

    figures = evaluate_checkpoint(cfg, checkpoint)
    if os.environ.get("RANK", "0") == "0":
        print(format_figures(figures), flush=True)


def main() -> None:
    import click

    from trainyard.dist import exit_process

    try:
        code = app(standalone_mode=False)
    except TrainyardError as err:
        _report_user_error(err)
    except (click.ClickException, typer.TyperException) as err:  # typer >= 0.22 raises its own click copies
        err.show()
        sys.exit(2)
    except (click.exceptions.Abort, typer.Abort):
        sys.exit(130)
    exit_process(code if isinstance(code, int) else 0)


def _report_user_error(err: TrainyardError) -> None:
    """Under our own launcher the parent prints the message once; otherwise print it here."""
    import os

    from trainyard.launch.local import EXIT_FILE_ENV, write_exit_file
    from trainyard.launch.torchrun import PREEMPTED_EXIT_CODE

    if os.environ.get(EXIT_FILE_ENV):
        write_exit_file(err.exit_code, err.render())
    elif err.exit_code == PREEMPTED_EXIT_CODE:  # every rank saved and stopped; one says so
        if os.environ.get("RANK", "0") == "0":
            _notice(err.render())
    else:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        prefix = f" (rank {os.environ.get('RANK', '0')})" if world > 1 else ""
        err_console.print(f"[bold red]trainyard: error{prefix}[/]")
        err_console.print(redact_text(err.render()), markup=False)
    from trainyard.dist import exit_process

    exit_process(err.exit_code)


if __name__ == "__main__":
    main()
