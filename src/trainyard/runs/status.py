"""Where a run stands, read from its run dir alone.

Seed 003 watched a four-node job with `kubectl logs | grep` on each pod. Everything needed
to answer "how far, how fast, when done, is anyone silent" is already in the run dir on the
shared disk: metrics.jsonl, checkpoints/LATEST, summary.json, and the heartbeat each rank
rewrites as it steps (heartbeats/rank-<r>.json). So any node, or a laptop with the disk
mounted, can ask, and nothing here touches torch.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from trainyard.atomic import manifest_damage, write_atomically
from trainyard.errors import ConfigError
from trainyard.runs import layout as run_layout

STALE_AFTER_S = 60.0
RUN_DIR_MARKERS = run_layout.MARKERS
HEARTBEAT_INTERVAL_S = 2.0
_TAIL_BYTES = 1 << 20
_RATE_WINDOW = 10


# ---------------------------------------------------------------- heartbeats


class BackgroundHeartbeat:
    """Rewrites heartbeats/rank-<r>.json every few seconds from a daemon thread.

    Beating from a thread rather than from the training loop makes a stale heartbeat mean
    a dead process or host, never a rank merely blocked in a collective: that is what a
    failed collective needs to tell the lost ranks from the ones they dragged down. The
    trainer sets `.step` after each optimizer step.
    """

    def __init__(self, run_dir: Path, rank: int, interval_s: float = HEARTBEAT_INTERVAL_S) -> None:
        self.path = Path(run_dir) / run_layout.HEARTBEATS / f"rank-{rank}.json"
        self.rank = rank
        self.interval_s = interval_s
        self.step = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"heartbeat-rank{rank}", daemon=True)

    def start(self) -> BackgroundHeartbeat:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._write()
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating, with a last beat at the step reached: every exit (the end, a preemption, an error) leaves
        where the rank stopped, not its beat of up to an interval before."""
        self._stop.set()
        self._thread.join(timeout=2 * self.interval_s)
        try:
            self._write()
        except OSError:
            pass

    def _write(self) -> None:
        record = {
            "rank": self.rank,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "step": self.step,
            "time": time.time(),
        }
        write_atomically(self.path, json.dumps(record), durable=False)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._write()
            except OSError:
                pass  # a flaky shared disk must not stop training; status shows the gap


def silent_ranks(run_dir: Path, own_rank: int, wait_s: float = 2.5 * HEARTBEAT_INTERVAL_S) -> list[dict[str, Any]]:
    """Ranks whose heartbeat did not move during `wait_s`: the lost ones, after a failed
    collective. Ranks that are alive keep beating meanwhile (BackgroundHeartbeat).

    After a collective timeout the lost ranks are usually silent for longer than `wait_s`
    already: those are returned at once, so the report does not wait on top of the timeout."""
    beats = read_heartbeats(run_dir)
    already = [beat for beat in stale_heartbeats(beats, time.time(), wait_s) if beat["rank"] != own_rank]
    if already:
        return already
    before = {beat["rank"]: beat.get("time") for beat in beats}
    time.sleep(wait_s)
    return [
        beat
        for beat in read_heartbeats(run_dir)
        if beat["rank"] != own_rank and beat.get("time") == before.get(beat["rank"])
    ]


def read_heartbeats(run_dir: Path) -> list[dict[str, Any]]:
    beats = []
    for path in sorted((Path(run_dir) / run_layout.HEARTBEATS).glob("rank-*.json")):
        try:
            beats.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue  # being replaced right now; the next read sees it
    return sorted(beats, key=lambda beat: beat.get("rank", -1))


def stale_heartbeats(beats: list[dict[str, Any]], now: float, stale_after_s: float) -> list[dict[str, Any]]:
    return [beat for beat in beats if now - float(beat.get("time", 0)) > stale_after_s]


