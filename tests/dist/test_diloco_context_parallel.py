"""Context parallelism inside DiLoCo sites: 2 sites of 2 ranks, hsdp within a site (replicate 1 x shard 2) at
dist.context_parallel 2, trains as the same sites without CP. With CP a site's 2 ranks are one data rank, so the
job without CP that reads the same rows per site is 2 sites of 1 rank (fsdp within a site; 2 data ranks, as here):
the rows of each site's micro-batch packed into one padding-free row (8 rows of ~100 tokens: the CP ranks' halves
cut through a document), the loss normalised by the site's target tokens, counted over its CP group. Three inner
SGD steps (a linear update: AdamW's normalisation turns the gradients' rounding into 1e-5 of lora_B, near zero), the
outer step (Nesterov, outer_lr 0.7, momentum 0.9, fp32 pseudo-gradients), then one inner step of the next round:
every step's fp32 loss, the round-start weights after the outer step (a full checkpoint's `model`) and each site's
own weights after step 4 (`site-<s>`) equal the run without CP's, with LoRA and with full fine-tuning.

Tolerance: the ranks sum their halves' losses and gradients in another order (measured: losses within 1e-7 of their
value, weights within 4e-7 of their largest, while a site's step 4 moves them by 0.2-1.4 of it).

Fault-tolerant sites (torchft: each site its own `trainyard launch` of 2 processes, a lighthouse between them) at
CP 2 train as the same sites in one world: each site's rows, its CP group and the outer sync across sites are the
same, so each site's full checkpoint (the round-start weights and its own) equals the one-world run's.

Also: the meshes (a site of one world, and a fault-tolerant site that is a world of its own) pair each rank with
its counterparts in the other sites, keep its CP group within its site, and split the outer sync between the
replicas of a shard; the CLI refuses a site that cannot carry CP (exit 2)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml

from tests import warm
from tests.conftest import TINY, events, run_cli, run_script, train_in
from tests.dist.checkpoint_helpers import kill_tree
from tests.dist.test_diloco import consolidated
from tests.world import World, free_port
from trainyard.checkpoint.save import step_dir

pytestmark = [pytest.mark.dist, pytest.mark.worlds]

JOB = [
    "train.micro_batch_size=8", "log.every_steps=1", "log.progress=false", "log.tensorboard=false",
    "eval.every_steps=0", "eval.at_end=false", "train.precision=fp32", "data.padding_free=true",
    "model.attn_implementation=varlen", "train.max_steps=4", "checkpoint.every_steps=0",
    "dist.strategy=diloco", "diloco.groups=2", "diloco.sync_every=3", "train.optimizer=sgd", "train.lr=0.5",
    "train.max_grad_norm=0",
]
WITH_CP = ["diloco.inner=hsdp", "dist.shard_size=2", "dist.context_parallel=2"]
WITHOUT_CP = ["diloco.inner=fsdp"]
REL = 1e-6


def train(world: World, out: Path, *overrides: str) -> Path:
    train_in(world, TINY, f"output_dir={out}", *JOB, *overrides)
    return out / "tiny"


@pytest.fixture(scope="module", params=[False, True], ids=["full", "lora"])
def runs(request: pytest.FixtureRequest, worlds: Callable[[int], World],
         tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("diloco-cp")
    lora = f"lora.enabled={str(request.param).lower()}"
    return {"cp": train(worlds(4), out / "cp", lora, *WITH_CP), "plain": train(worlds(2), out / "plain", lora,
                                                                               *WITHOUT_CP)}


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return (got - want).abs().max().item() <= REL * max(want.abs().max().item(), 1e-30)


def test_cp_in_a_site_trains_and_takes_the_outer_step_as_the_site_without_cp(runs: dict[str, Path]) -> None:
    got, want = ({e["step"]: e["loss"] for e in events(runs[k], "train")} for k in ("cp", "plain"))
    assert sorted(got) == sorted(want) == [1, 2, 3, 4]
    for step, loss in want.items():
        assert abs(got[step] - loss) <= REL * abs(loss), (step, got[step], loss)
    for run in runs.values():
        assert [e["step"] for e in events(run, "system") if e.get("event") == "outer_sync"] == [3]
    cp, plain = (consolidated(step_dir(runs[k] / "checkpoints", 4)) for k in ("cp", "plain"))
    for part in ("model", "site-0", "site-1"):
        mine, theirs = (found[part] if part == "model" else found[part]["model"] for found in (cp, plain))
        assert mine.keys() == theirs.keys(), part
        wrong = [name for name, tensor in theirs.items() if not close(mine[name], tensor)]
        assert not wrong, f"{part}: {wrong[:3]}"
    moved = [name for name, tensor in plain["site-0"]["model"].items()
             if not torch.equal(tensor, plain["site-1"]["model"][name])]
    assert moved, "the sites' step-4 weights must differ (each site's own step after the sync)"


def test_fault_tolerant_sites_at_cp_2_train_as_the_same_sites_in_one_world(runs: dict[str, Path],
                                                                             tmp_path: Path) -> None:
    """Two sites of `trainyard launch --nproc 2`, each a torch world of its own (hsdp 1 x 2 at CP 2), synced through
    torchft: the lighthouse wants both, so neither syncs alone."""
    lighthouse = pytest.importorskip("torchft.coordination").LighthouseServer(
        bind="[::]:0", min_replicas=2, join_timeout_ms=60_000)
    lora = f"lora.enabled={str(yaml.safe_load((runs['cp'] / 'config.yaml').read_text())['lora']['enabled']).lower()}"
    sites: list[warm.Command | subprocess.Popen[bytes]] = []
    try:
        for site in range(2):
            with open(tmp_path / f"site-{site}.out", "wb") as sink:
                sites.append(warm.start([
                    "launch", TINY, "--nnodes", "1", "--node-rank", "0", "--master", f"127.0.0.1:{free_port()}",
                    "--nproc", "2", f"output_dir={tmp_path}", *JOB, *WITH_CP, lora,
                    "diloco.fault_tolerant=true", "diloco.sites=2", f"diloco.site={site}",
                    f"diloco.lighthouse={lighthouse.address().removeprefix('http://')}", "dist.timeout_s=60",
                ], new_session=True, output=sink.fileno()))
        codes = [site.wait(timeout=300) for site in sites]
    finally:
        for site in sites:
            kill_tree(site)
        lighthouse.shutdown()
    logs = "\n".join((tmp_path / f"site-{s}.out").read_text()[-3000:] for s in range(2))
    assert codes == [0, 0], logs
    want = consolidated(step_dir(runs["cp"] / "checkpoints", 4))
    for site in range(2):
        run = tmp_path / "tiny" / f"site-{site}"
        synced = [e for e in events(run, "system") if e.get("event") == "outer_sync"]
        assert [(e["step"], e["outer_sites"]) for e in synced] == [(3, 2)], synced
        got = consolidated(step_dir(run / "checkpoints", 4))
        # a fault-tolerant site is the one site of its own world: its own weights are its checkpoint's site-0
        for part, mine, theirs in (("model", got["model"], want["model"]),
                                   (f"site-{site}", got["site-0"]["model"], want[f"site-{site}"]["model"])):
            assert mine.keys() == theirs.keys(), part
            wrong = [name for name, tensor in theirs.items() if not close(mine[name], tensor)]
            assert not wrong, f"site {site}, {part}: {wrong[:3]}"


def test_meshes_pair_counterparts_and_keep_cp_groups_within_a_site(worlds: Callable[[int], World],
                                                                     tmp_path: Path) -> None:
    """On 4 ranks: 2 sites of hsdp (replicate 1 x shard 2) and of fsdp, and one fault-tolerant site (sites 1) of
    hsdp (replicate 2 x shard 2) and of fsdp (4), all at CP 2 (tests/dist/scripts/diloco_context_mesh.py)."""
    run_script(worlds(4), "diloco_context_mesh", str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(4)]
    for rank, found in enumerate(ranks):
        cp = [rank // 2 * 2, rank // 2 * 2 + 1]  # consecutive ranks
        for case in ("hsdp-2", "fsdp-2"):  # sites {0, 1} and {2, 3}
            assert found[case]["site"] == [rank % 2, rank % 2 + 2], (case, found[case])
            assert found[case]["within"] == found[case]["shard"] == cp, (case, found[case])
            assert found[case]["cp"] == cp and found[case]["slicers"] is None, (case, found[case])
        assert found["hsdp-1"]["site"] == found["fsdp-1"]["site"] == [rank]  # a world of its own: torchft crosses
        assert found["hsdp-1"]["within"] == found["fsdp-1"]["within"] == [0, 1, 2, 3]
        assert found["hsdp-1"]["cp"] == found["fsdp-1"]["cp"] == cp
        assert found["hsdp-1"]["shard"] == cp and found["fsdp-1"]["shard"] == [0, 1, 2, 3]
        assert found["hsdp-1"]["slicers"] == [rank % 2, rank % 2 + 2]  # the replicas of a shard split its sync
        assert found["fsdp-1"]["slicers"] is None


@pytest.mark.parametrize("fault_tolerant", [[], ["diloco.fault_tolerant=true", "diloco.site=0", "diloco.sites=2"]],
                         ids=["one-world", "fault-tolerant"])
def test_ddp_in_a_site_cannot_carry_cp_and_exits_2_naming_the_fields(fault_tolerant: list[str]) -> None:
    result = run_cli("train", TINY, "dist.strategy=diloco", "diloco.groups=2", "diloco.inner=ddp",
                     "dist.context_parallel=2", "data.padding_free=true", "model.attn_implementation=varlen",
                     *fault_tolerant, "--dry-run", "--world-size", "4")
    assert result.returncode == 2, result.stderr[-2000:]
    flat = " ".join(result.stderr.split())
    for needle in ["dist.context_parallel 2 under dist.strategy diloco", "diloco.inner ddp shards nothing",
                   "set diloco.inner: hsdp or fsdp, or dist.context_parallel: 1"]:
        assert needle in flat, flat
    assert "Traceback" not in result.stderr
