"""Expert parallelism (EP): each rank of an EP group holds experts / N whole experts of every MoE block, and the
tokens travel to their experts instead of the experts to the tokens.

EP is carved out of the shard dimension (`dist.build_mesh`: "shard" = "shard_mod_ep" x "ep"), as torchtitan
does: routers, attention, shared experts and dense layers stay under FSDP2/HSDP over the whole shard dimension;
the expert stacks (and their adapters) hold only this EP rank's rows and are FSDP-sharded over what is left of it
("shard_mod_ep", and "replicate" under HSDP), so no step all-gathers every expert. With context parallelism each
EP group is made of whole CP groups ("ep" = "ep_mod_cp" x "cp"): each rank routes its slice of the rows like any
data-parallel rank's rows.

The forward (`TokenExchange`, called by moe_lora's grouped path on the expert-sorted rows) sends each row to the
rank holding its expert and back with autograd-aware all-to-alls, capacity-free: no row is dropped. The routing
weights are applied on the row's own rank, so the result is the single-process one. Gradients: an expert's
weights receive every rank's rows through the all-to-all's backward (a sum over the EP group), which FSDP then sums
over the expert mesh; dividing by the whole data-parallel size (not the expert mesh's) gives the average the other
parameters get.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import MethodType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as torch_dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from trainyard import dist
from trainyard.errors import ConfigError
from trainyard.model import nf4_experts
from trainyard.model.routing import EXPERT_PARALLEL_FAMILIES
from trainyard.model.weights import InMemory, RowReader, SafetensorsFolder, checkpoint_key

if TYPE_CHECKING:
    from peft.tuners.lora import ParamWrapper

    from trainyard.model.moe_lora import LowRank

FAMILIES = EXPERT_PARALLEL_FAMILIES
"""Families whose EP loss and gradients are proven equal to one process's (tests/dist/test_expert_parallel.py)."""
STRATEGIES = ("fsdp", "hsdp")


@dataclass(frozen=True)
class ExpertStack:
    """One MoE block's routed experts: the transformers experts module, and what FSDP shards as one unit (the
    outermost PEFT wrapper around it under LoRA, else the module itself)."""

    name: str
    experts: torch.nn.Module
    unit: torch.nn.Module
    wrappers: tuple[ParamWrapper, ...]


def find_expert_stacks(model: torch.nn.Module) -> list[ExpertStack]:
    """Every module of fused 3-D experts (a transformers class run by `use_experts_implementation`)."""
    outermost = _adapter_chains(model)
    stacks = []
    for name, module in model.named_modules():
        if hasattr(module, "has_gate") and hasattr(module, "num_experts") and _has_stack(module):
            unit, chain = outermost.get(id(module), (module, ()))
            stacks.append(ExpertStack(name, module, unit, chain))
    return stacks


def _adapter_chains(model: torch.nn.Module) -> dict[int, tuple[torch.nn.Module, tuple[ParamWrapper, ...]]]:
    """By id of each module whose 3-D parameters LoRA adapts: its outermost PEFT wrapper and the wrappers' chain.
    Empty, and PEFT not imported, where nothing has loaded PEFT (no LoRA)."""
    if "peft" not in sys.modules:
        return {}
    from peft.tuners.lora import ParamWrapper

    from trainyard.model.moe_lora import wrapper_chain

    wrappers = [module for module in model.modules() if isinstance(module, ParamWrapper)]
    inner = {id(m.base_layer) for m in wrappers}
    outermost = {}
    for module in wrappers:
        if id(module) not in inner:
            chain = wrapper_chain(module)
            outermost[id(chain[-1].get_base_layer())] = (module, tuple(chain))
    return outermost


def _has_stack(module: torch.nn.Module) -> bool:
    """3-D expert stacks, or stacks model.quantize nf4 holds per expert."""
    return any(param.dim() == 3 for param in module.parameters(recurse=False)) or bool(nf4_experts.stacks_of(module))


