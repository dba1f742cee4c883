"""The CLI contract: bad input exits 2 with a message and no traceback; --dry-run plans."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, TINY, run_cli, trainyard


def assert_user_error(result, *needles: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout
    for needle in needles:
        assert needle in result.stderr, result.stderr


def test_unknown_key_exits_2_with_suggestion(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text("run_name: x\ntrain:\n  lr: 0.1\n  micro_batch: 3\n")
    assert_user_error(
        run_cli("train", str(job)), f"{job}:4", "train.micro_batch", "did you mean 'train.micro_batch_size'"
    )


def test_bad_override_value_exits_2() -> None:
    assert_user_error(run_cli("train", TINY, "train.lr=fast"), "train.lr", "'fast'", "override 'train.lr=fast'")


def test_missing_config_file_exits_2() -> None:
    assert_user_error(run_cli("train", "nope.yaml"), "nope.yaml")


def test_missing_data_file_exits_2(tmp_path: Path) -> None:
    missing = tmp_path / "absent.jsonl"
    result = run_cli("train", TINY, f"output_dir={tmp_path}", f"data.path={missing}")
    assert_user_error(result, str(missing))


def test_global_batch_that_does_not_divide_exits_2(tmp_path: Path) -> None:
    result = run_cli(
        "train", TINY, f"output_dir={tmp_path}", "train.global_batch_size=12", "--dry-run", "--world-size", "8"
    )
    assert_user_error(result, "train.global_batch_size=12")


ALPACA = '{"instruction": "Say hi", "output": "hi"}\n'
CHAT = '{"messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi"}]}\n'


@pytest.mark.parametrize(
    ("config", "target", "needles"),
    [
        ("mistral7b-lora-ddp.yaml", ["--gpu", "h100-80gb"],
         ["world size       8", "strategy         ddp", "lora             r=16", "on 1 x 8 h100-80gb (fits)"]),
        ("glm45air-fsdp-lora.yaml", ["--gpu", "h200", "--nodes", "2"],
         ["world size       16", "strategy         hsdp", "x 4 accumulation x 16 ranks", "on 2 x 8 h200 (fits)",
          "network 100 Gb/s per node (TCP sockets (dist.network: socket))"]),
        ("scratch-1.5b.yaml", ["--gpu", "h100-80gb", "--nodes", "2"],
         ["524,288 tokens per step", "strategy         diloco",
          "diloco           2 sites x 8 ranks (ddp within a site), sync every 50",
          "off (full fine-tuning)", "parameters       1,", "steps            190735",
          "fineweb-edu/sample/100BT/*.parquet 65%", "token budget     100,000,000,000 tokens"]),
        ("scratch-stdlib.yaml", ["--world-size", "2"],
         ["steps            300", "builtin:python-stdlib 70%, builtin:pydoc-topics 30%", "rows of 256 tokens"]),
        ("tiny.yaml", ["--world-size", "2"],
         ["parameters       90,816 total, 90,816 trainable", "strategy         ddp"]),
        ("tiny-moe.yaml", ["--world-size", "2"],
         ["strategy         fsdp", "lora             r=8 alpha=16 on 12 modules, 4 expert parameters"]),
    ],
)
def test_dry_run_prints_the_plan_without_weights(
    config: str, target: list[str], needles: list[str], tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from trainyard.cli import app

    data = tmp_path / "rows.jsonl"
    data.write_text(CHAT if "glm" in config else ALPACA)
    local = [f"data.path={data}", f"output_dir={tmp_path}"] if "scratch" not in config else []
    result = CliRunner().invoke(app, ["train", str(REPO / "configs" / config), *local, "--dry-run", *target])
    assert result.exit_code == 0, result.output
    for needle in needles:
        assert needle in result.output, result.output


def test_help_lists_commands() -> None:
    result = trainyard("--help")
    assert result.returncode == 0
    for command in ("train", "launch", "slurm", "k8s", "status", "eval", "export", "doctor", "report"):
        assert command in result.stdout


def test_the_command_leaves_what_it_made_to_the_process_end_not_to_the_exit_s_collections() -> None:
    """Every object alive at exit is frozen before the interpreter's own exit, which would otherwise collect over
    all of them several times (1.2-1.5 s of CPU once torch and transformers are imported); atexit still runs."""
    script = (
        "import atexit, gc, sys; from trainyard.cli import main; "
        "atexit.register(lambda: print('frozen at exit:', gc.get_freeze_count())); main(['--help'])"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    frozen = int(result.stdout.rsplit("frozen at exit:", 1)[1])
    assert frozen > 10_000, result.stdout[-500:]
