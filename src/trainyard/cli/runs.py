"""Commands that read a run dir or a checkpoint: status, diagnose, report, export."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from trainyard.cli.app import (
    _positive,
    app,
)


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

    from trainyard.runs.status import format_status, read_status

    report = read_status(run_dir, stale_after_s=stale_after)
    print(json.dumps(report, indent=2, default=str) if as_json else format_status(report))


@app.command()
def diagnose(
    run_dir: Annotated[Path, typer.Argument(help="the run dir: <output_dir>/<run_name>")],
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object instead of text")] = False,
) -> None:
    """After a hang: which ranks did not join which collective, read from the flight records."""
    import json

    from trainyard.runs.diagnose import diagnose as read_diagnosis
    from trainyard.runs.diagnose import format_diagnosis

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
    from trainyard.checkpoint.export import export as export_checkpoint

    print(export_checkpoint(ckpt, out, merge_lora))


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
    from trainyard.runs.report import write_report

    for path in write_report(run_dirs, out, force=force):
        print(path)
