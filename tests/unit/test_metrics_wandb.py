"""W&B continuity: the run id lives in the run dir, so a requeued or resumed job logs to the same W&B run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import TINY
from trainyard.config_file import dump_config, load_config
from trainyard.errors import ConfigError
from trainyard.metrics import WANDB_ID_FILE, start_wandb


def test_two_starts_of_one_run_dir_continue_one_wandb_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config(TINY, [f"output_dir={tmp_path}", "log.wandb.project=continuity", "log.wandb.group=sweep-1"])
    cfg.run_dir.mkdir(parents=True)
    ids, sync_dirs = [], []
    for _ in range(2):  # the first start, then the requeued job's
        run = start_wandb(cfg)
        ids.append(run.id)
        sync_dirs.append(Path(run.settings.sync_dir))
        run.log({"train/loss": 1.0}, step=len(ids))
        run.finish()
    assert ids[0] == ids[1] == (cfg.run_dir / WANDB_ID_FILE).read_text().strip()
    # both starts log under the one id (two starts in one second share wandb's dir name, so the dirs are not counted)
    assert all(d.name.endswith(f"-{ids[0]}") and d.parent == cfg.run_dir / "wandb" for d in sync_dirs)
    other = load_config(TINY, [f"output_dir={tmp_path / 'other'}", "log.wandb=true"])
    other.run_dir.mkdir(parents=True)
    run = start_wandb(other)
    run.finish()
    assert run.id != ids[0]


def test_the_id_file_holds_the_id_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_API_KEY", "PLANTEDwandbkey0123456789abcdef0123456789")
    cfg = load_config(TINY, [f"output_dir={tmp_path}", "log.wandb=true"])
    cfg.run_dir.mkdir(parents=True)
    start_wandb(cfg).finish()
    text = (cfg.run_dir / WANDB_ID_FILE).read_text()
    assert text.strip().isalnum() and "PLANTED" not in text


@pytest.mark.parametrize(
    ("overrides", "want"),
    [
        (["log.wandb=true"], {"project": "trainyard", "entity": None, "group": None}),
        (["log.wandb=true", "log.wandb_project=old-form"], {"project": "old-form", "entity": None, "group": None}),
        (["log.wandb.entity=team", "log.wandb.group=g"], {"project": "trainyard", "entity": "team", "group": "g"}),
    ],
)
def test_log_wandb_takes_project_entity_and_group_and_the_old_form(overrides: list[str], want: dict) -> None:
    cfg = load_config(TINY, overrides)
    assert cfg.log.wandb is not None and cfg.log.wandb.model_dump() == want
    written = load_config(TINY, [f"log.wandb={json.dumps(cfg.log.wandb.model_dump())}"])
    assert written.log.wandb == cfg.log.wandb
    assert "wandb_project: null" in dump_config(cfg)  # the written-back job holds the new form only


def test_wandb_off_and_two_projects_at_once() -> None:
    assert load_config(TINY, ["log.wandb=false", "log.wandb_project=x"]).log.wandb is None
    assert load_config(TINY).log.wandb is None
    with pytest.raises(ConfigError, match="old spelling of log.wandb.project"):
        load_config(TINY, ["log.wandb.project=a", "log.wandb_project=b"])
