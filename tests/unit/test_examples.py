"""Every job in examples/ passes the dry run its header prints, for its cluster: the model is planned on the meta
device (a config.json-only folder stands in for weights this machine lacks) and the data is read."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli

EXAMPLES = REPO / "examples"
LLAMA_31_8B = {  # meta-llama/Llama-3.1-8B-Instruct's config.json, the fields that shape it
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16"}
ROWS = {
    "chat": {"messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi there"}]},
    "alpaca": {"instruction": "Say hi", "input": "", "output": "hi there"},
    "preference": {"prompt": "Say hi", "chosen": "hi there", "rejected": "go away"},
}
STAND_INS = {"meta-llama/Llama-3.1-8B-Instruct": LLAMA_31_8B, "models/llama3.1-8b-sft": LLAMA_31_8B}
"""Models the examples name that are neither on this machine nor in the estimate's table: their config.json."""


def dry_run_args(job: Path) -> list[str]:
    """The cluster flags of the dry run the example's header prints."""
    line = next(line for line in job.read_text().splitlines() if line.startswith("#") and "--dry-run" in line)
    return shlex.split(line.partition("--dry-run")[2])


def stand_ins(job: Path, tmp_path: Path) -> list[str]:
    """Overrides that put a small data file of the job's format, and a config.json-only model, where the job names
    files that live on its cluster."""
    import yaml

    settings = yaml.safe_load(job.read_text())
    overrides = []
    data = settings["data"]
    if "path" in data:
        rows = tmp_path / "rows.jsonl"
        rows.write_text((json.dumps(ROWS[data["format"]]) + "\n") * 12)
        overrides.append(f"data.path={rows}")
    model = settings["model"].get("path")
    if model in STAND_INS:
        folder = tmp_path / "model"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(STAND_INS[model]))
        overrides.append(f"model.path={folder}")
    return overrides


@pytest.mark.parametrize("name", sorted(path.name for path in EXAMPLES.glob("*.yaml")))
def test_each_example_passes_its_dry_run_for_its_cluster(name: str, tmp_path: Path) -> None:
    job = EXAMPLES / name
    assert f"({name})" in (EXAMPLES / "README.md").read_text(), f"examples/README.md says nothing of {name}"
    cluster = dry_run_args(job)
    assert "--gpu" in cluster, "an example plans for its cluster"
    result = run_cli("train", str(job.relative_to(REPO)), *stand_ins(job, tmp_path), "--dry-run", *cluster)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "parameters       unknown" not in result.stdout  # the model was planned, not skipped
    assert "(fits)" in result.stdout
