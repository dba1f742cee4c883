"""Host (CPU) memory of one node of a job: what a Kubernetes pod or a Slurm allocation must ask for, so the
kernel's OOM killer does not end a job the GPUs had room for.

A node holds, per process, the interpreter and its libraries, and the larger of two transient copies: its shard of
the weights on the way to the device at load, or its shard of the full checkpoint staged for an async save. Once per
node it holds the whole model while a random init draws it (one process per node does, the others wait) and, on
rank 0's node, the whole adapter gathered for a lite save. On a CPU device every byte of the device estimate is host
memory too.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainyard.config import JobConfig
from trainyard.estimate.memory import Memory
from trainyard.hardware import GIB, Gpu

PROCESS_BYTES_GPU = 3 * GIB
"""torch, transformers and CUDA's host side (driver, cuBLAS and NCCL host buffers, pinned staging) per process:
stated, not measured."""
PROCESS_BYTES_CPU = 1 * GIB
"""torch and transformers per process on a CPU node."""
FP32_BYTES = 4


@dataclass(frozen=True)
class HostMemory:
    """Bytes of host memory one node needs at its peak, by part."""

    processes: float
    """Interpreters and libraries of every process on the node."""
    transient_per_process: float
    """The larger of the weights shard copied in at load and the full checkpoint shard staged for an async save."""
    device_state: float
    """On a CPU device, the device estimate's peak of every process: it is host memory."""
    random_init: float
    """The whole model in fp32 while one process per node draws it (model.config jobs only)."""
    adapter_gather: float
    """The whole LoRA adapter in fp32 on rank 0 during a lite or full save."""
    per_node: int

    @property
    def request_gib(self) -> int:
        """Whole GiB, rounded up: what a manifest asks for."""
        return -(-self.per_node // GIB)


def host_memory(cfg: JobConfig, memory: Memory, kind: Gpu, processes_per_node: int,
                total_params: int, trainable_params: int) -> HostMemory:
    """The node's peak host bytes for this job on `processes_per_node` processes of device kind `kind`."""
    on_cpu = kind.device_name is None
    process = PROCESS_BYTES_CPU if on_cpu else PROCESS_BYTES_GPU
    loaded = memory.weights + memory.lora_adapters
    staged = memory.weights + memory.lora_adapters + memory.optimizer if cfg.checkpoint.async_save else 0.0
    transient = 0.0 if on_cpu else max(loaded, staged)  # on a CPU device the state is already in device_state
    device_state = memory.peak - memory.runtime if on_cpu else 0.0  # the runtime is `process`
    random_init = total_params * FP32_BYTES if cfg.model.config is not None else 0.0
    adapter = trainable_params * FP32_BYTES if cfg.lora.enabled else 0.0
    per_node = processes_per_node * (process + transient + device_state) + random_init + adapter
    return HostMemory(processes_per_node * process, transient, processes_per_node * device_state, random_init,
                      adapter, int(per_node))
