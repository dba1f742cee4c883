"""`trainyard init` writes a commented first job from a model and a data file, with the plan's choices, that passes
`train --dry-run` for its cluster; it never overwrites a file and names the bad flag or file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.conftest import run_cli
from trainyard.estimate.arch import KNOWN_ARCHITECTURES

CHAT = {"messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi there"}]}
ALPACA = {"instruction": "Say hi", "input": "", "output": "hi there"}
PAIR = {"prompt": "Say hi", "chosen": "hi there", "rejected": "go away"}


def config_folder(tmp_path: Path, hub_id: str, **changes: int) -> Path:
    """A seed job's model as its config.json alone (with `changes`): the plan builds it on the meta device, no
    weights."""
    folder = tmp_path / hub_id.rpartition("/")[2]
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**KNOWN_ARCHITECTURES[hub_id], **changes}))
    return folder


NARROW = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def rows(tmp_path: Path, row: dict[str, str], count: int = 12) -> Path:
    path = tmp_path / "rows.jsonl"
    path.write_text((json.dumps(row) + "\n") * count)
    return path


SHAPES = {  # the seed jobs' shapes (configs/mistral7b-lora-ddp.yaml, configs/glm45air-fsdp-lora.yaml) and a DPO job
    "mistral-7b-on-8xh100": ("mistralai/Mistral-7B-v0.1", ALPACA, "sft", ["--gpu", "h100-80gb", "--gpus-per-node", "8"],
                             {"data.format": "alpaca", "dist.strategy": "ddp"}),
    "glm45air-on-2x8-h200": ("zai-org/GLM-4.5-Air", CHAT, "sft",
                             ["--gpu", "h200", "--gpus-per-node", "8", "--nodes", "2"],
                             {"data.format": "chat", "dist.strategy": "hsdp"}),  # only gradients cross nodes
    "dpo-mistral-7b-on-2xh100": ("mistralai/Mistral-7B-v0.1", PAIR, "dpo",
                                 ["--gpu", "h100-80gb", "--gpus-per-node", "2"],
                                 {"data.format": "preference", "train.objective": "dpo"}),
}


def settings(job: Path) -> dict[str, object]:
    """The job file's settings, dotted."""
    flat: dict[str, object] = {}
    for key, value in yaml.safe_load(job.read_text()).items():
        flat.update({f"{key}.{k}": v for k, v in value.items()} if isinstance(value, dict) else {key: value})
    return flat


@pytest.mark.parametrize("shape", SHAPES)
def test_the_job_written_passes_its_dry_run_for_the_cluster(shape: str, tmp_path: Path) -> None:
    hub_id, row, objective, cluster, expected = SHAPES[shape]
    model, data, job = config_folder(tmp_path, hub_id), rows(tmp_path, row), tmp_path / "job.yaml"
    made = run_cli("init", str(model), str(data), *cluster, "--objective", objective, "--out", str(job))
    assert made.returncode == 0, made.stderr
    written = settings(job)
    assert written["model.path"] == str(model) and written["data.path"] == str(data)
    assert expected.items() <= written.items(), written
    assert written["train.precision"] == "bf16-mixed"  # the plan's for a GPU, not this CPU's
    assert "dist.strategy" in written  # the plan's choice for several GPUs, never left to auto
    lines = [line for line in job.read_text().splitlines() if line and not line.startswith("#") and ":" in line]
    assert all("  # " in line for line in lines if not line.endswith(":")), job.read_text()
    assert "lora.enabled" not in written and "train.max_steps" not in written  # the defaults are not repeated
    planned = run_cli("train", str(job), "--dry-run", *cluster)
    assert planned.returncode == 0, planned.stdout + planned.stderr
    assert f"strategy         {written['dist.strategy']}" in planned.stdout


def test_a_hub_id_not_on_this_machine_is_written_without_the_model_dependent_choices(tmp_path: Path) -> None:
    data, job = rows(tmp_path, CHAT), tmp_path / "job.yaml"
    made = run_cli("init", "someone/not-downloaded-7b", str(data), "--gpu", "h100-80gb", "--out", str(job))
    assert made.returncode == 0, made.stderr
    assert "not on this machine: the strategy and the fit were not planned" in made.stderr
    assert "not on this machine" in job.read_text()  # the file says so too
    written = settings(job)
    assert "dist.strategy" not in written and written["data.format"] == "chat"
    assert run_cli("train", str(job), "--dry-run", "--gpu", "h100-80gb").returncode == 0


def test_it_never_overwrites_a_file_without_force(tmp_path: Path) -> None:
    """A Mistral of 2 narrow layers: --out and --force act alike for any model, and the forced init plans its
    model twice (the 7B's meta models: 2 s of CPU)."""
    model, data = config_folder(tmp_path, "mistralai/Mistral-7B-v0.1", **NARROW), rows(tmp_path, ALPACA)
    job = tmp_path / "job.yaml"
    job.write_text("mine\n")
    cluster = ["--gpu", "h100-80gb", "--gpus-per-node", "1"]
    refused = run_cli("init", str(model), str(data), *cluster, "--out", str(job))
    assert refused.returncode == 2 and f"--out {job} already exists" in refused.stderr
    assert job.read_text() == "mine\n"
    assert run_cli("init", str(model), str(data), *cluster, "--out", str(job), "--force").returncode == 0
    assert "model:" in job.read_text()


@pytest.mark.parametrize(
    ("args", "needle"),
    [(["MODEL_DIR", "missing.jsonl"], "missing.jsonl does not exist"),
     (["EMPTY_DIR", "DATA"], "has no config.json"),
     (["./no-such-model", "DATA"], "./no-such-model does not exist"),
     (["MODEL_DIR", "DATA", "--objective", "ppo"], "--objective"),
     (["MODEL_DIR", "DATA", "--gpu", "tpu-v9"], "tpu-v9"),
     (["MODEL_DIR", "DATA", "--nodes", "2"], "--gpu"),
     (["MOE_DIR", "DATA", "--gpu", "l4", "--gpus-per-node", "1"], "no plan fits 1 x 1 l4")],
)
def test_bad_input_exits_2_naming_the_flag_or_file(args: list[str], needle: str, tmp_path: Path) -> None:
    model, data = config_folder(tmp_path, "mistralai/Mistral-7B-v0.1"), rows(tmp_path, ALPACA)
    (tmp_path / "empty").mkdir()
    # GLM-4.5-Air in 8 of its 46 layers: 43 GiB a device, more than an L4 holds, and a sixth of the meta model
    moe = config_folder(tmp_path, "zai-org/GLM-4.5-Air", num_hidden_layers=8)
    names = {"MODEL_DIR": str(model), "MOE_DIR": str(moe),
             "EMPTY_DIR": str(tmp_path / "empty"), "DATA": str(data), "missing.jsonl": str(tmp_path / "missing.jsonl")}
    result = run_cli("init", *[names.get(arg, arg) for arg in args], "--out", str(tmp_path / "job.yaml"))
    assert result.returncode == 2, result.stdout + result.stderr
    assert needle in result.stdout + result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "job.yaml").exists()
