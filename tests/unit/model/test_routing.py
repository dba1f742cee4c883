"""The MoE routers' load over a log window, read from the routers' own outputs: transformers' auxiliary loss
exactly, every token counted once (not again in activation checkpointing's recompute, not in eval)."""

from __future__ import annotations

import pytest
import torch

from tests.unit.model.families import build, documents
from trainyard.model.routing import ExpertLoad, find_routers, idle_by_layer


def _batch() -> torch.Tensor:
    return torch.stack([doc[:13] for doc in documents()])


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_the_aux_loss_is_transformers_own_and_each_token_counts_top_k_times(family: str) -> None:
    model = build(family, "eager").train()
    routers = find_routers(model)
    assert [r.layer for r in routers] == [0, 1] and all(r.experts == 4 for r in routers)
    load = ExpertLoad(routers, torch.device("cpu"))
    ids = _batch()
    out = model(input_ids=ids, output_router_logits=True)
    figures = load.figures(load.row())
    assert figures["router_aux_loss"] == pytest.approx(out.aux_loss.item(), rel=1e-6)
    chosen = [torch.topk(logits.float().softmax(-1), 2, dim=-1).indices for logits in out.router_logits]
    want = [torch.bincount(c.flatten(), minlength=4).tolist() for c in chosen]
    assert figures["expert_load"]["tokens_per_expert"] == want
    assert all(sum(row) == ids.numel() * 2 for row in want)


def test_recomputed_and_eval_forwards_count_nothing_more() -> None:
    model = build("qwen3_moe", "eager").train()
    load = ExpertLoad(find_routers(model), torch.device("cpu"))
    ids = _batch()
    model(input_ids=ids, labels=ids).loss.backward()
    plain = load.row().clone()
    load.reset()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model(input_ids=ids, labels=ids).loss.backward()  # the backward reruns each layer's forward
    torch.testing.assert_close(load.row(), plain)
    model.eval()
    with torch.no_grad():
        model(input_ids=ids)
    torch.testing.assert_close(load.row(), plain)


def test_an_expert_the_router_never_picks_is_named_idle() -> None:
    model = build("gpt_oss", "eager").train()
    with torch.no_grad():
        model.model.layers[1].mlp.router.bias[3] = -1e4  # gpt-oss's router has a bias: expert 3 of layer 1 loses
    load = ExpertLoad(find_routers(model), torch.device("cpu"))
    model(input_ids=_batch())
    figures = load.figures(load.row())
    assert idle_by_layer(figures["expert_load"]) == {1: [3]}
    assert figures["expert_load"]["max_over_mean"][1] > 1.0


def test_counting_never_reads_the_choices_back_to_the_host() -> None:
    """On the meta device a tensor has no data: an op that sizes its output from the data (bincount, nonzero)
    cannot run there, just as it cannot run on a GPU without waiting for it. The hook counts there all the same."""
    model = build("qwen3_moe", "eager").train()
    routers = find_routers(model)
    load = ExpertLoad(routers, torch.device("meta"))
    logits = torch.zeros(13, 4, device="meta")
    chosen = torch.zeros(13, 2, dtype=torch.long, device="meta")
    for slot, router in enumerate(routers):
        load._hook(slot)(router.module, (), (logits, None, chosen))
    assert load.counts.shape == (2, 4) and load.counts.device.type == "meta"
