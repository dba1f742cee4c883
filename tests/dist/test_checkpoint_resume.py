"""A killed or preempted 2-rank run, run again, ends bitwise where the uninterrupted one ends."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import SEED, TINY, assert_ok, events, run_cli, run_script, train_in, trainyard
from tests.dist.checkpoint_helpers import (
    COMMON,
    EVERY,
    FULL_FSDP,
    LORA_DDP,
    LORA_FSDP,
    STEPS,
    adapter_tensors,
    assert_same_tensors,
    dcp_adapter_tensors,
    events_of_last_run,
    kill_tree,
    last_step,
    model_tensors,
    resumed_events,
    start,
    train_args,
    wait_for_step,
)
from tests.unit.checkpoint.test_layout import DAMAGE, garble
from tests.world import World
from trainyard.checkpoint.save import (
    MARKER,
    committed,
    damage,
    latest_full,
    resolve_resume,
    step_dir,
    write_marker,
)
from trainyard.errors import CheckpointError
from trainyard.runs.status import read_status

pytestmark = pytest.mark.dist

MODES = {
    "ddp-lora-sync": LORA_DDP,
    "fsdp-full-async": [*FULL_FSDP, "checkpoint.async=true"],
    "fsdp-lora-sync": LORA_FSDP,
}
REFERENCES = {
    "ddp-lora-sync": "lora_reference",
    "fsdp-full-async": "full_reference",
    "fsdp-lora-sync": "fsdp_lora_reference",
}


def assert_same_final_weights(run_dir: Path, reference: Path, lora: bool) -> None:
    """The last checkpoint's DCP weights and (LoRA) its PEFT adapter file, bit for bit."""
    got, want = step_dir(run_dir / "checkpoints", STEPS), step_dir(reference / "checkpoints", STEPS)
    assert_same_tensors(model_tensors(got), model_tensors(want))
    if lora:
        assert_same_tensors(adapter_tensors(got), adapter_tensors(want))


def craft_partial(checkpoints: Path, like: Path | None) -> Path:
    """What a kill in the middle of a save leaves: shards on disk, no commit marker."""
    step = last_step(checkpoints.parent) + 1
    while step % EVERY == 0 or step_dir(checkpoints, step).exists():
        step += 1  # a step the rerun never saves, so it can only vanish by being cleaned up
    partial = step_dir(checkpoints, step)
    if like is not None:
        shutil.copytree(like, partial)
        (partial / MARKER).unlink()
        shard = next(partial.glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[:100])
    else:
        partial.mkdir()
    return partial


@pytest.mark.parametrize("mode", MODES)
def test_sigkill_at_a_random_step_then_rerun_ends_bitwise_identical(
    tmp_path: Path, mode: str, draw_step, request: pytest.FixtureRequest
) -> None:
    """A node dies at a random step (maybe mid-save); a save cut short (shards, no marker) is
    crafted beside it. The rerun removes the partial folder, resumes from the last committed
    checkpoint, replays no step and skips none, and ends with the reference's exact weights."""
    lora = "lora" in mode
    reference: Path = request.getfixturevalue(REFERENCES[mode])
    args = train_args(tmp_path, *MODES[mode])
    run_dir, checkpoints = tmp_path / "tiny", tmp_path / "tiny" / "checkpoints"
    kill_at = draw_step(EVERY + 1, STEPS - EVERY)
    proc = start(args)
    seen = wait_for_step(proc, run_dir, kill_at)
    kill_tree(proc)
    assert proc.returncode == -signal.SIGKILL
    assert last_step(run_dir) < STEPS, "the run finished before the kill"
    saved = latest_full(checkpoints)
    partial = craft_partial(checkpoints, saved)

    result = trainyard(*args)
    assert_ok(result)

    context = f"killed at step >= {kill_at} (saw {seen}, TRAINYARD_TEST_SEED={SEED}), last committed {saved}"
    assert not partial.exists(), context
    resumed = resumed_events(run_dir)
    if saved is None:  # killed before the first commit: a fresh start is right
        assert resumed == [], context
        first_step = 1
    else:
        assert [e["path"] for e in resumed] == [str(saved)], context
        first_step = int(saved.name[5:]) + 1
    train = events_of_last_run(run_dir, "train")
    assert [e["step"] for e in train] == list(range(first_step, STEPS + 1)), context
    assert_same_final_weights(run_dir, reference, lora)
    kept = [p.name for p in committed(checkpoints)]
    assert kept[-2:] == [f"step-{STEPS - EVERY:08d}", f"step-{STEPS:08d}"], context
    if saved is not None:  # rotation keeps 2, plus the one this run resumed from
        assert saved.name in kept and len(kept) <= 3, (context, kept)
    if mode.endswith("async"):  # async saves: reported at once, committed a step or two later, never lost
        saves = events_of_last_run(run_dir, "checkpoint")
        started = {e["step"] for e in saves if e.get("async_save")}
        assert started and started <= {e["step"] for e in saves if e.get("committed")}, saves


