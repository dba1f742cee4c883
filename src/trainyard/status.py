"""Where a run stands, read from its run dir alone, and the heartbeats that make it possible.

Seed 003 watched a four-node job with `kubectl logs | grep` on each pod. Everything needed
to answer "how far, how fast, when done, is anyone dead" is already in the run dir on the
shared disk: metrics.jsonl, checkpoints/LATEST, summary.json, and one heartbeat file per
rank. So any node, or a laptop with the disk mounted, can ask.
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from trainyard.errors import ConfigError, DistError

HEARTBEAT_INTERVAL_S = 2.0
STALE_AFTER_S = 60.0
_TAIL_BYTES = 1 << 20
_RATE_WINDOW = 10


# ---------------------------------------------------------------- heartbeats (written by ranks)


def heartbeat_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / "heartbeats" / f"rank-{rank}.json"


def write_heartbeat(run_dir: Path, rank: int, step: int) -> None:
    """{"rank","host","pid","step","time"} (+ "node", torchrun's node rank), replaced atomically."""
    path = heartbeat_path(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    beat = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "step": step, "time": time.time()}
    if os.environ.get("GROUP_RANK", "").isdigit():
        beat["node"] = int(os.environ["GROUP_RANK"])
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(beat))
    tmp.replace(path)


class Heartbeat:
    """A daemon thread that rewrites this rank's heartbeat every few seconds.

    It beats while the process lives, even when the main thread is stuck in a collective,
    so a stale heartbeat means a dead process or host, not a slow step. The trainer sets
    `.step` after each optimizer step.
    """

    def __init__(self, run_dir: Path, rank: int, interval_s: float = HEARTBEAT_INTERVAL_S) -> None:
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.interval_s = interval_s
        self.step = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"heartbeat-rank{rank}", daemon=True)

    def start(self) -> "Heartbeat":
        write_heartbeat(self.run_dir, self.rank, self.step)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval_s * 2)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                write_heartbeat(self.run_dir, self.rank, self.step)
            except OSError:
                pass  # a full or flaky shared disk must not kill training; status will show the gap


def read_heartbeats(run_dir: Path) -> list[dict[str, Any]]:
    beats = []
    for path in sorted((Path(run_dir) / "heartbeats").glob("rank-*.json")):
        try:
            beats.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue  # being replaced right now; the next read sees it
    return sorted(beats, key=lambda beat: beat.get("rank", -1))


def stale_heartbeats(beats: list[dict[str, Any]], now: float, stale_after_s: float) -> list[dict[str, Any]]:
    return [beat for beat in beats if now - float(beat.get("time", 0)) > stale_after_s]


def describe_ranks(beats: list[dict[str, Any]], now: float) -> str:
    """'ranks 2, 3 (node 1, host gpu7; silent 12 s, last at step 40)' grouped by host."""
    groups: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
    for beat in beats:
        groups.setdefault((beat.get("node"), beat.get("host")), []).append(beat)
    parts = []
    for (node, host), group in groups.items():
        ranks = ", ".join(str(beat["rank"]) for beat in group)
        where = ", ".join(item for item in (f"node {node}" if node is not None else "", f"host {host}") if item)
        silent = max(now - float(beat["time"]) for beat in group)
        step = max(int(beat.get("step", 0)) for beat in group)
        noun = "rank" if len(group) == 1 else "ranks"
        parts.append(f"{noun} {ranks} ({where}; silent {silent:.0f} s, last at step {step})")
    return "; ".join(parts)


# ---------------------------------------------------------------- lost peers (called by the trainer)

_PEER_ADDRESS = re.compile(r"\[([0-9A-Fa-f.:]+)\]:(\d+)")
_LOST_PEER_WORDS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "timed out", "Timed out", "timeout", "NCCL", "Gloo", "gloo")
_LOST_PEER_TYPES = ("DistBackendError", "DistNetworkError", "DistStoreError")


def lost_peer_error(run_dir: Path, err: BaseException, rank: int, wait_s: float = 2.5 * HEARTBEAT_INTERVAL_S) -> DistError | None:
    """Turn a failed collective into an error that names the ranks that went away.

    The trainer calls this when a collective raises (DistBackendError, or a RuntimeError
    from gloo/NCCL) and raises what it returns. It waits a little more than two heartbeat
    intervals: ranks still alive keep beating meanwhile (their own collective failed too),
    the lost ones do not. None means the error does not look like a lost peer.
    """
    text = str(err)
    if type(err).__name__ not in _LOST_PEER_TYPES and not any(word in text for word in _LOST_PEER_WORDS):
        return None
    before = {beat["rank"]: beat["time"] for beat in read_heartbeats(run_dir)}
    time.sleep(wait_s)
    now = time.time()
    silent = [beat for beat in read_heartbeats(run_dir) if beat["rank"] != rank and beat["time"] == before.get(beat["rank"])]
    peers = sorted({f"{host}:{port}" for host, port in _PEER_ADDRESS.findall(text)})
    first_line = text.strip().splitlines()[0] if text.strip() else type(err).__name__
    if silent:
        what = f"rank {rank} lost contact with {describe_ranks(silent, now)}"
    elif peers:
        what = f"rank {rank} lost contact with the process at {', '.join(peers)}"
    else:
        what = f"a collective failed on rank {rank}"
    if peers and silent:
        what += f"; the failed connection was to {', '.join(peers)}"
    return DistError(
        f"{what}. Cause: {first_line}",
        where=str(run_dir),
        fix="that node's processes died or its network went away: check its logs under "
        f"{Path(run_dir) / 'logs'}, then start the job again on every node (it resumes from checkpoints/LATEST)",
    )


