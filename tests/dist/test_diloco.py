"""DiLoCo on 2 sites: the algebra reduces to DDP where it must, the outer step is Nesterov SGD on the sites'
averaged pseudo-gradient, and a run killed mid-round resumes to the uninterrupted run's exact weights."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.conftest import TINY, assert_ok, events, run_cli, run_script, train_in, trainyard
from tests.dist.checkpoint_helpers import (
    assert_same_tensors,
    kill_tree,
    last_step,
    model_tensors,
    resumed_events,
    start,
    wait_for_step,
)
from tests.world import World
from trainyard.checkpoint.save import latest_full, step_dir

pytestmark = pytest.mark.dist

COMMON = [
    "lora.enabled=false", "train.micro_batch_size=8", "log.every_steps=1", "log.progress=false",
    "log.tensorboard=false", "eval.every_steps=0", "eval.at_end=false", "train.precision=bf16-mixed",
]
TWO_SITES = ["dist.strategy=diloco", "diloco.groups=2"]


def consolidated(step: Path) -> dict:
    """Every entry of a full DCP checkpoint, nested as saved."""
    with tempfile.TemporaryDirectory() as scratch:
        dcp_to_torch_save(step, Path(scratch) / "all.pt")
        return torch.load(Path(scratch) / "all.pt", weights_only=True)


def run(world: World, out: Path, *overrides: str) -> Path:
    """The job on a shared world of its ranks (tests/world.py): what a launch of that many runs, without its start."""
    train_in(world, TINY, f"output_dir={out}", *COMMON, *overrides)
    return out / "tiny"


INNER = pytest.mark.parametrize(
    ("inner", "nproc"),
    [(["diloco.inner=ddp"], 2), (["diloco.inner=fsdp"], 4), (["diloco.inner=hsdp", "dist.shard_size=1"], 4)],
    ids=["ddp-2x1", "fsdp-2x2", "hsdp-2x2x1"],
)
"""Sites of one rank under DDP; sites of two ranks that shard the weights (and the outer state) under FSDP; sites
of two replicas of one shard under HSDP (the 3-D mesh, where the replicas split their shard's sync; sharding itself
is FSDP's case: 8 processes on the suite's 2 cores took 4 minutes)."""


@INNER
def test_one_inner_step_per_round_over_a_linear_update_is_ddp(
    worlds: Callable[[int], World], tmp_path: Path, inner: list[str], nproc: int
) -> None:
    """H = 1, outer_lr 1, no momentum, inner SGD: the average of the sites' SGD steps is the SGD step of the
    average gradient when every site holds as many target tokens (a site normalises its loss by its own, never
    waiting for another: rows all cut to 96 tokens make them equal). Equal up to float rounding: DDP averages
    gradients, DiLoCo averages the weights they produced."""
    # fp32 compute: under bf16 a rounding-level difference in the weights flips bf16 roundings of activations
    linear = ["train.optimizer=sgd", "train.lr=0.5", "train.max_grad_norm=0", "train.max_steps=8",
              "train.precision=fp32", "data.max_length=96"]
    ddp = run(worlds(nproc), tmp_path / "ddp", *linear, "dist.strategy=ddp")
    outer = ["diloco.sync_every=1", "diloco.outer_lr=1", "diloco.outer_momentum=0", *inner]
    diloco = run(worlds(nproc), tmp_path / "diloco", *linear, *TWO_SITES, *outer)

    want = [(e["step"], e["loss"]) for e in events(ddp, "train")]
    got = [(e["step"], e["loss"]) for e in events(diloco, "train")]
    assert [s for s, _ in got] == [s for s, _ in want] == list(range(1, 9))
    np.testing.assert_allclose([loss for _, loss in got], [loss for _, loss in want], rtol=2e-5)
    assert want[-1][1] < want[0][1] - 0.5, "the trajectory compared must move"
    syncs = [e for e in events(diloco, "system") if e.get("event") == "outer_sync"]
    assert [e["step"] for e in syncs] == list(range(1, 9))
    final = model_tensors(step_dir(diloco / "checkpoints", 8))
    reference = model_tensors(step_dir(ddp / "checkpoints", 8))
    for name, tensor in reference.items():
        torch.testing.assert_close(final[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    # One model's fp32 pseudo-gradient per site, divided over the site's ranks (a ring over 2 sites sends it once):
    # under HSDP each rank's shard is a quarter of the model, each of its 2 replicas syncs half of that.
    parameters = json.loads((diloco / "summary.json").read_text())["trainable_params"]
    assert syncs[0]["outer_sync_bytes"] == pytest.approx(4 * parameters / (nproc // 2), rel=1e-3)


def int8_round_trip(pseudo_grad: np.ndarray) -> np.ndarray:
    """What a site's tensor is worth after int8 with one scale per tensor: the code times the scale."""
    scale = np.abs(pseudo_grad).max() / 127 or 1.0
    return np.clip(np.round(pseudo_grad / scale), -127, 127) * scale


