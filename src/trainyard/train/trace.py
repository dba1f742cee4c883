"""`trainyard estimate --trace`: one real optimizer step of the job, at its real shape and world size, on this
one process, with fake tensors (shapes and dtypes, no memory) and a fake process group of the real world size.

It lives with training because it *is* a training step: the model built on the meta device as build.py builds it,
parallelized by parallelize.py on dist.build_mesh's mesh for the strategy the estimate plans, then a window of
micro-batches (forward, backward, gradients reduced as the loop reduces them), clipping and an AdamW step. The
estimate room never imports dist, parallel or train, so the formula's figures come in from below and the traced
ones are set beside them. What is traced: the peak of live tensor bytes on rank 0 (every storage an op creates,
counted until it is freed or resized, as FSDP2 frees its unsharded weights), the unsharded (gathered) weights' own
peak, and every collective with the mesh dimension it runs on and its bytes.

The step traced is a steady one: AdamW's moments are created before it, as every step after the first holds them.
Under dist.context_parallel it is one CP rank's step (trace_context.py): its slice of each row, its all-to-alls.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as torch_dist
from torch._guards import active_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fake_collectives import CollectiveOp, collective_ops, sync_ops
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from trainyard import dist, estimate
from trainyard import hardware as machines
from trainyard import precision as precision_room
from trainyard.config import JobConfig
from trainyard.diloco import outer as diloco
from trainyard.errors import ConfigError
from trainyard.estimate import arch as estimate_arch
from trainyard.estimate import memory as estimate_memory
from trainyard.estimate.memory import Layout, Memory
from trainyard.estimate.timing import Lengths
from trainyard.model import attention
from trainyard.model import build as model_room
from trainyard.model import lora as lora_room
from trainyard.model import quantize
from trainyard.model import weights
from trainyard.parallel import parallelize as parallel
from trainyard.plan import batching
from trainyard.train import trace_context
from trainyard.train.optim import build_optimizer, grad_norm_and_clip
from trainyard.train.trace_batch import documents, micro_batches
from trainyard.train.trace_kernels import FUSED, GroupedMmInAnyDtype, balanced_exchanges, hooked, traced_attention

CPU = torch.device("cpu")
_C10D = torch.ops.c10d
_FUNCTIONAL = torch.ops._c10d_functional
# Collective -> (kind, where its output is: an argument index, or None for the returned tensor, where its input is).
_PAYLOAD: dict[Any, tuple[str, int | None, int]] = {
    _C10D._allgather_base_.default: ("all_gather", 0, 1),
    _C10D.allgather_.default: ("all_gather", 0, 1),
    _C10D._reduce_scatter_base_.default: ("reduce_scatter", 0, 1),
    _C10D.reduce_scatter_.default: ("reduce_scatter", 0, 1),
    _C10D.allreduce_.default: ("all_reduce", 0, 0),
    _C10D.broadcast_.default: ("broadcast", 0, 0),
    _FUNCTIONAL.all_reduce.default: ("all_reduce", None, 0),
    _FUNCTIONAL.all_gather_into_tensor.default: ("all_gather", None, 0),
    _FUNCTIONAL.reduce_scatter_tensor.default: ("reduce_scatter", None, 0),
    _FUNCTIONAL.all_to_all_single.default: ("all_to_all", None, 0),
    torch.ops._c10d_functional_autograd.all_to_all_single.default: ("all_to_all", None, 0),
}


@dataclass(frozen=True)
class Collective:
    """One collective of the traced step on rank 0."""

    kind: str
    """all_gather, reduce_scatter, all_reduce, broadcast (or the op's own name)."""
    group: str
    """The mesh dimension it runs over ("shard", "replicate", "site", "local"), or "world"."""
    ranks: int
    bytes_in: int
    """What this rank puts in: its shard for an all-gather, the whole tensor for a reduce-scatter or all-reduce."""
    bytes_out: int


@dataclass
class Trace:
    """The traced step beside the formula's estimate of the same job, model and layout."""

    mesh: str
    layers: int
    accumulation: int
    static_bytes: int
    """Live at the traced step's start: this rank's weights, buffers and AdamW's moments."""
    peak_bytes: int
    """The traced step's peak of live tensor bytes on this rank."""
    gathered_peak_bytes: int
    """The most bytes of FSDP2's unsharded parameters alive at once (0 without FSDP2): the root's, which FSDP2
    keeps from forward to backward, and the unit being computed's."""
    collectives: list[Collective]
    layout: Layout
    formula: Memory
    """The formula's memory per device for the same model and layout."""
    notes: list[str] = field(default_factory=list)

    def collective_totals(self) -> dict[tuple[str, str, int], tuple[int, int, int]]:
        """(kind, group, ranks) -> (calls, bytes in, bytes out) over the step, in first-seen order."""
        totals: dict[tuple[str, str, int], tuple[int, int, int]] = {}
        for one in self.collectives:
            calls, sent, received = totals.get((one.kind, one.group, one.ranks), (0, 0, 0))
            totals[(one.kind, one.group, one.ranks)] = (calls + 1, sent + one.bytes_in, received + one.bytes_out)
        return totals


class LiveBytes(TorchDispatchMode):
    """Live bytes of every storage an op creates, from creation until it is freed or resized (FSDP2 frees its
    unsharded weights with `resize_(0)`, which no dispatch mode sees: the method is wrapped while tracing), and
    the peak since `start_window`. FSDP2's unsharded parameters are also counted apart, as "gathered"."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[int, int] = {}
        self.gathered: set[int] = set()
        self.live = self.peak = self.gathered_live = self.gathered_peak = self.window_start = 0
        self._fake_mode: Any = None
        self._resize = torch.UntypedStorage.resize_

    def __enter__(self) -> LiveBytes:
        self._fake_mode = active_fake_mode()  # DTensor's sharding propagation runs ops under a fake mode of its own
        original, resized = self._resize, self._resized

        @functools.wraps(original)
        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            result = original(storage, size)
            resized(storage)
            return result

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *args: Any) -> None:
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
        super().__exit__(*args)

    def start_window(self) -> None:
        self.window_start = self.peak = self.live
        self.gathered_peak = self.gathered_live

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(kind is DTensor for kind in types):
            return NotImplemented  # DTensor runs the op on its local shard, which comes back through here
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if active_fake_mode() is self._fake_mode:
            for tensor in _plain_tensors(tree_leaves(out)):
                if tensor.device.type != "meta":
                    self._created(tensor.untyped_storage())
            for tensor in _gathered_by(func, kwargs):
                self._mark_gathered(tensor.untyped_storage())
        return out

    def _created(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key not in self.sizes:
            weakref.finalize(storage, self._freed, key)
            self._set(key, storage.nbytes())

    def _resized(self, storage: torch.UntypedStorage) -> None:
        if id(storage) in self.sizes:
            self._set(id(storage), storage.nbytes())

    def _mark_gathered(self, storage: torch.UntypedStorage) -> None:
        self._created(storage)
        key = id(storage)
        if key not in self.gathered:
            self.gathered.add(key)
            self.gathered_live += self.sizes[key]
            self.gathered_peak = max(self.gathered_peak, self.gathered_live)

    def _set(self, key: int, size: int) -> None:
        change = size - self.sizes.get(key, 0)
        self.sizes[key] = size
        self.live += change
        self.peak = max(self.peak, self.live)
        if key in self.gathered:
            self.gathered_live += change
            self.gathered_peak = max(self.gathered_peak, self.gathered_live)

    def _freed(self, key: int) -> None:
        self._set(key, 0)
        del self.sizes[key]
        self.gathered.discard(key)


def _plain_tensors(leaves: list[Any]) -> Iterator[torch.Tensor]:
    """The tensors holding storage: a wrapper subclass's inner tensors (an NF4 weight's codes and scales), whose
    ops run inside its own dispatch, unseen here; the wrapper's nominal storage is its dense size."""
    for leaf in leaves:
        if is_traceable_wrapper_subclass(leaf):
            yield from _plain_tensors([getattr(leaf, name) for name in leaf.__tensor_flatten__()[0]])
        elif isinstance(leaf, torch.Tensor):
            yield leaf


