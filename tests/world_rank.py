"""One rank of a `tests.world.World`: read a task per line from stdin, run it, write one JSON reply line."""

from __future__ import annotations

import gc
import importlib
import json
import os
import sys
import traceback


def main() -> None:
    replies = os.fdopen(int(os.environ["TRAINYARD_WORLD_RESULT_FD"]), "w")
    for line in sys.stdin:
        task = json.loads(line)
        module, _, name = task["function"].partition(":")
        try:
            value = getattr(importlib.import_module(module), name)(*task["args"], **task["kwargs"])
            reply = {"ok": True, "value": value, "groups": process_groups()}
        except BaseException:  # noqa: BLE001 (a SystemExit of the code under test is a reply too)
            reply = {"ok": False, "error": traceback.format_exc()}
        sys.stdout.flush()
        sys.stderr.flush()
        replies.write(json.dumps(reply, default=str) + "\n")
        replies.flush()
    gc.freeze()  # the exit's collections would walk every object torch made (~1.3 s of CPU a rank): cli.exit_process


def process_groups() -> int:
    """The process groups this rank holds, the shared one included: `tests.world.World` starts the world again
    once they are many."""
    import torch.distributed as dist

    return len(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else 0


if __name__ == "__main__":
    main()
