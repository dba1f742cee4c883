"""One check before the nodes: `train --dry-run` reads the data and the tokenizer, plans for the target cluster (not
this machine), and exits 2 when the plan does not fit, the data is unusable or the resume point does not exist."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.conftest import TINY, run_cli
from trainyard.cli import app
from trainyard.config_file import load_config
from trainyard.estimate import timing as estimate_time

TURN = {"messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi there"}]}


def dry_run(*args: str) -> tuple[int, str]:
    result = run_cli("train", TINY, *args, "--dry-run")
    return result.returncode, result.stdout + result.stderr


def chat_file(tmp_path: Path, rows: list[object]) -> Path:
    path = tmp_path / "chat.jsonl"
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def test_the_data_is_read_its_lengths_epochs_and_one_marked_example_shown(tmp_path: Path) -> None:
    data = chat_file(tmp_path, [TURN] * 20)
    code, output = dry_run(f"data.path={data}", f"output_dir={tmp_path}", "train.max_steps=10",
                           "train.micro_batch_size=4", "--world-size", "1")
    assert code == 0, output
    assert f"data             {data} (chat): 20 rows, 20 usable" in output
    assert "tokens           per document p50 " in output and "0 truncated" in output
    assert "epochs           10 steps x 4 samples = 2 epochs of 20 documents" in output
    assert "\u00abhi there" in output  # the answer is trained, marked
    assert "\u00abSay hi" not in output  # the prompt is not
    assert "(the data's 20 documents, p50" in output  # the estimate uses the real lengths


def test_a_bad_row_is_named_by_file_and_line_or_counted_when_skipped(tmp_path: Path) -> None:
    data = chat_file(tmp_path, [TURN, TURN, "{not json", TURN])
    code, output = dry_run(f"data.path={data}", f"output_dir={tmp_path}")
    assert code == 2
    assert f"{data}:3" in output and "Traceback" not in output
    code, output = dry_run(f"data.path={data}", f"output_dir={tmp_path}", "data.on_bad_row=skip")
    assert code == 0, output
    assert "3 usable" in output
    assert f"(first at {data}:3)" in output


def test_missing_data_exits_2_before_any_node(tmp_path: Path) -> None:
    missing = tmp_path / "missing.jsonl"
    result = run_cli("train", TINY, f"data.path={missing}", f"output_dir={tmp_path}", "--dry-run")
    assert result.returncode == 2
    assert str(missing) in result.stderr and "the data is unusable" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_the_plan_is_for_the_target_cluster_and_a_plan_that_does_not_fit_exits_2(tmp_path: Path) -> None:
    code, output = dry_run(f"output_dir={tmp_path}", "--gpu", "h100-80gb", "--gpus-per-node", "8", "--nodes", "2")
    assert code == 0, output
    assert "world size       16" in output and "on 2 x 8 h100-80gb (fits)" in output
    assert "network 3200 Gb/s per node (8 x 400 Gb/s InfiniBand" in output
    too_big = ["model.config.hidden_size=8192", "model.config.intermediate_size=28672",
               "model.config.num_hidden_layers=60", "model.config.num_attention_heads=64",
               "model.config.num_key_value_heads=8", "dist.strategy=ddp"]
    code, output = dry_run(f"output_dir={tmp_path}", *too_big, "--gpu", "l4", "--gpus-per-node", "2")
    assert code == 2
    assert "does NOT fit" in output and "the plan does not fit" in output and "cheapest fix" in output


@pytest.mark.parametrize(
    ("resume", "code", "needle"),
    [("never", 0, "never: a fresh start"), ("auto", 0, "auto: nothing committed"),
     ("latest", 2, "checkpoint.resume (override")],
)
def test_resume_is_a_flag_checked_at_dry_run(resume: str, code: int, needle: str, tmp_path: Path) -> None:
    got, output = dry_run(f"output_dir={tmp_path}", "--resume", resume)
    assert got == code, output
    assert needle in output


def test_gpu_shape_options_need_a_gpu_kind() -> None:
    code, output = dry_run("--nodes", "2")
    assert code == 2 and "--gpus-per-node and --nodes describe --gpu nodes" in output
    code, output = dry_run("--gpu", "tpu-v9")
    assert code == 2 and "--gpu tpu-v9 is not a known device" in output


def test_step_tokens_follow_how_the_job_batches_its_real_lengths() -> None:
    lengths = estimate_time.Lengths((10, 20, 30, 100), "test")
    free = load_config(TINY, ["train.micro_batch_size=2", "data.max_length=128"])
    assert lengths.per_row(free) == (40.0, (10, 20, 30, 100))
    packed = load_config(TINY, ["data.packing=true", "data.max_length=128"])
    assert lengths.per_row(packed) == (128, (10, 20, 30, 100))  # full rows, attention per document
    padded = load_config(TINY, ["data.padding_free=false", "train.micro_batch_size=2", "data.max_length=128"])
    # E[max of 2 draws] over {10, 20, 30, 100}: 10/16 + 20*3/16 + 30*5/16 + 100*7/16
    row, documents = lengths.per_row(padded)
    assert row == pytest.approx((10 + 60 + 150 + 700) / 16) and documents == (row,)
    assert estimate_time.Lengths().per_row(free) == (128, (128,))


def test_memory_is_planned_for_the_largest_micro_batch_as_the_job_collates_it() -> None:
    lengths = estimate_time.Lengths((10, 20, 30, 100), "test", batch_why="read")
    free = load_config(TINY, ["train.micro_batch_size=2", "data.max_length=128"])
    assert lengths.largest_micro_batch(free) == estimate_time.MicroBatch(130, 100, "read")  # one row: 100 + 30
    padded = load_config(TINY, ["data.padding_free=false", "train.micro_batch_size=2", "data.max_length=128"])
    assert lengths.largest_micro_batch(padded).tokens == 200  # two rows padded to the longest
    packed = load_config(TINY, ["data.packing=true", "train.micro_batch_size=2", "data.max_length=128"])
    assert lengths.largest_micro_batch(packed).tokens == 160  # all 160 tokens fill 2 rows of 128 only partly
    unread = estimate_time.Lengths(batch_why="why").largest_micro_batch(free)
    assert unread == estimate_time.MicroBatch(256, 128, "micro_batch_size x data.max_length: why")


def test_estimate_reads_the_data_and_says_what_it_assumed(tmp_path: Path) -> None:
    data = chat_file(tmp_path, [TURN] * 8)
    result = CliRunner().invoke(app, ["estimate", TINY, f"data.path={data}", "--gpu", "a100-80gb", "--nodes", "2"])
    assert result.exit_code == 0, result.output
    assert "the data's 8 documents" in result.output
    assert "1600 Gb/s per node (8 x 200 Gb/s InfiniBand, usual for a100-80gb nodes)" in result.output
    assert "compute at an assumed MFU of 0.4, not measured" in result.output  # no measured path priced yet
    result = CliRunner().invoke(app, ["estimate", TINY, "dist.network=wan", "--nodes", "2", "--mfu", "0.3"])
    assert "compute at an assumed MFU of 0.3, not measured" in result.output
    assert "1 Gb/s per node (a WAN (dist.network: wan))" in result.output


@pytest.mark.parametrize("command", ["slurm", "k8s"])
def test_cluster_scripts_run_the_same_check_before_writing(command: str, tmp_path: Path) -> None:
    out = tmp_path / "job.out"
    shape = ["--nodes", "2", "--gpus-per-node", "8", "--out", str(out), *(["--image", "img:1"] * (command == "k8s"))]
    missing = [f"data.path={tmp_path / 'missing.jsonl'}", f"output_dir={tmp_path}"]
    result = run_cli(command, TINY, *missing, *shape)
    assert result.returncode == 2, result.stderr
    assert "the data is unusable" in result.stderr and not out.exists()
    result = run_cli(command, TINY, *missing, *shape, "--skip-data-check")
    assert result.returncode == 0, result.stderr
    assert out.is_file()


def test_epochs_become_steps_from_the_rows_the_dry_run_counts(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(Path(TINY).read_text().replace("  max_steps: 30\n", "  epochs: 2\n"))
    data = chat_file(tmp_path, [TURN] * 50)
    result = CliRunner().invoke(app, ["train", str(job), f"data.path={data}", f"output_dir={tmp_path}",
                                      "--dry-run", "--world-size", "2"])
    assert result.exit_code == 0, result.output
    assert "steps            7 (train.epochs 2 over 50 rows)" in result.output  # ceil(2 x 50 / 16)
    assert "epochs           7 steps x 16 samples = 2.24 epochs of 50 documents" in result.output


def short_chats(tmp_path: Path, count: int = 24) -> Path:
    """Rows of a few dozen tokens: far below any data.max_length below."""
    return chat_file(tmp_path, [{"messages": [{"role": "user", "content": f"Q{i} " + "word " * (i % 5)},
                                              {"role": "assistant", "content": "yes " * (1 + i % 4)}]}
                                for i in range(count)])


def planned_tokens(output: str) -> int:
    """The tokens of the micro-batch the estimate line says memory was planned for."""
    return int(output.split("planned for a micro-batch of ", 1)[1].split(" tokens", 1)[0].replace(",", ""))


def test_memory_is_planned_for_the_datas_largest_micro_batch_and_for_max_length_only_unread(tmp_path: Path) -> None:
    """micro_batch_size x data.max_length (8 x 1M tokens, with every token's attention over a 1M-token document)
    fits no machine; the data's largest micro-batch is a few hundred tokens, and the first step runs exactly that."""
    job = [f"data.path={short_chats(tmp_path)}", f"output_dir={tmp_path}", "data.max_length=1000000",
           "model.config.max_position_embeddings=1000000", "train.micro_batch_size=8", "--world-size", "1"]
    code, output = dry_run(*job)
    assert code == 0, output
    first_step = output.split("every rank's largest micro-batch: ", 1)[1].split(" tokens", 1)[0]
    assert planned_tokens(output) == int(first_step.replace(",", "")) < 1000
    assert "(fits), planned for a micro-batch of" in output and "(the data's largest)" in output
    code, output = dry_run(*job, "--skip-data-check")
    assert code == 2 and "does NOT fit" in output
    assert planned_tokens(output) == 8_000_000
    assert "(micro_batch_size x data.max_length: --skip-data-check, the data was not read)" in output


def test_train_refuses_by_the_dry_runs_rule_for_its_prepared_rows(tmp_path: Path) -> None:
    """`train` checks its fit with the dry run's function, for the largest micro-batch of the rows it prepared."""
    import datasets
    import torch

    from trainyard import plan
    from trainyard.dist import DistInfo
    from trainyard.errors import ConfigError

    cfg = load_config(TINY, ["data.max_length=1000000", "model.config.max_position_embeddings=1000000"])
    model, info = plan.meta_model(cfg), DistInfo(0, 1, 0, 1, torch.device("cpu"), None)
    assert model is not None
    rows = datasets.Dataset.from_dict({"input_ids": [[1] * (10 + i) for i in range(20)]})
    plan.check_fits("none", "ddp", 1, model, info, None, cfg, plan.reading.prepared_lengths(cfg, rows))
    with pytest.raises(ConfigError) as refused:
        plan.check_fits("none", "ddp", 1, model, info, None, cfg, plan.reading.prepared_lengths(cfg, None))
    assert "the plan does not fit" in refused.value.what and "8,000,000 tokens" in refused.value.what


def llama(tmp_path: Path, name: str, **widths: object) -> Path:
    """A Llama's config.json alone (Llama-3's shape at the given widths): the dry run builds it on the meta device,
    no weights."""
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_key_value_heads": 8, "vocab_size": 128256,
        "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
        **widths}))
    return folder


