"""The outer sync walks the weights in chunks through buffers made once: what it holds beyond the outer state is a
couple of chunks however large the model, and the walk changes no result. One process, one site (a 1-rank gloo
group); the sites' arithmetic is tests/dist/test_diloco.py's."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as torch_dist
from torch._C._profiler import _EventType
from torch.distributed.device_mesh import DeviceMesh

from trainyard import dist
from trainyard.config import DilocoConfig
from trainyard.diloco.outer import OuterSync, _walk
from trainyard.dist import DistInfo

CHUNK_MIB = 0.5
CHUNK_BYTES = CHUNK_MIB * 2**20
HELD_CHUNKS = {"fp32": 2.0, "bf16": 2.0, "int8": 3.0}
"""What a sync may hold beyond the outer state, in fp32 chunks: the chunk, plus a bf16 slice, or int8's fp32 worth
and its codes (the slice's, every site's and the gather's own copy)."""


@pytest.fixture
def one_site() -> Iterator[tuple[DeviceMesh, DistInfo]]:
    """A diloco mesh of one site of one rank."""
    torch_dist.init_process_group("gloo", store=torch_dist.HashStore(), rank=0, world_size=1)
    info = DistInfo(0, 1, 0, 1, torch.device("cpu"), "gloo")
    try:
        yield dist.build_mesh(info, "diloco", None, sites=1), info
    finally:
        torch_dist.destroy_process_group()


def model() -> torch.nn.Module:
    """About 2.1M parameters: 16 chunks of CHUNK_MIB, with tensors that straddle chunks."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(1000, 1024), torch.nn.Linear(1024, 1040))


def fp32_bytes(module: torch.nn.Module) -> int:
    return sum(4 * p.numel() for p in module.parameters())


def progress(module: torch.nn.Module, seed: int) -> list[torch.Tensor]:
    """A round of inner progress: what each parameter moves by."""
    generator = torch.Generator().manual_seed(seed)
    return [0.01 * torch.randn(param.shape, generator=generator) for param in module.parameters()]


@torch.no_grad()
def move(module: torch.nn.Module, steps: list[torch.Tensor]) -> None:
    for param, step in zip(module.parameters(), steps, strict=True):
        param.sub_(step)


def peak_bytes(work: Callable[[], object]) -> int:
    """The most CPU memory `work` allocated and had not yet freed at once, from the profiler's allocation events
    (CPU tensors are invisible to tracemalloc): they carry every allocation, the collectives' own included."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profile:
        work()

    def walk(nodes: list) -> Iterator:
        for node in nodes:
            yield node
            yield from walk(node.children)

    events = profile.profiler.kineto_results.experimental_event_tree()
    sizes = sorted((n.start_time_ns, n.extra_fields.alloc_size) for n in walk(events) if n.tag == _EventType.Allocation)
    live = peak = 0
    for _, size in sizes:
        live += size
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8"])
def test_the_sync_holds_a_couple_of_chunks_beyond_the_outer_state(
    one_site: tuple[DeviceMesh, DistInfo], dtype: str
) -> None:
    """Before: the pseudo-gradients, their concatenation, its padded copy, the average and the Nesterov step each
    held a model's worth (6x the fp32 model, 8.5x with int8's per-value scales)."""
    mesh, info = one_site
    module = model()
    steps = [progress(module, seed) for seed in range(2)]  # made before the count starts
    outer: list[OuterSync] = []

    def rounds() -> None:
        outer.append(OuterSync(module, DilocoConfig(sync_chunk_mib=CHUNK_MIB, pseudo_grad_dtype=dtype), mesh, info))
        made_at = outer[0].buffers.values.data_ptr()
        for round_steps in steps:
            move(module, round_steps)
            outer[0].sync()
        assert outer[0].buffers.values.data_ptr() == made_at, "the sync's buffer is made once"

    held = peak_bytes(rounds) - 2 * fp32_bytes(module)  # the round-start weights and the momentum
    assert len(outer[0].chunks) == 16
    assert held <= HELD_CHUNKS[dtype] * CHUNK_BYTES, f"{held / CHUNK_BYTES:.2f} chunks"


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8"])
def test_chunks_change_no_result(one_site: tuple[DeviceMesh, DistInfo], dtype: str) -> None:
    """Small chunks cut tensors apart (int8 still scales each tensor by its own largest value): the weights and
    momentum after two rounds are bitwise those of a single chunk."""
    mesh, info = one_site
    template = torch.nn.Sequential(torch.nn.Linear(30, 20), torch.nn.Linear(20, 7, bias=False))
    modules = [copy.deepcopy(template) for _ in range(2)]
    syncs = [OuterSync(module, DilocoConfig(pseudo_grad_dtype=dtype, sync_chunk_mib=mib), mesh, info)
             for module, mib in zip(modules, (64.0, 37 * 4 / 2**20), strict=True)]  # one chunk; chunks of 37 values
    assert [len(sync.chunks) for sync in syncs] == [1, 21]
    for seed in range(2):
        steps = progress(template, seed)
        for module, sync in zip(modules, syncs, strict=True):
            move(module, steps)
            sync.sync()
    for whole, chunked in zip(modules[0].parameters(), modules[1].parameters(), strict=True):
        assert torch.equal(whole, chunked)
    for whole, chunked in zip(syncs[0].momentum, syncs[1].momentum, strict=True):
        assert torch.equal(whole, chunked)
    assert not torch.equal(syncs[0].momentum[0], torch.zeros_like(syncs[0].momentum[0])), "the rounds must move"


def test_the_walk_lays_every_value_once_in_chunks_each_slicer_splits_evenly() -> None:
    sizes, chunk, slices = [5, 0, 12, 3], 8, 4
    chunks = _walk(sizes, chunk, slices)
    assert [(c.length, c.padded) for c in chunks] == [(8, 8), (8, 8), (4, 4)]
    covered = [[False] * size for size in sizes]
    for c in chunks:
        assert sum(p.target.stop - p.target.start for p in c.pieces) == c.length
        assert c.pieces[0].target.start == 0
        for before, after in zip(c.pieces, c.pieces[1:]):
            assert before.target.stop == after.target.start
        for piece in c.pieces:
            assert piece.source.stop - piece.source.start == piece.target.stop - piece.target.start
            for value in range(piece.source.start, piece.source.stop):
                assert not covered[piece.index][value]
                covered[piece.index][value] = True
    assert all(all(values) for values in covered)
    assert _walk([10], 8, 4)[-1].padded == 4  # the last chunk's 2 values padded to a multiple of the slicers
