"""train.compile: whole decoder blocks compiled give the eager model's loss and gradients, compile a bounded number
of times over micro-batches of varying lengths, dispatch far fewer aten ops, and fall back to eager (one warning)
where a graph breaks. One compiled model serves the first three tests: inductor compiles with a C++ compiler here."""

from __future__ import annotations

import collections
import copy
import logging
import random
from typing import Any

import pytest
import torch
from torch._dynamo.utils import clear_compilation_metrics, get_compilation_metrics
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from trainyard.config import TrainConfig
from trainyard.data import collate
from trainyard.loss import token_loss_sum
from trainyard.model.attention import VARLEN
from trainyard.parallel import compile as compile_room

STEPS = 12


def tiny_llama(implementation: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(config)
    model.set_attn_implementation(implementation)
    return model


def micro_batch(generator: random.Random) -> dict[str, torch.Tensor]:
    """A padding-free row of 1 to 4 documents of 5 to 40 tokens: its length and document count vary."""
    rows = []
    for _ in range(generator.randint(1, 4)):
        n = generator.randint(5, 40)
        rows.append({"input_ids": [generator.randint(1, 63) for _ in range(n)],
                     "labels": [-100] + [generator.randint(1, 63) for _ in range(n - 1)]})
    return collate(rows, pad_id=0)


@pytest.fixture(scope="module")
def trained() -> dict[str, Any]:
    """The eager and compiled models' losses and gradients over STEPS micro-batches, and what dynamo compiled."""
    torch._dynamo.reset()
    clear_compilation_metrics()
    eager = tiny_llama(VARLEN)
    compiled = copy.deepcopy(eager)
    summary = compile_room.compile_blocks(compiled)
    generator = random.Random(0)
    steps = []
    for _ in range(STEPS):
        batch = micro_batch(generator)
        pair = []
        for model in (eager, compiled):
            loss, _ = token_loss_sum(model, batch, torch.device("cpu"))
            loss.backward()
            pair.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
            model.zero_grad(set_to_none=True)
        steps.append((batch["input_ids"].shape[1], pair))
    metrics = get_compilation_metrics()
    return {"summary": summary, "steps": steps, "eager": eager, "compiled": compiled, "metrics": metrics}


def test_compiled_blocks_match_eager(trained):
    assert trained["summary"].blocks == 2 and not trained["summary"].fullgraph  # varlen's loop sits between graphs
    assert trained["summary"].warned == set()
    assert len({length for length, _ in trained["steps"]}) > 6
    for _, ((loss, grads), (got_loss, got_grads)) in trained["steps"]:
        torch.testing.assert_close(got_loss, loss, atol=1e-5, rtol=1e-5)
        for got, want in zip(got_grads, grads, strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_each_block_compiles_at_most_three_times(trained):
    """Every code dynamo compiled (the block's forward, the frames around the attention) over micro-batches of a
    dozen lengths and document counts: at most 3 versions, for both blocks together."""
    frames = collections.Counter((m.co_filename, m.co_firstlineno, m.co_name) for m in trained["metrics"] if m.co_name)
    assert frames, "nothing was compiled"
    assert max(frames.values()) <= 3, frames


def aten_ops(block: torch.nn.Module, inputs: dict[str, Any]) -> int:
    """How many aten ops one forward and backward of `block` dispatches (the profiler's aten:: events), once
    these inputs' graphs are compiled."""
    block(**inputs)[0].sum().backward()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        block(**inputs)[0].sum().backward()
    return sum(1 for event in profile.events() if event.name.startswith("aten::"))


def block_inputs(model: LlamaForCausalLM, length: int) -> dict[str, Any]:
    hidden = torch.randn(1, length, model.config.hidden_size, requires_grad=True)
    positions = torch.arange(length)[None]
    return {"hidden_states": hidden, "position_ids": positions, "attention_mask": None,
            "position_embeddings": model.model.rotary_emb(hidden, positions)}


def test_a_compiled_block_dispatches_at_most_a_third_of_the_aten_ops():
    """The proxy for launch overhead: one document through a decoder layer, forward and backward, where the whole
    block is one graph (sdpa; trainyard's varlen loop runs its attention's ops eagerly between two graphs)."""
    eager = tiny_llama("sdpa")
    compiled = copy.deepcopy(eager)
    assert compile_room.compile_blocks(compiled).fullgraph
    inputs = block_inputs(eager, 24)
    eager_ops = aten_ops(eager.model.layers[0], inputs)
    compiled_ops = aten_ops(compiled.model.layers[0], inputs)
    assert compiled_ops * 3 <= eager_ops, (compiled_ops, eager_ops)


BREAKING = "test_breaking_attention"


def breaking_attention(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """sdpa behind a graph break dynamo cannot trace through."""
    torch._dynamo.graph_break()
    return sdpa_attention_forward(*args, **kwargs)


def test_a_block_whose_graph_breaks_runs_eagerly_with_one_warning(caplog):
    AttentionInterface.register(BREAKING, breaking_attention)
    eager = tiny_llama(BREAKING)
    compiled = copy.deepcopy(eager)
    summary = compile_room.compile_blocks(compiled)
    assert summary.fullgraph
    batch = collate([{"input_ids": list(range(1, 20)), "labels": list(range(1, 20))}], pad_id=0, padding_free=False)
    with caplog.at_level(logging.WARNING, logger="trainyard"):
        losses = [token_loss_sum(model, batch, torch.device("cpu"))[0] for model in (eager, compiled, compiled)]
    warnings = [record.getMessage() for record in caplog.records if "train.compile" in record.getMessage()]
    assert len(warnings) == 1, warnings
    assert "LlamaDecoderLayer runs eagerly" in warnings[0] and "graph_break" in warnings[0], warnings[0]
    torch.testing.assert_close(losses[1], losses[0])
    torch.testing.assert_close(losses[2], losses[0])


@pytest.mark.parametrize(("setting", "device", "compiles"), [
    ("auto", "cuda", True), ("auto", "cpu", compile_room.CPU_AUTO), (True, "cpu", True), (False, "cuda", False),
])
def test_auto_compiles_on_cuda(setting, device, compiles):
    assert compile_room.resolve(setting, torch.device(device)) is compiles


def test_old_configs_keep_their_boolean():
    assert TrainConfig().compile == "auto"
    assert TrainConfig(compile=True).compile is True
    assert TrainConfig(compile="false").compile is False