def describe_ranks(beats: list[dict[str, Any]], now: float) -> str:
    """'ranks 2, 3 (host gpu7; silent 12 s, last at step 40)', one group per host."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for beat in beats:
        groups.setdefault(str(beat.get("host", "?")), []).append(beat)
    parts = []
    for host, group in groups.items():
        ranks = ", ".join(str(beat["rank"]) for beat in group)
        silent = max(now - float(beat["time"]) for beat in group)
        step = max(int(beat.get("step", 0)) for beat in group)
        noun = "rank" if len(group) == 1 else "ranks"
        parts.append(f"{noun} {ranks} (host {host}; silent {silent:.0f} s, last at step {step})")
    return "; ".join(parts)


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
            event = json.loads(line)
        except ValueError:
            continue  # a line still being written
        if isinstance(event, dict):
            events.append(event)
    return events


def _max_steps(run_dir: Path) -> int | None:
    try:
        config = yaml.safe_load((run_dir / run_layout.CONFIG).read_text()) or {}
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
        return (run_dir / run_layout.CHECKPOINTS / "LATEST").read_text().strip() or None
    except OSError:
        return None


def _damaged_checkpoints(run_dir: Path) -> dict[str, str]:
    """Committed checkpoints whose files no longer match their commit marker: name -> the damaged file and how."""
    folder = run_dir / run_layout.CHECKPOINTS
    steps = sorted(folder.glob("step-*")) if folder.is_dir() else []
    return {step.name: problem for step in steps if (problem := manifest_damage(step, run_layout.COMMITTED))}


def _state(finished: bool, train_events: list[dict[str, Any]], beats: list[dict[str, Any]]) -> str:
    """finished (summary.json), running, or not started: no rank ever logged a step or wrote a heartbeat (a run dir
    holding only its config.yaml, or a job still queued or loading)."""
    if finished:
        return "finished"
    return "running" if train_events or beats else "not started"


def read_status(run_dir: Path | str, stale_after_s: float = STALE_AFTER_S, now: float | None = None) -> dict[str, Any]:
    """State, step, loss, tokens/s, ETA, last committed checkpoint and silent ranks of one run."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        what = "is a file, not a run dir" if run_dir.exists() else "does not exist"
        raise ConfigError(f"run dir {run_dir} {what}", fix="pass <output_dir>/<run_name> of the job, e.g. runs/tiny")
    if not any((run_dir / name).exists() for name in RUN_DIR_MARKERS):
        raise ConfigError(
            f"{run_dir} is not a run dir (none of {', '.join(RUN_DIR_MARKERS)} in it)",
            fix="pass <output_dir>/<run_name> of a job that started, e.g. runs/tiny",
        )
    now = time.time() if now is None else now
    events = _tail_events(run_dir / run_layout.METRICS)
    train = [event for event in events if event.get("kind") == "train" and "step" in event and "time" in event]
    evals = [event for event in events if event.get("kind") == "eval"]
    last = train[-1] if train else {}
    max_steps = _max_steps(run_dir)
    finished = (run_dir / run_layout.SUMMARY).is_file()
    per_step = _seconds_per_step(train)
    beats = read_heartbeats(run_dir)
    stale = [] if finished else stale_heartbeats(beats, now, stale_after_s)
    status: dict[str, Any] = {
        "run_dir": str(run_dir),
        "state": _state(finished, train, beats),
        "finished": finished,
        "step": last.get("step"),
        "max_steps": max_steps,
        "loss": last.get("loss"),
        "objective_figures": objective_figures(last),
        "lr": last.get("lr"),
        "grad_norm": last.get("grad_norm"),
        "tokens_per_s": last.get("tokens_per_s"),
        "seconds_per_step": per_step,
        "eta_s": None,
        "last_event_age_s": now - events[-1]["time"] if events and "time" in events[-1] else None,
        "last_eval": {k: v for k, v in evals[-1].items() if k not in ("kind", "time")} if evals else None,
        "eval_objective_figures": objective_figures(evals[-1], prefix="eval_") if evals else {},
        "last_checkpoint": _last_checkpoint(run_dir),
        "damaged_checkpoints": _damaged_checkpoints(run_dir),
        "heartbeats": [{**beat, "age_s": round(now - float(beat.get("time", 0)), 1)} for beat in beats],
        "stale_ranks": [beat["rank"] for beat in stale],
        "stale_description": describe_ranks(stale, now) if stale else None,
        "flight_records": sorted(
            p.name for p in (run_dir / run_layout.FLIGHT).glob("*-rank-*") if not p.name.startswith(".")
        ),
    }
    if not finished and per_step and max_steps and last.get("step") is not None:
        status["eta_s"] = max(0.0, (max_steps - last["step"]) * per_step)
    if finished:
        try:
            status["summary"] = json.loads((run_dir / run_layout.SUMMARY).read_text())
        except (OSError, ValueError) as err:
            raise ConfigError(
                f"{run_dir / 'summary.json'} is unreadable ({err})",
                fix="the run wrote it last; restore it from the run's logs or remove it to see the live status",
            ) from None
    return status


