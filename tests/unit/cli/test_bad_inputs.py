"""Every bad input the CLI can be given ends with exit 2, a message naming the culprit, no traceback,
and the user's files untouched. One table, run through the CLI's entry point in this process; the cases in
REAL_PROCESS start a real `trainyard` process, proving what a shell sees."""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import REPO, TINY, TINY_MOE, run_cli, trainyard

SCRATCH = str(REPO / "configs" / "scratch-1.5b.yaml")  # DiLoCo across sites, 524,288 tokens a step
GLM = str(REPO / "configs" / "glm45air-fsdp-lora.yaml")  # HSDP, 64 samples a step
WIDE = {"COLUMNS": "1000"}  # one message per line, so a long path is never wrapped mid-name


def make_inputs(root: Path) -> Path:
    """The bad (and a few good) files the cases point at, all under `root/in`."""
    d = root / "in"
    d.mkdir()
    (d / "binary.jsonl").write_bytes(bytes(range(256)) * 8)
    (d / "latin1.jsonl").write_bytes('{"text": "ok"}\n{"text": "caf\xe9"}\n'.encode("latin-1"))
    (d / "binary.json").write_bytes(b"\x1f\x8b\x08\x00" + bytes(range(256)))
    (d / "object.json").write_text('{"text": "one object, not a list"}')
    (d / "empty.jsonl").write_bytes(b"")
    (d / "rows.csv").write_text("text\nhello\n")
    table = pa.table({"text": [f"row {i}" for i in range(64)]})
    pq.write_table(table, d / "good.parquet")
    whole = (d / "good.parquet").read_bytes()
    (d / "truncated.parquet").write_bytes(whole[: len(whole) // 2])
    (d / "random.parquet").write_bytes(bytes(range(256)) * 4)
    pq.write_table(pa.table({"foo": ["x"] * 4}), d / "columns.parquet")
    (d / "not_saved").mkdir()
    (d / "not_saved" / "notes.txt").write_text("not a dataset")
    (d / "broken_saved").mkdir()
    (d / "broken_saved" / "state.json").write_text('{"_data_files": [')
    (d / "broken_saved" / "dataset_info.json").write_text("{")
    (d / "a_file").write_text("a regular file\n")
    (d / "binary.yaml").write_bytes(b"\x00\x01\x02\xff\xfe" * 40)
    (d / "job_dir.yaml").mkdir()
    (d / "model_empty").mkdir()
    bad_json = d / "model_bad_json"
    bad_json.mkdir()
    (bad_json / "config.json").write_text('{\n  "model_type": "llama",\n  "hidden_size": ,\n  "vocab_size": 9\n}\n')
    truncated = d / "model_truncated"
    truncated.mkdir()
    (truncated / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    header = json.dumps({"w": {"dtype": "F32", "shape": [1024], "data_offsets": [0, 4096]}}).encode()
    (truncated / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 100)
    garbage = d / "model_garbage"
    garbage.mkdir()
    (garbage / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (garbage / "model.safetensors").write_bytes(struct.pack("<Q", 24) + b"this is not json at all!" + b"\0" * 64)
    (garbage / "tokenizer_config.json").write_text("{")
    _fake_checkpoint(d / "run")
    (d / "not_a_run").mkdir()
    (d / "not_a_run" / "keep.txt").write_text("mine")
    broken = d / "run_broken"
    broken.mkdir()
    event = {"kind": "train", "time": 1.0, "step": 1, "loss": 2.0, "lr": 1e-3, "tokens_per_s": 10.0}
    (broken / "metrics.jsonl").write_text(json.dumps(event) + "\n")
    (broken / "env.json").write_bytes(b"\xff\xfe binary \x00\x01")
    (broken / "summary.json").write_text('{"steps": ')
    (d / "out_full").mkdir()
    (d / "out_full" / "keep.txt").write_text("mine")
    return d


def _fake_checkpoint(run_dir: Path) -> None:
    """A committed checkpoint folder and its run's config: enough for export to reach --out."""
    step = run_dir / "checkpoints" / "step-00000001"
    step.mkdir(parents=True)
    (step / "COMMITTED").write_text(json.dumps({"kind": "full"}))
    (run_dir / "config.yaml").write_text(Path(TINY).read_text())


def snapshot(root: Path) -> dict[str, tuple[str, int]]:
    """Content hash and mtime of every file under root."""
    return {
        str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


Args = Callable[[Path], list[str]]
LAUNCH = ("launch", "{tiny}", "output_dir={in}/../runs")
LAUNCH += ("--nnodes", "1", "--node-rank", "0", "--master", "127.0.0.1:29400")


FEW_ROWS = ("data.synthetic_train_size=32", "data.synthetic_eval_size=16")
"""Of the builtin rows a job trains on: a case that fails at its model or its plan tokenizes them first (the 576
of the tiny configs are most of its CPU), and no case is about how many there are."""


def train(*extra: str) -> Args:
    """`train tiny` writing under tmp, with `{in}` and `{tmp}` filled in."""
    return lambda d: ["train", TINY, f"output_dir={d.parent}/runs", "train.max_steps=1", *FEW_ROWS, *_fill(extra, d)]


def moe(*extra: str) -> Args:
    """`train tiny-moe` on one process, writing under tmp."""
    return lambda d: ["train", TINY_MOE, f"output_dir={d.parent}/runs", "train.max_steps=1", *FEW_ROWS,
                      *_fill(extra, d)]


def cli(*argv: str) -> Args:
    return lambda d: _fill(argv, d)


def _fill(items: tuple[str, ...], d: Path) -> list[str]:
    return [item.replace("{in}", str(d)).replace("{tiny}", TINY) for item in items]


# (id, argv, words the message must contain, status): "new" failed on the code before this suite
# (exit 0 or 1, a traceback, or exit 2 with a message missing the culprit), "guard" already answered well
CASES: list[tuple[str, Args, list[str], str]] = [
    # data files
    ("data-binary-jsonl", train("data.path={in}/binary.jsonl"), ["data.path", "binary.jsonl", "binary file"], "new"),
    ("data-latin1-jsonl", train("data.path={in}/latin1.jsonl"), ["data.path", "latin1.jsonl:2", "UTF-8"], "new"),
    ("eval-latin1-jsonl", train("data.eval_path={in}/latin1.jsonl"), ["data.eval_path", "latin1.jsonl:2"], "new"),
    ("data-binary-json", train("data.path={in}/binary.json"), ["data.path", "binary.json", "binary file"], "new"),
    ("data-truncated-parquet", train("data.path={in}/truncated.parquet"),
     ["data.path", "truncated.parquet", "Parquet"], "new"),
    ("data-random-parquet", train("data.path={in}/random.parquet"), ["data.path", "random.parquet", "Parquet"], "new"),
    ("data-broken-saved", train("data.path={in}/broken_saved"), ["data.path", "broken_saved", "save_to_disk"], "new"),
    ("data-empty-jsonl", train("data.path={in}/empty.jsonl"), ["empty.jsonl", "empty"], "guard"),
    ("data-missing", train("data.eval_path={in}/absent.jsonl"), ["data.eval_path", "absent.jsonl"], "guard"),
    ("data-folder-not-saved", train("data.path={in}/not_saved"), ["data.path", "not_saved", "save_to_disk"], "guard"),
    ("data-wrong-columns", train("data.path={in}/columns.parquet"), ["columns.parquet:row 0", "['foo']"], "guard"),
    ("data-json-object", train("data.path={in}/object.json"), ["object.json", "list of objects"], "guard"),
    ("data-unknown-suffix", train("data.path={in}/rows.csv"), ["rows.csv", "unknown file type"], "guard"),
    # the config itself
    ("config-binary", cli("train", "{in}/binary.yaml"), ["binary.yaml:1", "YAML"], "new"),
    ("config-is-folder", cli("train", "{in}/job_dir.yaml"), ["job_dir.yaml", "folder"], "new"),
    ("train-betas", train("train.betas=[1.5,0.9]"), ["train.betas", "override"], "new"),
    ("model-dtype-float16", train("model.dtype=float16"), ["model.dtype", "loss scaler", "bfloat16"], "new"),
    ("train-precision", train("train.precision=fp16"), ["train.precision", "bf16-mixed"], "new"),
    ("ddp-cannot-fit", train("model.config.hidden_size=16384", "model.config.intermediate_size=53248",
                             "model.config.num_hidden_layers=126", "model.config.num_attention_heads=128",
                             "model.config.num_key_value_heads=8", "dist.strategy=ddp"),
     ["dist.strategy ddp", "GiB per rank", "more ranks"], "new"),
    ("lora-target-modules", train("lora.enabled=true", "lora.target_modules=[nope]"),
     ["lora.target_modules", "nope"], "new"),
    ("lora-target-modules-one-missing", train("lora.enabled=true", "lora.target_modules=[q_proj,qproj]"),
     ["lora.target_modules", "qproj", "self_attn.q_proj, self_attn.k_proj"], "new"),
    ("lora-target-parameters-dense", train("lora.enabled=true", "lora.target_parameters=[mlp.experts.down_proj]"),
     ["lora.target_parameters", "mlp.experts.down_proj", "none (no fused experts"], "new"),
    ("moe-target-modules", moe("lora.target_modules=[q_proj,w1]"),
     ["lora.target_modules", "w1", "mlp.shared_experts.gate_proj"], "new"),
    ("moe-target-parameters", moe("lora.target_parameters=[experts.w1]"),
     ["lora.target_parameters", "experts.w1", "mlp.experts.gate_up_proj, mlp.experts.down_proj"], "new"),
    ("moe-lora-dropout", moe("lora.dropout=0.1"), ["lora.dropout", "set lora.dropout: 0"], "new"),
    ("model-config-heads", train("model.config.num_attention_heads=5"), ["model.config", "attention heads"], "new"),
    # folders the run creates
    ("output-dir-is-file", cli("train", "{tiny}", "output_dir={in}/a_file"),
     ["output_dir", "a_file", "is a file"], "new"),
    ("output-dir-under-file", cli("train", "{tiny}", "output_dir={in}/a_file/runs"),
     ["output_dir", "a_file is a file"], "new"),
    ("run-dir-is-file", cli("train", "{tiny}", "output_dir={in}", "run_name=a_file"),
     ["output_dir", "a_file", "run_name"], "new"),
    ("data-cache-dir-is-file", train("data.cache_dir={in}/a_file"), ["data.cache_dir", "a_file", "is a file"], "new"),
    ("model-cache-dir-under-file", train("model.cache_dir={in}/a_file/models"), ["model.cache_dir", "a_file"], "new"),
    # model and checkpoint paths
    ("model-path-is-file", train("model.config=null", "model.path={in}/a_file"),
     ["model.path", "a_file", "is a file"], "new"),
    ("model-no-config-json", train("model.config=null", "model.path={in}/model_empty"),
     ["model.path", "config.json"], "new"),
    ("model-bad-config-json", train("model.config=null", "model.path={in}/model_bad_json"),
     ["model.path", "config.json:3"], "new"),
    ("model-truncated-safetensors", train("model.config=null", "model.path={in}/model_truncated"),
     ["model.path", "model.safetensors", "truncated"], "new"),
    ("model-garbage-safetensors", train("model.config=null", "model.path={in}/model_garbage"),
     ["model.path", "model.safetensors"], "new"),
    ("tokenizer-corrupt-folder", train("model.tokenizer={in}/model_garbage"),
     ["model.tokenizer", "model_garbage"], "new"),
    ("resume-missing", train("checkpoint.resume={in}/nowhere"), ["checkpoint.resume", "nowhere"], "guard"),
    ("eval-checkpoint-missing", cli("eval", "{tiny}", "--checkpoint", "{in}/nowhere"),
     ["nowhere", "checkpoint"], "guard"),
    # numbers that make no sense
    ("train-nproc-0", train("--nproc", "0"), ["--nproc"], "new"),
    ("train-nproc-negative", train("--nproc", "-1"), ["--nproc"], "new"),
    ("train-world-size-0", cli("train", "{tiny}", "--dry-run", "--world-size", "0"), ["--world-size"], "new"),
    ("train-max-restarts-negative", train("--nproc", "2", "--max-restarts", "-1"), ["--max-restarts"], "new"),
    ("eval-nproc-0", cli("eval", "{tiny}", "--checkpoint", "{in}/run", "--nproc", "0"), ["--nproc"], "new"),
    ("launch-max-restarts-negative",
     cli(*LAUNCH, "--max-restarts", "-1"),
     ["--max-restarts"], "new"),
    ("launch-shutdown-timeout-0",
     cli(*LAUNCH, "--shutdown-timeout", "0"),
     ["--shutdown-timeout"], "new"),
    ("launch-preempt-exit-code-0",
     cli(*LAUNCH, "--preempt-exit-code", "0"),
     ["--preempt-exit-code"], "new"),
    ("status-missing-argument", cli("status"), ["Missing argument", "run_dir"], "new"),
    ("status-stale-after-not-a-number", cli("status", "{in}/run", "--stale-after", "soon"), ["--stale-after"], "new"),
    ("train-unknown-option", cli("train", "{tiny}", "--nprocs", "2"), ["--nprocs"], "new"),
    ("launch-node-rank-negative", cli("launch", "{tiny}", "--nnodes", "1", "--node-rank", "-1"),
     ["--node-rank"], "guard"),
    ("launch-nproc-0", cli(*LAUNCH[:7], "--nproc", "0"),
     ["--nproc"], "guard"),
    ("launch-nnodes-0", cli("launch", "{tiny}", "output_dir={in}/../runs", "--nnodes", "0"), ["--nnodes"], "guard"),
    ("doctor-timeout-0", cli("doctor", "--nnodes", "1", "--timeout", "0"), ["--timeout"], "new"),
    ("doctor-node-rank-negative", cli("doctor", "--node-rank", "-1"), ["--node-rank"], "guard"),
    ("doctor-nnodes-0", cli("doctor", "--nnodes", "0"), ["--nnodes"], "guard"),
    ("status-stale-after-negative", cli("status", "{in}/run", "--stale-after", "-1"), ["--stale-after"], "new"),
    ("status-not-a-run-dir", cli("status", "{in}/not_a_run"), ["not_a_run", "not a run dir"], "new"),
    ("status-a-file", cli("status", "{in}/a_file"), ["a_file", "is a file"], "new"),
    ("slurm-cpus-per-task-0", cli("slurm", "{tiny}", "--gpus-per-node", "0", "--cpus-per-task", "0"),
     ["--cpus-per-task"], "new"),
    ("slurm-gpus-per-node-missing", cli("slurm", "{tiny}", "--nodes", "2"), ["--gpus-per-node"], "new"),
    ("slurm-nodes-0", cli("slurm", "{tiny}", "--nodes", "0"), ["--nodes"], "guard"),
    ("slurm-gpus-negative", cli("slurm", "{tiny}", "--gpus-per-node", "-1"), ["--gpus-per-node"], "guard"),
    ("k8s-nproc-per-node-0", cli("k8s", "{tiny}", "--image", "img:1", "--nproc-per-node", "0"),
     ["--nproc-per-node"], "new"),
    ("k8s-grace-negative", cli("k8s", "{tiny}", "--image", "img:1", "--grace", "-5"), ["--grace"], "guard"),
    ("k8s-nodes-0", cli("k8s", "{tiny}", "--image", "img:1", "--nodes", "0"), ["--nodes"], "guard"),
    ("report-binary-env-json", cli("report", "{in}/run_broken", "--out", "{in}/report"), ["env.json", "UTF-8"], "new"),
    ("status-broken-summary", cli("status", "{in}/run_broken"), ["summary.json", "unreadable"], "new"),
    # the job's shape at the world a cluster script asks for, checked when it is written
    ("slurm-diloco-groups-3-of-16", cli("slurm", SCRATCH, "diloco.groups=3", "--nodes", "4", "--gpus-per-node", "4"),
     ["diloco.groups 3", "override 'diloco.groups=3'", "16 ranks"], "new"),
    ("k8s-global-batch-tokens-on-12", cli("k8s", SCRATCH, "--image", "img:1", "--nodes", "3", "--gpus-per-node", "4"),
     ["train.global_batch_tokens", "scratch-1.5b.yaml"], "new"),
    ("slurm-hsdp-shard-3-of-16", cli("slurm", GLM, "dist.shard_size=3", "--nodes", "2", "--gpus-per-node", "8"),
     ["dist.shard_size 3", "world size 16", "dist.shard_size=3"], "new"),
    ("k8s-out-under-file", cli("k8s", "{tiny}", "--image", "img:1", "--out", "{in}/a_file/job.yaml"),
     ["--out", "a_file is a file"], "new"),
    ("k8s-out-is-folder", cli("k8s", "{tiny}", "--image", "img:1", "--out", "{in}/not_a_run"),
     ["--out", "folder"], "new"),
    ("slurm-out-under-file", cli("slurm", "{tiny}", "output_dir={in}/../runs", "--gpus-per-node", "0", "--out",
                                 "{in}/a_file/job.sbatch"),
     ["--out", "a_file is a file"], "new"),
    ("report-not-a-run-dir", cli("report", "{in}/not_a_run"), ["not_a_run", "metrics.jsonl"], "guard"),
    ("export-not-a-checkpoint", cli("export", "{in}/not_a_run", "--out", "{in}/exported"),
     ["not_a_run", "checkpoint"], "guard"),
    ("export-out-not-empty", cli("export", "{in}/run", "--out", "{in}/out_full"),
     ["--out", "out_full", "not empty"], "guard"),
    ("export-out-under-file", cli("export", "{in}/run", "--out", "{in}/a_file/model"),
     ["--out", "a_file is a file"], "new"),
    ("export-out-is-file", cli("export", "{in}/run", "--out", "{in}/a_file"),
     ["--out", "a_file", "is a file"], "new"),
]


# One case per kind of failure (data file, config, model folder, typer's own option check, a generated
# script, a run directory) as a real process: the exit status and stderr a shell sees.
REAL_PROCESS = {"data-binary-jsonl", "config-binary", "model-bad-config-json", "train-nproc-0",
                "slurm-diloco-groups-3-of-16", "status-broken-summary"}


@pytest.mark.parametrize(("case", "args", "needles", "status"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_exits_2_names_the_culprit_and_keeps_files(
    tmp_path: Path, case: str, args: Args, needles: list[str], status: str
) -> None:
    inputs = make_inputs(tmp_path)
    before = snapshot(inputs)
    if case in REAL_PROCESS:
        result = trainyard(*args(inputs), env=WIDE, timeout=300)
    else:
        result = run_cli(*args(inputs), env=WIDE)
    assert result.returncode == 2, f"exit {result.returncode} ({status})\n{result.stderr[-3000:]}"
    assert "Traceback" not in result.stderr + result.stdout, result.stderr[-3000:]
    for needle in needles:
        assert needle in result.stderr, f"{needle!r} not in:\n{result.stderr[-3000:]}"
    assert snapshot(inputs) == before, "a failed command changed or removed the user's files"


# ---------------------------------------------------------------- --out never overwrites

GENERATORS = {
    "k8s": (["k8s", "--image", "img:1"], "kind: PyTorchJob"),
    "slurm": (["slurm", "--nodes", "1", "--gpus-per-node", "0"], "#SBATCH"),
}


def _generate(command: str, config: str, out: Path, *extra: str):
    argv, _ = GENERATORS[command]
    runs = f"output_dir={out.parent / 'runs'}"  # slurm makes the log folder: keep it beside --out
    return run_cli(argv[0], config, runs, *argv[1:], "--out", str(out), *extra, env=WIDE)


@pytest.mark.parametrize("command", sorted(GENERATORS))
def test_out_refuses_an_existing_file_unless_forced(tmp_path: Path, command: str) -> None:
    """The README's `--out job.yaml` used to replace the user's file silently."""
    out = tmp_path / "mine.txt"
    out.write_text("the user's own file\n")
    refused = _generate(command, TINY, out)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert "--out" in refused.stderr and "--force" in refused.stderr and str(out) in refused.stderr
    assert out.read_text() == "the user's own file\n"
    forced = _generate(command, TINY, out, "--force")
    assert forced.returncode == 0, forced.stderr
    assert GENERATORS[command][1] in out.read_text()


@pytest.mark.parametrize("command", sorted(GENERATORS))
def test_out_never_replaces_the_config_it_reads_even_with_force(tmp_path: Path, command: str) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(Path(TINY).read_text())
    before = snapshot(tmp_path)
    result = _generate(command, str(job), job, "--force")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "job config" in result.stderr and str(job) in result.stderr
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("command", sorted(GENERATORS))
def test_out_writes_a_new_file_in_a_new_folder(tmp_path: Path, command: str) -> None:
    out = tmp_path / "new" / "job.out"
    result = _generate(command, TINY, out)
    assert result.returncode == 0, result.stderr
    assert GENERATORS[command][1] in out.read_text()
    assert not [p.name for p in out.parent.iterdir() if p.name.startswith(".")], "a temp file was left beside --out"


def test_report_out_keeps_report_files_unless_forced(tmp_path: Path) -> None:
    from tests.unit.runs.test_report import write_run

    run_dir = tmp_path / "runs" / "a"
    write_run(run_dir, lr=1e-3, finished=True)
    out = tmp_path / "report"
    out.mkdir()
    (out / "report.md").write_text("my notes\n")
    (out / "other.txt").write_text("unrelated\n")
    refused = run_cli("report", str(run_dir), "--out", str(out), env=WIDE)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert "report.md" in refused.stderr and "--force" in refused.stderr
    assert sorted(p.name for p in out.iterdir()) == ["other.txt", "report.md"]
    assert (out / "report.md").read_text() == "my notes\n"
    forced = run_cli("report", str(run_dir), "--out", str(out), "--force", env=WIDE)
    assert forced.returncode == 0, forced.stderr
    assert (out / "report.md").read_text() != "my notes\n" and (out / "loss.png").is_file()
    assert (out / "other.txt").read_text() == "unrelated\n"
