"""Each process imports what its command uses: reading a run dir never imports torch, and a training worker never
imports what only other jobs or other commands need. Read from `sys.modules` in a fresh interpreter after the
command ran, not from a timing."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, TINY
from tests.unit.runs.test_status import beat, make_run

PROBE = """
import contextlib, io, json, sys
from trainyard.cli import main
loaded = []
for argv in json.loads(sys.argv[1]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            main(argv)
        except SystemExit as stop:
            code = stop.code
    loaded.append({"code": code, "modules": sorted(sys.modules)})
print(json.dumps(loaded))
import gc
gc.freeze()  # all read: leave without the exit's collections over what loaded (as trainyard.cli.exit_process)
"""
NEVER_TO_READ_A_RUN = ("torch", "torch.distributed", "transformers", "peft", "datasets", "trainyard.dist",
                       "trainyard.model")


def imported_by(*commands: list[str]) -> list[dict]:
    """The modules loaded after each command, run one after another in one fresh interpreter (so a command sees
    what the ones before it loaded: list the lightest first)."""
    result = subprocess.run([sys.executable, "-c", PROBE, json.dumps(list(commands))], capture_output=True, text=True,
                            cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def light(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """One fresh interpreter runs the commands that must not import torch, in an order where none loads what a
    later one must not (a command's modules include those loaded before it): `status` of a missing run dir;
    `status`, `diagnose` and `report` of a run; `train` with a misspelt override, then with a missing data file.
    One interpreter for the three tests, not one each: every start imports the CLI again."""
    tmp = tmp_path_factory.mktemp("light")
    run_dir = tmp / "run"
    now = time.time()
    make_run(run_dir, [10, 20, 30, 40], start=now - 100)
    beat(run_dir, 0, 40, now)
    (run_dir / "flight").mkdir()
    missing = tmp / "job.yaml"
    job = yaml.safe_load(Path(TINY).read_text())
    missing.write_text(yaml.safe_dump({**job, "data": {"path": str(tmp / "no.jsonl")}}))
    commands = {"user error": [["status", str(tmp / "no-such-run")]],
                "run dir": [["status", str(run_dir)], ["diagnose", str(run_dir)],
                            ["report", str(run_dir), "--out", str(tmp / "report.png")]],
                "bad train": [["train", str(TINY), "trian.max_steps=1"], ["train", str(missing), "--nproc", "2"]]}
    seen = iter(imported_by(*[argv for group in commands.values() for argv in group]))
    return {name: [dict(next(seen), argv=argv) for argv in group] for name, group in commands.items()}


def test_reading_a_run_dir_never_imports_torch(light: dict[str, list[dict]]) -> None:
    for seen in light["run dir"]:
        assert seen["code"] in (0, None), seen["argv"]
        assert not set(NEVER_TO_READ_A_RUN) & set(seen["modules"]), seen["argv"]
    assert "matplotlib" not in light["run dir"][1]["modules"]  # after diagnose: only the report draws


def test_a_user_error_in_status_imports_no_torch(light: dict[str, list[dict]]) -> None:
    """The error path (exit 2, the message) reached no launcher code that imports torch's elastic agent."""
    [seen] = light["user error"]
    assert seen["code"] == 2
    assert not set(NEVER_TO_READ_A_RUN) & set(seen["modules"])


def test_bad_input_to_train_fails_before_torch_is_imported(light: dict[str, list[dict]]) -> None:
    """A misspelt override and a missing data file: exit 2 from the config and the job's paths alone (the launcher
    imports torch only once the job is known to be runnable)."""
    for command in light["bad train"]:
        assert command["code"] == 2, command["argv"]
        assert "torch" not in command["modules"], command["argv"]


def test_a_training_worker_imports_no_other_commands_or_jobs_code() -> None:
    """The recipe a worker runs: no fault-tolerant DiLoCo (torchft), no plotting, no sinks it was not asked for,
    no trace or estimate of another job's memory. (torch._dynamo is not in the list: transformers' masking_utils
    imports it for every model.)"""
    probe = "import sys, trainyard.train.recipe; print('\\n'.join(sys.modules)); import gc; gc.freeze()"  # as PROBE
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    modules = set(result.stdout.split())
    unwanted = {"torchft", "matplotlib", "wandb", "tensorboard", "trainyard.train.trace", "trainyard.runs.report",
                "trainyard.launch.k8s", "trainyard.launch.slurm", "trainyard.doctor.probe"}
    assert not unwanted & modules, unwanted & modules


JOBS_PROBE = """
import contextlib, io, json, os, socket, sys
from trainyard.cli import main
from trainyard.config_file import load_config
loaded = {}
commands, workers = json.loads(sys.argv[1]), json.loads(sys.argv[2])
for argv in commands:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            main(argv)
        except SystemExit as stop:
            assert stop.code in (0, None), (argv, stop.code)
    loaded[argv[0]] = sorted(sys.modules)
with socket.socket() as free:
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=str(port))  # what torchrun sets: a 1-rank gloo group, so the model is DDP-wrapped
from trainyard.train.recipe import run
for name, (config, overrides) in workers.items():
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        summary = run(load_config(config, overrides))
    assert (summary["steps"], summary["strategy"]) == (1, "ddp"), summary
    loaded[name] = sorted(sys.modules)
print(json.dumps(loaded))
sys.stdout.flush()
os._exit(0)  # a process group exists: no teardown (as dist.exit_process)
"""
PLANNING = ("peft", "datasets", "pandas", "torchft", "trainyard.train")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[str]]:
    """One fresh interpreter runs `slurm`, `k8s` and `estimate` (no --trace) for the tiny full fine-tune, then, as
    a torchrun worker would, one optimizer step of a DDP full fine-tune and one of a DDP LoRA job on a mixture's
    token shards (read from JSONL by hand, no `datasets`); the modules loaded after each, lightest first."""
    tmp = tmp_path_factory.mktemp("jobs")
    lines = [json.dumps({"text": f"sentence {i} of the shard {i % 7} in words"}) for i in range(64)]
    (tmp / "text.jsonl").write_text("\n".join(lines) + "\n")
    job = yaml.safe_load(Path(TINY).read_text())
    job["data"] = {"mixture": [{"path": str(tmp / "text.jsonl"), "weight": 1.0}], "max_length": 32}
    job["train"] = {"max_steps": 1, "micro_batch_size": 2}
    job["eval"] = {"at_end": False}
    job["log"] = {"progress": False, "tensorboard": False}
    (tmp / "shards.yaml").write_text(yaml.safe_dump(job))
    commands = [["slurm", TINY, f"output_dir={tmp / 'runs'}", "--nodes", "2", "--gpus-per-node", "4",
                 "--out", str(tmp / "job.sbatch")],
                ["k8s", TINY, f"output_dir={tmp / 'runs'}", "--image", "img:1", "--out", str(tmp / "job.yaml")],
                ["estimate", TINY]]
    workers = {"full": (str(tmp / "shards.yaml"), [f"output_dir={tmp / 'full'}"]),
               "lora": (str(tmp / "shards.yaml"), [f"output_dir={tmp / 'lora'}", "lora.enabled=true"])}
    result = subprocess.run([sys.executable, "-c", JOBS_PROBE, json.dumps(commands), json.dumps(workers)],
                            capture_output=True, text=True, cwd=tmp, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return {name: set(modules) for name, modules in json.loads(result.stdout).items()}


def test_planning_commands_import_no_peft_datasets_or_training(jobs: dict[str, set[str]]) -> None:
    """slurm and k8s estimate the signal lead, estimate plans the job: a meta model's counts, nothing that
    trains or reads data through `datasets`."""
    for command in ("slurm", "k8s", "estimate"):
        assert not {m for m in jobs[command] if m.startswith(PLANNING)}, command


def test_a_full_fine_tune_worker_imports_no_peft(jobs: dict[str, set[str]]) -> None:
    assert "trainyard.train.recipe" in jobs["full"] and "peft" not in jobs["full"]


def test_a_lora_worker_on_token_shards_imports_no_datasets_or_torchft(jobs: dict[str, set[str]]) -> None:
    lora = jobs["lora"]
    assert "peft" in lora  # the adapter was built
    assert not {"datasets", "pandas", "pyarrow", "torchft"} & lora, {"datasets", "pandas", "pyarrow", "torchft"} & lora
