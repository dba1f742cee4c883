"""How the local launcher ends when it is told to stop: with the workers' own exit code, wherever torch's agent was
when the signal came."""

from __future__ import annotations

import signal
import types
from pathlib import Path

import pytest

from trainyard.launch import local


def test_a_stop_signal_inside_torch_s_timing_wrapper_still_ends_in_the_workers_exit_code(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """torch's agent raises SignalException wherever its main thread is; in the gap of its own timing wrapper
    (`metrics.prof`) before the wrapper notes its start, the wrapper's `finally` raises over it. Here the signal
    lands exactly there: the wrapper's first clock reading raises it."""
    import torch.distributed.launcher.api as launcher_api
    from torch.distributed.elastic.metrics import api as metrics
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def stopped(*_: object) -> float:
        raise SignalException("Process got signal: 15", sigval=signal.SIGTERM)

    monkeypatch.setattr(metrics, "time", types.SimpleNamespace(time=stopped))

    @metrics.prof
    def monitor_workers() -> None:
        raise AssertionError("the signal comes first")

    monkeypatch.setattr(launcher_api, "elastic_launch", lambda config, entrypoint: lambda *args: monitor_workers())
    prefix = str(tmp_path / "exit")
    assert local._launch(2, ["train"], 0, False, prefix) == (128 + signal.SIGTERM, "stopped by SIGTERM")
    (tmp_path / "exit.rank0").write_text("75\npreempted by SIGTERM after step 13")  # as the workers report a save
    assert local._launch(2, ["train"], 0, False, prefix) == (75, "preempted by SIGTERM after step 13")