@pytest.mark.parametrize(
    ("nproc", "lr", "momentum", "dtype"), [(4, 0.7, 0.9, "fp32"), (2, 1.0, 0.0, "fp32"), (4, 0.7, 0.9, "int8")]
)
def test_the_outer_step_is_nesterov_sgd_on_the_average_of_the_sites_pseudo_gradients(
    worlds: Callable[[int], World], tmp_path: Path, nproc: int, lr: float, momentum: float, dtype: str
) -> None:
    """2 sites of 2: each local rank reduces a slice across sites, the site gathers the slices. int8: each site
    sends its tensors as codes and one scale each, and the average is of what those are worth."""
    run_script(worlds(nproc), "diloco_outer_step", str(tmp_path), str(lr), str(momentum), dtype)
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(nproc)]
    sent = int8_round_trip if dtype == "int8" else (lambda pseudo_grad: pseudo_grad)
    buffers = None
    for round_index in range(2):
        start = [np.array(t, dtype=np.float64) for t in ranks[0][round_index]["start"]]
        for other in ranks[1:]:
            assert all(np.array_equal(a, b) for a, b in zip(start, other[round_index]["start"], strict=True))
        sites = ranks[:: nproc // 2]  # the first rank of each site; a site's ranks hold the same weights
        pseudo = [
            np.mean([sent(s - np.array(site[round_index]["before"][i])) for site in sites], axis=0)
            for i, s in enumerate(start)
        ]
        buffers = pseudo if buffers is None else [momentum * m + g for m, g in zip(buffers, pseudo, strict=True)]
        expected = [s - lr * (g + momentum * m) for s, g, m in zip(start, pseudo, buffers, strict=True)]
        for site in ranks:  # every site starts the next round from the same new weights
            for want, got in zip(expected, site[round_index]["after"], strict=True):
                np.testing.assert_allclose(np.array(got), want, rtol=1e-6, atol=1e-7)
    parameters, tensors = 3 * 2 + 2 + 2 * 1 + 1, 4
    per_rank = -(-parameters // (nproc // 2))  # each local rank's slice
    if dtype == "int8":  # an all-gather of 1-byte codes and 4-byte scales
        assert ranks[0][0]["bytes"] == (2 - 1) * (per_rank + tensors * 4)
    else:
        assert ranks[0][0]["bytes"] == 2 * (2 - 1) / 2 * per_rank * 4  # a ring all-reduce of fp32 pseudo-gradients


@INNER
def test_sigkill_mid_round_then_resume_ends_bitwise_equal(
    worlds: Callable[[int], World], tmp_path: Path, inner: list[str], nproc: int, draw_step
) -> None:
    """Checkpoints every 3 steps with rounds of 4: the saves before the end (3, 6, 9) are all mid-round, where the
    sites' weights differ. A step's outer sync comes before its train event, so a kill after the event of any step
    in 4..11 lands after one sync and before the next one's event (in a save or the next steps' inner work), and
    the resume starts mid-round too. The kill is drawn in 4..8: on a busy machine (load 34) one drawn at 10 landed
    only after the run's last step, 12, as the tiny steps outran the watcher."""
    job = [*TWO_SITES, *inner, "diloco.sync_every=4", "train.max_steps=12",
           "checkpoint.every_steps=3", "checkpoint.keep_last=2"]
    reference = run(worlds(nproc), tmp_path / "reference", *job)

    kill_at = draw_step(4, 8)
    killed = tmp_path / "killed"
    proc = start(["train", TINY, f"output_dir={killed}", *COMMON, *job, "--nproc", str(nproc)])
    wait_for_step(proc, killed / "tiny", kill_at)
    kill_tree(proc)
    landed = last_step(killed / "tiny")  # the kill came after this step's event, before the next one's
    context = f"killed after step {landed} (drew {kill_at})"
    assert landed < 12, context
    assert latest_full(killed / "tiny" / "checkpoints") is not None, f"{context}: before a save"
    assert_ok(trainyard("train", TINY, f"output_dir={killed}", *COMMON, *job, "--nproc", str(nproc)))  # resumes

    sites = consolidated(step_dir(reference / "checkpoints", 9))  # mid-round: each site moved on its own
    assert sites["site-0"]["model"].keys() == sites["site-1"]["model"].keys() == sites["model"].keys()
    moved = [name for name, tensor in sites["site-0"]["model"].items()
             if not torch.equal(tensor, sites["site-1"]["model"][name])]
    assert len(moved) == len(sites["model"]), "inner steps must not sync across sites"
    assert not torch.equal(sites["model"][moved[0]], sites["site-0"]["model"][moved[0]])  # round-start weights
    # The tied head is the round-start embedding too, not one site's current one (which a resume then loaded).
    assert torch.equal(sites["model"]["lm_head.weight"], sites["model"]["model.embed_tokens.weight"])

    resumed_at = resumed_events(killed / "tiny")[-1]["step"]
    assert resumed_at in (3, 6, 9) and resumed_at <= landed, f"{context}, resumed after {resumed_at}"
    assert_same_tensors(
        model_tensors(step_dir(killed / "tiny" / "checkpoints", 12)),
        model_tensors(step_dir(reference / "checkpoints", 12)),
    )
    after = [(e["step"], e["loss"]) for e in events(killed / "tiny", "train") if e["step"] > resumed_at]
    want = [(e["step"], e["loss"]) for e in events(reference, "train") if e["step"] > resumed_at]
    assert after[-len(want):] == want, f"{context}, resumed after {resumed_at}"


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        (["diloco.sync_every=0"], ["diloco.sync_every", "greater than or equal to 1"]),
        (["diloco.groups=3"], ["diloco.groups 3", "do not divide the world of 4"]),
        (["diloco.pseudo_grad_dtype=int4"], ["diloco.pseudo_grad_dtype"]),
        (["dist.shard_size=2"], ["dist.shard_size is set but diloco.inner is ddp"]),
        (["diloco.inner=hsdp", "diloco.groups=2", "dist.shard_size=3"],
         ["dist.shard_size 3 does not divide a diloco site's size 2"]),
    ],
)
def test_bad_diloco_settings_exit_2_naming_the_field(overrides: list[str], needles: list[str]) -> None:
    result = run_cli("train", TINY, "dist.strategy=diloco", *overrides, "--dry-run", "--world-size", "4")
    assert result.returncode == 2, result.stderr[-2000:]
    flat = " ".join(result.stderr.split())
    for needle in needles:
        assert needle in flat, flat
    assert "Traceback" not in result.stderr


