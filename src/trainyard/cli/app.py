"""The typer app and what every command shares: failing with an exit code, the notice for a
preemption, config + overrides, `--out` files that never overwrite, and running one command to its exit code
(in this process or in a forked worker)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from trainyard.errors import TrainyardError
from trainyard.redaction import redact_text

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="One YAML-described LLM training job, from a CPU to many nodes."
)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)  # paths and messages stay on one line: grep-able

ConfigArgs = Annotated[list[str], typer.Argument(help="CONFIG then key=value overrides")]
"""The `CONFIG [k=v ...]` argument of the commands that need a job config (read by `_config_and_overrides`)."""


@app.callback()
def _root() -> None:
    """One YAML-described LLM training job, from a CPU to many nodes."""


def _fail(code: int, message: str, preempt_code: int | None = None) -> None:
    from trainyard.launch.torchrun import PREEMPTED_EXIT_CODE

    if code == (preempt_code or PREEMPTED_EXIT_CODE):
        _notice(message)
    else:
        err_console.print("[bold red]trainyard: error[/]")
        err_console.print(redact_text(message), markup=False, soft_wrap=True)
    raise typer.Exit(code)


def _notice(message: str) -> None:
    """Preempted after a committed checkpoint (exit 75): one line saying how to go on, not an error."""
    what, _, fix = message.partition("\nFix: ")
    err_console.print(redact_text(f"trainyard: {what}" + (f" — {fix}" if fix else "")), markup=False, soft_wrap=True)


REMOVE = "~"
"""`~section.key` on the command line removes a key of the job file (Hydra's and torchtune's syntax)."""


def _split_config_and_overrides(items: list[str]) -> tuple[str | None, list[str]]:
    """`train [CONFIG] [k=v ...]`: the first item is the config unless it is an override."""
    if items and "=" not in items[0] and not items[0].startswith(REMOVE):
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

    from trainyard.config_file import PRESETS, preset_path
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


def _config_and_overrides(args: list[str]) -> tuple[str, list[str]]:
    """`CONFIG [k=v ...]` where CONFIG is required (multi-node commands have no default job)."""
    config_path, overrides = _split_config_and_overrides(args)
    if config_path is None:
        from trainyard.errors import ConfigError

        raise ConfigError("no CONFIG given", fix="pass a YAML file (or a preset name) before the key=value overrides")
    return config_path, overrides


def run_command(argv: list[str] | None) -> int:
    """Run one command; its exit code, with a user error already reported (a forked worker returns it)."""
    import click

    try:
        code = app(args=argv, prog_name="trainyard", standalone_mode=False)
    except TrainyardError as err:
        return _report_user_error(err)
    except (click.ClickException, typer.TyperException) as err:  # typer >= 0.22 raises its own click copies
        err.show()
        return 2
    except (click.exceptions.Abort, typer.Abort):
        return 130
    return code if isinstance(code, int) else 0


def run_forked_worker(argv: list[str], stop_signals: tuple[str, ...]) -> None:
    """One worker forked by the local launcher (`launch.forked`). It returns on success: torch's agent counts a
    worker done when its function returns, and one that exits with 0 instead would leave the launcher waiting
    forever. Any other exit code leaves at once, as a worker interpreter does (`dist.exit_process`)."""
    from trainyard.launch.forked import as_fresh_interpreter

    as_fresh_interpreter(stop_signals)
    try:
        code = run_command(argv)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        os._exit(code)


def _report_user_error(err: TrainyardError) -> int:
    """Under our own launcher the parent prints the message once; otherwise print it here."""
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
        err_console.print(redact_text(err.render()), markup=False, soft_wrap=True)
    return err.exit_code
