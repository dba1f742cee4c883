"""train.objective and the dpo section: settings that do not fit exit 2 naming the field and where it was set; the
dry run shows a pair with its trained tokens marked; the objective counts target tokens (SFT) or pairs (DPO)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import TINY, run_cli
from trainyard.config import DpoConfig
from trainyard.config_file import dump_config, load_config
from trainyard.data import build_byte_tokenizer, collate
from trainyard.data.chat import ChatTemplate
from trainyard.data.preference import encode_pair
from trainyard.objective import Dpo, Sft

QUIET = ["log.tensorboard=false"]


def job_file(tmp_path: Path, body: str) -> Path:
    """The tiny model on line 1, then `body`."""
    model = load_config(TINY, []).model
    path = tmp_path / "job.yaml"
    path.write_text("model: " + json.dumps({"config": model.config, "tokenizer": model.tokenizer}) + f"\n{body}")
    return path


def pairs_file(tmp_path: Path) -> Path:
    path = tmp_path / "pairs.jsonl"
    rows = [{"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": str(i + 2)} for i in range(8)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ("dpo:\n  beta: 0.2\n", "dpo.beta ({file}:3) is set but train.objective is sft"),
        ("train:\n  objective: dpo\nlora:\n  enabled: true\ndpo:\n  loss: ipo\n  label_smoothing: 0.1\n",
         "dpo.label_smoothing ({file}:8) applies to dpo.loss sigmoid and robust only, not ipo"),
        ("train:\n  objective: dpo\nlora:\n  enabled: true\ndpo:\n  simpo_gamma: 1.0\n",
         "dpo.simpo_gamma ({file}:7) applies to dpo.loss simpo only"),
        ("train:\n  objective: dpo\nlora:\n  enabled: true\ndata:\n  packing: true\n", "data.packing ({file}:7) is on"),
        ("lora:\n  enabled: false\n  init_from: sft/adapter\n",
         "lora.init_from sft/adapter is an adapter to start from, but lora.enabled is false"),
    ],
    ids=["dpo-with-sft", "smoothing-with-ipo", "gamma-without-simpo", "packing", "init-from-without-lora"],
)
def test_settings_that_do_not_fit_the_objective_exit_2_naming_the_field(tmp_path: Path, body: str, named: str) -> None:
    path = job_file(tmp_path, body)
    result = run_cli("train", str(path), "--dry-run")
    assert result.returncode == 2, result.stderr
    assert named.format(file=path) in result.stderr and "Traceback" not in result.stderr


def test_a_reference_free_loss_fine_tunes_fully_and_its_written_config_reloads(tmp_path: Path) -> None:
    cfg = load_config(TINY, ["train.objective=dpo", "lora.enabled=false", "dpo.loss=simpo", "dpo.simpo_gamma=1.0"])
    written = tmp_path / "config.yaml"
    written.write_text(dump_config(cfg))
    again = load_config(str(written), [])
    assert (again.train.objective, again.dpo.loss, again.dpo.simpo_gamma) == ("dpo", "simpo", 1.0)
    assert load_config(str(written), ["train.objective=sft", "dpo.loss=sigmoid", "dpo.simpo_gamma=0.5"]).dpo.beta == 0.1


@pytest.mark.parametrize(("lora", "loss", "reference"), [
    ("true", "ipo", "reference        DPO: the same weights with the LoRA adapters off, one forward without gradients"),
    ("false", "sigmoid", "reference        DPO: the initial model's log-probabilities, one forward over the data"),
    ("false", "orpo", None),
], ids=["lora", "full", "reference-free"])
def test_the_dry_run_shows_the_objective_a_pair_with_its_trained_tokens_and_the_reference_cost(
    tmp_path: Path, lora: str, loss: str, reference: str | None
) -> None:
    pairs = pairs_file(tmp_path)
    result = run_cli("train", TINY, "--dry-run", f"data.path={pairs}", "train.objective=dpo", f"lora.enabled={lora}",
                     f"dpo.loss={loss}", f"output_dir={tmp_path}", *QUIET)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"objective        dpo, loss {loss} (beta 0.1); reference: " in out
    assert ("reference: none (reference-free)" in out) == (reference is None)
    assert f"example          {pairs}:1, trained tokens between «»:" in out
    assert "chosen:   0+1=«1<|eos|>»" in out and "rejected: 0+1=«2<|eos|>»" in out
    assert "epochs of 8 pairs" in out and "(the data's 8 pairs, p50" in out
    assert (reference in out) if reference else "reference        DPO" not in out


@pytest.mark.parametrize(("objective", "data", "says"), [
    ("dpo", "builtin:dates", "builtin:dates:row 0: missing field: 'chosen' and 'rejected' are missing"),
    ("sft", "pairs", "pairs.jsonl:1: this row is a preference pair"),
])
def test_data_that_does_not_fit_the_objective_exits_2(tmp_path: Path, objective: str, data: str, says: str) -> None:
    path = pairs_file(tmp_path) if data == "pairs" else data
    result = run_cli("train", TINY, "--dry-run", f"data.path={path}", f"train.objective={objective}",
                     "lora.enabled=true", "data.max_length=200", f"output_dir={tmp_path}", *QUIET)
    assert result.returncode == 2 and says in result.stdout + result.stderr


def test_the_objective_counts_target_tokens_or_pairs() -> None:
    tok = build_byte_tokenizer()
    rows = [encode_pair({"prompt": "ab", "chosen": "c", "rejected": "de"}, tok, ChatTemplate(), 64)] * 3
    batch = collate(rows, tok.pad_token_id)
    assert Dpo(DpoConfig(), torch.device("cpu")).count(batch) == 3
    assert Sft().count(batch) == 3 * (2 + 3)  # "c<|eos|>", "de<|eos|>" per pair