def test_inner_steps_collectives_stay_within_the_site(worlds: Callable[[int], World], tmp_path: Path) -> None:
    """2 sites of 2, rounds of 4 steps, a train event every step: from each step's start to its outer sync (or the
    next step), every collective the flight recorder saw (votes, DDP's gradients, log figures) is within the rank's
    site. A WAN stall then holds the sites up only at the sync, where the cross-site traffic is. On the shared
    4-rank world (a task that raises fails the test with each rank's traceback)."""
    run_script(worlds(4), "diloco_inner_collectives", str(tmp_path / "out"), str(tmp_path))
    for rank in range(4):
        record = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        site = [r for r in range(4) if r // 2 == rank // 2]
        ends = [mark[2] for mark in record["marks"][1:]] + [max(e["id"] for e in record["entries"]) + 1]
        inner = [(step, low, high) for (kind, step, low), high in zip(record["marks"], ends, strict=True)
                 if kind == "step"]
        assert [step for step, _, _ in inner] == list(range(1, 9))
        for step, low, high in inner:
            within = [e for e in record["entries"] if low <= e["id"] < high]
            assert within, f"rank {rank} step {step}: no collective recorded"
            crossing = [(e["op"], e["ranks"]) for e in within if e["ranks"] != site]
            assert not crossing, f"rank {rank} step {step} left its site {site}: {crossing}"
        after_syncs = {tuple(e["ranks"]) for e in record["entries"] if e["id"] >= record["marks"][4][2]}
        assert (rank % 2, rank % 2 + 2) in after_syncs, "the outer sync's all-reduce across sites was recorded"
