"""Find the fault in minutes: which rank went non-finite, drifted, or never arrived.

These checks run only at their interval or on a failure path, where every rank is present,
so they cost nothing on a healthy step. `TRAINYARD_FAULT` injects a fault on purpose
(`nan@rank1:step3`, `desync@rank1:step3`, `leak@rank1:step3`) so the detection itself can be tested.
"""

from __future__ import annotations

import faulthandler
import logging
import math
import os
import re
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from trainyard.dist import FLIGHT_DIR, DistInfo, all_gather_rows, flight_recorder_enabled, group_ranks
from trainyard.errors import DistError
from trainyard.parallel.parallelize import unwrap
from trainyard.runs import layout as run_layout
from trainyard.runs.status import describe_ranks, silent_ranks

FAULT_ENV = "TRAINYARD_FAULT"
_COMM_FAILURE = re.compile(r"timed out|timeout|connection (closed|reset)|broken pipe|peer|gloo|nccl", re.IGNORECASE)


def injected(kind: str, info: DistInfo, step: int) -> bool:
    """True where TRAINYARD_FAULT asks for this fault on this rank at this step."""
    wanted = os.environ.get(FAULT_ENV, "")
    return wanted == f"{kind}@rank{info.rank}:step{step}"


LEAK_BYTES = 32 * 2**20
"""What an injected leak keeps per log window: far above the noise of a process's RSS between windows."""
_leaked: list[torch.Tensor] = []


