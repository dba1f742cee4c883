"""How the local launcher ends when it is told to stop: with the workers' own exit code, wherever torch's agent was
when the signal came."""

from __future__ import annotations

import signal
import sys
import threading
import types
import weakref
from datetime import timedelta
from pathlib import Path
from typing import Any

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
    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)  # the stop installs a hook: this test's own

    @metrics.prof
    def monitor_workers() -> None:
        raise AssertionError("the signal comes first")

    monkeypatch.setattr(launcher_api, "elastic_launch", lambda config, entrypoint: lambda *args: monitor_workers())
    prefix = str(tmp_path / "exit")
    assert local._launch(2, ["train"], 0, False, prefix) == (128 + signal.SIGTERM, "stopped by SIGTERM")
    (tmp_path / "exit.rank0").write_text("75\npreempted by SIGTERM after step 13")  # as the workers report a save
    assert local._launch(2, ["train"], 0, False, prefix) == (75, "preempted by SIGTERM after step 13")


class Rendezvous:
    """Stands for torch's rendezvous handler: its keep-alive timer beats through a weak reference to it."""


def test_a_stopped_launch_prints_no_traceback_when_torch_s_keep_alive_thread_frees_the_rendezvous(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch's own `_PeriodicTimer`, beating as `DynamicRendezvousHandler._keep_alive_weak` does (a strong reference
    to the handler while it beats), and the handler's last other reference dropped mid-beat: the handler is freed on
    the timer's thread, whose finalizer then joins that same thread. Any other unraisable exception still reaches the
    previous hook."""
    from torch.distributed.elastic.rendezvous.utils import _PeriodicTimer

    reported: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", reported.append)
    local.ignore_keep_alive_self_join()
    beating, go_on = threading.Event(), threading.Event()

    def keep_alive(weak_self: weakref.ref[Rendezvous]) -> None:
        handler = weak_self()
        if handler is not None:
            beating.set()
            go_on.wait(10)

    handler = Rendezvous()
    handler.timer = _PeriodicTimer(timedelta(milliseconds=10), keep_alive, weakref.ref(handler))  # type: ignore
    handler.timer.start()  # type: ignore[attr-defined]
    thread = handler.timer._thread  # type: ignore[attr-defined]
    assert beating.wait(10)
    del handler
    go_on.set()
    thread.join(10)
    assert not thread.is_alive()  # the finalizer told it to stop before it failed to join it
    assert reported == []

    def failing() -> None:
        raise ValueError("another finalizer's failure")

    weakref.finalize(Rendezvous(), failing)  # freed at once: its failure is unraisable
    assert [type(unraisable.exc_value) for unraisable in reported] == [ValueError]
