"""torch.compile of each whole decoder layer (train.compile), the step of the parallelize order between activation
checkpointing and sharding.

Each block's `forward` is compiled, not its `__call__`: FSDP2's hooks and transformers' checkpointing wrapper stay
outside the compiled code, as torchtitan keeps them. The sequence length varies from micro-batch to micro-batch, so
every input dimension of that length is marked dynamic before each call: one graph serves every length. An
attention that reads the collator's host bounds (documents.HOST_BOUNDS: a Python loop over each micro-batch's
documents) would specialise a graph on each micro-batch's lengths; it runs as it is, between two compiled graphs of
the block, and every other family compiles the whole block as one graph (fullgraph). A block whose graph breaks
anywhere else runs eagerly from then on, with one warning per cause.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch._dynamo.utils import counters
from torch.utils import _pytree as pytree
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from trainyard.model import state_layers
from trainyard.model.build import decoder_blocks
from trainyard.model.documents import HOST_BOUNDS, HOST_LOOP

CPU_AUTO = False
"""auto on CPU: no. Measured on a 2-core AMD EPYC (avx2, fp32 as auto's precision gives it there, one thread, load
1.1-1.3), SmolLM2-135M LoRA r=8, a row of 4 documents (780 tokens), 5 interleaved rounds: 8.06 s a step eager, 7.60 s
compiled (-6%), after a first step of 58.9 s (49.3 s compiling; eager's first: 11.3 s). The compile is repaid after
~110 steps: at the default 100 a run is no faster. `true` compiles for longer runs."""

log = logging.getLogger("trainyard")


def resolve(setting: bool | str, device: torch.device) -> bool:
    """train.compile: true and false as given; auto compiles on CUDA, and on CPU as CPU_AUTO says."""
    if setting != "auto":
        return bool(setting)
    return device.type == "cuda" or (device.type == "cpu" and CPU_AUTO)


@dataclass
class Compiled:
    """What compile_blocks did: how many blocks, whether each is one graph, and the warnings it gave."""

    blocks: int
    fullgraph: bool
    warned: set[str]


def compile_blocks(model: torch.nn.Module) -> Compiled:
    """Compile every decoder block's forward; a host-bounds attention is kept out of the graphs (`HOST_LOOP`).
    Under transformers' activation checkpointing (which wraps the class's forward) the checkpointed function is
    what is compiled: the checkpoint stays eager around it, and the backward's recompute runs the compiled code."""
    implementation = model.config._attn_implementation
    fullgraph = implementation not in HOST_BOUNDS and not state_layers.installed(model)
    if not fullgraph:
        _keep_out_of_graph(implementation)
    result = Compiled(0, fullgraph, set())
    for block in decoder_blocks(model):
        run = _watched(block, fullgraph, result.warned)
        if getattr(block, "gradient_checkpointing", False):
            checkpoint = block._gradient_checkpointing_func
            block._gradient_checkpointing_func = functools.partial(_checkpointed, checkpoint, run)
        else:
            block.forward = functools.wraps(block.forward)(functools.partial(run, block.forward))
        result.blocks += 1
    return result


def _checkpointed(checkpoint: Callable[..., Any], run: Callable[..., Any], function: Callable[..., Any],
                  *args: Any) -> Any:
    return checkpoint(functools.partial(run, function), *args)


def _call(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """What each block compiles: its forward (or the function its checkpoint runs) with its inputs."""
    return function(*args, **kwargs)


def _keep_out_of_graph(implementation: str) -> None:
    """Register the implementation's attention as a function dynamo does not trace (once): its Python loop runs
    eagerly, and its output is made contiguous, so the graph after it sees one layout whatever the documents."""
    attend = ALL_ATTENTION_FUNCTIONS[implementation]
    if getattr(attend, "_trainyard_out_of_graph", False):
        return

    @torch.compiler.disable(reason=HOST_LOOP)
    def out_of_graph(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        output, weights = attend(*args, **kwargs)
        return output.contiguous(), weights

    out_of_graph._trainyard_out_of_graph = True  # type: ignore[attr-defined]
    AttentionInterface.register(implementation, out_of_graph)


def _watched(block: torch.nn.Module, fullgraph: bool, warned: set[str]) -> Callable[..., Any]:
    """`_call` compiled for one block, the length dimensions marked dynamic at each call. Its first call is
    watched: a graph break other than the attention's (`HOST_LOOP`), or a failed compile, turns the block back to
    eager for good, with a warning the first time each cause is seen."""
    compiled = torch.compile(_call, fullgraph=fullgraph)
    state: dict[str, Callable[..., Any] | None] = {"run": None}

    def first_call(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        before = dict(counters["graph_break"])
        try:
            output = compiled(function, *args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as error:  # fullgraph's break, or inductor's failure
            _fall_back(block, str(error), warned)
            state["run"] = _call
            return function(*args, **kwargs)
        breaks = [reason for reason, count in counters["graph_break"].items()
                  if count > before.get(reason, 0) and HOST_LOOP not in reason]
        if breaks:
            _fall_back(block, breaks[0], warned)
        state["run"] = _call if breaks else compiled
        return output

    def run(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if state["run"] is not _call:
            bound = (function.args, function.keywords) if isinstance(function, functools.partial) else ()
            _mark_lengths(args, kwargs, bound)
        return (state["run"] or first_call)(function, *args, **kwargs)

    return run


def _fall_back(block: torch.nn.Module, cause: str, warned: set[str]) -> None:
    """One warning per cause: the first line of dynamo's reason says what broke the graph."""
    first_line = cause.strip().splitlines()[0] if cause.strip() else type(block).__name__
    if first_line not in warned:
        warned.add(first_line)
        log.warning("train.compile: %s runs eagerly (and every block that breaks the same way): %s",
                    type(block).__name__, first_line)


def _mark_lengths(args: tuple[Any, ...], kwargs: dict[str, Any], bound: Any) -> None:
    """Mark what varies between micro-batches dynamic in every tensor the block takes: each dimension (past the
    batch) of the hidden states' length (hidden states, positions, rotary tables, masks), and the length of the
    1-D ones (the documents' bounds, one more than their count). `bound`: what a checkpoint's partial holds."""
    hidden = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 2:
        return
    length = hidden.shape[1]
    for leaf in pytree.tree_leaves((args, kwargs, bound)):
        if isinstance(leaf, torch.Tensor):
            for dim in range(leaf.dim()):
                if leaf.dim() == 1 or (dim > 0 and leaf.shape[dim] == length):
                    torch._dynamo.maybe_mark_dynamic(leaf, dim)


def compile_seconds() -> float:
    """Seconds torch.compile has spent in this process: each frame's (dynamo, AOT autograd, inductor's forward)
    and each backward graph's, compiled at its first backward."""
    seconds = 0.0
    for metrics in torch._dynamo.utils.get_compilation_metrics():
        seconds += metrics.entire_frame_compile_time_s or 0.0
        seconds += (metrics.backward_cumulative_compile_time_us or 0) / 1e6
    return seconds


def first_step_timer(model: torch.nn.Module) -> None:
    """Log, at the second forward, what the first micro-batch's forward and backward spent compiling: the compile
    the first step pays."""
    started: list[float] = []

    def mark(module: torch.nn.Module, args: Any) -> None:
        if not started:
            started.append(time.perf_counter())
            return
        handle.remove()
        log.info("train.compile: the first micro-batch compiled for %.1f s of its %.1f s", compile_seconds(),
                 time.perf_counter() - started[0])

    handle = model.register_forward_pre_hook(mark)
