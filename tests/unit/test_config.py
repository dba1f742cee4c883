"""The job schema: loading, overrides, errors that name field/file/line, redaction, batch plan."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.conftest import TINY, run_cli
from trainyard.batch import accumulation_steps
from trainyard.config import JobConfig
from trainyard.config_file import dump_config, load_config
from trainyard.errors import ConfigError
from trainyard.redaction import REDACTED, is_secret_name, redact

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return str(path)


def test_required_keys_exist_with_their_names() -> None:
    cfg = JobConfig()
    for dotted in [
        "run_name",
        "output_dir",
        "train.max_steps",
        "train.micro_batch_size",
        "train.global_batch_size",
        "train.global_batch_tokens",
        "train.lr",
        "train.seed",
        "lora.enabled",
        "lora.r",
        "lora.alpha",
        "lora.dropout",
        "dist.strategy",
        "eval.every_steps",
        "eval.subset_size",
        "checkpoint.every_steps",
        "checkpoint.resume",
        "log.every_steps",
        "model.path",
        "data.path",
        "data.format",
        "data.max_length",
        "data.packing",
    ]:
        node = cfg
        for part in dotted.split("."):
            node = getattr(node, part)


def test_file_then_overrides_in_order(tmp_path: Path) -> None:
    path = write(tmp_path, "train:\n  lr: 0.5\n  max_steps: 7\n")
    cfg = load_config(path, ["train.lr=0.25", "lora.enabled=false", "data.path=x.jsonl"])
    assert cfg.train.lr == 0.25
    assert cfg.train.max_steps == 7
    assert cfg.lora.enabled is False
    assert cfg.data.path == "x.jsonl"


def test_unknown_key_in_file_names_line_and_suggests(tmp_path: Path) -> None:
    path = write(tmp_path, "train:\n  lr: 1.0\n  max_stepz: 3\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    text = err.value.render()
    assert f"{path}:3" in text
    assert "train.max_stepz" in text
    assert "did you mean 'train.max_steps'" in text


def test_unknown_section_in_override_names_the_override() -> None:
    with pytest.raises(ConfigError) as err:
        load_config("tiny", ["trian.lr=1"])
    text = err.value.render()
    assert "override 'trian.lr=1'" in text
    assert "did you mean 'train'" in text


def test_wrong_type_and_range_name_field_and_value(tmp_path: Path) -> None:
    path = write(tmp_path, "run_name: ok\ntrain:\n  micro_batch_size: zero\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "train.micro_batch_size" in err.value.render()
    assert "'zero'" in err.value.render()
    assert f"{path}:3" in err.value.render()
    with pytest.raises(ConfigError) as err:
        load_config("tiny", ["eval.every_steps=-1"])
    assert "eval.every_steps" in err.value.render() and "-1" in err.value.render()


def test_zero_interval_turns_off() -> None:
    cfg = load_config("tiny", ["eval.every_steps=0", "checkpoint.every_steps=0"])
    assert cfg.eval.every_steps == 0 and cfg.checkpoint.every_steps == 0


def test_invalid_yaml_names_line(tmp_path: Path) -> None:
    path = write(tmp_path, "train:\n  lr: [1,\n  max_steps: 2\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "not valid YAML" in err.value.render()
    assert f"{path}:" in err.value.render()


def test_missing_file_names_it_and_presets() -> None:
    with pytest.raises(ConfigError) as err:
        load_config("no/such.yaml")
    assert "no/such.yaml" in err.value.render() and "quickstart" in err.value.render()


def test_accumulation_from_global_batch() -> None:
    cfg = load_config("tiny", ["train.micro_batch_size=2", "train.global_batch_size=16"])
    assert accumulation_steps(cfg, 2) == 4
    assert accumulation_steps(cfg, 8) == 1
    with pytest.raises(ConfigError) as err:
        accumulation_steps(cfg, 3)
    assert "train.global_batch_size" in err.value.render()


def test_accumulation_from_global_tokens() -> None:
    cfg = load_config("configs/scratch-1.5b.yaml")
    assert accumulation_steps(cfg, 16) == 524288 // (4 * 16 * 2048)
    with pytest.raises(ConfigError):
        accumulation_steps(cfg, 3)


def test_a_token_budget_sets_max_steps_on_any_world_and_the_written_config_reloads(tmp_path: Path) -> None:
    cfg = load_config("configs/scratch-stdlib.yaml", ["train.total_tokens=10000"])
    assert cfg.train.max_steps == 3  # ceil(10000 / 4096)
    written = tmp_path / "config.yaml"
    written.write_text(dump_config(cfg))
    assert load_config(str(written)).train.max_steps == 3
    by_samples = load_config(
        "configs/scratch-stdlib.yaml",
        ["train.global_batch_tokens=null", "train.global_batch_size=4", "train.total_tokens=10000"],
    )
    assert by_samples.train.max_steps == 10  # ceil(10000 / (4 x 256))
    for overrides, needles in [
        (["train.global_batch_tokens=null"], ["train.total_tokens needs", "train.global_batch_tokens"]),
        (["train.total_tokens=1228800", "train.max_steps=7"], ["not both", "300 steps", "max_steps says 7"]),
    ]:
        with pytest.raises(ConfigError) as err:
            load_config("configs/scratch-stdlib.yaml", overrides)
        for needle in needles:
            assert needle in err.value.render(), err.value.render()
    steps = load_config("configs/scratch-stdlib.yaml", ["train.max_steps=7"])  # the command line's length wins
    assert (steps.train.max_steps, steps.train.total_tokens) == (7, None)
    assert steps._notes[0].startswith("train.max_steps from the command line replaces train.total_tokens (")


def test_both_batch_rules_is_an_error() -> None:
    with pytest.raises(ConfigError) as err:
        load_config("tiny", ["train.global_batch_size=8", "train.global_batch_tokens=1024"])
    assert "not both" in err.value.render()


def test_secret_names() -> None:
    for name in ["HF_TOKEN", "wandb_api_key", "db-password", "SECRET", "token"]:
        assert is_secret_name(name), name
    for name in ["max_new_tokens", "global_batch_tokens", "keep_last", "monkey"]:
        assert not is_secret_name(name), name


def test_dump_redacts_secret_values_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    planted = "hf_plantedSECRETvalue123"
    monkeypatch.setenv("HF_TOKEN", planted)
    cfg = load_config("tiny", ["run_name=leak", f"data.path=/data/{planted}/x.jsonl"])
    text = dump_config(cfg)
    assert planted not in text
    assert REDACTED in text
    assert yaml.safe_load(text)["train"]["max_steps"] == cfg.train.max_steps


def test_redact_hides_secret_keys_in_nested_data() -> None:
    data = {"wandb": {"api_key": "abc123456"}, "steps": 3, "items": [{"password": "hunter22"}]}
    out = redact(data, secrets=[])
    assert out["wandb"]["api_key"] == REDACTED and out["items"][0]["password"] == REDACTED
    assert out["steps"] == 3


@pytest.mark.parametrize(
    "name",
    ["tiny.yaml", "quickstart.yaml", "mistral7b-lora-ddp.yaml", "glm45air-fsdp-lora.yaml", "scratch-1.5b.yaml",
     "llama-1b.yaml", "scratch-stdlib.yaml"],
)
def test_shipped_configs_load(name: str) -> None:
    load_config(str(REPO / "configs" / name))


def test_a_binary_config_file_is_a_config_error_naming_its_line(tmp_path):
    """It used to raise UnicodeDecodeError with a traceback."""
    job = tmp_path / "job.yaml"
    job.write_bytes(b"run_name: x\ntrain:\n  lr: \xff\xfe\n")
    with pytest.raises(ConfigError, match="not UTF-8 text") as err:
        load_config(str(job))
    assert err.value.where == f"{job}:3"


def test_betas_outside_zero_one_are_rejected_before_the_optimizer_sees_them():
    with pytest.raises(ConfigError, match=r"train.betas \[1.5, 0.9\] must each be in \[0, 1\)"):
        load_config("tiny", ["train.betas=[1.5,0.9]"])


def test_model_download_timeout_s_waits_without_limit_unless_set_above_zero() -> None:
    assert load_config("tiny").model.download_timeout_s is None
    assert load_config("tiny", ["model.download_timeout_s=7200"]).model.download_timeout_s == 7200
    with pytest.raises(ConfigError, match="model.download_timeout_s"):
        load_config("tiny", ["model.download_timeout_s=0"])


def test_the_config_remembers_where_each_field_was_set(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("run_name: x\ndata:\n  path: a.jsonl\n")
    cfg = load_config(str(job), ["output_dir=/elsewhere"])
    assert cfg.where("data.path") == f"{job}:3"
    assert cfg.where("data.cache_dir") == f"{job}:2"  # unset: its section's line
    assert cfg.where("output_dir") == "override 'output_dir=/elsewhere'"
    assert cfg.where("train.lr") is None


@pytest.mark.parametrize(
    ("override", "suggestion"),
    [
        ("lr=1e-4", "did you mean 'train.lr'?"),  # said 'lora'
        ("lora.lr=1e-4", "did you mean 'train.lr'?"),
        ("max_stepz=3", "did you mean 'train.max_steps'?"),
        ("train.every_steps=5", "did you mean 'eval.every_steps', 'checkpoint.every_steps' or 'log.every_steps'?"),
        ("train.max_step=5", "did you mean 'train.max_steps'?"),  # its own section first
    ],
)
def test_did_you_mean_searches_every_section(override: str, suggestion: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config("tiny", [override])
    assert err.value.fix == suggestion
    assert err.value.where == f"override '{override}'"


def list_hint(field: str, value: str) -> tuple[str, str]:
    """The override and the YAML line the error's fix shows for a scalar given to a list field."""
    with pytest.raises(ConfigError) as err:
        load_config("tiny", [f"{field}={value}"])
    assert "Input should be a valid list" in err.value.what and f"(got '{value}')" in err.value.what
    fix = err.value.fix or ""
    override = fix.split("as an override ", 1)[1].split(" ", 1)[0]
    yaml_line = fix.split("in the YAML file ", 1)[1]
    return override, yaml_line


