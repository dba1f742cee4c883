"""Wrap a loaded model for data parallelism: DDP, or FSDP2 per block then the root.

Never loads weights. The order of steps is fixed: strategy → (FSDP: shard each block,
then the root | DDP: replicate) so the same job always ends up with the same layout.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import psutil
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from trainyard.dist import DistInfo
from trainyard.model import decoder_blocks

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


def choose_strategy(requested: str, model: torch.nn.Module, info: DistInfo) -> str:
    """`auto`: none alone; ddp while replicated training state fits half a device; else fsdp."""
    if requested != "auto":
        return "none" if info.world_size == 1 else requested
    if info.world_size == 1:
        return "none"
    fits = replicated_state_bytes(model) <= _DDP_MEMORY_SHARE * device_memory_bytes(info)
    return "ddp" if fits else "fsdp"


def wrap(model: torch.nn.Module, strategy: str, info: DistInfo) -> torch.nn.Module:
    model.to(info.device)
    if strategy == "ddp":
        return DistributedDataParallel(
            model,
            device_ids=[info.local_rank] if info.device.type == "cuda" else None,
            forward_sync_buffers=False,  # no collective in eval forwards
        )
    if strategy == "fsdp":
        return shard_fsdp2(model, info)
    return model


def shard_fsdp2(model: torch.nn.Module, info: DistInfo) -> torch.nn.Module:
    """fully_shard every decoder block, then the root (embeddings, norm, head)."""
    mesh = init_device_mesh(info.device.type, (info.world_size,))
    policy = MixedPrecisionPolicy()
    if info.device.type == "cuda":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in decoder_blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


class CommTimer:
    """Seconds DDP's gradient all-reduces were in flight (measured, overlap included)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def attach_comm_timer(model: torch.nn.Module) -> CommTimer | None:
    """Time every gradient bucket's all-reduce from launch to completion (DDP only)."""
    if not isinstance(model, DistributedDataParallel):
        return None
    timer = CommTimer()

    # No annotations: DDP checks them literally and this module's are postponed strings.
    def timed_allreduce(group, bucket):  # type: ignore[no-untyped-def]
        started = time.perf_counter()

        def finished(future: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            timer.seconds += time.perf_counter() - started
            return future.value()

        return default_hooks.allreduce_hook(group, bucket).then(finished)

    model.register_comm_hook(None, timed_allreduce)
    return timer


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module users see (PEFT or HF), without the DDP shell."""
    return model.module if isinstance(model, DistributedDataParallel) else model


@contextlib.contextmanager
def gradient_sync(model: torch.nn.Module, enabled: bool) -> Iterator[None]:
    """Skip the gradient all-reduce on all but the last micro-batch of a window."""
    if isinstance(model, DistributedDataParallel) and not enabled:
        with model.no_sync():
            yield
        return
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
    yield
