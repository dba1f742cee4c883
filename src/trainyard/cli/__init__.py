"""The `trainyard` command: parse, call the library, turn user errors into exit codes. The top room: it imports
what it calls, and nothing imports it."""

from __future__ import annotations

import gc
import sys

# Imported for what they do: each module registers its commands on `app`.
from trainyard.cli import cluster, estimate, init, jobs, runs  # noqa: F401
from trainyard.cli.app import app, run_command  # noqa: F401 (app: tests invoke it)


def main(argv: list[str] | None = None) -> None:
    """`argv` None reads the command line; tests pass a list to run a command in their own process."""
    exit_process(run_command(argv))


def exit_process(code: int) -> None:
    """A process group can exist only where torch.distributed was imported: a command that never needed it
    does not import it (and torch) to say so.

    Everything alive is moved out of the cyclic collector's reach first (`gc.freeze`): the interpreter's exit
    collects several times over every object torch and transformers made, 1.2-1.5 s of CPU after importing the
    training stack, 0.15 s frozen. atexit handlers still run, and objects outside reference cycles are still
    released as ever; only cycles are left to the process's end."""
    gc.freeze()
    if "torch.distributed" in sys.modules:
        from trainyard.dist import exit_process as leave_group

        leave_group(code)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


if __name__ == "__main__":
    main()