def test_a_scalar_for_a_list_shows_the_list_syntax_that_loads(tmp_path: Path) -> None:
    override, yaml_line = list_hint("lora.target_modules", "q_proj,v_proj")
    assert (override, yaml_line) == ("lora.target_modules=[q_proj,v_proj]", "target_modules: [q_proj, v_proj]")
    assert load_config("tiny", [override]).lora.target_modules == ["q_proj", "v_proj"]
    job = tmp_path / "job.yaml"
    job.write_text(f"lora:\n  {yaml_line}\n")
    assert load_config(str(job)).lora.target_modules == ["q_proj", "v_proj"]
    override, _ = list_hint("checkpoint.preemption_signals", "SIGTERM")
    assert load_config("tiny", [override]).checkpoint.preemption_signals == ["SIGTERM"]


def test_a_list_of_sections_gets_no_scalar_list_hint() -> None:
    with pytest.raises(ConfigError) as err:
        load_config("tiny", ["data.mixture=a.jsonl"])
    assert "data.mixture: Input should be a valid list" in err.value.what and "[a.jsonl]" not in str(err.value.fix)


def test_every_error_of_a_file_and_its_overrides_is_reported_at_once(tmp_path: Path) -> None:
    job = write(tmp_path, "run_name: x\ntrain:\n  micro_batch: 3\n  lr: fast\nlora:\n  r: 0\n")
    with pytest.raises(ConfigError) as err:
        load_config(job, ["eval.every_steps=-1", "lr=1e-4"])
    text = err.value.render()
    assert text.startswith("5 problems in the job config:"), text
    for line in [
        f"  {job}:3: unknown key 'train.micro_batch'\n    Fix: did you mean 'train.micro_batch_size'?",
        "  override 'lr=1e-4': unknown key 'lr'\n    Fix: did you mean 'train.lr'?",
        f"  {job}:4: train.lr: Input should be a valid number",
        f"  {job}:6: lora.r: Input should be greater than or equal to 1 (got 0)",
        "  override 'eval.every_steps=-1': eval.every_steps: Input should be greater than or equal to 0 (got -1)",
    ]:
        assert line in text, text
    assert "Extra inputs are not permitted" not in text  # pydantic's copy of the unknown keys
    assert err.value.fix == "change those values in the file, or override them with key=value"


