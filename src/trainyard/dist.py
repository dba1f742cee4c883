"""Process groups, rank facts, timeouts, "first" gating and network presets.

Knows nothing of models or data. Every collective the library makes goes through the
few helpers here, so they are easy to count and easy to keep few.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainyard.config import DistConfig
from trainyard.errors import ConfigError
from trainyard.launch.local import launched_by_torchrun
from trainyard.network import IFNAME_VARS, apply_network_preset, check_nic, interface_error
from trainyard.runs import layout as run_layout


def is_fsdp(module: torch.nn.Module) -> bool:
    """Whether fully_shard wrapped `module`; False without importing torch.distributed.fsdp (FSDP1 with it) when no
    code of this process has."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(module, fsdp.FSDPModule)


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str | None
    network: dict[str, str] = field(default_factory=dict)
    """The network preset's variables as the process group saw them (the user's own values kept)."""
    timeout_s: float | None = None
    """dist.timeout_s: the default group's, and every mesh group's (build_mesh passes it on)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def _pick_backend(cfg: DistConfig, device: torch.device) -> str:
    if cfg.backend != "auto":
        return cfg.backend
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def init(cfg: DistConfig, run_dir: Path | None = None, nic_where: str | None = None) -> DistInfo:
    """Join the process group torchrun prepared (or run alone), with the job's timeout.

    NCCL and Gloo read their variables once, when the first process group is created: the
    network preset and the flight recorder go into the environment before it (see
    `_before_group`). `nic_where` says where dist.nic was set, for the error if it is wrong."""
    rank = _env_int("RANK", 0)
    world = _env_int("WORLD_SIZE", 1)
    network = apply_network_preset(cfg)
    # Under torchrun even one process forms a group: a strategy asked for by name still wraps.
    create_group = (world > 1 or launched_by_torchrun()) and not dist.is_initialized()
    if create_group:
        _before_group(cfg, run_dir, nic_where)
        _thread_lock_for_progress_bars()
    local_rank = _env_int("LOCAL_RANK", 0)
    local_world = _env_int("LOCAL_WORLD_SIZE", world)
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    backend = _pick_backend(cfg, device) if create_group else None
    if backend is not None:
        _create_group(backend, cfg, device)
    return DistInfo(rank, world, local_rank, local_world, device, backend, network, cfg.timeout_s)


def _thread_lock_for_progress_bars() -> None:
    """tqdm guards its bars (datasets makes one even where they are off) with a multiprocessing lock: a named
    semaphore, which multiprocessing's resource tracker expects released at exit. A worker leaves by `os._exit`
    (exit_process), which releases nothing, so every preempted run ended with the tracker's warning of "leaked
    semaphore objects". The bars of one process need only a thread lock."""
    import threading

    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


def _before_group(cfg: DistConfig, run_dir: Path | None, nic_where: str | None) -> None:
    """A dist.nic in force must exist here; the flight recorder is read once, at group creation."""
    if cfg.nic and cfg.nic in (os.environ.get(name) for name in IFNAME_VARS):
        check_nic(cfg.nic, nic_where)
    if run_dir is not None:
        apply_flight_recorder(run_dir)


