"""How long the gradient collectives were in flight: DDP's all-reduces (a comm hook) and FSDP2's all-gathers and
reduce-scatters (its collective hooks), timed with CUDA events on GPU and wall clock on CPU."""

from __future__ import annotations

import time

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
from torch.nn.parallel import DistributedDataParallel

_MAX_PENDING_EVENTS = 1024


class CommTimer:
    """Seconds the gradient collectives were in flight (measured, overlap included).

    On CPU (gloo) a collective's future completes when the data has arrived, so wall-clock time
    from launch to callback is the measure. On CUDA the host only enqueues work (NCCL's `.then()`
    fires at enqueue), so each collective is bracketed by CUDA events and their elapsed times are
    read when the figures are taken. A step's timings are held apart until the step is known to
    count (trained) or not (skipped for a non-finite loss).
    """

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self._step_seconds = 0.0
        self._seconds = 0.0
        self._step_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def add_seconds(self, seconds: float) -> None:
        self._step_seconds += seconds

    def start_event(self) -> torch.cuda.Event:
        """An event on the current stream, where the collective is about to be enqueued."""
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def end_event(self, started: torch.cuda.Event) -> None:
        """Close the pair on the current stream, which must be ordered after the collective."""
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self._step_events.append((started, event))

    def end_step(self, keep: bool) -> None:
        if keep:
            self._seconds += self._step_seconds
            self._events.extend(self._step_events)
        self._step_seconds = 0.0
        self._step_events = []
        if len(self._events) > _MAX_PENDING_EVENTS:
            self._fold_finished()

    def _fold_finished(self) -> None:
        """Turn pairs that already finished into seconds, so a long log interval holds few events."""
        pending = []
        for started, ended in self._events:
            if ended.query():
                self._seconds += started.elapsed_time(ended) / 1000.0
            else:
                pending.append((started, ended))
        self._events = pending

    def take(self) -> float:
        """Seconds of the kept steps since the last take (waits for their events on CUDA)."""
        seconds = self._seconds
        for started, ended in self._events:
            ended.synchronize()
            seconds += started.elapsed_time(ended) / 1000.0
        self._seconds, self._events = 0.0, []
        return seconds


class _TimedAllGather(DefaultAllGather):
    """FSDP2's own all-gather, timed while the root trains (an evaluation's are not step time)."""

    def __init__(self, timer: CommTimer, root: torch.nn.Module) -> None:
        super().__init__()
        self.timer, self.root = timer, root

    def __call__(self, output_tensor, input_tensor, group, async_op=False):  # type: ignore[no-untyped-def]
        def launch():  # type: ignore[no-untyped-def]
            return super(_TimedAllGather, self).__call__(output_tensor, input_tensor, group, async_op=async_op)

        return _timed(self.timer, launch) if self.root.training else launch()


class _TimedReduceScatter(DefaultReduceScatter):
    """FSDP2's own reduce-scatter, timed."""

    def __init__(self, timer: CommTimer) -> None:
        super().__init__()
        self.timer = timer

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):  # type: ignore[no-untyped-def]
        return _timed(self.timer, lambda: super(_TimedReduceScatter, self).__call__(
            output_tensor, input_tensor, group, op, async_op=async_op))


def _timed(timer: CommTimer, launch):  # type: ignore[no-untyped-def]
    """Run one FSDP2 collective. FSDP2 issues it synchronously on its own stream, so the end event
    (or the clock on CPU) follows completion. An async one (only `unshard(async_op=True)`, which
    trainyard never calls) is waited for first, which would cost that call its overlap."""
    if timer.cuda:
        started = timer.start_event()
        work = launch()
        if work is not None:
            work.wait()  # on CUDA this orders the current stream after the collective; the host goes on
        timer.end_event(started)
        return work
    clock = time.perf_counter()
    work = launch()
    if work is not None:
        work.wait()
    timer.add_seconds(time.perf_counter() - clock)
    return work


def attach_comm_timer(model: torch.nn.Module) -> CommTimer | None:
    """Time DDP's bucket all-reduces (a comm hook) or FSDP2's all-gathers and reduce-scatters
    (custom collectives of each sharded module); None for an unwrapped model."""
    if isinstance(model, FSDPModule):
        timer = CommTimer(cuda=_device_type(model) == "cuda")
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_all_gather(_TimedAllGather(timer, model))
                module.set_custom_reduce_scatter(_TimedReduceScatter(timer))
        return timer
    if not isinstance(model, DistributedDataParallel):
        return None
    timer = CommTimer(cuda=_device_type(model) == "cuda")

    # No annotations: DDP checks them literally and this module's are postponed strings.
    def timed_allreduce(group, bucket):  # type: ignore[no-untyped-def]
        if timer.cuda:
            started = timer.start_event()

            def finished_cuda(future):  # type: ignore[no-untyped-def]
                # A CUDA future runs its callback on streams that wait for the all-reduce.
                timer.end_event(started)
                return future.value()

            return default_hooks.allreduce_hook(group, bucket).then(finished_cuda)
        clock = time.perf_counter()

        def finished(future):  # type: ignore[no-untyped-def]
            timer.add_seconds(time.perf_counter() - clock)
            return future.value()

        return default_hooks.allreduce_hook(group, bucket).then(finished)

    model.register_comm_hook(model.process_group, timed_allreduce)  # DDP's own group (a DiLoCo site's, say)
    return timer


def _device_type(model: torch.nn.Module) -> str:
    return next((p.device.type for p in model.parameters()), "cpu")
