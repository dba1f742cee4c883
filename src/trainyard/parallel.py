"""Wrap a meta-built model for data parallelism, then materialise each rank's own weights.

The order is fixed: FSDP2 shards each block, then the root (HSDP: the same on a 2-D mesh),
while every weight is still on the meta device; only then is memory allocated for this rank's
shards, and weights.py fills them. DDP (and a lone process) materialise one whole copy, fill
it, then replicate.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator

import psutil
import torch
import torch.distributed as torch_dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
from torch.nn.parallel import DistributedDataParallel

from trainyard import estimate, weights
from trainyard.config import JobConfig
from trainyard.dist import DistInfo
from trainyard.errors import ConfigError, ModelError, OptionError
from trainyard.model import decoder_blocks
from trainyard.precision import Precision

# AdamW keeps two fp32 moments per trainable parameter.
_ADAM_BYTES_PER_PARAM = 8
# Replicated state may use at most this share of a device; the rest is activations.
_DDP_MEMORY_SHARE = 0.5


def device_memory_bytes(info: DistInfo) -> int:
    if info.device.type == "cuda":
        return torch.cuda.get_device_properties(info.device).total_memory
    return psutil.virtual_memory().total // max(info.local_world_size, 1)


def replicated_state_bytes(model: torch.nn.Module) -> int:
    """Weights + gradients + AdamW moments, as each DDP rank would hold them."""
    total = 0
    for param in model.parameters():
        size = param.numel() * param.element_size()
        total += size
        if param.requires_grad:
            total += size + param.numel() * _ADAM_BYTES_PER_PARAM
    return total


def choose_strategy(requested: str, model: torch.nn.Module, info: DistInfo, cfg: JobConfig | None = None) -> str:
    """The strategy to run; for `auto`, see auto_strategy. A strategy asked for by name is kept in a
    1-process group (one GPU still tests its wrapper)."""
    if requested != "auto":
        return requested if info.distributed or torch_dist.is_initialized() else "none"
    return auto_strategy(model, info, cfg)[0]


def auto_strategy(
    model: torch.nn.Module | None, info: DistInfo, cfg: JobConfig | None = None, device: int | None = None
) -> tuple[str, str]:
    """(strategy, why) for `dist.strategy: auto`: none alone; else the first of ddp, hsdp (several nodes:
    only gradients cross the slow link) and fsdp whose estimated peak per rank (weights, gradients, optimizer,
    activations, buffers: estimate.py) fits the device. Without a job the estimate can model, the replicated
    training state decides: ddp while it fits half a device. `device`: bytes per rank of the target when it is
    not this machine (a dry run for another cluster)."""
    if info.world_size == 1:
        return "none", "one process"
    device = device or device_memory_bytes(info)
    nodes = math.ceil(info.world_size / max(info.local_world_size, 1))
    if cfg is not None:
        try:
            peaks: list[tuple[str, int]] = []
            for candidate in ["ddp", *(["hsdp"] if nodes > 1 else []), "fsdp"]:
                peak = estimate.planned_peak(cfg, candidate, info.world_size, info.local_world_size, device)
                peaks.append((candidate, peak))
                if peak <= device:
                    break
            said = ", ".join(f"{name} {peak / 2**30:.1f} GiB" for name, peak in peaks)
            return peaks[-1][0], f"estimated peak per rank {said}, of {device / 2**30:.1f} GiB"
        except (ModelError, ConfigError, OptionError, OSError, ValueError) as err:
            reason = f"no estimate ({str(err).splitlines()[0]}); replicated state decides: "
    else:
        reason = "replicated state decides: "
    if model is None:
        return "auto", reason + "unknown before the model is built"
    state, budget = replicated_state_bytes(model), _DDP_MEMORY_SHARE * device
    reason += f"{state / 2**30:.2f} GiB of weights, gradients and AdamW state, budget {budget / 2**30:.1f} GiB"
    if state <= budget:
        return "ddp", reason
    several_nodes = info.world_size > info.local_world_size
    return ("hsdp" if several_nodes and state / info.local_world_size <= budget else "fsdp"), reason


def check_fits(
    strategy: str, requested: str, shards: int, model: torch.nn.Module, info: DistInfo, where: str | None
) -> None:
    """Refuse, before any weight is read, a plan whose training state cannot fit a device.
    `shards`: how many ranks the state is divided over (1 for ddp, the shard group for hsdp)."""
    state = replicated_state_bytes(model)
    per_rank = state / shards
    device = device_memory_bytes(info)
    if per_rank <= device:
        return
    gib = 2**30
    sharded = state / info.world_size
    fix = (
        f"use dist.strategy: fsdp (about {sharded / gib:.1f} GiB per rank over {info.world_size} ranks)"
        if sharded <= device
        else f"use more ranks (at least {int(state // device) + 1} for fsdp), LoRA, or a smaller model"
    )
    raise ConfigError(
        f"dist.strategy {requested}{f' ({strategy} on {info.world_size} rank)' if strategy != requested else ''}: "
        f"weights, gradients and AdamW state need about {per_rank / gib:.1f} GiB per rank, "
        f"more than the {device / gib:.1f} GiB of {info.device.type} memory each rank has",
        where=where,
        fix=fix,
    )


def shards_within(strategy: str, site_inner: str) -> bool:
    """Whether the state is sharded over the mesh's last dimension: fsdp, hsdp's shard groups, a DiLoCo site."""
    return strategy in ("fsdp", "hsdp") or (strategy == "diloco" and site_inner in ("fsdp", "hsdp"))


def within_site(mesh: DeviceMesh) -> DeviceMesh:
    """A DiLoCo mesh without its "site" dimension: what the inner strategy runs over."""
    names = mesh.mesh_dim_names
    assert names is not None and names[0] == "site", f"not a diloco mesh: {names}"
    return mesh[names[1]] if len(names) == 2 else mesh[names[1:]]


def apply(
    model: torch.nn.Module,
    strategy: str,
    info: DistInfo,
    precision: Precision,
    source: weights.SafetensorsFolder | weights.InMemory,
    mesh: DeviceMesh | None,
    site_inner: str = "ddp",
) -> torch.nn.Module:
    """Wrap, then allocate and fill this rank's own weights. Parameters that already hold values
    (LoRA adapters) keep them; the meta ones and every persistent buffer are read from `source`.
    diloco runs `site_inner` (diloco.inner) within each site; the outer sync across sites is diloco.py's."""
    already_real = {name for name, param in model.named_parameters() if not param.is_meta}
    if shards_within(strategy, site_inner):
        assert mesh is not None, f"{strategy} shards over dist.build_mesh's mesh"
        shard_fsdp2(model, within_site(mesh) if strategy == "diloco" else mesh, precision)
    materialize(model, info.device)
    weights.load(model, source, skip=lambda name: name in already_real)
    if strategy == "ddp" or (strategy == "diloco" and site_inner == "ddp"):
        return DistributedDataParallel(
            model,
            device_ids=[info.local_rank] if info.device.type == "cuda" else None,
            process_group=mesh["local"].get_group() if strategy == "diloco" and mesh is not None else None,
            forward_sync_buffers=False,  # no collective in eval forwards
            init_sync=False,  # every rank just read the same weights: no start-up broadcast (nor its memory)
        )
    return model