def test_the_cli_prints_every_error_and_exits_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from trainyard.cli import main

    job = write(tmp_path, "train:\n  lr: fast\n  micro_batch_size: 0\n")
    monkeypatch.setattr("sys.argv", ["trainyard", "train", job, "lora.target_modules=q_proj"])
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "Traceback" not in err and "3 problems in the job config" in err
    for needle in [f"{job}:2: train.lr", f"{job}:3: train.micro_batch_size", "lora.target_modules=[q_proj]"]:
        assert needle in err, err


def test_a_tilde_override_removes_a_key_of_the_file(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text("train:\n  lr: 0.5\n  max_steps: 7\nlora:\n  r: 4\n")
    cfg = load_config(str(job), ["~train.lr", "~lora.r", "~lora.alpha"])  # alpha: not in the file, nothing to do
    defaults = load_config(str(job), ["train.max_steps=7"])
    assert cfg.train.lr == type(defaults.train)().lr and cfg.lora.r == type(defaults.lora)().r
    assert cfg.train.max_steps == 7
    assert "train.lr" not in cfg._where  # nothing set it any more: errors point at the section


@pytest.mark.parametrize(("override", "suggestion"), [("~train.lrr", "did you mean 'train.lr'?"),
                                                      ("~lr", "did you mean 'train.lr'?")])
def test_a_tilde_override_of_an_unknown_key_says_which_one_was_meant(override: str, suggestion: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(TINY, [override])
    assert f"override '{override}': unknown key" in err.value.render() and suggestion in err.value.render()
    result = run_cli("train", TINY, override, "--dry-run")
    assert result.returncode == 2 and suggestion in result.stderr and "Traceback" not in result.stderr


def test_null_sets_an_optional_field_to_none_and_names_a_required_ones_default(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text("train:\n  max_steps: 7\n  global_batch_size: 16\n")
    assert load_config(str(job), ["train.global_batch_size=null"]).train.global_batch_size is None
    with pytest.raises(ConfigError) as err:
        load_config(str(job), ["train.max_steps=null"])
    text = err.value.render()
    default = load_config(str(job), ["~train.max_steps"]).train.max_steps
    assert f"train.max_steps cannot be null: it always has a value (its default is {default})" in text, text
    assert "~train.max_steps" in text and "override 'train.max_steps=null'" in text


def test_an_override_cannot_both_remove_and_set() -> None:
    with pytest.raises(ConfigError, match="both removes and sets"):
        load_config(TINY, ["~train.lr=1"])
