"""The agent process of `trainyard launch`: torchrun's own agent, run by `launch.torchrun.run_torchrun` as
`python -m trainyard.launch.agent` with exactly torchrun's flags."""

from __future__ import annotations

import gc
import os
import sys

from trainyard.launch import forked
from trainyard.launch.local import (
    SIGNALS_TO_FORWARD,
    ignore_keep_alive_self_join,
    signal_behind,
    stop_on_first_signal,
)
from trainyard.launch.torchrun import DEFAULT_MASTER_PORT, PREEMPTED_EXIT_CODE, SHARED_STORE_ENV, USER_ERROR_EXIT_CODE


def main(argv: list[str]) -> int:
    """torchrun, except that a stop signal or workers preempted after a save end in an exit code, and that on a
    CPU-only torch build the workers are forked from a fork server (`forked`), as `trainyard train --nproc` does.

    Slurm signals every process of a step, the agent included, and torchrun answers a signal
    with a SignalException traceback and workers that exit 75 with a ChildFailedError report,
    although the workers saved and said so in their exit files. Workers that all exit 2 printed the
    user's error and its fix; torchrun's report would bury it. Other failures keep torchrun's report.
    """
    # torch 2.13's c10d rendezvous shares one TCP store for the workers, made by the first round's rank 0 node, which
    # never publishes its address under a later round's keys: a node that comes back after a host died waits for it
    # until the store times out (DistStoreError in _assign_worker_ranks). Each round's own store avoids that.
    os.environ.setdefault(SHARED_STORE_ENV, "1")
    fork = forked.forks_safely() and _runs_trainyard(argv)
    if fork:  # imports the workers' stack while this process imports torch's agent
        forked.start_fork_server(forked.modules_for(None), SIGNALS_TO_FORWARD)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    stop_on_first_signal()
    try:
        if fork:
            _run_forked(argv)
        else:
            torchrun_main(argv)
    except ChildFailedError as err:
        codes = {failure.exitcode for failure in err.failures.values()}
        if codes == {PREEMPTED_EXIT_CODE}:
            return PREEMPTED_EXIT_CODE
        if codes == {USER_ERROR_EXIT_CODE}:  # bad input: the workers printed what to fix; no agent traceback
            return USER_ERROR_EXIT_CODE
        raise
    except Exception as err:  # a stop signal: the agent stopped its workers; their exit files say how they ended
        stop = signal_behind(err)
        if stop is None:
            raise
        ignore_keep_alive_self_join()
        return 128 + int(stop.sigval)
    finally:
        if fork:
            forked.stop_fork_server()
    return 0


def _runs_trainyard(argv: list[str]) -> bool:
    """Whether torchrun's command is `-m trainyard.cli ...` (tests run the agent over scripts of their own)."""
    return any(argv[i : i + 2] == ["-m", "trainyard.cli"] for i in range(len(argv) - 1))


def _run_forked(argv: list[str]) -> None:
    """What torchrun's `run` does with its flags (a standalone node's rendezvous, the default master port), with
    forked workers running the `trainyard` command torchrun would have started (`-m trainyard.cli ARGS`)."""
    import uuid

    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    args = parse_args(argv)
    if args.standalone:
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = DEFAULT_MASTER_PORT
    config, _, _ = config_from_args(args)
    config.start_method = "forkserver"
    forked.quiet_agent_tracebacks()
    elastic_launch(config, entrypoint=forked.worker())(list(args.training_script_args), SIGNALS_TO_FORWARD)


if __name__ == "__main__":
    code = main(sys.argv[1:])
    gc.freeze()  # as `trainyard.cli.exit_process`: the exit's collections would walk every object torch made
    sys.exit(code)
