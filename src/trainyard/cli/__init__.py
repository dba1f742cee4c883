"""The `trainyard` command: parse, call the library, turn user errors into exit codes. The top room: it imports
what it calls, and nothing imports it."""

from __future__ import annotations

import os
import sys

import typer

# Imported for what they do: each module registers its commands on `app`.
from trainyard.cli import cluster, estimate, jobs, runs  # noqa: F401
from trainyard.cli.app import _notice, app, err_console
from trainyard.errors import TrainyardError
from trainyard.redaction import redact_text


def main(argv: list[str] | None = None) -> None:
    """`argv` None reads the command line; tests pass a list to run a command in their own process."""
    import click

    try:
        code = app(args=argv, prog_name="trainyard", standalone_mode=False)
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
    exit_process(err.exit_code)


def exit_process(code: int) -> None:
    """A process group can exist only where torch.distributed was imported: a command that never needed it
    does not import it (and torch) to say so."""
    if "torch.distributed" in sys.modules:
        from trainyard.dist import exit_process as leave_group

        leave_group(code)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


if __name__ == "__main__":
    main()