PREEMPTED = {
    "ddp-lora": ([*LORA_DDP], "lora_reference"),
    # Lite saves too: each one must hold exactly the adapter DCP saved at that step.
    "fsdp-lora": ([*LORA_FSDP, f"checkpoint.lite_every_steps={EVERY}"], "fsdp_lora_reference"),
}


@pytest.mark.parametrize("mode", PREEMPTED)
def test_sigterm_to_the_launcher_saves_exits_75_and_loses_no_step(
    tmp_path: Path, mode: str, draw_step, request: pytest.FixtureRequest
) -> None:
    overrides, reference_name = PREEMPTED[mode]
    reference: Path = request.getfixturevalue(reference_name)
    # No periodic saves: the preemption save is always a new one, at whatever step it lands.
    args = train_args(tmp_path, *overrides, "checkpoint.every_steps=0")
    run_dir, checkpoints = tmp_path / "tiny", tmp_path / "tiny" / "checkpoints"
    stop_at = draw_step(EVERY + 1, STEPS - EVERY)
    proc = start(args)
    try:
        wait_for_step(proc, run_dir, stop_at)
        proc.send_signal(signal.SIGTERM)  # the launcher only: it forwards to its workers
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.returncode is None:
            kill_tree(proc)
    context = f"SIGTERM after step >= {stop_at} (TRAINYARD_TEST_SEED={SEED})"
    assert proc.returncode == 75, (context, stderr[-3000:])
    assert "SIGTERM" in stderr, (context, stderr[-3000:])
    if "Traceback" in stderr or "resource_tracker" in stderr:  # ("leaked semaphore objects" at exit)
        pytest.fail(f"{context}: the launcher printed a traceback or the resource tracker's warning:\n{stderr}")
    stopped = last_step(run_dir)
    assert stopped < STEPS, context
    assert latest_full(checkpoints) == step_dir(checkpoints, stopped), f"{context}: not the last step trained"

    result = trainyard(*args)
    assert_ok(result)
    train = events_of_last_run(run_dir, "train")
    assert [e["step"] for e in train] == list(range(stopped + 1, STEPS + 1)), context
    summary = (run_dir / "summary.json").read_text()
    assert f'"steps": {STEPS}' in summary
    assert_same_final_weights(run_dir, reference, lora=True)
    if "lite_every_steps" in " ".join(overrides):  # before and after the preemption alike
        lite = [int(p.name[5:]) for p in committed(checkpoints, "lite")]
        assert lite == [s for s in range(EVERY, STEPS, EVERY) if s != stopped], (context, lite)
        for step in lite:
            want = dcp_adapter_tensors(step_dir(reference / "checkpoints", step))
            assert_same_tensors(adapter_tensors(step_dir(checkpoints, step)), want)


def test_fsdp_lora_adapter_files_hold_the_weights_dcp_saved(fsdp_lora_reference: Path) -> None:
    """Seed 000's case: under FSDP2 every rank holds a shard of each LoRA matrix. The adapter
    written beside each full checkpoint must be the gathered whole, equal to DCP's copy."""
    saved = committed(fsdp_lora_reference / "checkpoints")
    assert [p.name for p in saved] == [f"step-{s:08d}" for s in range(EVERY, STEPS + 1, EVERY)]
    for path in saved:
        assert_same_tensors(adapter_tensors(path), dcp_adapter_tensors(path))


