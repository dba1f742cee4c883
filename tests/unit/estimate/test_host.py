"""Host memory of a node: per process, the larger transient copy, once per node the random init and the adapter."""

from __future__ import annotations

from tests.conftest import REPO, TINY
from trainyard.config_file import load_config
from trainyard.estimate import Hardware, estimate, host_memory
from trainyard.hardware import GIB

GLM = str(REPO / "configs" / "glm45air-fsdp-lora.yaml")
SCRATCH = str(REPO / "configs" / "scratch-1.5b.yaml")


def test_a_node_of_more_processes_needs_more_and_the_parts_add_up() -> None:
    cfg = load_config(GLM, [])
    four, eight = host_memory(cfg, Hardware("h200", 4, 2)), host_memory(cfg, Hardware("h200", 8, 2))
    assert eight.per_node > four.per_node
    parts = eight.processes + 8 * eight.transient_per_process + eight.random_init + eight.adapter_gather
    assert abs(parts - eight.per_node) < 1
    assert eight.request_gib * GIB >= eight.per_node > (eight.request_gib - 1) * GIB


def test_an_async_save_stages_the_optimizer_too() -> None:
    sync = host_memory(load_config(GLM, ["checkpoint.async=false"]), Hardware("h200", 8, 2))
    staged = host_memory(load_config(GLM, ["checkpoint.async=true"]), Hardware("h200", 8, 2))
    memory = estimate(load_config(GLM, ["checkpoint.async=true"]), Hardware("h200", 8, 2), suggest=False).memory
    assert staged.transient_per_process == memory.weights + memory.lora_adapters + memory.optimizer
    assert staged.per_node > sync.per_node


def test_a_random_init_counts_the_whole_fp32_model_once_per_node() -> None:
    cfg = load_config(SCRATCH, [])
    result = estimate(cfg, Hardware("h100-80gb", 8, 2), suggest=False)
    host = host_memory(cfg, Hardware("h100-80gb", 8, 2))
    assert host.random_init == 4 * result.total_params
    assert host.adapter_gather == 0  # full fine-tuning: no adapter


def test_on_a_cpu_node_the_device_state_is_host_memory() -> None:
    cfg = load_config(TINY, [])
    host = host_memory(cfg, Hardware("cpu", 2, 1))
    memory = estimate(cfg, Hardware("cpu", 2, 1), suggest=False).memory
    assert memory.runtime > 0  # a CPU process's peak counts its interpreter; the node counts it once per process
    assert host.device_state == 2 * (memory.peak - memory.runtime) and host.transient_per_process == 0
