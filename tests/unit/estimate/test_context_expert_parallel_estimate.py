"""The estimate under dist.context_parallel with dist.expert_parallel: seed 000's GLM-4.5-Air (the known table,
nothing downloaded) with one document of 65,536 tokens on 2 nodes x 8 H200, HSDP, EP 8 within each node. Each rank
holds tokens / CP of the row through the block (activations, and the EP all-to-all's rows, which are its slice's),
attention's exchange buffers beside; per step both all-to-alls are counted: EP's for the rank's tokens over CP times
the micro-batches (the data ranks are world / CP), so the same bytes a step as without CP, and CP's around every
layer's attention. It plans and fits, at CP 1 already (checkpointed), with room for more at CP 2 and 8; auto EP takes
a multiple of the CP size. The dry run plans it the same way."""

from __future__ import annotations

import pytest

from tests.conftest import REPO, run_cli
from trainyard import estimate
from trainyard.estimate import experts
from trainyard.config_file import load_config

SEED_000 = str(REPO / "configs" / "glm45air-fsdp-lora.yaml")
H200_2X8 = estimate.Hardware("h200", 8, 2)
TOKENS, TOP_K, HIDDEN, MOE_LAYERS, BF16, GLOBAL = 65536, 8, 4096, 45, 2, 64
LONG = [f"data.max_length={TOKENS}", "data.packing=false", "data.padding_free=true", "train.micro_batch_size=1",
        "model.attn_implementation=varlen", "dist.expert_parallel=8"]


def job(context: int | str, *more: str):
    return load_config(SEED_000, [*LONG, f"dist.context_parallel={context}", *more])


@pytest.fixture(scope="module")
def glm() -> estimate.mem.Model:
    return estimate.mem.model_of(job(1))


@pytest.fixture(scope="module")
def planned(glm) -> dict[int, estimate.Estimate]:
    return {cp: estimate.estimate(job(cp), H200_2X8, model=glm, suggest=False) for cp in (1, 2, 8)}


def test_glm_45_air_at_65k_tokens_with_ep_and_cp_plans_and_fits_on_2x8_h200(planned: dict) -> None:
    for cp, result in planned.items():
        assert (result.layout.expert_parallel, result.layout.context_parallel) == (8, cp)
        assert result.fits, (cp, result.memory.peak / 2**30)
    peaks = [planned[cp].memory.peak for cp in (1, 2, 8)]
    assert peaks == sorted(peaks, reverse=True) and peaks[0] - peaks[1] > 20 * 2**30  # CP 2 frees > 20 GiB
    text = estimate.render(planned[2])
    assert "expert parallel 8" in text and "context parallel 2" in text
    assert "ep all-to-all" in text and "cp all-to-all" in text


def test_each_rank_holds_its_slice_and_routes_only_its_tokens(planned: dict) -> None:
    plain = planned[1].memory
    for cp in (2, 8):
        got = planned[cp].memory
        assert got.activations == pytest.approx(plain.activations / cp, rel=0.02)
        assert got.expert_exchange == 2 * TOKENS // cp * TOP_K * HIDDEN * BF16  # the slice's rows out and in
        assert got.context_exchange > 0 and plain.context_exchange == 0
        assert got.weights == plain.weights  # CP and EP carved out of the same shard group of 8


def test_both_all_to_alls_are_counted_per_step(planned: dict) -> None:
    ep_alone = planned[1].timing
    for cp in (2, 8):
        timed = planned[cp].timing
        micro_batches = GLOBAL // (H200_2X8.gpus_per_node * H200_2X8.nodes // cp)  # over world / CP data ranks
        want = micro_batches * 6 * MOE_LAYERS * TOKENS / cp * TOP_K * HIDDEN * BF16 * 7 / 8
        assert timed.expert_exchanged_bytes == pytest.approx(want) == pytest.approx(ep_alone.expert_exchanged_bytes)
        assert timed.context_exchanged_bytes > 0 and ep_alone.context_exchanged_bytes == 0
        assert timed.within_node_bytes > ep_alone.within_node_bytes  # CP's exchange stays within a node too


def test_auto_ep_takes_a_multiple_of_the_cp_size(glm) -> None:
    for cp in (2, 8):
        result = estimate.estimate(job(cp, "dist.expert_parallel=auto"), H200_2X8, model=glm, suggest=False)
        assert result.layout.expert_parallel % cp == 0 or result.layout.expert_parallel == 1, result.layout
    assert experts.candidates(glm.shape, 8, 8, context=4) == [8, 4]


def test_the_dry_run_plans_it_on_2x8_h200_and_it_fits() -> None:
    result = run_cli("train", SEED_000, *LONG, "dist.context_parallel=2", "--dry-run", "--gpu", "h200",
                     "--gpus-per-node", "8", "--nodes", "2", "--skip-data-check")
    assert result.returncode == 0, result.stderr[-2000:]
    out = " ".join(result.stdout.split())
    assert "8 data ranks (context-parallel groups of 2 ranks)" in out, out
    assert "expert parallel 8: each rank holds 16 of the 128 routed experts" in out and "context parallel 2" in out
    assert "(fits)" in out and "context: all-to-all" in out and "experts: all-to-all" in out, out
