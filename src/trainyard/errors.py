"""User-facing errors: what is wrong, where, and how to fix it.

The CLI turns any `TrainyardError` into one short paragraph and exit code 2 (or the
error's own `exit_code`); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class TrainyardError(Exception):
    """A problem the user can fix: bad config, data, path or checkpoint."""

    exit_code: int = 2

    def __init__(
        self,
        what: str,
        *,
        where: str | None = None,
        fix: str | None = None,
    ) -> None:
        self.what = what
        self.where = where
        self.fix = fix
        super().__init__(self.render())

    def render(self) -> str:
        parts = [f"{self.where}: {self.what}" if self.where else self.what]
        if self.fix:
            parts.append(f"Fix: {self.fix}")
        return "\n".join(parts)


class ConfigError(TrainyardError):
    """The job config (YAML file or override) is invalid."""


class DataError(TrainyardError):
    """A data file or row cannot be used."""


class ModelError(TrainyardError):
    """A model path, file or config cannot be loaded."""


class CheckpointError(TrainyardError):
    """A checkpoint is missing, incomplete or incompatible."""


class DistError(TrainyardError):
    """The distributed setup (ranks, rendezvous, timeouts) failed in a way the user can fix."""

    exit_code = 1


class OptionError(TrainyardError):
    """A command-line option has a value that cannot be used."""


class PlanError(TrainyardError):
    """The job cannot run as planned: it does not fit its devices, its data is unusable, or its resume point."""


class NonFiniteError(TrainyardError):
    """A non-finite loss or gradient, named with its step and ranks (train.on_nonfinite: error)."""

    exit_code = 1


class OutOfMemory(TrainyardError):
    """The device ran out of memory: which step and batch, and what the estimate predicted."""

    exit_code = 1


class Preempted(TrainyardError):
    """Stopped by a preemption signal after a checkpoint was committed: requeue me."""

    exit_code = 75


class RunDirError(TrainyardError):
    """A run directory (metrics.jsonl, summary.json) is missing or unreadable."""