def leak_if_injected(info: DistInfo, step: int) -> None:
    """`leak@rankR:stepN`: from the log at step N on, rank R keeps LEAK_BYTES more on its device at each log, as a
    list of tensors kept across steps would. A log without that fault lets go of what an earlier run kept."""
    wanted = re.fullmatch(r"leak@rank(\d+):step(\d+)", os.environ.get(FAULT_ENV, ""))
    if wanted is None or int(wanted[1]) != info.rank or step < int(wanted[2]):
        _leaked.clear()
        return
    _leaked.append(torch.ones(LEAK_BYTES // 4, device=info.device))  # written, so resident (unlike a zeroed map)


def corrupt_one_parameter(model: torch.nn.Module) -> None:
    with torch.no_grad():
        next(p for p in unwrap(model).parameters() if p.requires_grad).add_(0.5)


def flagged_ranks(flag: bool, info: DistInfo, group: dist.ProcessGroup | None = None) -> list[int]:
    """Global ranks of the group (the world by default) where `flag` holds; call only where every rank of the group
    reaches this line (a DiLoCo site checks its own steps without waiting for the other sites)."""
    if not info.distributed:
        return [0] if flag else []
    mine = torch.tensor([1.0 if flag else 0.0], device=info.device)
    every = all_gather_rows(mine, group)
    return [rank for rank, value in zip(group_ranks(group), every.view(-1).tolist(), strict=True) if value > 0]


def replica_norm(model: torch.nn.Module) -> float:
    """Norm of the trainable weights: identical on every DDP replica unless they drifted."""
    total = sum(p.detach().double().pow(2).sum() for p in unwrap(model).parameters() if p.requires_grad)
    return math.sqrt(float(total))


def check_replicas_agree(model: torch.nn.Module, info: DistInfo, step: int, tolerance: float) -> None:
    """All-gather each rank's weight norm; name the ranks that differ from rank 0."""
    mine = torch.tensor([replica_norm(model)], dtype=torch.float64, device=info.device)
    every = [torch.zeros_like(mine) for _ in range(info.world_size)]
    dist.all_gather(every, mine)
    norms = [value.item() for value in every]
    reference = norms[0]
    drifted = [r for r, norm in enumerate(norms) if abs(norm - reference) > tolerance * max(1.0, abs(reference))]
    if drifted:
        shown = ", ".join(f"rank {r}: {norms[r]:.8g}" for r in drifted)
        raise DistError(
            f"replicas desynced at step {step}: weight norm on rank 0 is {reference:.8g}, but {shown}",
            fix="a rank ran different code or data, or hardware corrupted memory: stop, check that node, "
            "resume from the last checkpoint",
        )


def dump_stacks(run_dir: Path, info: DistInfo) -> Path:
    """This rank's Python stacks (every thread), for the post-mortem of a hang."""
    path = run_dir / run_layout.LOGS / f"stack-rank-{info.rank}.txt"
    with open(path, "w") as handle:
        faulthandler.dump_traceback(file=handle, all_threads=True)
    return path


def looks_like_comm_failure(err: BaseException) -> bool:
    return bool(_COMM_FAILURE.search(str(err)))


def _store():
    """The rendezvous key-value store every rank already reaches (outside gloo/NCCL pairs)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


# Where in a step a rank last was, written just before it enters a collective.
CONTROL, GRAD_SYNC, REPORT = 0.1, 0.5, 0.8


def record_progress(info: DistInfo, step: int, phase: float) -> None:
    """A store write before each blocking collective: after a hang, the ranks whose mark is
    behind the others' are the ones that never arrived."""
    store = _store() if info.distributed else None
    if store is not None:
        store.set(f"trainyard/progress/{info.rank}", f"{step + phase:.1f}")


def _ranks_that_failed_too(store, ranks: list[int], wait_s: float) -> set[int]:
    """Of `ranks`, those that reached the failure path themselves within `wait_s`: alive, so not the lost ones."""
    deadline = time.monotonic() + wait_s
    failed: set[int] = set()
    while True:
        failed |= {rank for rank in ranks if store.check([f"trainyard/failed/{rank}"])}
        if failed == set(ranks) or time.monotonic() >= deadline:
            return failed
        time.sleep(0.1)


def missing_ranks(info: DistInfo, wait_s: float = 3.0) -> str:
    """Ranks that never reached the step the others are stuck in, read from the store.

    A live rank can be behind too: when a peer dies after its part of a collective, the ranks that
    finished it move on while the others fail inside it. Each failing rank marks itself in the
    store, and the ranks that mark themselves within `wait_s` are not named."""
    store = _store()
    if store is None:
        return "the rendezvous store is gone too (the launcher or rank 0's node died?)"
    store.set_timeout(timedelta(seconds=5))  # a cut-off node must not hang here too
    try:
        mine = store.get(f"trainyard/progress/{info.rank}")
        store.set(f"trainyard/failed/{info.rank}", mine)
    except RuntimeError:
        return "this node cannot reach the rendezvous store either: it is the one cut off (or the store's host died)"
    reached = {}
    for rank in range(info.world_size):
        try:
            reached[rank] = float(store.get(f"trainyard/progress/{rank}").decode())
        except (RuntimeError, ValueError):  # unreachable store or a rank that never wrote
            reached[rank] = -1
    front = max(reached.values())
    behind = [rank for rank, step in reached.items() if step < front and rank != info.rank]
    try:
        alive = _ranks_that_failed_too(store, behind, wait_s) if behind else set()
    except RuntimeError:
        alive = set()
    lost = [rank for rank in behind if rank not in alive]
    if lost:
        shown = ", ".join(f"rank {r} last seen at step {reached[r]:g}" for r in lost)
        return f"ranks {','.join(map(str, lost))} did not arrive ({shown}; the others waited at {front:g})"
    return f"every live rank reached the same point ({front:g}); the fault is inside that collective"


def dump_flight_record(run_dir: Path, info: DistInfo) -> list[Path]:
    """Write this rank's flight record (its last collectives) into <run_dir>/flight/.

    Gloo has no watchdog to do it, and NCCL's only does when it is the one that times
    out; a rank that gets its failure back in Python writes its own here. The format is
    torch's own (`_dump_fr_trace`), the one the NCCL watchdog writes."""
    if not flight_recorder_enabled():
        return []
    c10d = torch._C._distributed_c10d
    folder = Path(run_dir) / FLIGHT_DIR
    written = []
    dumps = [("gloo", getattr(c10d, "_dump_fr_trace", None))]
    if info.backend and "nccl" in info.backend:
        dumps.append(("nccl", getattr(c10d, "_dump_nccl_trace", None)))
    for kind, dump in dumps:
        path = folder / f"{kind}-rank-{info.rank}"
        if dump is None or (kind == "nccl" and path.exists()):  # the watchdog's own dump wins
            continue
        try:
            data = dump(True, True, False)  # collectives, stack traces, not only the active ones
        except RuntimeError:
            continue  # no recorder for this backend in this build
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
        written.append(path)
    return written


def _log_to_files(level: int, message: str, exc: BaseException | None = None) -> None:
    """To logs/rank-<r>.log only: a traceback there helps; on the console it buries the message."""
    logger = logging.getLogger("trainyard")
    exc_info = (type(exc), exc, exc.__traceback__) if exc is not None else None
    record = logger.makeRecord(logger.name, level, __file__, 0, message, None, exc_info)
    for handler in logger.handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def explain_comm_failure(err: BaseException, info: DistInfo, run_dir: Path, step: int, timeout_s: float) -> DistError:
    """Turn a collective timeout or lost peer into a message naming the ranks and hosts.

    The original exception, with its traceback, goes to this rank's log first; the flight
    record is written before anything else runs, so it ends at the failed collective."""
    _log_to_files(logging.ERROR, f"collective failed at step {step}", err)
    flight = dump_flight_record(run_dir, info)
    stacks = dump_stacks(run_dir, info)
    who = missing_ranks(info)
    if "did not arrive" not in who:  # same point in the store: ask the heartbeats who went silent
        silent = silent_ranks(run_dir, info.rank)
        if silent:
            ranks = ",".join(str(beat["rank"]) for beat in silent)
            who = f"ranks {ranks} did not arrive ({describe_ranks(silent, time.time())} stopped beating)"
    first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    message = f"rank {info.rank} lost its peers at step {step}: {who}. The collective failed with: {first_line}"
    logging.getLogger("trainyard").error(message)
    return DistError(
        message,
        fix=(
            f"`trainyard diagnose {run_dir}` names the ranks that did not join which collective"
            f"{' (flight record in ' + str(flight[0].parent) + ')' if flight else ''}; "
            f"logs/rank-*.log hold each rank's error; this rank's stacks are in {stacks}. "
            f"dist.timeout_s is {timeout_s:g}s"
        ),
    )