def _gathered_by(func: Any, kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The unsharded parameters an op fills: FSDP2 copies each all-gather's output out into them when their unit
    runs. The output itself is a communication buffer (where a prefetched unit waits): in the peak, not here."""
    return list(kwargs["out"]) if func is torch.ops.fsdp.split_with_sizes_copy.default else []


class CollectiveLog(TorchDispatchMode):
    """Every collective an op of c10d (FSDP2, DDP, torch.distributed) or of the functional collectives (DTensor)
    issues, with the mesh dimension its process group is."""

    def __init__(self, groups: dict[str, str]) -> None:
        super().__init__()
        self.groups = groups
        self.seen: list[Collective] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(kind is DTensor for kind in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if func in collective_ops and func not in sync_ops:
            self.seen.append(self._describe(func, args, out))
        return out

    def _describe(self, func: Any, args: Any, out: Any) -> Collective:
        group = CollectiveOp.get_process_group(func, args)
        kind, output_at, input_at = _PAYLOAD.get(func, (func._opname, 0, 0))
        output = out if output_at is None else args[output_at]
        name = self.groups.get(group.group_name, f"other group {group.group_name}")
        return Collective(kind, name, group.size(), _nbytes(args[input_at]), _nbytes(output))


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(tensors) if isinstance(t, torch.Tensor))


def group_names(mesh: DeviceMesh | None) -> dict[str, str]:
    """Process group name -> the mesh dimension it is ("world" for the default group)."""
    names = {torch_dist.group.WORLD.group_name: "world"}  # type: ignore[union-attr]
    meshes = [mesh, mesh._get_root_mesh()] if mesh is not None else []  # EP's groups are the root mesh's dims
    for one in meshes:
        for dim in one.mesh_dim_names or ():
            group = one.get_group(dim)
            if group.group_name not in names or names[group.group_name] == "world":
                names[group.group_name] = f"{dim} (the world)" if group.group_name in names else dim
    return names


@contextlib.contextmanager
def fake_world(world: int) -> Iterator[None]:
    """torch's fake process group of `world` ranks, this process rank 0: collectives return at once, unsent."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if torch_dist.is_initialized():
        raise ConfigError("estimate --trace runs outside a training process (a process group exists here)",
                          fix="run `trainyard estimate CONFIG --trace` on its own")
    torch_dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        torch_dist.destroy_process_group()


def architecture(cfg: JobConfig, layers: int | None) -> Any:  # -> PretrainedConfig
    """The job's HF config as the estimate reads it (model.config, a config.json already on this machine, or the
    estimator's table of known hub models: never a download), cut to `layers` decoder layers when given, with
    every per-layer list (layer_types and the like) cut with them."""
    config = estimate_arch.hf_config(cfg)
    if layers is None:
        return config
    depth = config.num_hidden_layers
    for key, value in list(vars(config).items()):
        if isinstance(value, list) and len(value) == depth:
            setattr(config, key, value[:layers])
    config.num_hidden_layers = layers
    return config


def formula(cfg: JobConfig, config: Any, hardware: estimate.Hardware) -> tuple[Layout, Memory]:
    """The formula's layout (strategy, shard group) and memory per device for the same model (cut or not)."""
    shape = estimate_arch.shape_of(config)
    model = estimate_memory.Model(shape, estimate_arch.count(estimate_arch.meta_model(cfg, config), shape))
    kind = machines.gpu(hardware.gpu)
    world = hardware.gpus_per_node * hardware.nodes
    if cfg.dist.strategy == "auto" and world > 1:
        device = machines.device_bytes(kind, hardware.gpus_per_node)
        strategy = estimate.auto_strategy(cfg, world, hardware.gpus_per_node, device)[0]
        cfg = cfg.model_copy(update={"dist": cfg.dist.model_copy(update={"strategy": strategy})})
    layout = estimate_memory.resolve_strategy(cfg, model, kind, hardware.gpus_per_node, hardware.nodes)
    batch = Lengths().largest_micro_batch(cfg)  # unread data: the estimate's, a token budget's N included
    return layout, estimate_memory.memory(cfg, model, layout, estimate_memory.resolve_precision(cfg, kind), batch)


def meta_model(
    cfg: JobConfig, config: Any, precision: precision_room.Precision, device: str = "cuda"
) -> torch.nn.Module:
    """The model as build.build_and_wrap builds it for `device` ("cuda" or "cpu"), on the meta device (LoRA adapters
    too, in the masters' dtype)."""
    return meta_model_and_nf4(cfg, config, precision, device)[0]


def meta_model_and_nf4(
    cfg: JobConfig, config: Any, precision: precision_room.Precision, device: str = "cuda"
) -> tuple[torch.nn.Module, list[str]]:
    """meta_model, and the weights model.quantize nf4 stores in 4 bits (chosen on the plain model, as build.py does;
    none without nf4)."""
    base_dtype = precision.frozen_dtype if cfg.lora.enabled else precision.trainable_dtype
    model = _with_attention(cfg, config, base_dtype, device)
    nf4 = quantize.nf4_targets(model, base_dtype).quantized if cfg.model.quantize == "nf4" else []
    if cfg.lora.enabled:
        with torch.device("meta"), lora_room.real_stand_ins(model, precision.trainable_dtype):
            model = lora_room.apply_lora(model, cfg.lora, cfg.train.seed)
    return model, nf4


def _with_attention(cfg: JobConfig, config: Any, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """The model with the attention the job chooses on its devices, as it runs on CPU fake tensors (trace_kernels)."""
    packed = attention.packed_rows(cfg.data)
    model = model_room.build_meta_model(cfg.model.model_copy(update={"attn_implementation": "varlen"}), config,
                                        dtype, CPU, training=True, packed=packed)
    model.config._attn_implementation = traced_attention(cfg.model.attn_implementation, model, packed,
                                                         cfg.where("model.attn_implementation"), device)
    return model


def adapters_in_memory(model: torch.nn.Module) -> None:
    """LoRA adapters hold their values before the base is parallelized (build.py draws them): here fake ones, so
    parallelize.apply leaves them as it leaves real ones."""
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and param.is_meta and param.requires_grad:
                module._parameters[name] = torch.nn.Parameter(torch.empty_like(param, device=CPU))


@dataclass
class FakeWeights:
    """A weights source (weights.load's) serving each tensor's rows as empty fake tensors of the right shape."""

    shapes: dict[str, tuple[torch.Size, torch.dtype]]
    folder: str = "fake weights"

    @classmethod
    def of(cls, model: torch.nn.Module) -> FakeWeights:
        return cls({weights.checkpoint_key(name): (t.shape, t.dtype) for name, t in weights.tensors_to_load(model)})

    def rows(self, key: str) -> Callable[[int, int], torch.Tensor]:
        shape, dtype = self.shapes[key]
        if not shape:
            return lambda start, stop: torch.empty((), dtype=dtype)
        return lambda start, stop: torch.empty((stop - start, *shape[1:]), dtype=dtype)


def hold_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """AdamW creates its moments at its first step and every later step holds them throughout: a step over zero
    gradients creates them before the traced one (no forward: DDP would rebuild its buckets at the next one, with
    a broadcast of real bucket indices that fake tensors do not hold)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def optimizer_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: JobConfig, precision: precision_room.Precision,
    micro_batches: int, outer: diloco.OuterSync | None,
) -> None:
    """The loop's step (recipe._train_steps): each micro-batch's forward and backward under `gradient_sync`,
    the clip over the ranks that hold the gradients (a DiLoCo site's), AdamW's step, gradients freed. `outer`
    is only held: its outer state counts in the peak, and an inner step sends nothing across sites."""
    for index in range(micro_batches):
        with parallel.gradient_sync(model, last=index == micro_batches - 1, defer=cfg.dist.defer_grad_sync):
            with precision_room.autocast(precision, CPU, enabled=not isinstance(model, FSDPModule)):
                loss = trace_context.rank_loss(model, cfg)
            loss.backward()
    grad_norm_and_clip(model, cfg.train.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def trace(cfg: JobConfig, hardware: estimate.Hardware, layers: int | None = None) -> Trace:
    """Trace one optimizer step of `cfg` on `hardware` (its GPU kind sets the precision, its shape the world and
    the strategy, as the formula plans them); `layers` cuts the model's depth (tests). train.micro_batch_tokens
    auto takes the N the dry run and `train` take for unread data (plan.batching)."""
    cfg = batching.micro_batch_tokens(cfg, hardware)[0]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")  # as training does
        # moe_lora checks its operands' alignment, as the job does: a fake tensor's address is 0, which it passes
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        return _trace(cfg, hardware, layers)


def _trace(cfg: JobConfig, hardware: estimate.Hardware, layers: int | None) -> Trace:
    config = architecture(cfg, layers)
    layout, planned = formula(cfg, config, hardware)
    precision = estimate_memory.resolve_precision(cfg, layout.gpu)
    device, context = "cpu" if layout.gpu.device_name is None else "cuda", layout.context_parallel
    model, nf4 = meta_model_and_nf4(cfg, config, precision, device)
    if context > 1:
        trace_context.check(cfg, model, context, layout.shard, device)
    info = dist.DistInfo(0, layout.world, 0, layout.gpus_per_node, CPU, "fake")
    with fake_world(layout.world):
        sites = diloco.site_count(cfg, info) if layout.strategy == "diloco" else None
        mesh = dist.build_mesh(info, layout.strategy, cfg.dist.shard_size, sites, cfg.diloco.inner,
                               layout.expert_parallel, context)
        memory, log = LiveBytes(), CollectiveLog(group_names(mesh))
        # buffers stay real: a few small tensors
        with FakeTensorMode(allow_non_fake_inputs=True), GroupedMmInAnyDtype(), memory, log:
            _step_on_fake_tensors(cfg, model, nf4, layout, precision, info, mesh, memory)
    return Trace(
        mesh=(dist.describe_mesh(mesh) + (f" (cp {context})" if context > 1 else "") if mesh is not None
              else f"the world of {layout.world}"),
        layers=config.num_hidden_layers,
        accumulation=micro_batches(cfg, layout.world // context),
        static_bytes=memory.window_start,
        peak_bytes=memory.peak,
        gathered_peak_bytes=memory.gathered_peak,
        collectives=list(log.seen),
        layout=layout,
        formula=planned,
        notes=_notes(cfg, model, layout),
    )


def _step_on_fake_tensors(
    cfg: JobConfig, model: torch.nn.Module, nf4: list[str], layout: Layout, precision: precision_room.Precision,
    info: dist.DistInfo, mesh: DeviceMesh | None, memory: LiveBytes,
) -> None:
    """Parallelize and fill the model (`nf4`'s weights in 4 bits, as build.py holds them), hold AdamW's moments, open
    the peak's window, take the traced step."""
    adapters_in_memory(model)
    if nf4:
        shards = mesh.size(-1) if mesh is not None and parallel.shards_within(layout.strategy, cfg.diloco.inner) else 1
        quantize.quantize_meta(model, set(nf4), shards, CPU, weights.checkpoint_key, layout.expert_parallel)
    wrapped = hooked(parallel.apply(model, layout.strategy, info, precision, FakeWeights.of(model), mesh,
                                    cfg.diloco.inner, cfg.model.gradient_checkpointing, compile_blocks=False,
                                    expert_parallel_size=layout.expert_parallel,
                                    context_parallel_size=layout.context_parallel))
    balanced_exchanges(wrapped)
    optimizer, _ = build_optimizer(wrapped, cfg)
    diloco_mesh = mesh if layout.strategy == "diloco" else None
    outer = diloco.OuterSync(wrapped, cfg.diloco, diloco_mesh, info) if diloco_mesh is not None else None
    hold_optimizer_state(optimizer)
    memory.start_window()
    data_ranks = layout.world // layout.context_parallel  # each CP group reads one rank's rows
    optimizer_step(wrapped, optimizer, cfg, precision, micro_batches(cfg, data_ranks), outer)


def _notes(cfg: JobConfig, model: torch.nn.Module, layout: Layout) -> list[str]:
    """What the traced step does differently from the job's on its GPUs."""
    strategy, traced = layout.strategy, trace_context.attention_of(model)
    fused = " (sdpa's fused kernel: what flash-attention and flex_attention save)" if traced == FUSED else ""
    notes = [f"attention: the job's {cfg.model.attn_implementation}, traced as {traced}{fused}"]
    if isinstance(cfg.train.micro_batch_tokens, int):
        notes.append(f"train.micro_batch_tokens {cfg.train.micro_batch_tokens:,}: each micro-batch one padding-free "
                     f"row of {sum(documents(cfg)):,} tokens (documents of data.max_length), as many as the estimate "
                     "plans for rows of data.max_length")
    if cfg.train.compile:
        notes.append("train.compile: the blocks run eagerly here (compiled kernels may save less)")
    if layout.expert_parallel > 1:
        notes.append(f"expert parallel {layout.expert_parallel}: rank 0 holds its experts only; routing is taken "
                     "as balanced (each rank sends every other rank 1 / N of its routed rows), as the formula does")
    if layout.context_parallel > 1:
        notes.append(trace_context.note(cfg, layout.context_parallel))
    if strategy == "ddp" or (strategy == "diloco" and cfg.diloco.inner == "ddp"):
        notes.append("DDP reduces its first step's gradients in one bucket, later ones in 25 MB buckets: the same "
                     "bytes in more calls")
    return notes


def held_between_steps(memory: Memory) -> float:
    """The formula's state held from step to step: weights, adapters, AdamW's moments, DDP's buckets, DiLoCo's."""
    return (memory.weights + memory.lora_adapters + memory.optimizer + memory.ddp_buckets + memory.diloco_outer
            + memory.diloco_sync)