def llama_8b(tmp_path: Path) -> Path:
    return llama(tmp_path, "llama-8b", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, tie_word_embeddings=False)


def test_an_8b_lora_on_one_h100_is_planned_for_its_short_documents(tmp_path: Path) -> None:
    """4 rows x 4,096 tokens do not fit one H100 with an 8B LoRA; the data's rows of a few dozen tokens do."""
    job = [f"data.path={short_chats(tmp_path)}", f"output_dir={tmp_path}", "model.config=null",
           f"model.path={llama_8b(tmp_path)}", "lora.enabled=true", "data.max_length=4096",
           "train.micro_batch_size=4", "--gpu", "h100-80gb", "--gpus-per-node", "1"]
    code, output = dry_run(*job)
    assert code == 0, output
    assert "parameters       8,0" in output and "on 1 x 1 h100-80gb (fits), planned for a micro-batch of" in output
    assert planned_tokens(output) < 400
    code, output = dry_run(*job, "--skip-data-check")
    assert code == 2 and "on 1 x 1 h100-80gb (does NOT fit)" in output
    assert planned_tokens(output) == 16_384 and "--skip-data-check, the data was not read" in output


def llama_3b(tmp_path: Path) -> Path:
    """Its replicated full fine-tuning state (~51 GB) is more than half an H100, yet a DDP rank's whole peak fits one."""
    return llama(tmp_path, "llama-3b", hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                 num_attention_heads=24, tie_word_embeddings=True)


def test_auto_is_resolved_by_one_rule_in_the_plan_and_its_estimate(tmp_path: Path) -> None:
    """dist.strategy auto: the plan's line, `trainyard estimate` and the dry run's estimate choose alike (the first
    strategy whose estimated peak fits), never by the replicated state's half-device share."""
    job = [f"data.path={short_chats(tmp_path)}", f"output_dir={tmp_path}", "model.config=null",
           f"model.path={llama_3b(tmp_path)}", "lora.enabled=false", "dist.strategy=auto"]
    cluster = ["--gpu", "h100-80gb", "--gpus-per-node", "8"]
    code, output = dry_run(*job, *cluster)
    assert code == 0, output
    assert "strategy         ddp (requested auto: estimated peak per rank ddp" in output, output
    estimated = run_cli("estimate", TINY, *job, *cluster, "--json")
    assert estimated.returncode == 0, estimated.stderr[-2000:]
    assert json.loads(estimated.stdout)["strategy"] == "ddp"
