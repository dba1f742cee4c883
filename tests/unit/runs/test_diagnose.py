"""`trainyard diagnose` names a stuck rank's PID and host, with the py-spy line that shows where it is."""

from __future__ import annotations

import json
import pickle
import time
from pathlib import Path

from trainyard.runs.diagnose import diagnose, format_diagnosis


def beat(run_dir: Path, rank: int, host: str, pid: int, step: int, at: float) -> None:
    """A heartbeat as the trainer writes it (runs.status.BackgroundHeartbeat)."""
    (run_dir / "heartbeats").mkdir(parents=True, exist_ok=True)
    record = {"rank": rank, "host": host, "pid": pid, "step": step, "time": at}
    (run_dir / "heartbeats" / f"rank-{rank}.json").write_text(json.dumps(record))


def flight_record(run_dir: Path, rank: int, last_seq: int) -> None:
    """A Gloo flight record of the default group whose newest collective is all_reduce #`last_seq`."""
    entries = [
        {"process_group": ("0", "default_pg"), "collective_seq_id": seq, "profiling_name": "gloo:all_reduce",
         "state": "scheduled" if seq == last_seq else "completed", "input_sizes": [[8]], "frames": [],
         "time_created_ns": seq, "is_p2p": False}
        for seq in range(1, last_seq + 1)
    ]
    (run_dir / "flight").mkdir(parents=True, exist_ok=True)
    (run_dir / "flight" / f"gloo-rank-{rank}").write_bytes(pickle.dumps({"entries": entries}))


def test_the_rank_that_stayed_away_is_named_with_its_pid_and_the_py_spy_line(tmp_path: Path) -> None:
    now = time.time()
    (tmp_path / "env.json").write_text(json.dumps({"world_size": 2}))
    flight_record(tmp_path, 0, last_seq=5)
    flight_record(tmp_path, 1, last_seq=4)
    beat(tmp_path, 0, "gpu7", 4121, 40, now - 1)
    beat(tmp_path, 1, "gpu8", 5377, 39, now - 1)
    text = format_diagnosis(diagnose(tmp_path, now=now), now=now)
    assert "ranks 1 did not join all_reduce #5 of group 0" in text, text
    assert ("rank 1: last entered all_reduce #4; heartbeat: rank 1 (host gpu8; silent 1 s, last at step 39); "
            "pid 5377: `py-spy dump --pid 5377` on gpu8 shows where it is") in text, text
    assert "4121" not in text  # rank 0 entered the collective and waits: not the one to look at


def test_without_a_flight_record_a_running_job_lists_each_rank_s_pid_to_dump(tmp_path: Path) -> None:
    """No collective has timed out yet: a job hanging now shows where only through each rank's stack."""
    now = time.time()
    beat(tmp_path, 0, "gpu7", 4121, 40, now - 1)
    beat(tmp_path, 1, "gpu8", 5377, 40, now - 2)
    text = format_diagnosis(diagnose(tmp_path, now=now), now=now)
    assert "no flight record in flight/" in text, text
    assert "    rank 0 (host gpu7; silent 1 s, last at step 40); pid 4121: `py-spy dump --pid 4121` on gpu7" in text
    assert "    rank 1 (host gpu8; silent 2 s, last at step 40); pid 5377: `py-spy dump --pid 5377` on gpu8" in text
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 40}))
    assert "py-spy" not in format_diagnosis(diagnose(tmp_path, now=now), now=now)  # finished: its PIDs are gone