def test_two_rank_fsdp_checkpoint_resumes_in_one_process(tmp_path: Path, full_reference: Path) -> None:
    """DCP reshards model and optimizer: the one-process run continues the 2-rank trajectory."""
    start_from = step_dir(full_reference / "checkpoints", STEPS - EVERY)
    result = trainyard(
        *train_args(tmp_path, "lora.enabled=false", "dist.strategy=none", f"checkpoint.resume={start_from}", nproc=1)
    )
    assert_ok(result)
    run_dir = tmp_path / "tiny"
    assert [e["saved_world_size"] for e in resumed_events(run_dir)] == [2]
    losses = {e["step"]: e["loss"] for e in events(run_dir, "train")}
    reference = {e["step"]: e["loss"] for e in events(full_reference, "train")}
    assert sorted(losses) == list(range(STEPS - EVERY + 1, STEPS + 1))
    # one process sums what two ranks reduced, in bf16 products where the CPU has them: a few 1e-4 apart, while a
    # step on other rows differs by ~1e-2
    np.testing.assert_allclose([losses[s] for s in losses], [reference[s] for s in losses], rtol=5e-4, atol=1e-5)
    got = model_tensors(step_dir(run_dir / "checkpoints", STEPS))
    want = model_tensors(step_dir(full_reference / "checkpoints", STEPS))
    # Per tensor, not per element: where a gradient is near zero, AdamW's normalised update amplifies the products'
    # rounding, so on a CPU with bf16 units a single weight can land 1e-5 off (1 of 4,096 seen); a step on other rows
    # or a lost optimizer state moves whole tensors.
    for name in want:
        error = float((got[name].float() - want[name].float()).norm() / want[name].float().norm())
        assert error < 1e-4, (name, error)


def test_resuming_with_another_lora_rank_or_data_fails_naming_both(tmp_path: Path, lora_reference: Path) -> None:
    run_dir = tmp_path / "tiny"
    shutil.copytree(lora_reference, run_dir)
    config_before = (run_dir / "config.yaml").read_text()
    result = trainyard(*train_args(tmp_path, *LORA_DDP, "lora.r=8", "data.synthetic_train_size=256", nproc=1))
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    message = "".join(result.stderr.split())  # the console wraps long lines anywhere
    assert str(latest_full(run_dir / "checkpoints")) in message
    assert "lora:checkpointhas" in message and "'r':16" in message and "'r':8" in message
    assert "data_fingerprint:checkpointhas" in message
    assert (run_dir / "config.yaml").read_text() == config_before, "a rejected resume rewrote the run's config.yaml"


DAMAGED_MODES = {"ddp": ("lora_reference", LORA_DDP), "fsdp2": ("fsdp_lora_reference", LORA_FSDP)}


def copy_last_two(reference: Path, run_dir: Path) -> tuple[Path, Path]:
    """The reference run dir with its two newest full checkpoints (what keep_last: 2 leaves): older, newest."""
    keep = {p.name for p in committed(reference / "checkpoints")[-2:]}

    def older_steps(folder: str, names: list[str]) -> list[str]:
        return [n for n in names if Path(folder).name == "checkpoints" and n.startswith("step-") and n not in keep]

    shutil.copytree(reference, run_dir, ignore=older_steps)
    older, newest = committed(run_dir / "checkpoints")
    return older, newest


