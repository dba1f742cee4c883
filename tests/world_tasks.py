"""Tasks a `tests.world.World` runs on its ranks: the library's own entry points, called as the CLI calls them."""

from __future__ import annotations

import os
from typing import Any


def train(config: str, overrides: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """`trainyard train CONFIG overrides` as one rank runs it under torchrun: check the inputs, run the recipe.
    `env` holds for this run only (fault injection, secrets)."""
    from trainyard.config_file import load_config
    from trainyard.doctor.preflight import check_job_inputs
    from trainyard.train.recipe import run

    saved = dict(os.environ)
    os.environ.update(env or {})
    try:
        cfg = load_config(config, overrides)
        check_job_inputs(cfg)
        return run(cfg)
    finally:
        os.environ.clear()
        os.environ.update(saved)


PATCHABLE = ("torch.distributed", "trainyard.health", "trainyard.dist", "trainyard.train.recipe")
"""Modules whose attributes a script may replace to observe the code under test (counting collectives, slowing
one): put back after each task, so the next task runs the real thing."""


def script(path: str, argv: list[str]) -> None:
    """A tests/dist script run as torchrun would run it (`__main__`, its argv, its folder on sys.path), except
    that its closing `exit_process` returns to this rank's loop instead of ending the process."""
    import importlib
    import runpy
    import sys
    from pathlib import Path

    from trainyard import dist

    modules = [importlib.import_module(name) for name in PATCHABLE]
    saved = {module: dict(vars(module)) for module in modules}
    saved_argv, saved_path, saved_env = sys.argv, list(sys.path), dict(os.environ)
    sys.argv, sys.path[0:0] = [path, *argv], [str(Path(path).parent)]
    dist.exit_process = _return
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as stop:
        if stop.code not in (0, None):
            raise
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        os.environ.clear()
        os.environ.update(saved_env)
        for module, attributes in saved.items():
            for name in set(vars(module)) - set(attributes):
                delattr(module, name)
            for name, value in attributes.items():
                if vars(module).get(name) is not value:
                    setattr(module, name, value)


def _return(code: int) -> None:
    raise SystemExit(code)