def check(model: torch.nn.Module, expert_parallel: int, strategy: str, shard: int, where: str | None) -> None:
    """Refuse, before any weight is read, an EP size the job cannot run exactly."""
    if expert_parallel == 1:
        return
    if strategy not in STRATEGIES:
        raise ConfigError(
            f"dist.expert_parallel {expert_parallel} needs dist.strategy fsdp or hsdp (EP is carved out of the "
            f"shard dimension), not {strategy}",
            where=where, fix="set dist.strategy: fsdp (or hsdp), or dist.expert_parallel: 1",
        )
    stacks = find_expert_stacks(model)
    family = getattr(getattr(model, "config", None), "model_type", "?")
    if not stacks:
        raise ConfigError(
            f"dist.expert_parallel {expert_parallel}: the model ({family}) has no routed experts stored as 3-D "
            "stacks", where=where, fix="set dist.expert_parallel: 1 (EP is for MoE models)",
        )
    if family not in FAMILIES:
        raise ConfigError(
            f"dist.expert_parallel {expert_parallel}: expert parallelism is not proven exact for {family}",
            where=where, fix=f"set dist.expert_parallel: 1 (EP runs {', '.join(FAMILIES)})",
        )
    experts = stacks[0].experts.num_experts
    if experts % expert_parallel or shard % expert_parallel:
        raise ConfigError(
            f"dist.expert_parallel {expert_parallel} must divide the number of experts ({experts}) and the shard "
            f"dimension ({shard} ranks)", where=where,
            fix="set dist.expert_parallel to one of "
            + ", ".join(str(d) for d in range(1, min(experts, shard) + 1) if experts % d == 0 and shard % d == 0),
        )
    if (experts // expert_parallel) % (shard // expert_parallel):
        raise ConfigError(
            f"dist.expert_parallel {expert_parallel}: each EP rank's {experts // expert_parallel} experts do not "
            f"split evenly over the {shard // expert_parallel} ranks left of the shard dimension (checkpoints lay "
            "an expert stack out in whole rows per rank)", where=where,
            fix=f"set dist.expert_parallel so that {experts} / it is a multiple of {shard} / it",
        )


@dataclass(frozen=True)
class ExpertMeshes:
    ep: DeviceMesh
    """The EP group: the ranks whose experts together make every expert."""
    shard: DeviceMesh
    """What FSDP2 shards the expert stacks over: "shard_mod_ep" (HSDP: "replicate" x "shard_mod_ep")."""
    whole: DeviceMesh
    """`shard`'s dimensions, then "ep": the mesh a whole expert stack is laid out on for checkpoints."""

    def whole_stack(self, part: DTensor, local_experts: int, expert_innermost: bool) -> DTensor:
        """This rank's part of an expert tensor (FSDP2's shard of its EP rank's experts) as a DTensor of the whole
        stack, sharing its memory (a checkpoint loads into it in place). Rows (stacks, lora_A): the EP rank's rows
        are split again by FSDP2, a strided shard on its dimension. lora_B [out, r x experts], expert innermost,
        is seen as [out, r, experts]: FSDP2 splits dim 0, EP dim 2."""
        local = part.to_local()
        ranks = self.ep.size()
        if expert_innermost:
            out, columns = part.shape
            local = local.view(local.shape[0], columns // local_experts, local_experts)
            shape = torch.Size((out, columns // local_experts, local_experts * ranks))
            placements = (*part.placements, Shard(2))
        else:
            shape = torch.Size((part.shape[0] * ranks, *part.shape[1:]))
            placements = (*(_StridedShard(0, split_factor=ranks) if p.is_shard(0) else p for p in part.placements),
                          Shard(0))
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(local, self.whole, placements, run_check=False, shape=shape, stride=stride)


def expert_meshes(mesh: DeviceMesh) -> ExpertMeshes:
    """The EP and expert-sharding meshes of a mesh `dist.build_mesh` made with expert_parallel > 1."""
    root = mesh._get_root_mesh()
    names = root.mesh_dim_names or ()
    assert "shard_mod_ep" in names, f"not an expert-parallel mesh: {names}"
    outer = tuple(name for name in names if name in ("replicate", "shard_mod_ep"))  # not "ep" nor its CP parts
    return ExpertMeshes(root["ep"], root[outer] if len(outer) > 1 else root[outer[0]], root[(*outer, "ep")])


def meshes_of(model: torch.nn.Module) -> tuple[ExpertMeshes, int] | None:
    """The expert meshes and experts per EP rank of a model built with expert parallelism; None otherwise."""
    for module in model.modules():
        if hasattr(module, "expert_meshes"):
            return module.expert_meshes, module.local_experts
    return None


def size_of(model: torch.nn.Module) -> int | None:
    """The EP size a model was built with; None without expert parallelism."""
    found = meshes_of(model)
    return None if found is None else found[0].ep.size()


def whole_stacks(model: torch.nn.Module, state: Any, experts_apart: bool = True) -> Any:
    """A (nested) state dict of the model or its optimizer as DCP writes and reads it at any EP size: every expert
    tensor as the whole stack's DTensor (`ExpertMeshes.whole_stack`), the layout of a run without EP, and an expert
    lora_B as [out, r, experts] with or without EP, so that DCP reshards a checkpoint between EP sizes. A load into
    it fills the original tensors (views of their memory). `experts_apart` False, without EP: lora_B as PEFT's
    [out, r x experts], as checkpoints written before held it."""
    found = meshes_of(model)
    if found is not None:
        return _whole(state, "", *found)
    names = expert_adapter_names(model)
    return _apart(state, None, names) if names and experts_apart else state


def expert_adapter_names(model: torch.nn.Module) -> dict[str, int]:
    """The state-dict names of the expert stacks' lora_B weights (torch.distributed.checkpoint's names: no DDP,
    compile or activation-checkpointing wrapper in them), each with its number of experts."""
    experts = {id(wrapper.lora_B[adapter].weight): wrapper.num_experts
               for stack in find_expert_stacks(model) for wrapper in stack.wrappers for adapter in wrapper.lora_B}
    names = {}
    for name, param in model.named_parameters():
        if id(param) in experts:
            for wrapper in ("module.", "_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module."):
                name = name.replace(wrapper, "")
            names[name] = experts[id(param)]
    return names


def saved_apart(model: torch.nn.Module, saved: dict[str, Any]) -> bool:
    """Whether a checkpoint (its DCP metadata's entries by name) holds the expert lora_B as [out, r, experts], as
    `whole_stacks` writes it, rather than PEFT's [out, r x experts] (a checkpoint of a run without EP written before
    checkpoints resumed across EP sizes)."""
    names = expert_adapter_names(model)
    sizes = [len(entry.size) for key, entry in saved.items() if hasattr(entry, "size") and _ends_in(key, names)]
    return not sizes or 3 in sizes  # DiLoCo's round-start weights stay in PEFT's layout beside its site's


def _ends_in(key: str, names: dict[str, int]) -> bool:
    parts = key.split(".")
    return any(".".join(parts[start:]) in names for start in range(len(parts)))


def _apart(value: Any, experts: int | None, names: dict[str, int]) -> Any:
    """`value` with each expert lora_B (and its optimizer state) seen as [out, r, experts]."""
    if isinstance(value, dict):
        return {key: _apart(item, names.get(key, experts), names) for key, item in value.items()}
    if experts is None or not isinstance(value, torch.Tensor) or value.dim() != 2:
        return value
    if not isinstance(value, DTensor):
        return value.view(value.shape[0], -1, experts)
    assert all(p.is_replicate() or p.is_shard(0) for p in value.placements), value.placements
    local = value.to_local()
    shape = torch.Size((value.shape[0], value.shape[1] // experts, experts))
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local.view(local.shape[0], -1, experts), value.device_mesh, value.placements,
                              run_check=False, shape=shape, stride=stride)


def whole_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Each parameter EP ranks hold apart, by name: its shape in the same model without EP (but the per-expert NF4
    weights of a quantized stack, which stand for the stack: nf4_experts.as_whole_stacks)."""
    found = meshes_of(model)
    if found is None:
        return {}
    ranks, apart = found[0].ep.size(), expert_parallel_groups(model)
    shapes = {}
    for name, param in model.named_parameters():
        if id(param) in apart and nf4_experts.stack_expert(name) is None:
            shape = list(param.shape)
            shape[1 if ".lora_B." in name else 0] *= ranks
            shapes[name] = tuple(shape)
    return shapes


def peft_layout(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A gathered expert lora_B, [out, r, experts] as its whole view lays it out, in PEFT's [out, r x experts]."""
    return tensor.reshape(tensor.shape[0], -1) if ".lora_B." in name and tensor.dim() == 3 else tensor


def _whole(value: Any, path: str, meshes: ExpertMeshes, local_experts: int) -> Any:
    if isinstance(value, dict):
        return {key: _whole(item, f"{path}.{key}", meshes, local_experts) for key, item in value.items()}
    if isinstance(value, DTensor) and value.device_mesh.mesh_dim_names == meshes.shard.mesh_dim_names:
        return meshes.whole_stack(value, local_experts, expert_innermost=".lora_B." in path)
    return value


def shard_experts(model: torch.nn.Module, meshes: ExpertMeshes) -> dict[str, int]:
    """Keep only this EP rank's experts (rows of every expert stack and of their adapters) and send tokens to
    the others'; returns the first row of each base stack in the checkpoint, by checkpoint name, for loading."""
    ep = meshes.ep
    rank, ranks = ep.get_local_rank(), ep.size()
    first_rows: dict[str, int] = {}
    for stack in find_expert_stacks(model):
        total = stack.experts.num_experts
        local = total // ranks
        start = rank * local
        for name, param in list(stack.experts._parameters.items()):
            kept = param.data[start : start + local]
            stack.experts._parameters[name] = torch.nn.Parameter(
                kept if kept.is_meta else kept.clone(), requires_grad=param.requires_grad
            )
            first_rows[checkpoint_key(f"{stack.name}.{name}")] = start
        for name in nf4_experts.keep_experts(stack.experts, start, local):  # expert i here: the stack's start + i
            first_rows[checkpoint_key(f"{stack.name}.{name}")] = start
        for wrapper in stack.wrappers:
            _keep_adapter_experts(wrapper, start, local)
        stack.experts.num_experts = local
        stack.experts.token_exchange = TokenExchange(ep.get_group(), ranks, total)
        stack.experts.forward = MethodType(_exchanged_forward, stack.experts)
        stack.unit.expert_meshes, stack.unit.local_experts = meshes, local
    return first_rows


def _keep_adapter_experts(wrapper: ParamWrapper, start: int, local: int) -> None:
    """PEFT's adapter of a fused stack: lora_A [experts x r, in] (expert-major rows), lora_B [out, r x experts]
    (expert innermost); keep this rank's experts' parts, in the same layouts."""
    total = wrapper.num_experts
    for adapter, lora_a in wrapper.lora_A.items():
        rank = wrapper.r[adapter]
        a = lora_a.weight.data[start * rank : (start + local) * rank].clone()
        lora_b = wrapper.lora_B[adapter]
        b = lora_b.weight.data.reshape(lora_b.weight.shape[0], rank, total)[:, :, start : start + local]
        lora_a.weight = torch.nn.Parameter(a, requires_grad=lora_a.weight.requires_grad)
        lora_b.weight = torch.nn.Parameter(b.reshape(b.shape[0], -1).clone(), requires_grad=lora_b.weight.requires_grad)
        lora_a.out_features = lora_b.in_features = rank * local
    wrapper.num_experts = local


def _exchanged_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The experts module's forward under EP without grouped adapters (full fine-tuning, or PEFT's fold)."""
    from trainyard.model.moe_lora import grouped_experts_forward  # moe_lora imports PEFT: an EP job's alone

    return grouped_experts_forward(self, {}, hidden_states, top_k_index, top_k_weights)


@dataclass(frozen=True)
class TokenExchange:
    """Runs expert-sorted rows on the EP ranks that hold their experts (rank p holds experts
    [p x local, (p + 1) x local)), and returns each row's expert output to its place."""

    group: torch_dist.ProcessGroup
    ranks: int
    experts: int

    def __call__(
        self, experts: torch.nn.Module, adapters: dict[str, LowRank], rows: torch.Tensor, expert_ids: torch.Tensor
    ) -> torch.Tensor:
        from trainyard.model.moe_lora import expert_counts, experts_on_sorted

        local = self.experts // self.ranks
        sent = expert_counts(expert_ids, self.experts).to(torch.int64)
        received = dist.all_to_all_counts(sent, self.group)  # [source rank, local expert]: rows sent to our experts
        # the one read per layer that the all-to-all's sizes need: both directions at once
        send_splits, receive_splits = torch.stack([sent, received]).view(2, self.ranks, local).sum(dim=2).tolist()
        arrived = dist.all_to_all_rows(rows, receive_splits, send_splits, self.group)
        # arrived: by source rank, then by expert; the grouped products want them by expert
        local_ids = torch.arange(local, device=rows.device).repeat(self.ranks)
        local_ids = torch.repeat_interleave(local_ids, received, output_size=sum(receive_splits))
        local_ids, order = torch.sort(local_ids, stable=True)
        out = experts_on_sorted(experts, adapters, arrived[order], local_ids)
        back = torch.empty_like(order)
        back[order] = torch.arange(order.size(0), device=order.device)
        return dist.all_to_all_rows(out[back].contiguous(), send_splits, receive_splits, self.group)


@dataclass
class ExpertRows:
    """A weight source read at this EP rank's experts: a base expert stack's rows start at its first row."""

    source: SafetensorsFolder | InMemory
    first_rows: dict[str, int]

    @property
    def folder(self) -> Any:
        return self.source.folder

    def rows(self, key: str) -> RowReader | None:
        read = self.source.rows(key)
        offset = self.first_rows.get(key)
        if read is None or offset is None:
            return read
        return lambda start, stop: read(start + offset, stop + offset)


def expert_parallel_groups(model: torch.nn.Module) -> dict[int, torch_dist.ProcessGroup]:
    """id(parameter) -> its EP group, for the parameters EP ranks hold apart (their norm sums over the group)."""
    return {
        id(param): module.expert_meshes.ep.get_group()
        for module in model.modules()
        if hasattr(module, "expert_meshes")
        for param in module.parameters()
    }
