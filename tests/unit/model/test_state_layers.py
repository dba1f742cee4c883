"""A split state layer (state_layers.py) computes, at every token of a padding-free row, what it computes for that
token's document alone, forward and backward: the row's bounds reach it from its block, also at the recompute of
activation checkpointing; without the split the same layer carries its state from one document into the next."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.unit.model.test_hybrid_families import CARRIERS, build, losses, rows
from tests.unit.model.test_families import TOLERANCE
from trainyard.config import DataConfig
from trainyard.data.collate import collate
from trainyard.model import collation
from trainyard.model import attention, state_layers

LENGTHS = (20, 13, 27, 5, 26, 9)
"""Documents of a row: groups of several lengths, one document shorter than a convolution's kernel."""


def _layer_and_row(family: str) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    model = build(family, attention.VARLEN)
    assert state_layers.install(model) > 0
    layer = next(m for m in model.modules() if type(m).__name__ == CARRIERS[family])
    torch.manual_seed(2)
    hidden = torch.randn(1, sum(LENGTHS), model.config.hidden_size, requires_grad=True)
    bounds = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return layer, hidden, bounds


def _run(layer: torch.nn.Module, hidden: torch.Tensor, bounds: torch.Tensor | None) -> torch.Tensor:
    setattr(layer, state_layers.BOUNDS, bounds)
    output = layer(hidden)
    return output[0] if isinstance(output, tuple) else output


@pytest.mark.parametrize("family", CARRIERS)
def test_a_split_state_layer_runs_each_document_on_its_own(family: str) -> None:
    layer, hidden, bounds = _layer_and_row(family)
    got = _run(layer, hidden, bounds)
    (got_grad,) = torch.autograd.grad(got.square().sum(), hidden)
    starts = bounds.tolist()
    alone = [hidden[:, a:b].detach().requires_grad_() for a, b in zip(starts, starts[1:])]
    want = torch.cat([_run(layer, doc, None) for doc in alone], dim=1)
    want_grad = torch.cat(torch.autograd.grad(want.square().sum(), alone), dim=1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-6)
    joined = _run(layer, hidden, None)  # the whole row as one sequence: the state crosses the boundaries
    assert (joined - want).abs().max() > 1e-2 * want.abs().max()


def test_documents_are_grouped_with_little_padding() -> None:
    lengths = [300, 12, 11, 10, 10, 9, 290, 8, 250, 7]
    found = state_layers.groups(lengths)
    assert sorted(i for group in found for i in group) == list(range(len(lengths)))
    for group in found:
        real = sum(lengths[i] for i in group)
        assert lengths[group[0]] == max(lengths[i] for i in group)
        assert lengths[group[0]] * len(group) <= state_layers.GROUP_SLACK * real
    assert len(found) <= 3  # the three long documents, then the short ones together
    assert state_layers.groups([5] * 40) == [list(range(40))]


def test_activation_checkpointing_recomputes_with_the_row_s_bounds() -> None:
    """The backward's recompute runs the block again: its pre-hook must hand the same bounds to the layer."""
    want = losses(build("qwen3_next"), collate(rows(), pad_id=0, padding_free=False))
    model = build("qwen3_next")
    model.config._attn_implementation = attention.choose("auto", model, torch.device("cpu"))
    state_layers.install(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert collation.model_one_row(model, DataConfig())
    got = losses(model, collate(rows(), pad_id=0, padding_free=True))
    assert max(abs(a - b) / b for a, b in zip(got, want)) < TOLERANCE, (got, want)


def test_a_copy_of_the_model_splits_its_own_layers() -> None:
    """A deep copy (a reference model, a test's twin) must run its own weights, not the original's."""
    model = build("qwen3_next")
    model.config._attn_implementation = attention.choose("auto", model, torch.device("cpu"))
    state_layers.install(model)
    batch = collate(rows(), pad_id=0, padding_free=True)
    same, twin = copy.deepcopy(model), copy.deepcopy(model)
    with torch.no_grad():  # only the state layers' weights: a copy running the original's would not see it
        for module in twin.modules():
            if type(module).__name__ == CARRIERS["qwen3_next"]:
                module.out_proj.weight.normal_(0, 0.5)
    want = losses(model, batch)[0]
    assert losses(same, batch)[0] == pytest.approx(want, rel=1e-6)
    assert abs(losses(twin, batch)[0] - want) > 1e-3


def test_a_row_of_one_document_runs_whole_without_the_kernels_bounds() -> None:
    """No split for one document, and no `cu_seq_lens_q` left for a kernel: transformers' torch fallback refuses it."""
    one = rows()[:1]
    want = losses(build("qwen3_next"), collate(one, pad_id=0, padding_free=False))
    model = build("qwen3_next")
    model.config._attn_implementation = attention.choose("auto", model, torch.device("cpu"))
    state_layers.install(model)
    got = losses(model, collate(one, pad_id=0, padding_free=True))
    assert max(abs(a - b) / b for a, b in zip(got, want)) < TOLERANCE, (got, want)