@pytest.mark.parametrize("mode", DAMAGED_MODES)
def test_every_kind_of_damage_to_a_real_checkpoint_is_named_and_passed_over(
    tmp_path: Path, mode: str, request: pytest.FixtureRequest
) -> None:
    """Each kind of damage done to the newest checkpoint of a real 2-rank run: auto resumes from the one before,
    naming the file; a named resume, export and eval refuse it (exit 2) naming the file; status marks it. The same
    for a lite checkpoint whose adapter is damaged."""
    reference: Path = request.getfixturevalue(DAMAGED_MODES[mode][0])
    for kind, (name, hurt, how) in DAMAGE.items():
        run_dir = tmp_path / kind.replace(" ", "-") / "tiny"
        older, newest = copy_last_two(reference, run_dir)
        hurt(newest / name)
        problem = damage(newest)
        assert damage(older) is None and problem and str(newest / name) in problem and how in problem, (kind, problem)
        assert resolve_resume("auto", run_dir / "checkpoints") == older, kind
        with pytest.raises(CheckpointError, match="is damaged"):
            resolve_resume(str(newest), run_dir / "checkpoints")
        exported = run_cli("export", str(newest), "--out", str(run_dir.parent / "export"))
        assert exported.returncode == 2 and str(newest / name) in "".join(exported.stderr.split()), exported.stderr
        assert list(read_status(run_dir)["damaged_checkpoints"]) == [newest.name], kind

    lite = step_dir(run_dir / "checkpoints", int(newest.name[5:]) + 1)
    shutil.copytree(older / "adapter", lite / "adapter")
    write_marker(run_dir / "checkpoints", lite, "lite")
    garble(lite / "adapter" / "adapter_model.safetensors")
    for argv in (["export", str(lite), "--out", str(tmp_path / "lite")],
                 ["eval", str(run_dir / "config.yaml"), "--checkpoint", str(lite)]):
        result = run_cli(*argv)
        message = "".join(result.stderr.split())
        assert result.returncode == 2 and "adapter_model.safetensorsisgarbled" in message, (argv, result.stderr)


def test_auto_resumes_from_the_newest_intact_checkpoint_and_leaves_the_damaged_one(
    world: World, tmp_path: Path, lora_reference: Path
) -> None:
    """DDP: a shard of the newest checkpoint cut short. Today's main crashed in DCP's load (exit 1)."""
    older, newest = copy_last_two(lora_reference, tmp_path / "tiny")
    shard = newest / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    train_in(world, TINY, f"output_dir={tmp_path}", *COMMON, *LORA_DDP, f"train.max_steps={int(older.name[5:]) + 1}")
    assert [e["path"] for e in resumed_events(tmp_path / "tiny")] == [str(older)]
    log = (tmp_path / "tiny" / "logs" / "rank-0.log").read_text()
    assert f"skipping damaged checkpoint {newest}" in log and f"{shard} is truncated" in log, log[-3000:]
    assert shard.stat().st_size == 100 and (newest / MARKER).is_file(), "the damaged checkpoint was not left in place"


def test_every_rank_loads_the_checkpoint_rank_0_chose_and_gets_its_refusal(world: World, tmp_path: Path) -> None:
    """Ranks whose views of the checkpoints differ (rank 1 sees step 20 cut short): each judging damage on its own
    loaded step 20 on rank 0 and step 10 on rank 1, mismatched shards in one model."""
    run_script(world, "agreed_resume", str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["auto"] for r in ranks] == ["step-00000020", "step-00000020"], ranks
    missing = tmp_path / "missing" / "step-00000020"
    assert ranks[0]["named"] == ranks[1]["named"], ranks  # rank 1 did not go on to load alone
    assert ranks[1]["named"].startswith(f"CheckpointError: checkpoint.resume: {missing} is not a committed"), ranks


def test_a_damaged_step_is_set_aside_and_saved_again_as_the_uninterrupted_run_saved_it(
    world: World, tmp_path: Path, fsdp_lora_reference: Path
) -> None:
    """FSDP2: a rank file of the newest checkpoint garbled (today: "does not match this job", exit 2). The resumed
    run trains through that step again; its new save there is intact, the damaged one kept beside it."""
    older, newest = copy_last_two(fsdp_lora_reference, tmp_path / "tiny")
    garble(newest / "rank-1.json")
    train_in(world, TINY, f"output_dir={tmp_path}", *COMMON, *LORA_FSDP)
    run_dir = tmp_path / "tiny"
    assert [e["path"] for e in resumed_events(run_dir)] == [str(older)]
    aside = newest.with_name(f"{newest.name}.damaged")
    assert "rank-1.json is garbled" in (damage(aside) or ""), damage(aside)
    assert damage(newest) is None and latest_full(run_dir / "checkpoints") == newest
    assert_same_final_weights(run_dir, fsdp_lora_reference, lora=True)
