"""Parallelize a meta-built model, in one fixed order, then materialise each rank's own weights.

Activation checkpointing and compile first; then FSDP2 shards each block, an untied embedding and head, then
the root (HSDP: the same on a 2-D mesh), while every weight is still on the meta device; only then is memory
allocated for this rank's shards, and weights.py fills them. DDP (and a lone process) materialise one whole copy,
fill it, then replicate. The strategy itself is plan's decision.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from trainyard.dist import DistInfo, is_fsdp
from trainyard.model import weights
from trainyard.model.build import decoder_blocks, untied_ends
from trainyard.parallel import checkpointing, context_parallel, expert_parallel, float8
from trainyard.parallel import compile as compile_room
from trainyard.precision import Precision

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy


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
    activation_checkpointing: bool | str = False,
    compile_blocks: bool | str = False,
    expert_parallel_size: int = 1,
    context_parallel_size: int = 1,
) -> torch.nn.Module:
    """The fixed order: keep this rank's experts (expert parallelism) → activation checkpointing → compile →
    shard → allocate and fill this rank's own weights (DDP: wrap after load). Parameters that already hold values
    (LoRA adapters) keep them; the meta ones and every persistent buffer are read from `source`. diloco runs
    `site_inner` (diloco.inner) within each site; the outer sync across sites is diloco/outer.py's. Context
    parallelism swaps the attention for its sequence-to-heads exchange (context_parallel.py) before anything wraps
    the blocks; train.precision fp8 swaps the blocks' linears for FP8 ones (float8.py) there too."""
    already_real = {name for name, param in model.named_parameters() if not param.is_meta}
    experts = None
    if expert_parallel_size > 1:
        assert mesh is not None and strategy in expert_parallel.STRATEGIES, "EP is carved out of fsdp/hsdp's mesh"
        experts = expert_parallel.expert_meshes(mesh)
        first_rows = expert_parallel.shard_experts(model, experts)
        source = expert_parallel.ExpertRows(source, first_rows)
    if context_parallel_size > 1:
        carried = site_inner if strategy == "diloco" else strategy  # a DiLoCo site's inner strategy carries it
        assert mesh is not None and carried in context_parallel.STRATEGIES, "CP is carved out of fsdp/hsdp's mesh"
        context_parallel.attach(model, mesh)
    float8.apply(model, precision, info.device, shards_within(strategy, site_inner), "train.precision")
    if activation_checkpointing:
        selective = activation_checkpointing == "selective"
        checkpointing.enable_activation_checkpointing(model, selective=selective)
        logging.getLogger("trainyard").info("activation checkpointing: %s", "selective" if selective else "full")
    if compile_room.resolve(compile_blocks, info.device):
        compiled = compile_room.compile_blocks(model)
        logging.getLogger("trainyard").info("torch.compile: %d decoder blocks, %s", compiled.blocks,
                                            "one graph each" if compiled.fullgraph else "the attention between graphs")
        compile_room.first_step_timer(model)
    if shards_within(strategy, site_inner):
        assert mesh is not None, f"{strategy} shards over dist.build_mesh's mesh"
        shard_fsdp2(model, within_site(mesh) if strategy == "diloco" else mesh, precision, experts)
    materialize(model, info.device)
    weights.load(model, source, skip=lambda name: name in already_real)
    if strategy == "ddp" or (strategy == "diloco" and site_inner == "ddp"):
        return DistributedDataParallel(
            model,
            device_ids=[info.local_rank] if info.device.type == "cuda" else None,
            process_group=mesh["local"].get_group() if strategy == "diloco" and mesh is not None else None,
            init_sync=False,  # every rank just read the same weights: no start-up broadcast (nor its memory)
            **no_buffer_sync_in_forward(DistributedDataParallel),
        )
    return model


def no_buffer_sync_in_forward(ddp: type) -> dict[str, bool]:
    """DDP's argument that keeps eval forwards free of collectives: `forward_sync_buffers` from torch 2.13, which
    deprecates `broadcast_buffers`, the only one before it (torch 2.11 refuses the new name)."""
    renamed = "forward_sync_buffers" in inspect.signature(ddp).parameters
    return {"forward_sync_buffers" if renamed else "broadcast_buffers": False}


def materialize(model: torch.nn.Module, device: torch.device) -> None:
    """Memory for meta tensors (a shard's worth under FSDP2), the rest moved to `device`. FSDP2
    swaps its own sharded parameters; elsewhere each shared Parameter is replaced once, for every
    module holding it, so tied weights stay tied."""
    if is_fsdp(model):
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
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if not precision.mixed:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=precision.compute_dtype, reduce_dtype=torch.float32)


def shard_fsdp2(
    model: torch.nn.Module,
    mesh: DeviceMesh,
    precision: Precision,
    experts: expert_parallel.ExpertMeshes | None = None,
) -> torch.nn.Module:
    """fully_shard every decoder block, the untied embedding and head, then the root (the rest). A 2-D mesh
    ("replicate", "shard") makes it HSDP: sharded within a group, replicated across groups. Under expert
    parallelism each block's expert stacks are their own unit first, on the expert mesh; their gradients are
    divided by the whole data-parallel size, as the rest's are (the all-to-all's backward summed the EP group's)."""
    from torch.distributed.fsdp import fully_shard  # FSDP1 comes with the package: only a sharded job loads it

    policy = mixed_precision_policy(precision)
    if experts is not None:
        for stack in expert_parallel.find_expert_stacks(model):
            fully_shard(stack.unit, mesh=experts.shard, mp_policy=policy)
            stack.unit.set_gradient_divide_factor(float(mesh.size()))
            if experts.shard.size(-1) > 1:  # gloo has no PREMUL_SUM: sum, then divide (alone, FSDP2 divides a copy)
                stack.unit.set_force_sum_reduction_for_comms(True)
    for block in decoder_blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    embedding, head = untied_ends(model)
    if embedding is not None:  # gathered for its lookup alone
        fully_shard(embedding, mesh=mesh, mp_policy=policy)
        if not any(param.requires_grad for param in embedding.parameters()):
            embedding.set_unshard_in_backward(False)  # else the first block's backward prefetches it, for nothing
    if head is not None:  # gathered for the loss and kept for its backward, which comes next
        fully_shard(head, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


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
    if is_fsdp(model):
        model.set_requires_gradient_sync(last or not defer)
        model.set_requires_all_reduce(last)
    yield
