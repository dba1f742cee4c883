"""How long the gradient collectives were in flight: DDP's all-reduces (a comm hook), FSDP2's all-gathers and
reduce-scatters (its collective hooks) and HSDP's replicate all-reduce (its all-reduce hook), timed with CUDA events
on GPU and wall clock on CPU. Collectives in flight together count once: the measure is the union of their spans."""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
from torch.distributed.tensor import DTensor, Replicate
from torch.nn.parallel import DistributedDataParallel

_MAX_PENDING = 1024

Interval = tuple[float, float]


def merge_intervals(intervals: Iterable[Interval]) -> list[Interval]:
    """[start, end) spans that overlap or touch as one: collectives queued or in flight together count once."""
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def covered_seconds(intervals: Iterable[Interval]) -> float:
    """Seconds at least one collective was in flight, which never exceeds the wall time they span."""
    return sum(end - start for start, end in merge_intervals(intervals))


class CommTimer:
    """Seconds the gradient collectives were in flight: the union of their [launch, completion) spans.

    On CPU (gloo) a collective's future completes when the data has arrived, so wall-clock time
    from launch to callback is the span. On CUDA the host only enqueues work (NCCL's `.then()`
    fires at enqueue), so each collective is bracketed by CUDA events, placed on a common time line
    by their elapsed time from the window's first event when the figures are taken. A step's spans
    are held apart until the step is known to count (trained) or not (skipped for a non-finite loss).
    """

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self._step_intervals: list[Interval] = []
        self._intervals: list[Interval] = []
        self._step_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._reference: torch.cuda.Event | None = None

    def add_interval(self, start: float, end: float) -> None:
        """One collective's wall-clock launch and completion (CPU)."""
        self._step_intervals.append((start, end))

    def start_event(self) -> torch.cuda.Event:
        """An event on the current stream, where the collective is about to be enqueued."""
        if self._reference is None:
            self._reference = _recorded_event()
        return _recorded_event()

    def end_event(self, started: torch.cuda.Event) -> None:
        """Close the pair on the current stream, which must be ordered after the collective."""
        self._step_events.append((started, _recorded_event()))

    def end_step(self, keep: bool) -> None:
        if keep:
            self._intervals.extend(self._step_intervals)
            self._events.extend(self._step_events)
        self._step_intervals, self._step_events = [], []
        if len(self._events) + len(self._intervals) > _MAX_PENDING:
            self._fold_finished()

    def _fold_finished(self) -> None:
        """Turn pairs that already finished into spans and merge the spans, so a long log interval holds few."""
        finished = self._reference is not None and self._reference.query()
        pending = []
        for started, ended in self._events:
            if finished and ended.query():
                self._intervals.append(self._event_interval(started, ended))
            else:
                pending.append((started, ended))
        self._events = pending
        self._intervals = merge_intervals(self._intervals)

    def _event_interval(self, started: torch.cuda.Event, ended: torch.cuda.Event) -> Interval:
        """A pair's span in seconds from the reference event; its length from the pair itself (float32 is finer
        over a short span than over the whole window)."""
        assert self._reference is not None
        start = self._reference.elapsed_time(started) / 1000.0
        return start, start + started.elapsed_time(ended) / 1000.0

    def take(self) -> float:
        """Seconds of the kept steps since the last take (waits for their events on CUDA)."""
        for _, ended in self._events:
            ended.synchronize()
        if self._reference is not None:
            self._reference.synchronize()
        intervals = self._intervals + [self._event_interval(started, ended) for started, ended in self._events]
        self._intervals, self._events = [], []
        if not self._step_events:  # a step still open keeps the reference its events are measured from
            self._reference = None
        return covered_seconds(intervals)


def _recorded_event() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


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
    """FSDP2's own reduce-scatter, timed. It also marks where a unit's gradient reduction begins: FSDP2 allocates
    the reduce-scatter output last before reducing into it (and, for HSDP, all-reducing it), even with a shard
    of one, where no reduce-scatter runs."""

    def __init__(self, timer: CommTimer) -> None:
        super().__init__()
        self.timer = timer
        self.reduction_started: float | torch.cuda.Event | None = None

    def allocate(self, size, *, dtype, device):  # type: ignore[no-untyped-def]
        self.reduction_started = self.timer.start_event() if self.timer.cuda else time.perf_counter()
        return super().allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):  # type: ignore[no-untyped-def]
        return _timed(self.timer, lambda: super(_TimedReduceScatter, self).__call__(
            output_tensor, input_tensor, group, op, async_op=async_op))


class _TimedReplicateAllReduce:
    """HSDP's replicate all-reduce, which FSDP2 issues itself with no collective hook: its all-reduce hook runs
    right after it (on the all-reduce stream on CUDA), closing a span opened where the unit's reduction began.
    The span holds the reduce-scatter too, which the union counts once."""

    def __init__(self, timer: CommTimer, reduce_scatter: _TimedReduceScatter) -> None:
        self.timer, self.reduce_scatter = timer, reduce_scatter

    def __call__(self, reduce_output: torch.Tensor) -> None:
        started = self.reduce_scatter.reduction_started
        if isinstance(started, torch.cuda.Event):
            self.timer.end_event(started)
        elif started is not None:
            self.timer.add_interval(started, time.perf_counter())


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
    timer.add_interval(clock, time.perf_counter())
    return work


def attach_comm_timer(model: torch.nn.Module) -> CommTimer | None:
    """Time DDP's bucket all-reduces (a comm hook) or FSDP2's all-gathers, reduce-scatters (custom collectives of
    each sharded module) and HSDP's replicate all-reduces (an all-reduce hook); None for an unwrapped model."""
    if isinstance(model, FSDPModule):
        return _attach_to_fsdp2(model)
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
            timer.add_interval(clock, time.perf_counter())
            return future.value()

        return default_hooks.allreduce_hook(group, bucket).then(finished)

    model.register_comm_hook(model.process_group, timed_allreduce)  # DDP's own group (a DiLoCo site's, say)
    return timer


def _attach_to_fsdp2(model: FSDPModule) -> CommTimer:
    """Each sharded module's collectives, and its replicate all-reduce under HSDP only: on plain FSDP2 an all-reduce
    hook would move the post-reduce work onto another stream."""
    timer = CommTimer(cuda=_device_type(model) == "cuda")
    replicated = _is_hsdp(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            reduce_scatter = _TimedReduceScatter(timer)
            module.set_custom_all_gather(_TimedAllGather(timer, model))
            module.set_custom_reduce_scatter(reduce_scatter)
            if replicated:
                module.set_all_reduce_hook(_TimedReplicateAllReduce(timer, reduce_scatter))
    return timer


def _is_hsdp(model: torch.nn.Module) -> bool:
    """Whether the sharded parameters are also replicated across a mesh dimension (HSDP's replicate groups)."""
    param = next(model.parameters(), None)
    return isinstance(param, DTensor) and any(isinstance(p, Replicate) for p in param.placements)


def _device_type(model: torch.nn.Module) -> str:
    return next((p.device.type for p in model.parameters()), "cpu")
