"""Which ranks did not join which collective: a hang read from its run dir alone.

Under NCCL the watchdog kills a timed-out process before Python sees an exception, so the
store progress marks never get read. What survives is the flight record: each process
group's last collectives (op, sequence number, sizes, state) that the NCCL watchdog writes
to <run_dir>/flight/nccl-rank-<r> on a timeout, and that `health` writes for Gloo
(gloo-rank-<r>). Comparing the ranks' last sequence numbers names the ranks that never
entered the collective the others wait in. Like `status`, this never imports torch.
"""

from __future__ import annotations

import ast
import io
import json
import pickle
import re
import time
from pathlib import Path
from typing import Any

from trainyard.errors import ConfigError
from trainyard.runs import layout as run_layout
from trainyard.runs.status import describe_ranks, read_heartbeats

FLIGHT_DIR = run_layout.FLIGHT
# <kind>-rank-<r>, with a timestamp after it where TORCH_FR_DUMP_DYNAMIC_FILE_NAME is set
_DUMP_NAME = re.compile(r"^(?P<kind>[a-z]+)-rank-(?P<rank>\d+)(\D.*)?$")


class _PlainData(pickle.Unpickler):
    """Torch's dumps hold only dicts, lists, tuples, strings and numbers: refusing every
    class means a file in the run dir cannot make this process run code."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"flight record refers to {module}.{name}; not a torch flight-recorder dump")


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0  # replaced meanwhile: read_bytes below skips it


def read_flight_records(run_dir: Path) -> dict[tuple[str, int], dict[str, Any]]:
    """Every readable dump under <run_dir>/flight/, keyed by (backend kind, rank); the newest
    one where a rank wrote several."""
    records = {}
    for path in sorted((Path(run_dir) / FLIGHT_DIR).glob("*-rank-*"), key=_mtime):
        match = _DUMP_NAME.match(path.name)
        if not match:
            continue
        try:
            data = _PlainData(io.BytesIO(path.read_bytes())).load()
        except (OSError, pickle.UnpicklingError, EOFError, ValueError):
            continue  # half-written, or not a dump
        if isinstance(data, dict) and isinstance(data.get("entries"), list):
            records[(match["kind"], int(match["rank"]))] = data
    return records


def _world_size(run_dir: Path) -> int | None:
    try:
        return int(json.loads((run_dir / run_layout.ENV).read_text())["world_size"])
    except (OSError, KeyError, TypeError, ValueError):
        return None


def _group_ranks(dumps: dict[int, dict[str, Any]], group: str, desc: str, world: int | None) -> list[int] | None:
    """The group's ranks from the dump's pg_config (NCCL records them), else all ranks for the
    default group; None where the membership is unknown (a Gloo subgroup)."""
    for data in dumps.values():
        listed = (data.get("pg_config") or {}).get(group, {}).get("ranks")
        try:
            ranks = ast.literal_eval(listed) if isinstance(listed, str) else listed
        except (ValueError, SyntaxError):
            ranks = None
        if ranks:
            return sorted(int(r) for r in ranks)
    if desc == "default_pg" and world:
        return list(range(world))
    return None


def _collectives(data: dict[str, Any], group: str) -> list[dict[str, Any]]:
    return [
        e for e in data["entries"]
        if not e.get("is_p2p")
        and e.get("collective_seq_id", 0) > 0
        and tuple(e.get("process_group", ("", "")))[0] == group
    ]


def _op(entry: dict[str, Any]) -> str:
    return str(entry.get("profiling_name", "?")).split(":", 1)[-1]


def analyse_group(
    kind: str, group: str, desc: str, dumps: dict[int, dict[str, Any]], world: int | None
) -> dict[str, Any]:
    """One process group: the newest collective any rank entered, who is in it, who is behind."""
    last: dict[int, dict[str, Any]] = {}
    for rank, data in dumps.items():
        entries = _collectives(data, group)
        if entries:
            last[rank] = max(entries, key=lambda e: e["collective_seq_id"])
    seq = max(e["collective_seq_id"] for e in last.values())
    front = sorted(rank for rank, e in last.items() if e["collective_seq_id"] == seq)
    entry = last[front[0]]
    ranks = _group_ranks(dumps, group, desc, world)
    expected = ranks if ranks is not None else sorted(last)
    behind = {  # last_seq None: a record, but no collective of this group left in its ring
        rank: {"last_seq": last[rank]["collective_seq_id"], "last_op": _op(last[rank])} if rank in last
        else {"last_seq": None, "last_op": None}
        for rank in expected if rank in dumps and (rank not in last or last[rank]["collective_seq_id"] < seq)
    }
    no_record = [rank for rank in expected if rank not in dumps]
    ops = {rank: (_op(last[rank]), last[rank].get("input_sizes")) for rank in front}
    mismatched = {str(r): {"op": op, "input_sizes": sizes} for r, (op, sizes) in ops.items()}
    if len({json.dumps(v) for v in ops.values()}) == 1:
        mismatched = None
    states = {rank: last[rank].get("state") for rank in front}
    return {
        "backend": kind,
        "group": group,
        "group_desc": desc,
        "seq": seq,
        "op": _op(entry),
        "input_sizes": entry.get("input_sizes"),
        "entered": sorted(front),
        "states": states,
        "completed_everywhere": all(s == "completed" for s in states.values()) and not behind and not no_record,
        "behind": behind,
        "no_record": no_record,
        "membership_known": ranks is not None,
        "mismatched": mismatched,
        "created_ns": max(int(e.get("time_created_ns") or 0) for e in last.values()),
        "stack": [f"{f.get('filename')}:{f.get('line')} {f.get('name')}" for f in (entry.get("frames") or [])[:16]],
    }


def diagnose(run_dir: Path | str, now: float | None = None) -> dict[str, Any]:
    """The process groups whose ranks disagree, newest first, with the silent heartbeats."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(
            f"run dir {run_dir} does not exist", fix="pass <output_dir>/<run_name> of the job, e.g. runs/tiny"
        )
    now = time.time() if now is None else now
    records = read_flight_records(run_dir)
    world = _world_size(run_dir)
    groups = []
    for kind in sorted({k for k, _ in records}):
        dumps = {rank: data for (k, rank), data in records.items() if k == kind}
        names = {tuple(e.get("process_group", ("", ""))) for data in dumps.values() for e in data["entries"]}
        for group, desc in sorted(names):
            if any(_collectives(data, group) for data in dumps.values()):
                groups.append(analyse_group(kind, group, desc, dumps, world))
    suspect = [g for g in groups if g["behind"] or g["no_record"] or g["mismatched"]]
    suspect.sort(key=lambda g: g["created_ns"], reverse=True)
    beats = {beat["rank"]: beat for beat in read_heartbeats(run_dir)}
    return {
        "run_dir": str(run_dir),
        "dumps": sorted(f"{kind}-rank-{rank}" for kind, rank in records),
        "world_size": world,
        "hangs": suspect,
        "groups": groups,
        "heartbeats": {str(r): {**b, "age_s": round(now - float(b.get("time", 0)), 1)} for r, b in beats.items()},
        "finished": (run_dir / run_layout.SUMMARY).is_file(),
    }


