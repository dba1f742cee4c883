"""train.epochs: passes over the training rows instead of max_steps, sized once the rows are known."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.conftest import TINY, events, run_cli
from trainyard.batch import steps_for_epochs
from trainyard.config_file import load_config
from trainyard.errors import ConfigError
from trainyard.runs.status import read_status
from trainyard.train import recipe as trainer

ROWS = 40
"""data.synthetic_train_size of the runs below: builtin:dates has no bad row, so all of them train."""


def tiny_without_max_steps(tmp_path: Path) -> str:
    """configs/tiny.yaml less its max_steps: an override cannot remove a key, and epochs excludes it."""
    text = Path(TINY).read_text()
    job = tmp_path / "tiny-epochs.yaml"
    job.write_text(text.replace("  max_steps: 30\n", ""))
    assert "max_steps" not in job.read_text()
    return str(job)


def quiet_run_overrides(tmp_path: Path) -> list[str]:
    return [
        f"output_dir={tmp_path}",
        f"data.synthetic_train_size={ROWS}",
        "eval.every_steps=0",
        "eval.at_end=false",
        "checkpoint.at_end=false",
        "checkpoint.every_minutes=0",
        "checkpoint.preemption_signals=[]",
        "log.tensorboard=false",
        "log.every_steps=1",
        "dist.strategy=none",
        "train.warmup_steps=0",
        "train.min_lr_ratio=0",
    ]


@pytest.mark.parametrize(
    ("epochs", "extra", "steps"),
    [
        ("0.5", [], 3),  # ceil(0.5 x 40 rows / 8 samples per step)
        ("2", [], 10),
        ("2", ["train.global_batch_size=16"], 5),  # micro 8 x accumulation 2
    ],
)
def test_a_tiny_run_trains_the_steps_its_epochs_come_to(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], epochs: str, extra: list[str], steps: int
) -> None:
    overrides = [*quiet_run_overrides(tmp_path), f"train.epochs={epochs}", *extra]
    cfg = load_config(tiny_without_max_steps(tmp_path), overrides)
    summary = trainer.run(cfg)
    run_dir = cfg.run_dir
    assert summary["data_stats"]["train_rows"] == ROWS
    assert summary["steps"] == steps and summary["epoch"] == pytest.approx(steps * 8 * summary["accumulation"] / ROWS)
    written = yaml.safe_load((run_dir / "config.yaml").read_text())["train"]
    assert (written["max_steps"], written["epochs"], written["epoch_rows"]) == (steps, float(epochs), ROWS)
    assert load_config(str(run_dir / "config.yaml")).train.max_steps == steps  # the written job loads back
    assert read_status(run_dir)["max_steps"] == steps
    train = events(run_dir, "train")
    assert [event["step"] for event in train] == list(range(1, steps + 1))
    assert train[0]["epoch"] == pytest.approx(8 * summary["accumulation"] / ROWS)
    assert train[-1]["epoch"] == summary["epoch"]
    assert train[-1]["lr"] == pytest.approx(0.0, abs=1e-12)  # the cosine ends at these steps, not at 100
    sized = [event for event in events(run_dir, "system") if event.get("event") == "steps_from_epochs"]
    assert [(e["rows"], e["max_steps"]) for e in sized] == [(ROWS, steps)]
    assert f"step {steps}/{steps} " in capsys.readouterr().err  # the progress line's total: the ETA's too
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == steps


def test_steps_hold_on_another_world_size_that_keeps_the_global_batch(tmp_path: Path) -> None:
    cfg = load_config(tiny_without_max_steps(tmp_path), ["train.micro_batch_size=4", "train.epochs=1.5"])
    fresh = steps_for_epochs(cfg, 100, world_size=4)
    assert fresh == 10  # ceil(1.5 x 100 rows / 16 samples per step)
    assert steps_for_epochs(cfg, 100, world_size=2, saved_samples=16) == fresh  # accumulation 2 keeps 16
    assert steps_for_epochs(cfg, 100, world_size=1, saved_samples=16) == fresh
    assert steps_for_epochs(cfg, 100, world_size=2) == 19  # a fresh start on 2 ranks: 8 samples per step


def test_decimal_epochs_are_exact(tmp_path: Path) -> None:
    cfg = load_config(tiny_without_max_steps(tmp_path), ["train.micro_batch_size=1", "train.epochs=0.1"])
    assert steps_for_epochs(cfg, 30, world_size=1) == 3  # 0.1 x 30 is 3.0000000000000004 in floats


@pytest.mark.parametrize(
    ("file_text", "overrides", "needles"),
    [
        (
            "train:\n  max_steps: 30\n  epochs: 2\n",
            [],
            ["train.max_steps ({job}:2)", "train.epochs ({job}:3)", "not both"],
        ),
        (
            "train:\n  micro_batch_size: 4\n",
            ["train.max_steps=30", "train.epochs=2"],
            ["train.max_steps (override 'train.max_steps=30')", "train.epochs (override 'train.epochs=2')", "not both"],
        ),
        (
            "train:\n  global_batch_tokens: 1024\n",
            ["train.epochs=2", "train.total_tokens=4096"],
            ["train.total_tokens (override 'train.total_tokens=4096')", "train.epochs (override 'train.epochs=2')"],
        ),
    ],
)
def test_epochs_exclude_max_steps_and_total_tokens_naming_both(
    tmp_path: Path, file_text: str, overrides: list[str], needles: list[str]
) -> None:
    """Both in the file, or both on the command line: the user said two lengths in one place."""
    job = tmp_path / "job.yaml"
    job.write_text(file_text)
    with pytest.raises(ConfigError) as err:
        load_config(str(job), overrides)
    for needle in needles:
        assert needle.format(job=job) in err.value.render(), err.value.render()


@pytest.mark.parametrize(
    ("file_text", "override", "replaced"),
    [
        ("train:\n  max_steps: 30\n", "train.epochs=2", "train.max_steps ({job}:2)"),
        ("train:\n  epochs: 2\n", "train.max_steps=30", "train.epochs ({job}:2)"),
        ("train:\n  epochs: 2\n  global_batch_tokens: 1024\n", "train.total_tokens=4096", "train.epochs ({job}:2)"),
    ],
)
def test_a_length_on_the_command_line_replaces_the_files_and_says_so(
    tmp_path: Path, file_text: str, override: str, replaced: str
) -> None:
    """torchtune and Hydra let the later, more specific statement win: the command line over the file."""
    job = tmp_path / "job.yaml"
    job.write_text(file_text)
    cfg = load_config(str(job), [override])
    key, value = override.split("=")
    assert getattr(cfg.train, key.split(".")[1]) == float(value)
    assert cfg._notes == [f"{key} from the command line replaces {replaced.format(job=job)}"]
    others = {"train.epochs": cfg.train.epochs, "train.total_tokens": cfg.train.total_tokens}
    assert all(value is None for name, value in others.items() if name != key)


def test_the_dry_run_switches_a_config_to_epochs_from_the_command_line() -> None:
    result = run_cli("train", TINY, "train.epochs=2", "--dry-run")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "train.epochs from the command line replaces train.max_steps" in result.stdout
    assert "2 epochs" in result.stdout or "epochs 2" in result.stdout or "2.0 epochs" in result.stdout, result.stdout


def test_epochs_are_refused_with_a_pretraining_mixture(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text("data:\n  mixture:\n    - {path: a.jsonl, weight: 1}\ntrain:\n  epochs: 1\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(job))
    text = err.value.render()
    assert f"train.epochs ({job}:5)" in text and f"data.mixture ({job}:2)" in text
    assert "set train.total_tokens" in text


def test_epochs_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="train.epochs: Input should be greater than 0"):
        load_config("tiny", ["train.epochs=0"])


def test_a_pod_job_file_of_an_epochs_job_loads_back(tmp_path: Path) -> None:
    """Before the trainer sizes it, the dumped job (k8s job.yaml) leaves the default max_steps out."""
    from trainyard.config_file import dump_config

    cfg = load_config(tiny_without_max_steps(tmp_path), ["train.epochs=2"])
    dumped = tmp_path / "job.yaml"
    dumped.write_text(dump_config(cfg))
    assert "max_steps" not in yaml.safe_load(dumped.read_text())["train"]
    assert load_config(str(dumped)).train.epochs == 2
