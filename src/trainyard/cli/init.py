"""`trainyard init`: a first, commented job file from a model and a data file (the choices are the plan's)."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Annotated, Literal, Optional

import typer

from trainyard.cli.app import _check_out, _write_out, app, err_console
from trainyard.cli.jobs import GPU_KINDS, _target


@app.command("init")
def init_command(
    model: Annotated[str, typer.Argument(help="a hub id, or a local folder with the model's config.json")],
    data: Annotated[str, typer.Argument(help="the training rows: a .jsonl, .json or .parquet file")],
    gpu: Annotated[
        Optional[str], typer.Option("--gpu", help=f"plan for nodes of this device kind: {GPU_KINDS}")
    ] = None,
    gpus_per_node: Annotated[
        Optional[int], typer.Option("--gpus-per-node", min=1, help="with --gpu: GPUs per node (default 8)")
    ] = None,
    nodes: Annotated[Optional[int], typer.Option("--nodes", min=1, help="with --gpu: nodes (default 1)")] = None,
    objective: Annotated[
        Literal["sft", "dpo"],
        typer.Option("--objective", metavar="OBJECTIVE", help="sft, or dpo on chosen/rejected pairs"),
    ] = "sft",
    out: Annotated[Path, typer.Option("--out", help="the job file to write")] = Path("job.yaml"),
    force: Annotated[bool, typer.Option("--force", help="replace --out if it exists")] = False,
) -> None:
    """Write a commented job file: the data's format and lengths, the plan's strategy and precision for the
    cluster, only what differs from the defaults. It passes `train --dry-run` for that cluster."""
    from trainyard import jobfile

    _check_out(out, force, None)
    target = _target(gpu, gpus_per_node, nodes, 1)
    draft = jobfile.draft_job(model, data, target, objective)
    cluster = ["--gpu", gpu, "--gpus-per-node", str(target.gpus_per_node), "--nodes", str(target.nodes)] if gpu else []
    command = shlex.join(["trainyard", "init", model, data, *cluster, *(["--objective", objective]
                                                                       if objective != "sft" else [])])
    check = shlex.join(["trainyard", "train", str(out), "--dry-run", *cluster])
    text = jobfile.render(draft, command, check)
    jobfile.check_with_dry_run(text, out.name, target)
    _write_out(out, text)
    for note in draft.notes:
        err_console.print(f"trainyard: {note}", markup=False, soft_wrap=True)
    print(f"wrote {out}; check it with: {check}")
