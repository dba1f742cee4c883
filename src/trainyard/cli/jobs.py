"""Commands that run a job here: train, eval, and prepare (a mixture's token shards)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from trainyard.cli.app import (
    ConfigArgs,
    _config_and_overrides,
    _fail,
    _split_config_and_overrides,
    app,
    err_console,
)
from trainyard.redaction import redact_text


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
        typer.Option("--world-size", min=1, help="plan for this many ranks on this machine's kind (dry run)"),
    ] = None,
    gpu: Annotated[
        Optional[str], typer.Option("--gpu", help=f"plan for nodes of this device kind (dry run): {GPU_KINDS}")
    ] = None,
    gpus_per_node: Annotated[
        Optional[int], typer.Option("--gpus-per-node", min=1, help="with --gpu: ranks per node (default 8)")
    ] = None,
    nodes: Annotated[Optional[int], typer.Option("--nodes", min=1, help="with --gpu: nodes (default 1)")] = None,
    resume: Annotated[
        Optional[str],
        typer.Option("--resume", help="auto (newest committed checkpoint of the run), never, or a checkpoint path; "
                     "the same as checkpoint.resume"),
    ] = None,
    skip_data_check: Annotated[
        bool, typer.Option("--skip-data-check", help="with --dry-run: do not read the data here (it exists only on "
                           "the cluster); memory is then planned for rows of data.max_length")
    ] = False,
) -> None:
    """Train. No CONFIG runs the built-in quickstart. --dry-run reads the data and plans for the target."""
    from trainyard import config_file as config_room
    from trainyard.doctor.preflight import check_job_inputs

    config_path, overrides = _split_config_and_overrides(list(args or []))
    if resume is not None:
        overrides = [*overrides, f"checkpoint.resume={resume}"]
    cfg = config_room.load_config(config_path, overrides)
    if nproc is None:
        nproc = 2 if config_path is None else 1  # the quickstart is a 2-process DDP job
    if skip_data_check and not dry_run:
        from trainyard.errors import OptionError

        raise OptionError("--skip-data-check is for a dry run: training reads the data",
                          fix="add --dry-run, or drop --skip-data-check")
    if dry_run:
        from trainyard.plan import dry_run as plan_dry_run

        target = _target(gpu, gpus_per_node, nodes, world_size or nproc)
        text, problems = plan_dry_run(cfg, target, read_data=not skip_data_check)
        print("\n".join([*cfg._notes, text]))
        if problems:
            from trainyard.errors import PlanError

            elsewhere = "" if gpu else " (this plan is for this machine: pass --gpu KIND --gpus-per-node N --nodes M)"
            raise PlanError("the job cannot run as planned:\n- " + "\n- ".join(problems),
                            fix=f"change what each line names, then run the dry run again{elsewhere}")
        return
    check_job_inputs(cfg)  # before torch is imported: bad input fails in seconds
    from trainyard.launch.local import launched_by_torchrun, run_local, torchrun_equivalent

    if nproc > 1 and not launched_by_torchrun():
        argv = ["train", *([config_path] if config_path else []), *overrides]
        err_console.print(
            redact_text(f"launching: {torchrun_equivalent(nproc, argv, max_restarts)}"), markup=False, soft_wrap=True
        )
        code, message = run_local(nproc, argv, max_restarts, cfg)
        if code:
            _fail(code, message or "a worker failed")
        return
    from trainyard.launch.allocator import return_freed_memory
    from trainyard.train.recipe import run

    return_freed_memory()  # every training process: this one, or each worker the launcher started
    summary = run(cfg)
    _print_outcome(summary, cfg.run_dir)


GPU_KINDS = "h100-80gb, h100-pcie, h200, a100-80gb, a100-40gb, l4, cpu"


def _target(gpu: str | None, gpus_per_node: int | None, nodes: int | None, world_size: int):  # -> plan.Target
    """The cluster a dry run plans for: --gpu with its shape, or this machine's kind with --world-size ranks."""
    from trainyard.errors import OptionError
    from trainyard.plan import Target

    if gpu is None:
        if gpus_per_node is not None or nodes is not None:
            raise OptionError("--gpus-per-node and --nodes describe --gpu nodes", fix="add --gpu, e.g. --gpu h100-80gb")
        return Target.here(world_size)
    from trainyard.hardware import gpu as known_gpu

    known_gpu(gpu)
    target = Target(gpu, gpus_per_node or 8, nodes or 1)
    return target


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


@app.command("eval")
def eval_checkpoint(
    args: ConfigArgs,
    checkpoint: Annotated[Path, typer.Option("--checkpoint", help="a run dir or a checkpoints/step-XXXXXXXX folder")],
    nproc: Annotated[
        int,
        typer.Option("--nproc", min=1, help="processes on this machine; >1 re-executes under torchrun"),
    ] = 1,
) -> None:
    """Evaluate a checkpoint on the job's eval set: loss, perplexity, exact match (eval.generate)."""
    import os

    from trainyard import config_file as config_room
    from trainyard.doctor.preflight import check_job_inputs

    config_path, overrides = _config_and_overrides(args)
    cfg = config_room.load_config(config_path, overrides)
    check_job_inputs(cfg)
    from trainyard.launch.local import launched_by_torchrun, run_local, torchrun_equivalent

    if nproc > 1 and not launched_by_torchrun():
        argv = ["eval", config_path, *overrides, "--checkpoint", str(checkpoint)]
        err_console.print(
            redact_text(f"launching: {torchrun_equivalent(nproc, argv, 0)}"), markup=False, soft_wrap=True
        )
        code, message = run_local(nproc, argv, cfg=cfg)
        if code:
            _fail(code, message or "a worker failed")
        return
    from trainyard.checkpoint.evaluate import evaluate_checkpoint, format_figures

    figures = evaluate_checkpoint(cfg, checkpoint)
    if os.environ.get("RANK", "0") == "0":
        print(format_figures(figures), flush=True)


@app.command(context_settings={"allow_extra_args": False})
def prepare(
    args: Annotated[list[str], typer.Argument(help="CONFIG (YAML file or preset name) then key=value overrides")],
) -> None:
    """Tokenize the job's data.mixture once into memory-mapped token shards (reused by every later run)."""
    from trainyard import config_file as config_room
    from trainyard.data.mixture import unigram_entropy
    from trainyard.data.shards import check_sources, prepare
    from trainyard.model import source as source_room

    config_path, overrides = _config_and_overrides(args)
    cfg = config_room.load_config(config_path, overrides)
    check_sources(cfg)  # no mixture, or a path that matches nothing, fails before the tokenizer is loaded
    model_path = source_room.resolve_model_path(cfg.model) if cfg.model.path is not None else None
    tokenizer = source_room.load_tokenizer(cfg.model, model_path)
    prepared = prepare(cfg, tokenizer, log=lambda line: err_console.print(line, markup=False, soft_wrap=True))
    print(prepared.folder)
    for i, source in enumerate(prepared.sources):
        print(
            f"data.mixture[{i}] {source.path}: {source.documents:,} documents, {source.tokens:,} tokens, "
            f"{source.bytes:,} bytes ({prepared.dtype})"
        )
    weights = [source.weight for source in cfg.data.mixture or []]
    print(f"unigram entropy of the mixture: {unigram_entropy(prepared, weights):.4f} nats/token (the loss of a model "
          "that knows only how often each token occurs)")