# ---------------------------------------------------------------- status (read by anyone)


def _tail_events(path: Path) -> list[dict[str, Any]]:
    """The events in the last MiB of metrics.jsonl (enough for the newest of each kind)."""
    if not path.is_file():
        return []
    with open(path, "rb") as handle:
        handle.seek(0, os.SEEK_END)
        size = handle.tell()
        handle.seek(max(0, size - _TAIL_BYTES))
        lines = handle.read().decode("utf-8", "replace").splitlines()
    if size > _TAIL_BYTES:
        lines = lines[1:]  # the first line is cut
    events = []
    for line in lines:
        try:
            events.append(json.loads(line))
        except ValueError:
            continue  # a line still being written
    return events


def _max_steps(run_dir: Path) -> int | None:
    try:
        config = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
        return int(config["train"]["max_steps"])
    except (OSError, KeyError, TypeError, ValueError, yaml.YAMLError):
        return None


def _seconds_per_step(train_events: list[dict[str, Any]]) -> float | None:
    recent = train_events[-_RATE_WINDOW:]
    if len(recent) < 2:
        return None
    steps = recent[-1]["step"] - recent[0]["step"]
    seconds = recent[-1]["time"] - recent[0]["time"]
    return seconds / steps if steps > 0 and seconds > 0 else None


def _last_checkpoint(run_dir: Path) -> str | None:
    try:
        return (run_dir / "checkpoints" / "LATEST").read_text().strip() or None
    except OSError:
        return None


def read_status(run_dir: Path | str, stale_after_s: float = STALE_AFTER_S, now: float | None = None) -> dict[str, Any]:
    """Step, loss, tokens/s, ETA, last committed checkpoint and silent ranks of one run."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"run dir {run_dir} does not exist", fix="pass <output_dir>/<run_name> of the job, e.g. runs/tiny")
    now = time.time() if now is None else now
    events = _tail_events(run_dir / "metrics.jsonl")
    train = [event for event in events if event.get("kind") == "train" and "step" in event and "time" in event]
    evals = [event for event in events if event.get("kind") == "eval"]
    last = train[-1] if train else {}
    max_steps = _max_steps(run_dir)
    finished = (run_dir / "summary.json").is_file()
    per_step = _seconds_per_step(train)
    beats = read_heartbeats(run_dir)
    stale = [] if finished else stale_heartbeats(beats, now, stale_after_s)
    status: dict[str, Any] = {
        "run_dir": str(run_dir),
        "finished": finished,
        "step": last.get("step"),
        "max_steps": max_steps,
        "loss": last.get("loss"),
        "lr": last.get("lr"),
        "grad_norm": last.get("grad_norm"),
        "tokens_per_s": last.get("tokens_per_s"),
        "seconds_per_step": per_step,
        "eta_s": None,
        "last_event_age_s": now - events[-1]["time"] if events and "time" in events[-1] else None,
        "last_eval": {k: v for k, v in evals[-1].items() if k not in ("kind", "time")} if evals else None,
        "last_checkpoint": _last_checkpoint(run_dir),
        "heartbeats": [{**beat, "age_s": round(now - float(beat.get("time", 0)), 1)} for beat in beats],
        "stale_ranks": [beat["rank"] for beat in stale],
        "stale_description": describe_ranks(stale, now) if stale else None,
    }
    if not finished and per_step and max_steps and last.get("step") is not None:
        status["eta_s"] = max(0.0, (max_steps - last["step"]) * per_step)
    if finished:
        status["summary"] = json.loads((run_dir / "summary.json").read_text())
    return status


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def format_status(status: dict[str, Any]) -> str:
    """A few lines a person reads at a glance."""
    step = status["step"]
    progress = "no train step logged yet" if step is None else f"step {step}/{status['max_steps'] or '?'}"
    state = "finished" if status["finished"] else "running"
    lines = [f"{status['run_dir']}: {state}, {progress}"]
    if step is not None:
        lines.append(
            f"  loss {status['loss']:.4f}  lr {status['lr']:.2e}  {status['tokens_per_s'] or 0:.0f} tokens/s"
            + ("" if status["finished"] else f"  ETA {_duration(status['eta_s'])}")
        )
    if status["last_eval"]:
        shown = "  ".join(f"{k} {v:.4g}" for k, v in status["last_eval"].items() if isinstance(v, float))
        lines.append(f"  last eval (step {status['last_eval'].get('step')}): {shown}")
    lines.append(f"  last committed checkpoint: {status['last_checkpoint'] or 'none'}")
    if status["last_event_age_s"] is not None and not status["finished"]:
        lines.append(f"  last metrics event {status['last_event_age_s']:.0f} s ago")
    beats = status["heartbeats"]
    if beats:
        lines.append(f"  heartbeats: {len(beats)} ranks, newest {min(beat['age_s'] for beat in beats):.0f} s old")
    if status["stale_ranks"]:
        lines.append(f"  SILENT: {status['stale_description']}")
    return "\n".join(lines)