def objective_figures(event: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The objective's own figures an event carries (DPO's rewards and log-probabilities), named as logged: a loss
    alone does not say whether a DPO run learns to prefer the chosen answers."""
    names = (prefix + name for figures in run_layout.OBJECTIVE_FIGURES.values() for name in figures)
    return {name: event[name] for name in names if isinstance(event.get(name), int | float)}


def _figure_lines(figures: dict[str, float], where: str, prefix: str = "") -> list[str]:
    """'  rewards (train): margins 0.312  accuracies 0.75', a line per group of figures (rewards/, logps/)."""
    groups: dict[str, list[str]] = {}
    for name, value in figures.items():
        group, _, short = name.removeprefix(prefix).rpartition("/")
        groups.setdefault(group, []).append(f"{short} {value:.4g}")
    return [f"  {group} ({where}): {'  '.join(shown)}" for group, shown in groups.items()]


def _rank_lines(beats: list[dict[str, Any]]) -> list[str]:
    """'    host gpu7: rank 0 pid 4121, rank 1 pid 4122': where each rank runs, for `py-spy dump --pid` or a kill."""
    hosts: dict[str, list[str]] = {}
    for beat in beats:
        hosts.setdefault(str(beat.get("host", "?")), []).append(f"rank {beat.get('rank')} pid {beat.get('pid', '?')}")
    return [f"    host {host}: {', '.join(ranks)}" for host, ranks in hosts.items()]


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
    if status["state"] == "not started":
        progress = "no rank has logged a step or a heartbeat yet"
    lines = [f"{status['run_dir']}: {status['state']}, {progress}"]
    if step is not None:
        lines.append(
            f"  loss {status['loss']:.4f}  lr {status['lr']:.2e}  {status['tokens_per_s'] or 0:.0f} tokens/s"
            + ("" if status["finished"] else f"  ETA {_duration(status['eta_s'])}")
        )
        lines += _figure_lines(status["objective_figures"], "train")
    if status["last_eval"]:
        own = status["eval_objective_figures"]
        shown = "  ".join(
            f"{k} {v:.4g}" for k, v in status["last_eval"].items() if isinstance(v, float) and k not in own
        )
        lines.append(f"  last eval (step {status['last_eval'].get('step')}): {shown}")
        lines += _figure_lines(own, f"eval, step {status['last_eval'].get('step')}", prefix="eval_")
    lines.append(f"  last committed checkpoint: {status['last_checkpoint'] or 'none'}")
    for name, problem in status["damaged_checkpoints"].items():
        lines.append(f"  DAMAGED checkpoint {name} (resume: auto skips it): {problem}")
    if status["last_event_age_s"] is not None and not status["finished"]:
        lines.append(f"  last metrics event {status['last_event_age_s']:.0f} s ago")
    beats = status["heartbeats"]
    if beats:
        lines.append(f"  heartbeats: {len(beats)} ranks, newest {min(beat['age_s'] for beat in beats):.0f} s old")
        lines += [] if status["finished"] else _rank_lines(beats)
    if status["stale_ranks"]:
        lines.append(f"  SILENT: {status['stale_description']}")
    if status["flight_records"]:  # written only when a collective failed or timed out
        lines.append(
            f"  a collective failed: {len(status['flight_records'])} flight records; "
            f"`trainyard diagnose {status['run_dir']}` names who did not join"
        )
    return "\n".join(lines)