def materialize(model: torch.nn.Module, device: torch.device) -> None:
    """Memory for meta tensors (a shard's worth under FSDP2), the rest moved to `device`. FSDP2
    swaps its own sharded parameters; elsewhere each shared Parameter is replaced once, for every
    module holding it, so tied weights stay tied."""
    if isinstance(model, FSDPModule):
        model._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t.to(device))
        return
    replaced: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is None:
                continue
            if id(param) not in replaced:
                replaced[id(param)] = param if param.device == device else _real_on(param, device)
            module._parameters[name] = replaced[id(param)]
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(device)


def _real_on(param: torch.nn.Parameter, device: torch.device) -> torch.nn.Parameter:
    data = torch.empty_like(param, device=device) if param.is_meta else param.detach().to(device)
    return torch.nn.Parameter(data, requires_grad=param.requires_grad)


def mixed_precision_policy(precision: Precision) -> MixedPrecisionPolicy:
    """bf16-mixed: gather weights in bf16 for compute, reduce-scatter gradients in fp32 onto the
    fp32 shards the optimizer steps."""
    if not precision.mixed:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=precision.compute_dtype, reduce_dtype=torch.float32)


def shard_fsdp2(model: torch.nn.Module, mesh: DeviceMesh, precision: Precision) -> torch.nn.Module:
    """fully_shard every decoder block, then the root (embeddings, norm, head). A 2-D mesh
    ("replicate", "shard") makes it HSDP: sharded within a group, replicated across groups."""
    policy = mixed_precision_policy(precision)
    for block in decoder_blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


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


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module users see (PEFT or HF), without the DDP shell."""
    return model.module if isinstance(model, DistributedDataParallel) else model


@contextlib.contextmanager
def gradient_sync(model: torch.nn.Module, last: bool, defer: bool) -> Iterator[None]:
    """How a micro-batch's gradients are reduced, `last` of its window or not.

    DDP: all-reduce on the last only (no_sync before). FSDP2/HSDP: reduce-scatter every micro-batch,
    so each unit's unsharded gradient is freed right after its backward; HSDP all-reduces the shards
    across replicas on the last only. `defer`: FSDP2/HSDP reduce nothing before the last, keeping
    unsharded gradients of the whole model until then (memory for speed)."""
    if isinstance(model, DistributedDataParallel) and not last:
        with model.no_sync():
            yield
        return
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(last or not defer)
        model.set_requires_all_reduce(last)
    yield