def _rank_note(rank: int, report: dict[str, Any], now: float) -> str:
    beat = report["heartbeats"].get(str(rank))
    if beat is None:
        return ""
    return f"; heartbeat: {describe_ranks([beat], now)}{_py_spy(beat)}"


def _py_spy(beat: dict[str, Any]) -> str:
    """'; pid 4122: `py-spy dump --pid 4122` on gpu7 shows where it is': the stack of a rank that stays away is what
    a hang's fix starts from, and its PID is on one host only."""
    pid = beat.get("pid")
    if pid is None:
        return ""
    return f"; pid {pid}: `py-spy dump --pid {pid}` on {beat.get('host', 'its host')} shows where it is"


def _ranks_now(report: dict[str, Any], now: float) -> list[str]:
    """Without a flight record no collective has timed out yet: a run still going may be hanging inside one, and
    each rank's stack says where. One line a rank, with its PID and the py-spy line to run on its host."""
    if report["finished"] or not report["heartbeats"]:
        return []
    beats = sorted(report["heartbeats"].values(), key=lambda beat: beat.get("rank", -1))
    return ["  if it hangs now, each rank's stack says where:"] + [
        f"    {describe_ranks([beat], now)}{_py_spy(beat)}" for beat in beats
    ]


def format_diagnosis(report: dict[str, Any], now: float | None = None) -> str:
    """A few lines naming, per process group, the collective and the ranks that did not join."""
    now = time.time() if now is None else now
    if not report["dumps"]:
        return "\n".join([
            f"{report['run_dir']}: no flight record in {FLIGHT_DIR}/ (no collective failed, or the recorder "
            "was off: TORCH_FR_BUFFER_SIZE=0)", *_ranks_now(report, now)
        ])
    lines = [f"{report['run_dir']}: flight records from {len(report['dumps'])} dumps ({', '.join(report['dumps'])})"]
    if not report["hangs"]:
        lines.append("  every rank that left a record reached the same collective in every group;"
                     " the fault is inside it (network, NIC, a GPU), not a rank that stayed away")
    for hang in report["hangs"]:
        group = f"group {hang['group']} ({hang['group_desc']}, {hang['backend']})"
        late = sorted([*hang["behind"], *hang["no_record"]])
        if late:
            lines.append(f"  ranks {','.join(map(str, late))} did not join {hang['op']} #{hang['seq']} of {group}; "
                         f"ranks {','.join(map(str, hang['entered']))} entered it and waited")
        else:
            lines.append(f"  every rank reached collective #{hang['seq']} of {group}, but not the same one")
        for rank, seen in sorted(hang["behind"].items()):
            note = _rank_note(rank, report, now)
            if seen["last_seq"] is None:
                lines.append(f"    rank {rank}: its record holds no collective of this group{note}")
            else:
                lines.append(f"    rank {rank}: last entered {seen['last_op']} #{seen['last_seq']}{note}")
        for rank in hang["no_record"]:
            lines.append(f"    rank {rank}: left no flight record (stopped, killed, or frozen before it could dump)"
                         f"{_rank_note(rank, report, now)}")
        if hang["mismatched"]:
            calls = sorted(hang["mismatched"].items(), key=lambda item: int(item[0]))
            shown = "; ".join(f"rank {r}: {v['op']} {v['input_sizes']}" for r, v in calls)
            lines.append(f"    different collectives at #{hang['seq']}: {shown}")
        if not hang["membership_known"]:
            lines.append("    (this group's members are not recorded: only ranks with a record are compared)")
        caller = next((frame for frame in hang["stack"] if "/torch/" not in frame), None)
        if caller:
            lines.append(f"    entered from: {caller}")
    return "\n".join(lines)
