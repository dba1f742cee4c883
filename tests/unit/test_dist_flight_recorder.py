"""The flight recorder is on by default into the run dir; the user's own settings win; its
dumps are read without running code from them."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

from trainyard.dist import apply_flight_recorder, flight_recorder_enabled
from trainyard.runs.diagnose import diagnose, format_diagnosis, read_flight_records


def test_defaults_point_the_dumps_into_the_run_dir(tmp_path: Path) -> None:
    env: dict[str, str] = {}
    apply_flight_recorder(tmp_path, env)
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "flight" / "nccl-rank-")
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == env["TORCH_FR_DUMP_TEMP_FILE"]
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert int(env["TORCH_FR_BUFFER_SIZE"]) > 0
    assert (tmp_path / "flight").is_dir()


def test_user_settings_win_including_the_old_names(tmp_path: Path) -> None:
    env = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/elsewhere/trace_"}
    apply_flight_recorder(tmp_path, env)
    assert "TORCH_FR_BUFFER_SIZE" not in env and "TORCH_FR_DUMP_TEMP_FILE" not in env
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == "/elsewhere/trace_"
    assert not flight_recorder_enabled(env)
    assert not (tmp_path / "flight").exists()


class _Payload:
    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):
        return (os.mkdir, (str(self.target),))


def test_a_dump_that_would_run_code_is_refused(tmp_path: Path) -> None:
    (tmp_path / "flight").mkdir()
    target = tmp_path / "ran"
    (tmp_path / "flight" / "nccl-rank-0").write_bytes(pickle.dumps({"entries": [_Payload(target)]}))
    assert read_flight_records(tmp_path) == {}
    assert not target.exists()
    assert "no flight record" in format_diagnosis(diagnose(tmp_path))