def _create_group(backend: str, cfg: DistConfig, device: torch.device) -> None:
    """`init_process_group`, with an interface variable naming no usable NIC turned into a user error."""
    try:
        dist.init_process_group(
            backend=backend,
            timeout=timedelta(seconds=cfg.timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    except RuntimeError as err:  # DistBackendError included
        user_error = interface_error(str(err))
        if user_error is None:
            raise
        raise user_error from None


def hsdp_shape(
    info: DistInfo, shard_size: int | None, ranks: int | None = None, where: str | None = None
) -> tuple[int, int]:
    """(replicas, shard group size) over `ranks` (the world, or a DiLoCo site): shard within a node by default,
    so that only the gradient all-reduce between replicas crosses the link between nodes."""
    ranks = ranks or info.world_size
    shard = shard_size or min(info.local_world_size, ranks)
    if ranks % shard != 0:
        divisors = [d for d in range(1, ranks + 1) if ranks % d == 0]
        what = "the world size" if ranks == info.world_size else "a diloco site's size"
        raise ConfigError(
            f"dist.shard_size {shard} does not divide {what} {ranks}"
            + ("" if shard_size else " (it defaults to the processes per node)"),
            where=where,
            fix=f"set dist.shard_size to one of {', '.join(map(str, divisors))} (usually the GPUs per node)",
        )
    return ranks // shard, shard


def build_mesh(
    info: DistInfo,
    strategy: str,
    shard_size: int | None,
    sites: int | None = None,
    site_inner: str = "ddp",
    expert_parallel: int = 1,
    context_parallel: int = 1,
) -> DeviceMesh | None:
    """The device mesh a strategy works on: 1-D ("shard",) for fsdp, 2-D ("replicate", "shard") for hsdp,
    2-D ("site", "local") for diloco (`sites` of them), 3-D ("site", "replicate", "shard") for diloco with hsdp
    within a site, none for ddp or a single process. torchrun numbers a node's ranks consecutively, so the inner
    dimensions stay within a node. Every rank must call it; every group of the mesh waits dist.timeout_s.

    `expert_parallel` > 1 (fsdp, hsdp): the same mesh, its "shard" dimension flattened from ("shard_mod_ep",
    "ep") of a root mesh whose "ep" groups (consecutive ranks) hold the experts between them. `context_parallel` > 1
    carves "cp" the same way: its groups (consecutive ranks) split each row's tokens between them. With both, each
    EP group is made of whole CP groups (`_carved_mesh`)."""
    if strategy == "diloco":
        assert sites is not None, "diloco needs its number of sites"
        return _site_mesh(info, sites, shard_size, site_inner, context_parallel)
    carved = expert_parallel > 1 or context_parallel > 1
    if strategy == "fsdp":
        if carved:
            return _carved_mesh(info, (), info.world_size, expert_parallel, context_parallel)
        return _mesh(info, (info.world_size,), ("shard",))
    if strategy == "hsdp":
        replicas, shard = hsdp_shape(info, shard_size)
        if carved:
            return _carved_mesh(info, (replicas,), shard, expert_parallel, context_parallel)
        return _mesh(info, (replicas, shard), ("replicate", "shard"))
    return None


def carved_dims(shard: int, expert: int, context: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The root mesh's dimensions the shard dimension is flattened from, outermost first. EP alone:
    ("shard_mod_ep", "ep"); CP alone: ("shard_mod_cp", "cp"); both: ("shard_mod_ep", "ep_mod_cp", "cp"), "ep"
    flattened from the last two, so that each EP group is made of whole CP groups (config.dist: EP a multiple of
    CP). A row's tokens then stay within one EP group, and a rank's CP slice is routed to experts like any
    data-parallel rank's rows."""
    if expert > 1 and context > 1:
        assert expert % context == 0, f"EP {expert} is made of whole CP groups of {context}"
        return ("shard_mod_ep", "ep_mod_cp", "cp"), (shard // expert, expert // context, context)
    if expert > 1:
        return ("shard_mod_ep", "ep"), (shard // expert, expert)
    return ("shard_mod_cp", "cp"), (shard // context, context)


def _carved_mesh(info: DistInfo, replicas: tuple[int, ...], shard: int, expert: int, context: int) -> DeviceMesh:
    """("shard",) or ("replicate", "shard") as a view of a root mesh (["replicate",] `carved_dims`...): "ep"
    (experts) and "cp" (context) carved out of the shard dimension."""
    outer = ("replicate",) if replicas else ()
    names, sizes = carved_dims(shard, expert, context)
    root = _mesh(info, (*replicas, *sizes), (*outer, *names))
    if len(names) == 3:
        root[names[1:]]._flatten("ep", backend_override=group_backend(info))
    root[names]._flatten("shard", backend_override=group_backend(info))
    return root[(*outer, "shard")] if outer else root["shard"]


def _site_mesh(info: DistInfo, sites: int, shard_size: int | None, inner: str, context: int) -> DeviceMesh:
    """DiLoCo's mesh, ("site", "local") or ("site", "replicate", "shard") under hsdp within a site. With `context` > 1
    the site's shard dimension ("local" under fsdp) is a view of a root mesh whose "cp" groups (consecutive ranks)
    split each row, carved as `_carved_mesh` carves fsdp's; "site" still pairs the ranks that hold the same shard."""
    site = info.world_size // sites
    replicas, shard = hsdp_shape(info, shard_size, site) if inner == "hsdp" else (0, site)
    outer = ("site", "replicate") if replicas else ("site",)
    last = "shard" if replicas else "local"
    shape = (sites, replicas) if replicas else (sites,)
    if context == 1:
        return _mesh(info, (*shape, shard), (*outer, last))
    root = _mesh(info, (*shape, shard // context, context), (*outer, "shard_mod_cp", "cp"))
    root["shard_mod_cp", "cp"]._flatten(last, backend_override=group_backend(info))
    return root[(*outer, last)]


def _mesh(info: DistInfo, shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """init_device_mesh gives the groups it splits off torch's default timeout (30 minutes), not the default
    group's: each dimension gets the job's timeout through its backend options."""
    configs = {name: group_backend(info) for name in names}
    override = configs if all(configs.values()) else None
    return init_device_mesh(info.device.type, shape, mesh_dim_names=names, backend_override=override)


def group_backend(info: DistInfo) -> tuple[str, Any] | None:
    """(backend, options carrying dist.timeout_s) for a group split off the default one; None where torch's default
    must do. Fresh options each call: torch writes each new group's name and ranks into the options it is given.

    torch gives a subgroup the timeout of these options, and the options to the backend of their kind; a backend of
    another kind in the same group ("cpu:gloo,cuda:nccl": Gloo beside NCCL) gets that timeout by itself. So the
    options are NCCL's wherever the CUDA half is NCCL: with none, a CUDA job's groups waited torch's 30 minutes."""
    kind = options_kind(info.backend)
    if info.timeout_s is None or kind is None:
        return None
    if kind == "gloo":
        options = dist.ProcessGroupGloo._Options()
    elif hasattr(dist, "ProcessGroupNCCL"):
        options = dist.ProcessGroupNCCL.Options()
    else:
        return None  # a torch built without NCCL cannot have made an NCCL group
    options._timeout = timedelta(seconds=info.timeout_s)
    return info.backend, options


def options_kind(backend: str | None) -> str | None:
    """Whose options a group of `backend` ("gloo", "nccl", or device:backend pairs) takes: "nccl" where any
    device's half is NCCL, "gloo" where every half is Gloo, else None (a backend of another kind)."""
    if not backend:
        return None
    halves = {part.rpartition(":")[2].strip() for part in backend.split(",")}
    if "nccl" in halves:
        return "nccl"
    return "gloo" if halves == {"gloo"} else None


def describe_mesh(mesh: DeviceMesh | None) -> str:
    """The mesh in words for the log, e.g. "replicate 2 x shard 4"."""
    if mesh is None:
        return "none"
    return " x ".join(f"{name} {size}" for name, size in zip(mesh.mesh_dim_names or (), mesh.shape, strict=True))


def teardown() -> None:
    """Leave together. The group is not destroyed: with gloo on torch 2.13 that can hang or
    abort at interpreter exit, so distributed workers end with `exit_process` instead."""
    barrier()


def exit_process(code: int) -> None:
    """Exit now, skipping interpreter teardown when a process group exists (see teardown)."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    if dist.is_initialized():
        os._exit(code)
    sys.exit(code)


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum over the group's ranks (the world by default) in place; a no-op when running alone."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_to_all_counts(counts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Equal slices of `counts`, one to each rank of the group; what each rank sent this one, in rank order."""
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    return received


def all_to_all_rows(
    rows: torch.Tensor, receive_splits: list[int], send_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """`send_splits[r]` rows to each rank r, `receive_splits[r]` rows from each: differentiable (the backward sends
    the gradients back the same way)."""
    return all_to_all_single_autograd(rows, receive_splits, send_splits, group)


class _GroupSum(torch.autograd.Function):
    """A sum over the group whose backward sums the ranks' gradients: each rank's loss reads the sum (torch's own,
    torch.distributed.nn.functional.all_reduce, is deprecated)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return _summed(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return _summed(grad, ctx.group), None


def _summed(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    summed = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(summed, group=group)
    return summed


def group_sum(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`x` summed over the group, on every rank, differentiable."""
    return _GroupSum.apply(x, group)


def all_gather_rows(row: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Every rank's `row` in the group (the world by default), stacked in rank order (just the row alone)."""
    if not (dist.is_initialized() and dist.get_world_size(group) > 1):
        return row.unsqueeze(0)
    rows = [torch.zeros_like(row) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, row, group=group)
    return torch.stack(rows)


def group_ranks(group: dist.ProcessGroup | None = None) -> list[int]:
    """The global ranks of a group (the world by default), in its rank order."""
    if not dist.is_initialized():
        return [0]
    return dist.get_process_group_ranks(group or dist.group.WORLD)


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def broadcast_text(text: str, device: torch.device, src: int = 0) -> str:
    """Rank `src`'s text on every rank (its length first: one small collective when empty)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return text
    data = torch.tensor(list(text.encode()), dtype=torch.uint8, device=device)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src)
    if size.item() == 0:
        return ""
    if dist.get_rank() != src:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(data, src=src)
    return bytes(data.cpu().tolist()).decode()


@contextlib.contextmanager
def first_on_node(info: DistInfo) -> Iterator[None]:
    """Local rank 0 runs the block first (fills node caches); the others then run it too."""
    if info.local_rank != 0:
        barrier()
    yield
    if info.local_rank == 0:
        barrier()


def host_summary(info: DistInfo) -> dict[str, object]:
    return {
        "hostname": socket.gethostname(),
        "rank": info.rank,
        "world_size": info.world_size,
        "local_world_size": info.local_world_size,
        "device": str(info.device),
        "backend": info.backend,
    }


# ---------------------------------------------------------------- flight recorder

FLIGHT_DIR = run_layout.FLIGHT
FLIGHT_ENTRIES = 2000
# (variable, older alias) pairs: a user who set either one keeps their choice for both.
_FLIGHT_ALIASES = {
    "buffer": ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"),
    "prefix": ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"),
}


def flight_recorder_env(run_dir: Path) -> dict[str, str]:
    """What records the last collectives of every rank and writes them on a timeout.

    Every process group keeps a ring of its last collectives (op, sequence number, sizes,
    state, Python stack). The NCCL watchdog writes it to `<run_dir>/flight/nccl-rank-<r>`
    when a collective times out, before it kills the process; `health` writes the Gloo
    one itself (Gloo has no watchdog). `trainyard diagnose` reads them.
    """
    prefix = str(Path(run_dir) / FLIGHT_DIR / "nccl-rank-")
    return {
        # torch 2.13 reads TORCH_FR_BUFFER_SIZE first (2000 by default) and warns on the old name.
        "TORCH_FR_BUFFER_SIZE": str(FLIGHT_ENTRIES),
        # Both names of the dump prefix: which one the NCCL dump writer reads varies by release.
        "TORCH_FR_DUMP_TEMP_FILE": prefix,
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_ENABLE_MONITORING": "1",  # the dump on timeout needs the monitoring thread
        # How long the watchdog waits for the dumps before it aborts the process: the
        # failure is on record, and the job over, a few seconds after the collective timeout.
        "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "5000",
    }


def apply_flight_recorder(run_dir: Path, env: dict[str, str] | None = None) -> dict[str, str]:
    """Set the flight-recorder variables the user has not set; return the effective values.

    A user who sets the buffer size to 0 turns it off, and nothing is created."""
    target = os.environ if env is None else env
    wanted = flight_recorder_env(run_dir)
    for names in _FLIGHT_ALIASES.values():
        if any(name in target for name in names):
            for name in names:
                wanted.pop(name, None)
    for name, value in wanted.items():
        target.setdefault(name, value)
    if flight_recorder_enabled(target):
        (Path(run_dir) / FLIGHT_DIR).mkdir(parents=True, exist_ok=True)
    return {name: target[name] for name in flight_recorder_env(run_dir) if name in target}


def flight_recorder_enabled(env: dict[str, str] | None = None) -> bool:
    """False only where the user set the ring's size to 0 (torch records 2000 by default)."""
    target = os.environ if env is None else env
    size = next((target[n] for n in _FLIGHT_ALIASES["buffer"] if n in target), str(FLIGHT_ENTRIES))
    return size.strip() not in ("", "0")
